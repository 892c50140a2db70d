"""Before resuming: does the root still hold what the journal says the applied layers wrote?

A journal (journal.py) that says layers are applied is believed only as far as the root bears it
out: someone may have deleted files between the runs, or the disk lost them. The rule, bounded by
the files the applied layers wrote (at most the image's entry cap, tar/reader.py's EntryCount) and
reading no byte: every non-directory the journal lists as written, and not removed or replaced by
a later applied layer (a whiteout, an opaque directory, a file or symlink at it or at a parent, a
file written beneath it), is lstat'ed, and must be what the layer left (a regular file of its
size, a symlink, a hardlink's regular file: its target's inode, unless a later layer wrote the
target anew, a node). A joined file stands for its parts: a regular file of the size the journal
says it was joined to, else its first part layer is where the restore goes back to. The first
layer that fails is where the restore goes back to (Journal.rewind): it and every layer after it
are applied again. Not checked: directories (a layer's files need them, and those files are
checked), the bytes of a file of the right size, and layers an earlier run found in place and
skipped (skip.py checked them then; the journal lists no files for them). But the part layers of
a file are skipped all together or not at all: a run killed once the journal listed some of them
(skipped, no file written) and not the others goes back to the first of them, else the others,
checked alone, would be applied and leave a file that cannot be joined."""

from __future__ import annotations

import os
import stat
from typing import Optional, Sequence

from snapshotter.errors import printable
from snapshotter.index.entry import self_and_parents
from snapshotter.layer.extract_model import LINK_SHAPE, OTHER_SHAPE, SYMLINK_SHAPE
from snapshotter.layer.plan import parse_part_name
from snapshotter.oci.image import SNAP_PART_FILE

from .journal import Journal


def _expected(journal: Journal) -> dict[str, tuple[int, int]]:
    """{path: (layer n, shape)} of what the applied layers left, the last layer first: a path a
    later layer wrote or hid is that layer's, or gone."""
    out: dict[str, tuple[int, int]] = {}
    covered: set[str] = set()  # written or hidden by a later layer, with everything under it
    below: set[str] = set()  # opaque directories of a later layer: everything under them is hidden
    dirs: set[str] = set()  # directories a later layer wrote into: no longer an earlier layer's file
    for n in sorted(journal.done, reverse=True):
        done = journal.done[n]
        for rel, shape in zip(done.wrote, done.shapes):
            if rel not in out and rel not in dirs and not _hidden(rel, covered, below):
                out[rel] = (n, shape)
        covered.update(done.wrote)
        dirs.update(p for rel in done.wrote for p in self_and_parents(os.path.dirname(rel)))
        for rel in done.gone:
            (below if rel.endswith("/") else covered).add(rel.rstrip("/"))
    for rel in list(out):
        part = parse_part_name(rel)
        if part is not None and part[0] in journal.joined:  # joined: its parts are removed
            layer = out.pop(rel)[0]
            # Of the size joined; else applied again from its first part layer (a later one alone
            # would bring some of its parts back, not all) and joined again.
            first = min(layer, out.get(part[0], (layer, 0))[0])
            out[part[0]] = (first, journal.joined[part[0]])
    return out


def _hidden(rel: str, covered: set[str], below: set[str]) -> bool:
    return rel in covered or any(p in covered or p in below for p in self_and_parents(os.path.dirname(rel)))


def _there(path: str, shape: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if shape == SYMLINK_SHAPE:
        return stat.S_ISLNK(st.st_mode)
    if shape == OTHER_SHAPE:
        return not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode)
    return stat.S_ISREG(st.st_mode) and (shape == LINK_SHAPE or st.st_size == shape)


def _linked(root: str, rel: str, n: int, journal: Journal, expected: dict[str, tuple[int, int]]) -> bool:
    """A hardlink that layer n wrote at /rel is still one name of its target's file (one inode), unless
    a later layer wrote the target anew or hid it (then the two are apart, rightly)."""
    target = journal.done[n].links.get(rel)
    if target is None or expected.get(target, (n + 1, 0))[0] > n:
        return True
    try:
        a, b = os.lstat(os.path.join(root, rel)), os.lstat(os.path.join(root, target))
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _split_skipped_parts(journal: Journal, todo: Sequence[tuple[int, dict, str]]) -> Optional[tuple[int, str]]:
    """(the first part layer n of a file that the journal lists as done with no file written, while
    it does not list all the file's parts yet, that file), or None."""
    parts: dict[str, list[int]] = {}
    for n, (_, desc, _) in enumerate(todo, 1):
        ann = desc.get("annotations") or {}
        rel = ann.get(SNAP_PART_FILE) if isinstance(ann, dict) else None
        if isinstance(rel, str):
            parts.setdefault(rel, []).append(n)
    worst: Optional[tuple[int, str]] = None
    for rel, ns in parts.items():
        done = [n for n in ns if n <= journal.applied]
        # A part layer applied writes its part; one listed with none was skipped (or wrote nothing: applied again).
        if done and len(done) < len(ns) and any(n not in journal.done or not journal.done[n].wrote for n in done):
            worst = min(worst or (done[0], rel), (done[0], rel))
    return worst


def first_missing(root: str, journal: Journal, todo: Sequence[tuple[int, dict, str]]) -> Optional[tuple[int, str]]:
    """(the first applied layer n whose files are not all in `root`, or that is a part of a file
    skipped with only some of its other parts: what is wrong, in words), or None."""
    worst: Optional[tuple[int, str]] = None
    expected = _expected(journal)
    for rel, (n, shape) in expected.items():
        if (worst is None or n < worst[0]) and not (
                _there(os.path.join(root, rel), shape)
                and (shape != LINK_SHAPE or _linked(root, rel, n, journal, expected))):
            worst = (n, rel)
    if worst is not None:
        worst = (worst[0], f"/{printable(worst[1])} is not in {root} as it left it")
    split = _split_skipped_parts(journal, todo)
    if split is not None and (worst is None or split[0] < worst[0]):
        worst = (split[0], f"it found in place only some of the part layers of /{printable(split[1])}")
    return worst
