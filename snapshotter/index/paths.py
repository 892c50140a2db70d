"""Paths resolved through a tree's symlinks as seen from inside its root, the way a container sees
them: an absolute target starts again at the root, `..` stops at the root, and a chain of more than
MAX_SYMLINK_HOPS links is a loop. One rule for a box's scan, an image's index and the tree an
extractor writes, so that all three put a path in the same place."""

from __future__ import annotations

from typing import Callable, Optional

from snapshotter.tar.rules import MAX_SYMLINK_HOPS

from .entry import SYMLINK, Entry


def resolve_in_root(path: str, readlink: Callable[[str], Optional[str]]) -> Optional[str]:
    """`path` (relative to the root) with each of its components resolved, the last one too;
    None for a loop. `readlink(rel)` is the target of the symlink at `rel` (a path resolved so
    far), None if `rel` is not a symlink; it is asked about each component in turn."""
    done = ""
    todo = list(reversed(path.split("/")))
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            done = done.rpartition("/")[0]
            continue
        here = f"{done}/{part}" if done else part
        target = readlink(here)
        if target is None:
            done = here
            continue
        hops += 1
        if hops > MAX_SYMLINK_HOPS:
            return None
        if target.startswith("/"):
            done = ""
        todo.extend(reversed(target.split("/")))
    return done


def entry_links(*trees: dict[str, Entry]) -> Callable[[str], Optional[str]]:
    """`readlink` for a tree held as entries by path: the first of `trees` that holds a path says
    what is there (a layer's entries over the image's index below it)."""
    def readlink(rel: str) -> Optional[str]:
        for tree in trees:
            e = tree.get(rel)
            if e is not None:
                return e.linkname if e.kind == SYMLINK else None
        return None

    return readlink
