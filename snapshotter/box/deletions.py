"""What a snapshot deletes of a system, and when that is the system itself: counted at commit
against the base (a wrong --root: an empty directory diffs as the whole base deleted), and at a
restore onto a live root against the paths that root holds, from the deletions the layers carry
(restore/deletion_guard.py), before anything is written.

One rule for both. A snapshot deletes the system when it deletes a directory that holds paths,
or empties a system one (it stays, each of its paths deleted: a whiteout per file), that is
  1. a top-level directory (bin, etc, usr, workspace; an empty /srv or /mnt does not count:
     deleting it loses nothing), or a top-level link to one (/bin -> usr/bin); emptied, only a
     system one (SYSTEM_TOPS: a box that deletes the files the base put in /workspace or /root
     keeps its system), or
  2. a system directory: a direct child of usr/ (usr/bin, usr/lib, usr/share, usr/local), or a
     directory at most three levels deep under a system top-level directory (SYSTEM_TOPS: bin,
     boot, etc, lib*, sbin, usr) that holds more than BIG_SYSTEM_DIR paths (etc/ssl,
     usr/lib/x86_64-linux-gnu, usr/lib/python3); a package's own small directory (etc/nginx,
     usr/lib/nginx) and anything deeper (a site-packages' package) are not,
or when it deletes more than half of the paths there are. Directories are judged where they
are (a whiteout of bin/ls on a root where /bin links to usr/bin deletes usr/bin/ls).

The manifest's record of the commit's count (SNAP_DELETES) is information only: an image can
say anything there, so a restore never reads it; it counts what the layers' tar headers delete."""

from __future__ import annotations

import bisect
import json
import os
import stat
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from snapshotter.errors import IntegrityError, UsageError, quoted_path
from snapshotter.index.entry import DIR, Entry
from snapshotter.index.paths import resolve_in_root

SNAP_DELETES = "dev.snap.deletes"  # manifest annotation: {"paths": n, "of": base paths, "top": [top-level dirs]}
TOP_SHOWN = 5  # directories named in a message
SYSTEM_TOPS = frozenset({"bin", "boot", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "usr"})
BIG_SYSTEM_DIR = 100  # paths: a directory under a system top-level directory holding more is the system's
SYSTEM_DEPTH = 3  # components: usr/lib/x86_64-linux-gnu, and no deeper


def system_dir(rel: str, paths: int) -> bool:
    """Is deleting (or emptying) directory `rel`, which holds paths, `paths` of them deleted,
    deleting a system directory (rule 2 of the module doc; top-level directories are rule 1)?"""
    parts = rel.split("/")
    if len(parts) < 2 or parts[0] not in SYSTEM_TOPS:
        return False
    return (len(parts) == 2 and parts[0] == "usr") or (len(parts) <= SYSTEM_DEPTH and paths > BIG_SYSTEM_DIR)


@dataclass
class Deletions:
    paths: int  # paths the snapshot deletes (a deleted tree counts each path in it)
    of: int  # paths there are (at least that many, unless `exact`)
    top: list[str]  # top-level directories, holding paths, that it deletes
    system: list[str] = field(default_factory=list)  # deeper system directories it deletes or empties (system_dir)
    sizes: dict[str, int] = field(default_factory=dict)  # paths deleted in each directory of `top` and `system`
    exact: bool = True  # `of` counts every path; else the count stopped once it was over twice `paths`

    @property
    def deletes_system(self) -> bool:
        return bool(self.top) or bool(self.system) or 2 * self.paths > self.of

    def describe(self, whose: str = "the base's", sized: bool = False) -> str:
        """'2 of the base's top-level directories (/etc, /usr) and 9 of its 12 paths'; `sized`: the
        directories that delete most first, quoted, with their counts ('/usr/bin' 120 paths)."""
        def shown(dirs: list[str]) -> str:
            if sized:
                dirs = sorted(dirs, key=lambda d: (-self.sizes.get(d, 0), d))
            named = [f"{quoted_path(d)} {self.sizes.get(d, 0)} paths" if sized else "/" + d for d in dirs[:TOP_SHOWN]]
            return ", ".join(named) + (", ..." if len(dirs) > TOP_SHOWN else "")

        kinds = [(self.top, "top-level"), (self.system, "system")]
        dirs = "".join(f"{len(d)} of {whose} {kind} directories ({shown(d)}) and " for d, kind in kinds if d)
        of = f"{self.of}" if self.exact else f"more than {self.of}"
        return f"{dirs}{self.paths} of its {of} paths"

    def annotation(self) -> dict[str, str]:
        return {SNAP_DELETES: json.dumps({"paths": self.paths, "of": self.of, "top": self.top}, separators=(",", ":"))}


