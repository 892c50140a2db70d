"""Recognising the hub caches of a box: which blobs can be kept as references to the origin.

A hub cache (huggingface_hub's layout) holds one folder per repository, models--ORG--NAME (datasets--,
spaces--), with blobs/HASH (each file's bytes once), snapshots/COMMIT/PATH (relative symlinks to the
blobs) and refs/NAME (a branch or tag's commit). A blob becomes a Reference only if all of this holds:
its name is a sha256 (an LFS file; a 40-hex name is a git blob hash, a small file that stays in the
layers), its content hashes to that name (hashed here, not trusted), it is a regular file, and a
snapshots/COMMIT/PATH symlink written as the hub writes it names it (that says which repository,
commit and path the origin serves it as). Everything else stays in the layers, with why (Left).

The box's Hugging Face token files (HF_HOME/token, HF_HOME/stored_tokens, HF_TOKEN_PATH) are found
too: secrets, never to be pushed."""

from __future__ import annotations

import os
import posixpath
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from snapshotter.box.openat import DIR_FLAGS, open_beneath, open_root
from snapshotter.digests import file_digest
from snapshotter.index.entry import self_and_parents
from snapshotter.origin.references import (COMMIT_HASH, DEFAULT_ENDPOINT, FOLDER_PREFIX, REPO_ID, SHA256_HEX,
                                           Reference, RefName, References, plain_relative)

TYPE_OF_PREFIX = {prefix: kind for kind, prefix in FOLDER_PREFIX.items()}
TOKEN_FILES = ("token", "stored_tokens")  # HF_HOME's: the login token, and every token `hf auth login` kept
HOME_CACHES = (".cache/huggingface",)  # below each home: HF_HOME's default


@dataclass
class Recognition:
    """What a box's hub caches hold: the blobs kept as references, the refs, the blobs left in the
    layers (path, why), and the token files never to push (root-relative paths)."""

    references: list[Reference] = field(default_factory=list)
    refs: list[RefName] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)
    taken: dict = field(default_factory=dict)  # a commit's scan entries of them, taken out of its layers

    def document(self) -> References:
        return References(tuple(self.references), tuple(self.refs))


def default_candidates(root: str, box_env: Optional[dict] = None) -> list[str]:
    """Where a box keeps hub caches, root-relative: each home's ~/.cache/huggingface, and the folders
    the box's HF_HOME and HF_HUB_CACHE name (absolute in the box)."""
    homes = ["root"] + [f"home/{n}" for n in _names(os.path.join(root, "home"))]
    found = [f"{h}/{c}" for h in homes for c in HOME_CACHES]
    for var in ("HF_HOME", "HF_HUB_CACHE"):
        value = (box_env or {}).get(var, "")
        if value.startswith("/") and plain_relative(value.strip("/")):
            found.append(value.strip("/"))
    return [c for c in dict.fromkeys(found) if os.path.isdir(os.path.join(root, c))]


def recognise(root: str, candidates: Iterable[str], endpoint: str = DEFAULT_ENDPOINT,
              token_path: Optional[str] = None, workers: int = 4, memo: Optional[dict] = None,
              leaves_out: Callable[[str], bool] = lambda path: False) -> Recognition:
    """The hub caches found in or at the root-relative folders `candidates` (a hub cache, or a folder
    above one), as references recorded with `endpoint` (the box's HF_ENDPOINT). `token_path`: the box's
    HF_TOKEN_PATH, absolute in the box. Each candidate blob is hashed, `workers` at a time, but for
    one `memo` (kept between the recognitions of one root: a watcher's) knows hashed with the same
    stat data (device, inode, size, mtime, ctime: any write changes the last two). A path
    `leaves_out` (the profile's: excluded or secret) is not captured, so neither referenced nor read."""
    found, candidates = Recognition(), list(candidates)
    root_fd = open_root(root)
    try:
        repos: dict[str, None] = {}
        for candidate in candidates:
            candidate = candidate.strip("/")
            if plain_relative(candidate) and _plain_folder(root_fd, candidate):
                repos.update(dict.fromkeys(r for r in _repo_folders(root, candidate) if not _left_out(r, leaves_out)))
        linked = []
        for repo in repos:
            _read_refs(root, repo, found, leaves_out)
            linked.extend((r, b) for r, b in _read_links(root, repo)
                          if not _left_out(r.link_path, leaves_out) and not _left_out(r.blob_path, leaves_out))
        _left_unnamed(root, repos, _keep_verified(root_fd, linked, endpoint, found, workers, memo), found)
        found.secrets = token_files(root, [*candidates, *(posixpath.dirname(r) for r in repos)], token_path)
    finally:
        os.close(root_fd)
    return found


