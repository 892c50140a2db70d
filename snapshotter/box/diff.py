"""The diff of a live box against its base image's index."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Optional

from snapshotter.digests import file_digest
from snapshotter.index.entry import DIR, FILE, Entry

from .openat import Beneath, NotTheScanned
from .scan import Scan


@dataclass
class Diff:
    changed: list[Entry]  # added or modified paths of the box, sorted
    deleted: list[str]  # base paths gone from the box (only the top-most of a deleted tree)


def within_its_second(e: Entry, old: Entry) -> bool:
    """Is box file `e`, whose metadata matches its base entry `old` (same_as: size, whole-second
    mtime, ...), not at the base's mtime to the nanosecond? Then an edit of the same size within
    that second looks unchanged, and only its content tells (git's racy entries). A file the base's
    tar made is at the header's exact time: never read."""
    return bool(e.stamp) and old.digest is not None and e.kind == FILE and \
        int(e.stamp.split(":")[1]) != old.image_mtime_ns()


def scanned_digest(files: Beneath, e: Entry) -> Optional[str]:
    """The content digest of the regular file the scan saw at `e.path`, opened below the root
    following no symlink and without blocking; None if it is gone, is not that file any more or
    cannot be read now (the layer's read then holds it back)."""
    try:
        fd = files.open_scanned(e.path, int(e.stamp.split(":", 1)[0]) if e.stamp else None)
    except (FileNotFoundError, PermissionError, NotTheScanned):
        return None
    with os.fdopen(fd, "rb") as f:
        return file_digest(f)


def diff(base: dict[str, Entry], scan: Scan, skipped: Callable[[str], bool], rehash: bool = False,
         root: str = "/") -> Diff:
    """Compare the box with its base image. `skipped(path)` says a path was not scanned (excluded or
    a secret): such base paths are unknown, not deleted. A file that matches its base entry but
    for the fraction of its mtime's second is compared by content (within_its_second)."""
    box = scan.entries
    changed: list[Entry] = []
    with contextlib.ExitStack() as stack:
        files = None  # opened on the first content read: most commits read none

        def content_digest(e: Entry) -> Optional[str]:
            nonlocal files
            files = files or stack.enter_context(Beneath(root))
            return scanned_digest(files, e)

        for rel in sorted(box):
            e = box[rel]
            old = base.get(rel)
            if old is not None and rehash and e.kind == FILE and old.kind == FILE and old.digest:
                e.digest = content_digest(e)
                if e.digest is None:  # not the file the scan saw: the layer reads it again, or holds it back
                    changed.append(e)
                    continue
            if old is None or not e.same_as(old, compare_content=rehash):
                changed.append(e)
            elif not rehash and within_its_second(e, old):
                e.digest = content_digest(e)  # None: gone or swapped since the scan: the layer says so
                if e.digest != old.digest:
                    e.mtime_ns = int(e.stamp.split(":")[1])  # else a restore of it would look unchanged next time
                    changed.append(e)
    deleted: list[str] = []
    for rel in sorted(base):
        if rel in box or skipped(rel):
            continue
        parent = rel.rpartition("/")[0]
        if parent and (parent not in box or box[parent].kind != DIR):
            continue  # the parent's own whiteout or replacement covers it
        deleted.append(rel)
    return Diff(changed, deleted)
