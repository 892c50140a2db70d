"""Which file each extraction process is writing at its own path (Extractor.apply's `in_place`), so
that none is left torn. A process killed midway (kill -9, or stopped with its siblings when another
layer failed) leaves the file it was writing half-written at its path; a rerun of the same image
writes it again, but one of another image, or no rerun at all, would keep it. `sweep` removes it.

The log is one line per file, appended once it is created ([pid, path, st_dev, st_ino]), and one
when a layer is applied whole ([pid]): a process's last line, if a file's, names the only file of
its own that may be torn. Lines are appended with O_APPEND, one write each: several processes'
do not interleave."""

from __future__ import annotations

import json
import os
import stat
from typing import Optional

from snapshotter.state import open_own, remove_if_there


class InPlaceLog:
    """The log at `path` (in the state dir), as one extraction process appends to it."""

    def __init__(self, path: str):
        self.path = path
        self._fd: Optional[int] = None

    def writing(self, path: str, fd: int) -> None:
        """The file at `path` (open as `fd`) is being written in place."""
        st = os.fstat(fd)
        self._append([os.getpid(), path, st.st_dev, st.st_ino])

    def layer_applied(self) -> None:
        """The layer is applied whole: what this process wrote in place is complete."""
        if self._fd is not None:  # a process that wrote nothing in place has nothing to end
            self._append([os.getpid()])

    def _append(self, row: list) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.write(self._fd, json.dumps(row).encode() + b"\n")


def sweep(path: str) -> list[str]:
    """Remove each file the log at `path` names as being written when its process stopped (the
    process's last line, if it is still that file: same device and inode), then the log. The paths
    removed. A file that cannot be removed raises OSError, and the log stays for the next sweep."""
    try:
        with open_own(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return []
    last: dict[int, list] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line (a kill while appending), or the empty one after the last
        if isinstance(row, list) and row and isinstance(row[0], int):
            last[row[0]] = row
    removed = []
    for row in last.values():
        if len(row) != 4 or not isinstance(row[1], str):
            continue  # the process's last layer was applied whole
        try:
            st = os.lstat(row[1])
        except (FileNotFoundError, NotADirectoryError):
            continue
        if stat.S_ISREG(st.st_mode) and [st.st_dev, st.st_ino] == row[2:]:
            remove_if_there(row[1])
            removed.append(row[1])
    remove_if_there(path)
    return removed