def _names(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _plain_folder(root_fd: int, rel: str) -> bool:
    """Whether `rel` is a folder reached from the root through no symlink (one would lead out of the root)."""
    try:
        os.close(open_beneath(root_fd, rel, DIR_FLAGS))
        return True
    except OSError:
        return False


def _repo_folders(root: str, candidate: str) -> list[str]:
    """The repository folders at or below `candidate` (root-relative), not following symlinks."""
    if _repo_kind(candidate):
        return [candidate]
    repos = []
    for folder, dirs, _ in os.walk(os.path.join(root, candidate)):
        rel = os.path.relpath(folder, root).replace(os.sep, "/")
        for d in list(dirs):
            if _repo_kind(f"{rel}/{d}") and os.path.isdir(os.path.join(folder, d, "snapshots")):
                repos.append(f"{rel}/{d}")
                dirs.remove(d)  # a repository's own folders hold no other
        dirs.sort()
    return repos


def _repo_kind(rel: str) -> Optional[tuple[str, str]]:
    """(repo type, repo id) a folder's name says (models--ORG--NAME), or None."""
    prefix, sep, rest = posixpath.basename(rel).partition("--")
    if not sep or prefix not in TYPE_OF_PREFIX:
        return None
    repo_id = "/".join(rest.split("--"))
    return (TYPE_OF_PREFIX[prefix], repo_id) if rest.count("--") <= 1 and REPO_ID.fullmatch(repo_id) else None


def _left_out(path: str, leaves_out: Callable[[str], bool]) -> bool:
    """Whether the profile leaves out `path` or a folder above it (as a scan does)."""
    return any(leaves_out(p) for p in self_and_parents(path))


def _read_refs(root: str, repo: str, found: Recognition, leaves_out: Callable[[str], bool]) -> None:
    """A repository folder's refs/NAME files that hold a commit hash (and the profile keeps), into `found`."""
    repo_type, repo_id = _repo_kind(repo)
    refs_dir = os.path.join(root, repo, "refs")
    if not _real_folder(refs_dir):
        return  # a symlink would be followed out of the root: its files stay in the layers
    for folder, _, files in os.walk(refs_dir):
        for name in sorted(files):
            path = os.path.join(folder, name)
            commit = _small_text(path)
            ref = os.path.relpath(path, refs_dir).replace(os.sep, "/")
            if COMMIT_HASH.fullmatch(commit) and not _left_out(f"{repo}/refs/{ref}", leaves_out):
                found.refs.append(RefName(posixpath.dirname(repo), repo_type, repo_id, ref, commit))


def _read_links(root: str, repo: str) -> list[tuple[Reference, str]]:
    """A repository folder's snapshot symlinks that name a sha256 blob as the hub writes them:
    (reference without hash check or file attributes, blob name)."""
    repo_type, repo_id = _repo_kind(repo)
    linked = []
    snapshots = os.path.join(root, repo, "snapshots")
    for revision in _names(snapshots) if _real_folder(snapshots) else ():
        top = os.path.join(snapshots, revision)
        if not COMMIT_HASH.fullmatch(revision) or not _real_folder(top):
            continue  # a symlinked folder is not followed (it could lead out of the root): it stays in the layers
        for folder, dirs, files in os.walk(top):
            dirs.sort()
            for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]):
                link = os.path.join(folder, name)
                blob = _blob_named(root, repo, link)
                if blob:
                    path = os.path.relpath(link, top).replace(os.sep, "/")
                    ref = Reference(posixpath.dirname(repo), repo_type, repo_id, revision, path, blob, 0, "")
                    linked.append((ref, blob))
    return linked


