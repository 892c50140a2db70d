"""Room kept in the state dir for the notes a next commit cannot do without: that this box made the
snapshot its tag names (statcache.note_last_commit), that a restore into a root finished
(record.note_restore); and for the watcher's pid and exit files (`watch --stop` reads them). A model
download that fills the disk would otherwise cost them, and the next commit would be refused from
the tag it should move (lineage.py). One file of RESERVE_BYTES, made where there is room (its blocks
allocated, not a sparse file); given up, once, where such a note finds the disk full, and made again
once a note is written with room to spare."""

from __future__ import annotations

import errno
import os
from snapshotter.errors import DISK_FULL
from snapshotter.state import RESERVE, open_own, replace_file, sub, write_versioned

RESERVE_BYTES = 1 << 20  # a note is a few KiB; the rest is for the temp file each is replaced through


def write_note(path: str, version: int, fields: dict) -> None:
    """state.write_versioned for such a note: where the disk is full, again once the reserve is given up."""
    try:
        write_versioned(path, version, fields)
    except OSError as e:
        if e.errno not in DISK_FULL or not _give_up():
            raise
        write_versioned(path, version, fields)
        return
    _keep()


def _path() -> str:
    return os.path.join(sub(), RESERVE)


def _give_up() -> bool:
    """Whether there was a reserve to give up (now removed)."""
    try:
        os.unlink(_path())
        return True
    except OSError:
        return False


def _keep() -> None:
    """Make the reserve if there is none and the disk has room for it (else a later note tries again)."""
    path = _path()
    if os.path.lexists(path):
        return
    try:
        replace_file(path, _fill, opener=open_own, mode="wb")
    except OSError:
        pass  # no room yet


def _fill(f) -> None:
    try:
        os.posix_fallocate(f.fileno(), 0, RESERVE_BYTES)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        f.write(bytes(RESERVE_BYTES))  # a filesystem without fallocate