def count(index: dict[str, Entry], deleted: list[str]) -> Deletions:
    """What deleting `deleted` (the top-most paths of each deleted tree: box/diff.py's Diff) does to the
    base `index`. The paths below a path are one run of the sorted paths (those between 'p/' and
    'p0', '0' following '/'): no pass over a 200k-path base per deleted path. A directory that
    stays but loses every path below it (one whiteout per file) is judged as a deleted one."""
    if not deleted:
        return Deletions(0, len(index), [])
    paths = sorted(index)

    def below(rel: str) -> int:
        return bisect.bisect_left(paths, rel + "0") - bisect.bisect_left(paths, rel + "/")

    gone = sorted(rel for rel in deleted if rel in index)
    sums = [0]  # sums[i]: the paths the first i of `gone` delete
    for rel in gone:
        sums.append(sums[-1] + 1 + below(rel))
    dirs = {rel: below(rel) for rel in gone if index[rel].kind == DIR}
    for parent in {rel.rpartition("/")[0] for rel in gone if "/" in rel}:
        n = below(parent)
        if parent in index and index[parent].kind == DIR and ("/" in parent or parent in SYSTEM_TOPS) and \
                sums[bisect.bisect_left(gone, parent + "0")] - sums[bisect.bisect_left(gone, parent + "/")] == n:
            dirs[parent] = n  # emptied: all its paths deleted, the directory left
    top = sorted(rel for rel, n in dirs.items() if "/" not in rel and n)
    system = sorted(rel for rel, n in dirs.items() if n and system_dir(rel, 1 + n))
    return Deletions(sums[-1], len(index), top, system, {rel: 1 + dirs[rel] for rel in (*top, *system)})


def refuse_commit(root: str, d: Deletions) -> None:
    """Refuse to push a snapshot that deletes the system (unless forced: the caller's choice)."""
    if d.deletes_system:
        raise UsageError(f"the box at --root {root!r} deletes {d.describe()}: refusing to push a snapshot that "
                         "deletes the base's system", "check --root: it must be the box's root, where the base "
                         "image's files are; or pass --force to push it anyway")


# ---- a restore onto a live root ---------------------------------------------------------------------


@dataclass(frozen=True)
class Deleting:
    """One deletion a layer carries, as the extractor applies it (layer/extract.py)."""
    member: str  # the member's path: a whiteout ('usr/.wh.bin'), an opaque marker, or a non-directory
    parent: str  # the directory it deletes in, as named (resolved in the root when counted)
    name: str  # what it deletes there; "" for an opaque marker: all of it (but what the layer writes)
    layer: int = 0  # the layer's place among those applied: what an earlier one wrote, it deletes


class LiveRoot:
    """The paths a root holds, looked at only where a layer deletes: symlinks resolved as the
    extractor resolves a member's parent (as if the root were /), final components never followed,
    the paths the restore never writes (`never`: /proc, /tmp, the machine's own) never counted."""

    def __init__(self, root: str, never: Callable[[str], bool]):
        self.root, self.never = root, never
        self._links: dict[str, Optional[str]] = {}

    def _readlink(self, rel: str) -> Optional[str]:
        if rel not in self._links:
            try:
                self._links[rel] = os.readlink(os.path.join(self.root, rel))
            except OSError:  # not a link, or not there
                self._links[rel] = None
        return self._links[rel]

    def target(self, d: Deleting) -> Optional[str]:
        """Where `d` deletes: its parent resolved in the root, joined with its name (an opaque
        marker: the directory itself); None for a parent whose links loop (the extractor refuses it)."""
        parent = self.resolve(d.parent)
        if parent is None:
            return None
        return f"{parent}/{d.name}".strip("/") if d.name else parent

    def resolve(self, rel: str) -> Optional[str]:
        """`rel` with its links resolved in the root (index/paths.py); None for a loop."""
        return resolve_in_root(rel, self._readlink)

    def lstat(self, rel: str) -> Optional[os.stat_result]:
        try:
            return os.lstat(os.path.join(self.root, rel))
        except OSError:
            return None

    def children(self, rel: str) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.root, rel) if rel else self.root))
        except OSError:
            return []

    def walk(self, rel: str, limit: Optional[int] = None, skip_never: bool = False) -> Iterable[str]:
        """The paths below directory `rel` (not following links), at most `limit` of them."""
        stack, given = [rel], 0
        while stack:
            here = stack.pop()
            try:
                with os.scandir(os.path.join(self.root, here) if here else self.root) as it:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
            except OSError:
                continue
            for name, is_dir in entries:
                path = f"{here}/{name}" if here else name
                if skip_never and self.never(path):
                    continue
                yield path
                given += 1
                if limit is not None and given >= limit:
                    return
                if is_dir:
                    stack.append(path)