def _real_folder(path: str) -> bool:
    """A folder that is not a symlink: os.walk and listdir follow a top folder that is one."""
    return os.path.isdir(path) and not os.path.islink(path)


def _small_text(path: str) -> str:
    """The first bytes of a regular file, not through a symlink (which could lead anywhere)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        return f.read(100).decode("ascii", "replace") if stat.S_ISREG(os.fstat(fd).st_mode) else ""


def _blob_named(root: str, repo: str, link: str) -> str:
    """The sha256 blob a snapshot symlink names, if it is one the hub wrote: relative, to this repository's blobs/."""
    try:
        target = os.readlink(link)
    except OSError:
        return ""
    if target.startswith("/"):
        return ""
    lands = os.path.normpath(os.path.join(os.path.dirname(link), target))
    folder, name = os.path.split(lands)
    return name if folder == os.path.join(root, repo, "blobs") and SHA256_HEX.fullmatch(name) else ""


def _keep_verified(root_fd: int, linked: list[tuple[Reference, str]], endpoint: str, found: Recognition,
                   workers: int, memo: Optional[dict] = None) -> dict:
    """The linked blobs whose content hashes to their name, as references with the blob's attributes;
    the others left in the layers with why. Returns what each blob checked gave (its lstat or why not)."""
    blobs = sorted({posixpath.join(r.repo_folder, "blobs", blob) for r, blob in linked})
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        checked = dict(zip(blobs, pool.map(lambda b: _verified_blob(root_fd, b, memo), blobs)))
    for ref, blob in linked:
        st = checked[posixpath.join(ref.repo_folder, "blobs", blob)]
        if isinstance(st, os.stat_result):
            found.references.append(Reference(
                ref.cache, ref.repo_type, ref.repo_id, ref.revision, ref.path, blob, st.st_size, endpoint,
                stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns))
    found.left.extend((b, why) for b, why in checked.items() if isinstance(why, str))
    return checked


def _left_unnamed(root: str, repos: Iterable[str], checked: dict, found: Recognition) -> None:
    """The blobs of each repository that no snapshot symlink names, or whose name is a git hash: left."""
    for repo in repos:
        for name in _names(os.path.join(root, repo, "blobs")):
            path = posixpath.join(repo, "blobs", name)
            if path not in checked:
                found.left.append((path, "no snapshot names it" if SHA256_HEX.fullmatch(name)
                                   else "not named by a sha256 (a small file the hub hashes with git)"))


def _verified_blob(root_fd: int, blob: str, memo: Optional[dict] = None):
    """The blob's lstat if it is a regular file whose content hashes to its name (or `memo` saw it
    hash so with the same stat data), else why not."""
    try:
        fd = open_beneath(root_fd, blob)
    except OSError:
        return "not a regular file reached without symlinks"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_nlink > 1:  # a reference would lose its other names' link: the layers keep it
            return "hard-linked to other names"
        seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if memo is not None and memo.get(blob) == seen:
            return st
        if file_digest(f) != "sha256:" + posixpath.basename(blob):
            return "its content does not hash to its name"
    if memo is not None:
        memo[blob] = seen
    return st


def token_files(root: str, folders: list[str], token_path: Optional[str]) -> list[str]:
    """The token files in each Hugging Face home (a hub cache's parent, a candidate) and at HF_TOKEN_PATH."""
    paths = [posixpath.join(f.strip("/"), n) for f in folders for n in TOKEN_FILES]
    if token_path and token_path.startswith("/"):
        paths.append(token_path.strip("/"))
    return [p for p in dict.fromkeys(paths) if plain_relative(p) and os.path.lexists(os.path.join(root, p))]
