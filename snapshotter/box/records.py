"""Which installed distribution owns a path, as its `*.dist-info/RECORD` says: pip writes there every
file it installed for the distribution, so `yaml/` and `PyYAML-6.0.1.dist-info/` (or a namespace
package's `nvidia/cublas/` and `nvidia_cublas_cu12-*.dist-info/`) are known to be one unit, whatever
their names (layer/units.py falls back to names for the paths no RECORD lists).

A RECORD is the box's own file, read below the root's handle (box/openat.py) and bounded: one past
RECORD_MAX bytes, or not a regular file, is left out (its paths get the name rule). The owner of a
path two RECORDs list is the first by name: the same tree gives the same units anywhere."""

from __future__ import annotations

import csv
import io
import os
import posixpath
import re
import stat
from typing import Optional

from snapshotter.box.openat import open_beneath, open_root
from snapshotter.index.entry import FILE, Entry

RECORD_MAX = 16 * 1024**2  # torch's RECORD is about 2 MB
_RECORD = re.compile(r"(?:^|/)(?:site|dist)-packages/([^/]+)\.dist-info/RECORD$")
_SITE_DIR = re.compile(r"(?:^|/)(?:site|dist)-packages/.")  # a path below a site-packages directory


class Owners:
    """The distribution each path belongs to, named by its dist-info directory (root-relative): the
    one whose RECORD lists the path, else (a byte-code file compiled later, a file a package writes
    into itself) the one that owns every listed file below the path's nearest directory that has
    listed files."""

    def __init__(self, files: dict[str, str], dirs: Optional[dict[str, Optional[str]]] = None):
        self.files = files
        # A directory below site-packages: its one owner, or None (`dirs`: as made for these files before).
        self.dirs: dict[str, Optional[str]] = {} if dirs is None else dirs
        for path, key in sorted(files.items()) if dirs is None else ():
            parent = path.rpartition("/")[0]
            while _SITE_DIR.search(parent):
                self.dirs[parent] = key if self.dirs.get(parent, key) == key else None
                parent = parent.rpartition("/")[0]

    def owner_of(self, path: str) -> Optional[str]:
        key = self.files.get(path)
        parent = path.rpartition("/")[0]
        while key is None and _SITE_DIR.search(parent):
            if parent in self.dirs:
                return self.dirs[parent]  # the nearest directory with listed files decides
            parent = parent.rpartition("/")[0]
        return key


def owners_of(root: str, entries: dict[str, Entry], memo: Optional[RecordMemo] = None) -> Owners:
    """Who owns each path (Owners), from the RECORDs among `entries`. `memo` keeps each RECORD's
    parse for the next call while its stamp (inode, mtime, ctime) is the same."""
    memo = memo if memo is not None else RecordMemo()
    records = _records_in(entries)
    seen = tuple((p, e.stamp) for p, e in records)
    if memo.last is not None and memo.last[0] == seen:
        return memo.last[1]  # no RECORD changed
    memo.start()
    found: dict[str, str] = {}
    root_fd: Optional[int] = None
    try:
        for path, e in records:
            listed = memo.get(path, e.stamp)
            if listed is None:
                if root_fd is None:
                    root_fd = open_root(root)
                listed = _read(root_fd, path)
                memo.put(path, e.stamp, listed)
            key = path.rpartition("/")[0]  # the dist-info directory
            for owned in listed:
                if owned not in found or key < found[owned]:
                    found[owned] = key
    finally:
        if root_fd is not None:
            os.close(root_fd)
    owners = Owners(found)
    memo.last = (seen, owners) if all(stamp for _, stamp in seen) else None
    return owners


def _records_in(entries: dict[str, Entry]) -> list[tuple[str, Entry]]:
    return sorted((p, e) for p, e in entries.items() if p.endswith("/RECORD") and _RECORD.search(p)
                  and e.kind == FILE and e.size <= RECORD_MAX)


def record_stamps(entries: dict[str, Entry]) -> Optional[tuple]:
    """The RECORDs among `entries` with their stamps: what owners_of() gives depends on nothing
    else. None if one has no stamp (not a box's)."""
    seen = tuple((p, e.stamp) for p, e in _records_in(entries))
    return seen if all(stamp for _, stamp in seen) else None


def _read(root_fd: int, path: str) -> list[str]:
    """The root-relative paths the RECORD at `path` lists (its paths are relative to its
    site-packages directory; one that leaves the root is dropped); [] if it cannot be read."""
    try:
        fd = open_beneath(root_fd, path)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > RECORD_MAX:
            return []
        data = os.read(fd, RECORD_MAX + 1)
    except OSError:
        return []
    finally:
        os.close(fd)
    if len(data) > RECORD_MAX:
        return []
    site = path.rsplit("/", 2)[0]
    out = []
    text = data.decode("utf-8", "surrogateescape")
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error:  # not CSV after all: the name rule applies
        return []
    for row in rows:
        if not row or not row[0] or row[0].startswith("/"):
            continue
        rel = posixpath.normpath(posixpath.join(site, row[0]))
        if rel != ".." and not rel.startswith("../"):
            out.append(rel)
    return out


class RecordMemo:
    """The paths each RECORD listed at the last call, by its path and stamp (`snap watch` keeps one
    through PlanMemo): an unchanged RECORD is not read again. Each call keeps only what it used."""

    def __init__(self):
        self.last: Optional[tuple[tuple, Owners]] = None  # the RECORDs' paths and stamps, and what they gave
        self._now: dict[str, tuple[str, list[str]]] = {}
        self._old: dict[str, tuple[str, list[str]]] = {}

    def start(self) -> None:
        self._old, self._now = self._now, {}

    def state(self) -> tuple:
        """What this memo holds, as plain data (snapshot/kept.py keeps it between commits)."""
        last = (self.last[0], self.last[1].files, self.last[1].dirs) if self.last is not None else None
        return last, self._now

    @classmethod
    def from_state(cls, state: tuple) -> RecordMemo:
        memo = cls()
        last, memo._now = state
        memo.last = (last[0], Owners(last[1], last[2])) if last is not None else None
        return memo

    def get(self, path: str, stamp: str) -> Optional[list[str]]:
        hit = self._old.get(path)
        if hit is None or not stamp or hit[0] != stamp:
            return None
        self._now[path] = hit
        return hit[1]

    def put(self, path: str, stamp: str, listed: list[str]) -> None:
        self._now[path] = (stamp, listed)