def count_live(live: LiveRoot, deleting: Iterable[Deleting],
               written: dict[str, int]) -> tuple[Deletions, dict[str, Optional[str]]]:
    """What `deleting` (every layer's) does to the live root: (the count, {member: where it deletes,
    for the extractor to check}). A deleted directory counts each path in it; an opaque marker each
    path of its directory; neither counts a path a layer creates again (`written`: {path: the last
    layer that creates it}), from the layer that deletes it or a later one. A directory left with
    no child (a whiteout for each) is judged as a deleted one. Only the deleted trees are walked,
    and the root's other paths only until they are more than twice the deleted ones (enough to
    tell the half rule)."""
    where: dict[str, Optional[str]] = {}
    # deleted path -> (only its contents: an opaque marker's, last layer deleting it)
    units: dict[str, tuple[bool, int]] = {}
    for d in deleting:
        where[d.member] = target = live.target(d)
        if target is None or (target and live.never(target)):
            continue  # a loop (the extractor refuses it), or the machine's own path: never deleted
        for rel in [target] if d.name or target else [c for c in live.children("") if not live.never(c)]:
            only, layer = units.get(rel, (True, -1))  # an opaque marker at the root deletes each top-level path
            units[rel] = (only and bool(target) and not d.name, max(layer, d.layer))

    def created_again(rel: str) -> bool:  # by a layer no earlier than each that deletes it or a directory above it
        parts = rel.split("/")
        ups = ("/".join(parts[:k]) for k in range(1, len(parts) + 1))
        return rel in written and all(written[rel] >= units[up][1] for up in ups if up in units)

    deleted: dict[str, tuple[int, int, bool]] = {}  # path -> (paths deleted there, of them below it, whether it stays)
    for rel in sorted(units):
        if _inside_counted(rel, deleted):
            continue
        st = live.lstat(rel)
        if st is None:
            continue
        below = sum(1 for p in live.walk(rel) if not created_again(p)) if stat.S_ISDIR(st.st_mode) else 0
        # A link replaced is gone whatever takes its name.
        stays = units[rel][0] or (created_again(rel) and not stat.S_ISLNK(st.st_mode))
        deleted[rel] = (below + (0 if stays else 1), below, stays)
    return _judge(live, deleted, _emptied(live, deleted)), where


def _inside_counted(rel: str, counted: dict) -> bool:
    """Is `rel` inside a deleted tree already counted (sorted: a parent comes before its children)?"""
    parts = rel.split("/")
    return any("/".join(parts[:k]) in counted for k in range(1, len(parts)))


def _emptied(live: LiveRoot, deleted: dict[str, tuple[int, int, bool]]) -> dict[str, int]:
    """The directories that stay but lose every child (one whiteout for each): {directory: paths deleted in it}."""
    out = {}
    for parent in {rel.rpartition("/")[0] for rel in deleted if "/" in rel}:
        children = [f"{parent}/{name}" for name in live.children(parent)]
        if children and all(c in deleted and not deleted[c][2] for c in children):
            out[parent] = sum(deleted[c][0] for c in children)
    return out


def _judge(live: LiveRoot, deleted: dict[str, tuple[int, int, bool]], emptied: dict[str, int]) -> Deletions:
    paths = sum(n for n, _, _ in deleted.values())
    sizes = {rel: n for rel, (n, _, _) in deleted.items()}
    sizes.update(emptied)
    top, system = [], []
    for rel, (n, below, _) in [*deleted.items(), *((rel, (n, n, True)) for rel, n in emptied.items())]:
        if "/" not in rel and (below or _links_to_full_dir(live, rel)) and (rel in SYSTEM_TOPS or rel not in emptied):
            top.append(rel)
        elif below and system_dir(rel, n):
            system.append(rel)
    limit = 2 * paths + 1
    of = sum(1 for _ in live.walk("", limit, skip_never=True)) if paths else 0
    return Deletions(paths, of, sorted(top), sorted(system), {rel: sizes[rel] for rel in (*top, *system)},
                     exact=of < limit)


def _links_to_full_dir(live: LiveRoot, rel: str) -> bool:
    """A top-level link to a directory that holds anything (/bin -> usr/bin): deleting it deletes /bin."""
    st = live.lstat(rel)
    if st is None or not stat.S_ISLNK(st.st_mode):
        return False
    there = live.resolve(rel)
    return there is not None and there != rel and bool(live.children(there))


def refuse_live(root: str, ref: str, sign: str, d: Deletions) -> None:
    """Refuse, before anything is written, to apply onto a live system (`sign`: what shows one) the
    deletions of a snapshot that deletes its system."""
    if d.deletes_system:
        raise IntegrityError(f"{ref} deletes the system of {root!r}, a live system ({sign}): "
                             f"{d.describe('its', sized=True)}; refusing to apply it, nothing was written",
                             "was it committed from a wrong --root? pass --force to apply it anyway")
