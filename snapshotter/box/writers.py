"""Files that a process on the box is writing right now, as /proc shows them: held open for writing
(or mapped shared and writable). A snapshot never reads such a file while it is still changing: a
checkpoint saved in chunks or a weight rewritten in place would be captured half written.

/proc shows the processes of this PID namespace (all of a container's); another user's open files are
hidden from a non-root snap, and `Writers.complete` then says the answer may be partial (a root snap
is refused only a process of an outer namespace, which is not the box's)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Optional

from snapshotter.index.entry import FILE, Entry

from .clock import changed_since
from .scan import Scan

WRITING_QUIET_S = 5.0  # a file held open for writing counts as being written until left alone this long
BEING_WRITTEN = "being written"

_ACCESS_MODE = 0o3  # O_ACCMODE: O_RDONLY 0, O_WRONLY 1, O_RDWR 2
_DELETED = " (deleted)"


@dataclass
class Writers:
    paths: set[str] = field(default_factory=set)  # absolute paths, as the writing processes see them
    complete: bool = True  # False when some process's files could not be read (another user's)
    # Those of `paths` mapped shared-writable: a write through a mapping moves the file's times only at
    # its first write to a clean page, so the writes after it change no stat data (a write(2) moves
    # them each time the clock has moved: no stat data there is older than the write).
    mapped: set[str] = field(default_factory=set)

    def under(self, root: str, mapped: bool = False) -> set[str]:
        """The paths being written inside `root` (`mapped`: through a mapping), relative to it (as
        scans name them)."""
        root = os.path.realpath(root)
        prefix = root.rstrip("/") + "/"
        return {p[len(prefix):] for p in (self.mapped if mapped else self.paths) if p.startswith(prefix)}


def open_for_writing(proc: str = "/proc") -> Writers:
    """Every file some process (other than this one) holds open for writing or maps shared-writable."""
    found = Writers()
    me = str(os.getpid())
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit() and p != me]
    except OSError:
        return Writers(complete=False)
    for pid in pids:
        try:
            _fds_for_writing(os.path.join(proc, pid), found.paths)
        except PermissionError:
            # Hidden from root only by a process of an outer namespace (a sandbox's init), not one
            # of the box's; a non-root snap cannot see other users' processes, which may be writing.
            found.complete = found.complete and os.geteuid() == 0
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            continue  # the process ended while we looked
        try:
            _shared_writable_maps(os.path.join(proc, pid), found.mapped)
        except (PermissionError, FileNotFoundError, ProcessLookupError, NotADirectoryError):
            pass  # a container's init may hide its maps even from root; writes through a mapping are rare
    found.paths |= found.mapped
    return found


def last_change(e: Entry, restored_at: Optional[int] = None) -> float:
    """When a box file last changed, in seconds: the later of mtime and ctime (a rename into place
    changes only the ctime), except that a ctime from before a restore's end (`restored_at`, ns, the
    restore record's, when trusted) is the restore writing the file, not the box: then the mtime alone."""
    _, mtime_ns, ctime_ns = e.stamp.split(":")
    if restored_at is not None and not changed_since(int(ctime_ns), restored_at):
        return int(mtime_ns) / 1e9
    return max(int(mtime_ns), int(ctime_ns)) / 1e9


def being_written(scan: Scan, root: str, quiet_s: float, now: Optional[float] = None,
                  writers: Optional[Writers] = None, *, restored_at: Optional[int]) -> dict[str, str]:
    """Regular files of the scan that some process holds open for writing (or maps writable) and
    that changed within `quiet_s`: reading one now could capture it half written (a checkpoint saved
    in chunks, a weight rewritten in place). One left alone longer (a database kept open), or last
    written by a restore (`restored_at`, as in last_change), is read as usual: the read itself
    checks that it holds still."""
    now = time.time() if now is None else now
    held = {}
    for path in (writers or open_for_writing()).under(root):
        e = scan.entries.get(path)
        if e is not None and e.kind == FILE and e.stamp and now - last_change(e, restored_at) < quiet_s:
            held[path] = BEING_WRITTEN
    return held


def _fds_for_writing(pid_dir: str, out: set[str]) -> None:
    fd_dir = os.path.join(pid_dir, "fd")
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
            if not target.startswith("/") or target.endswith(_DELETED):
                continue  # a pipe, a socket, an anonymous inode, or a file no longer at any path: no fdinfo read
            with open(os.path.join(pid_dir, "fdinfo", fd), "rb") as f:
                info = f.read(4096)
        except (FileNotFoundError, ProcessLookupError):
            continue  # closed meanwhile
        for line in info.splitlines():
            if line.startswith(b"flags:"):
                if int(line.split()[1], 8) & _ACCESS_MODE:
                    out.add(target)
                break


def _shared_writable_maps(pid_dir: str, out: set[str]) -> None:
    """An mmap'ed file written through memory changes without a write(2), and stays mapped after
    its descriptor is closed."""
    with open(os.path.join(pid_dir, "maps"), "rb") as f:
        maps = f.read()
    if b"w-s " not in maps and b"wxs " not in maps:
        return  # no mapping of this process is shared and writable (its permissions would read -w-s or -wxs)
    for line in maps.split(b"\n"):  # the kernel writes a newline in a name as \012: one line per mapping
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[1][1:2] == b"w" and fields[1][3:4] == b"s":
            raw = fields[5]
            # A backslash is written as is: a name that holds "\012" itself reads the same as one
            # with a newline, so both are kept (only box paths count).
            for name in {raw, raw.replace(b"\\012", b"\n")}:
                path = name.decode(errors="surrogateescape")
                if path.startswith("/") and not path.endswith(_DELETED):
                    out.add(path)
