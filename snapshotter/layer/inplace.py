"""Which file each extraction process is writing at its own path (Extractor.apply's `in_place`), so
that none is left torn. A process killed midway (kill -9, or stopped with its siblings when another
layer failed) leaves the file it was writing half-written at its path; a rerun of the same image
writes it again, but one of another image, or no rerun at all, would keep it. `sweep` removes it.

The log is one line per file, appended before the file is made ([pid, path]), and one when the
process is done with a layer ([pid]: applied, or given up with its own files cleaned up). A
process's last line, if a file's, names the only file of its own that may be torn. Such a file is
made with no permission bits, and given its mode once its bytes are in (Extractor._write_file):
the sweep removes only a regular file of one name with mode 000 at that path, never one made or
finished since. Lines are appended with O_APPEND, one write each: several processes' do not
interleave."""

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

    def writing(self, path: str) -> None:
        """The file at `path` is about to be made and written in place, with mode 000 until it is whole."""
        self._append([os.getpid(), path])

    def layer_ended(self) -> None:
        """Nothing this process wrote in place is half-written: its layer was applied, or gave up
        having removed the file it was writing."""
        if self._fd is not None:  # a process that wrote nothing in place has nothing to end
            self._append([os.getpid()])

    def _append(self, row: list) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.write(self._fd, json.dumps(row).encode() + b"\n")


def sweep(path: str) -> tuple[list[str], list[str]]:
    """Remove each file the log at `path` names as being written when its process stopped (the
    process's last line, if the file there is still one being written: regular, one name, mode 000),
    then the log. (The paths removed, those that could not be: "path (why)".)"""
    try:
        with open_own(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return [], []
    last: dict[int, list] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line (a kill while appending), or the empty one after the last
        if isinstance(row, list) and row and isinstance(row[0], int):
            last[row[0]] = row
    removed, failed = [], []
    for row in last.values():
        if len(row) != 2 or not isinstance(row[1], str):
            continue  # the process's last layer ended
        try:
            st = os.lstat(row[1])
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and not st.st_mode & 0o7777:
                os.unlink(row[1])
                removed.append(row[1])
        except (FileNotFoundError, NotADirectoryError):
            pass  # never made, or gone since
        except OSError as e:
            failed.append(f"{row[1]!r} ({e.strerror or e})")
    remove_if_there(path)
    return removed, failed
