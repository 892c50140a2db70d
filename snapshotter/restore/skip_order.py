"""The order rule of skip.py (its module doc, 3.): a layer the root holds stays skipped only if no
layer applied before it writes or deletes one of its paths or a parent of them, and the parts of a
file only all together."""

from __future__ import annotations

import stat
from typing import Protocol

from snapshotter.oci.image import SNAP_PART_FILE
from snapshotter.tar.rules import check_name

WHITEOUT = "whiteout"  # a path kind in LayerCheck.paths beside stat's S_IFMT values: the path is deleted


class LayerCheck(Protocol):
    """What the order rule reads of skip.py's LayerCheck."""

    paths: list[tuple[str, object, tuple]]  # (path, kind, for a directory the attributes it sets)


def in_order(todo: list[tuple[int, dict, str]], start: int, checks: dict[int, LayerCheck],
             passed: set[int]) -> set[int]:
    """The layers of `passed` that stay skipped once the layers applied before them are (skip.py's
    module doc, 3.), and the parts of a file only all together. Repeated until nothing changes."""
    while True:
        kept = _order_pass(todo, start, checks, passed)
        kept = _whole_files(todo, start, kept)
        if kept == passed:
            return kept
        passed = kept


def _order_pass(todo: list, start: int, checks: dict[int, LayerCheck], passed: set[int]) -> set[int]:
    written: dict[str, tuple[object, tuple]] = {}  # what the layers applied so far write
    kept: set[int] = set()
    for n in range(start, len(todo)):
        check = checks.get(n)
        if check is None:
            return kept  # applied, and what it writes is not known: nothing after it is skipped
        if n in passed and not any(_clashes(path, kind, attrs, written) for path, kind, attrs in check.paths):
            kept.add(n)
            continue
        for path, kind, attrs in check.paths:
            if written.get(path, (None,))[0] is not WHITEOUT:  # a path deleted stays so for what lies below it
                written[path] = (kind, attrs)
    return kept


def _clashes(path: str, kind: object, attrs: tuple, written: dict[str, tuple[object, tuple]]) -> bool:
    """Does an applied layer's write of `path` or of a parent of it change what a skipped layer checked?"""
    have = written.get(path)
    if have is not None:
        if not (kind == stat.S_IFDIR and have[0] == stat.S_IFDIR):
            return True
        # The same directory: harmless if it keeps the mode, owner and xattrs, and its mtime is
        # decided later (or is the same).
        (mode, uid, gid, xattrs, mtime, decided_later), theirs = attrs, have[1]
        if (mode, uid, gid, xattrs) != theirs[:4] or (not decided_later and mtime != theirs[4]):
            return True
    parent = path
    while parent:  # up to the root ("": an opaque whiteout at the top)
        parent = parent.rpartition("/")[0]
        above = written.get(parent)
        if above is not None and above[0] != stat.S_IFDIR:
            return True
    return False


def _whole_files(todo: list, start: int, kept: set[int]) -> set[int]:
    """The part layers of a file stay skipped only if all its parts are (a resumed run applied none)."""
    parts: dict[str, list[int]] = {}
    for n, (_, desc, _) in enumerate(todo):
        ann = desc.get("annotations") or {}
        rel = ann.get(SNAP_PART_FILE) if isinstance(ann, dict) else None
        if isinstance(rel, str):
            parts.setdefault(rel, []).append(n)
    out = set(kept)
    for ns in parts.values():
        if not all(n in kept for n in ns):
            out -= set(ns)
    return out


def skipped_part_files(todo: list[tuple[int, dict, str]], skipped: dict[int, str]) -> set[str]:
    """The files cut into parts whose part layers are all skipped: nothing to join."""
    out = set()
    for n, (_, desc, _) in enumerate(todo):
        ann = desc.get("annotations") or {}
        rel = ann.get(SNAP_PART_FILE) if isinstance(ann, dict) else None
        if isinstance(rel, str) and n in skipped:
            out.add(check_name(rel))
    return out
