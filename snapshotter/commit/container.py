"""`snap commit --from-container NAME`: a container's changes, from the Docker engine's own diff.

Instead of walking a filesystem, ask the engine what the container's writable layer changed
against its image (kinds 0 modified, 1 added, 2 deleted) and copy out only those paths, through the
engine's archive API, into a mirror directory laid out like the box. The archive API resolves paths
inside the container, and the mirror is written by snap's careful extractor, so nothing in the
container (a symlink swapped in while we read) can make us read or write outside it. The base
image's index overlaid with these changes is then what a walk of the container would have seen, so
commit's usual diff and layer planning give the same layers."""

from __future__ import annotations

import bisect
import functools
import io
import os
import shutil
import stat
import tarfile
from dataclasses import replace
from typing import Callable, Optional

from snapshotter import progress
from snapshotter.box.diff import Diff, diff
from snapshotter.box.openat import file_head
from snapshotter.box.scan import Scan
from snapshotter.digests import file_digest, sha256_digest
from snapshotter.engine.run import connect
from snapshotter.errors import NotFound, SnapError, UsageError
from snapshotter.index.entry import DIR, FILE, Entry, clean_path, entry_from_stat
from snapshotter.layer.extract import Extractor
from snapshotter.layer.extract_model import ExtractOptions
from snapshotter.oci.image import Image
from snapshotter.profile import Profile, VenvRoots
from snapshotter.state import exclusive, sub
from snapshotter.tar.compress import IterReader

from .commit import commit_box
from .model import SCRATCH, CommitHooks, CommitOptions, CommitResult

ADDED, DELETED = 1, 2
_GO_MODE_DIR = 1 << 31  # os.ModeDir in the archive API's stat header


def commit_from_container(container: str, target: str, base: Optional[str], opts: CommitOptions) -> CommitResult:
    """Commit the changes of a (running or stopped) container. `base` defaults to the registry image the
    container was started from."""
    if base == SCRATCH:
        raise UsageError("--base scratch captures a root, not a container's changes",
                         "pass --root instead of --from-container")
    client = connect()
    import docker  # importable: connect() checked

    try:
        ct = client.containers.get(container)
    except docker.errors.NotFound:
        raise NotFound(f"no container {container!r} on the Docker engine", "list them with docker ps -a")
    base = base or base_of(ct)
    # The container came from its image: a tag that names it may move (snapshot/lineage.py).
    origins = tuple(d.split("@", 1)[1] for d in _repo_digests(ct) if "@" in d)
    # One mirror per container: a stable root keeps commit's stat cache file from piling up.
    mirror = os.path.join(sub("containers"), ct.id[:12])
    # Under the state lock from the start (commit_box takes it again, nested): a second commit of this
    # container waits, and never wipes the mirror the first one reads.
    with exclusive(opts.log):
        shutil.rmtree(mirror, ignore_errors=True)
        os.makedirs(mirror)
        try:
            return commit_box(target, base, replace(opts, root=mirror, origins=opts.origins + origins),
                              _ContainerChanges(ct, mirror, opts))
        finally:
            shutil.rmtree(mirror, ignore_errors=True)


class _ContainerChanges(CommitHooks):
    """The commit's changes are the container's diff (container_changes), read into `mirror`."""

    def __init__(self, ct, mirror: str, opts: CommitOptions):
        super().__init__()
        self.ct, self.mirror, self.opts = ct, mirror, opts

    def changes(self, base_img, index):
        return container_changes(self.ct, base_img, index, self.mirror, self.opts.profile, self.opts.log)


def base_of(ct) -> str:
    """The registry reference (pinned by digest) of the image a container was started from."""
    digests = _repo_digests(ct)
    if not digests:
        raise UsageError(f"the image of container {ct.name} did not come from a registry, "
                         "so snap cannot read its layers", "push it to a registry and pass it as --base")
    wanted = _repo(ct.attrs["Config"]["Image"])
    chosen = next((d for d in digests if _repo(d) == wanted), digests[0])
    return _with_registry(chosen)


def _repo_digests(ct) -> list[str]:
    """The registry names (NAME@sha256:...) of the image a container was started from."""
    import docker

    try:
        return ct.image.attrs.get("RepoDigests") or []
    except docker.errors.ImageNotFound:
        return []


def _repo(name: str) -> str:
    name = name.split("@", 1)[0]
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def _with_registry(name: str) -> str:
    """Docker Hub short names ('ubuntu@...', 'me/app@...') spelled out with their registry."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return name
    return f"docker.io/{name}" if rest else f"docker.io/library/{name}"


def container_changes(ct, base_img: Image, index: dict[str, Entry], mirror: str, profile: Profile,
                      log: Callable[[str], None] = lambda msg: None) -> tuple[Scan, Diff]:
    """Export the container's changed paths into `mirror` and return what commit needs: the scan of
    the container (the base index overlaid with the changes) and its diff against the base."""
    image_id = ct.attrs["Image"]
    if image_id not in (sha256_digest(base_img.config_bytes), base_img.manifest_digest):
        raise UsageError(f"container {ct.name} was started from image {image_id[:19]}, "
                         f"not from the base {base_img.ref}",
                         "pass the image it was started from as --base, or leave --base out")
    skipped = profile.leaves_out
    changes = {rel: c["Kind"] for c in ct.diff() or [] if (rel := clean_path(c["Path"]))}
    secrets = sorted(p for p in changes if not profile.exclude.match(p) and skipped(p) and not skipped(_parent(p)))
    log(f"container {ct.name}: {len(changes)} changed path(s) in the engine's diff")
    exported = _export_changes(ct, changes, mirror, skipped)
    view = dict(index)
    keys = sorted(view)
    for rel, kind in changes.items():
        if kind == DELETED:
            _drop_tree(view, keys, rel, keep_self=False)
    entries = _overlay(view, keys, exported, mirror, profile, secrets)
    venvs = VenvRoots(_parent(p) for p, e in view.items() if p.rpartition("/")[2] == "pyvenv.cfg" and e.kind == FILE)
    scan = Scan(view, venvs, sorted(secrets))
    d = diff(index, scan, skipped)
    # The engine says these were written: one rewritten at its old size and mtime still counts.
    seen = {e.path for e in d.changed}
    for rel, e in entries.items():
        old = index.get(rel)
        if rel not in seen and e.kind == FILE and old is not None and old.kind == FILE and old.digest:
            e.digest = file_digest(os.path.join(mirror, rel))
            if e.digest != old.digest:
                d.changed.append(e)
    d.changed.sort(key=lambda e: e.path)
    return scan, d


def _export_changes(ct, changes: dict[str, int], mirror: str, skipped: Callable[[str], bool]) -> list[str]:
    """Copy the changed paths out of the container into `mirror`: the paths it wrote there."""
    # An added directory is copied whole, unless something under it must be left out.
    blocked: set[str] = set()
    for p in changes:
        if skipped(p):
            while (p := _parent(p)) and p not in blocked:
                blocked.add(p)
    exported: list[str] = []
    whole = None  # the added directory being copied whole: its listed children come with it
    with progress.bar("copying from the container", len(changes), unit="paths") as b:
        for rel in sorted(changes, key=lambda p: p.split("/")):  # parents before children
            b.update(1)
            if (whole and rel.startswith(whole + "/")) or skipped(rel):
                continue
            take_all = changes[rel] == ADDED and rel not in blocked
            got = _export(ct, rel, mirror, take_all)
            exported.extend(got)
            if got and take_all:
                whole = rel
    return exported


def _overlay(view: dict[str, Entry], keys: list[str], exported: list[str], mirror: str, profile: Profile,
             secrets: list[str]) -> dict[str, Entry]:
    """Put the exported paths' entries over the base's in `view` (secrets noted in `secrets`, and
    left as the base has them): the entries put."""
    entries: dict[str, Entry] = {}
    for rel in exported:
        full = os.path.join(mirror, rel)
        st = os.lstat(full)
        e = entry_from_stat(rel, st, os.readlink(full) if stat.S_ISLNK(st.st_mode) else "")
        if e is None or profile.leaves_out(rel):
            continue
        if profile.is_secret(rel, e.kind == DIR, e.kind == FILE, functools.partial(file_head, full)):
            secrets.append(rel)  # a secret file, told by its kind and content: the base's copy stays
            continue
        old = view.get(rel)
        if old is not None and old.kind == DIR and e.kind != DIR:
            _drop_tree(view, keys, rel, keep_self=True)  # a file replaced a whole directory
        view[rel] = entries[rel] = e
    return entries


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _drop_tree(view: dict[str, Entry], keys: list[str], rel: str, keep_self: bool) -> None:
    """Remove `rel`'s subtree from the view; `keys` is the sorted base paths (a subtree is a range)."""
    if not keep_self:
        view.pop(rel, None)
    lo = bisect.bisect_left(keys, rel + "/")
    hi = bisect.bisect_left(keys, rel + "0")  # "0" sorts right after "/"
    for k in keys[lo:hi]:
        view.pop(k, None)


def _extract_options() -> ExtractOptions:
    root = os.geteuid() == 0
    return ExtractOptions(same_owner=root, allow_devices=root, allow_setuid=root)


def _export(ct, rel: str, mirror: str, take_all: bool) -> list[str]:
    """Copy one changed path out of the container into the mirror: a directory's own attributes only,
    or (take_all) the whole tree. Returns the paths written ([] if it is gone from the container)."""
    import docker

    try:
        chunks, info = ct.client.api.get_archive(ct.id, "/" + rel, chunk_size=1 << 20)
    except docker.errors.NotFound:
        return []  # deleted (or deleted since the diff)
    parent, _, name = rel.rpartition("/")
    pdir = _mirror_dir(mirror, parent)
    reader = IterReader(chunks)
    if info["mode"] & _GO_MODE_DIR and not take_all:
        # The archive of a directory is its whole tree, and the directory's own entry comes first:
        # keep that entry, hang up on the rest.
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            first = tar.next()
        chunks.close()
        if first is None or clean_path(first.name) != name:
            raise SnapError(f"the Docker engine sent an unexpected archive for /{rel}")
        one = io.BytesIO()
        with tarfile.open(fileobj=one, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(first)
        one.seek(0)
        Extractor(pdir, _extract_options()).apply(one)
        return [rel]
    Extractor(pdir, _extract_options()).apply(reader)
    reader.drain()
    out = [rel]
    top = os.path.join(pdir, name)
    if os.path.isdir(top) and not os.path.islink(top):
        for dirpath, dirnames, filenames in os.walk(top):
            base = rel + dirpath[len(top):]
            out.extend(f"{base}/{n}" for n in dirnames + filenames)
    return out


def _mirror_dir(mirror: str, rel: str) -> str:
    """The mirror's directory for `rel`, never through a symlink: parents were exported first, and a
    non-directory there means the container changed under us."""
    current = mirror
    for part in rel.split("/") if rel else []:
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)  # an unchanged base directory: only a place to put children
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise SnapError(f"/{rel} changed in the container while snap read it",
                            "stop the container (docker stop) and commit again")
    return current
