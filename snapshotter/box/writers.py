"""Files that a process on the box is writing right now, as /proc shows them: held open for writing
(or mapped shared and writable). A snapshot never reads such a file while it is still changing: a
checkpoint saved in chunks or a weight rewritten in place would be captured half written.

/proc shows the processes of this PID namespace (all of a container's); another user's open files are
hidden from a non-root snap, and `Writers.complete` then says the answer may be partial (a root snap
is refused only a process of an outer namespace, which is not the box's)."""

from __future__ import annotations

import os
import stat
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
    # The files of `mapped` by identity, (st_dev, st_ino) as this process's stat sees them: the walk
    # matches box files by these, not by path. The same file mapped through another name (a hard link
    # outside the root, a bind mount of a box directory elsewhere) shows another path in /proc.
    mapped_ids: set[tuple[int, int]] = field(default_factory=set)

    def under(self, root: str) -> set[str]:
        """The paths being written inside `root`, relative to it (as scans name them)."""
        root = os.path.realpath(root)
        prefix = root.rstrip("/") + "/"
        return {p[len(prefix):] for p in self.paths if p.startswith(prefix)}

    def maybe_mapped(self, entries: dict[str, Entry]) -> set[str]:
        """The files of `entries` (a scan's) that may be mapped shared-writable, by the inode an
        Entry's stamp starts with: a match by inode alone may name a file of another filesystem too
        (safe where it only makes a caller look at the file again). No pass at all when none is mapped."""
        if not self.mapped_ids:
            return set()
        inodes = {str(ino) for _, ino in self.mapped_ids}
        return {p for p, e in entries.items() if e.kind == FILE and e.stamp.partition(":")[0] in inodes}


def open_for_writing(proc: str = "/proc") -> Writers:
    """Every file some process (other than this one) holds open for writing or maps shared-writable."""
    found = Writers()
    me = str(os.getpid())
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit() and p != me]
    except OSError:
        return Writers(complete=False)
    resolved: dict[bytes, Optional[tuple[int, int]]] = {}  # a maps line's "dev inode" -> its file's identity
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
            _shared_writable_maps(os.path.join(proc, pid), found, resolved)
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


def _shared_writable_maps(pid_dir: str, found: Writers, resolved: dict[bytes, Optional[tuple[int, int]]]) -> None:
    """An mmap'ed file written through memory changes without a write(2), and stays mapped after
    its descriptor is closed. Each such file's path goes to found.mapped and its identity to
    found.mapped_ids (`resolved`: the identities already found, by the maps line's dev and inode)."""
    with open(os.path.join(pid_dir, "maps"), "rb") as f:
        maps = f.read()
    if b"s " not in maps:
        return  # no mapping of this process is shared (its permissions would read ---s)
    may_write = _MayWrite(pid_dir)
    for line in maps.split(b"\n"):  # the kernel writes a newline in a name as \012: one line per mapping
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[1][3:4] == b"s" and fields[4] != b"0" and (
                fields[1][1:2] == b"w" or may_write(fields[0])):
            key = fields[3] + b" " + fields[4]
            if key not in resolved:
                resolved[key] = _mapped_identity(pid_dir, fields)
            if resolved[key] is not None:
                found.mapped_ids.add(resolved[key])
            raw = fields[5]
            # A backslash is written as is: a name that holds "\012" itself reads the same as one
            # with a newline, so both are kept (only box paths count).
            for name in {raw, raw.replace(b"\\012", b"\n")}:
                path = name.decode(errors="surrogateescape")
                if path.startswith("/") and not path.endswith(_DELETED):
                    found.mapped.add(path)


class _MayWrite:
    """Whether a shared file map of one process, read-only now, may be made writable again: with
    mprotect, whose dirty pages then take writes with no fault, which move no time. So it is for a
    file opened for writing (VM_MAYWRITE), not one opened read-only (a weight mapped to be read,
    glibc's gconv cache). Asked of the map's /proc/PID/map_files link, whose mode is the file's open
    mode (root may look); else, once per process, of smaps' VmFlags ("mw"), dearer to read."""

    def __init__(self, pid_dir: str):
        self.pid_dir = pid_dir
        self.smaps: Optional[set[bytes]] = None  # the ranges smaps says may write, once read

    def __call__(self, span: bytes) -> bool:
        try:
            return bool(os.lstat(os.path.join(self.pid_dir, "map_files", span.decode())).st_mode & stat.S_IWUSR)
        except PermissionError:
            pass
        except OSError:
            return False  # unmapped meanwhile
        if self.smaps is None:
            self.smaps = _smaps_may_write(self.pid_dir)
        return span in self.smaps


def _smaps_may_write(pid_dir: str) -> set[bytes]:
    """The address ranges (as maps names them) of the process's mappings smaps says may be made
    writable (VmFlags "mw")."""
    out, current = set(), None
    with open(os.path.join(pid_dir, "smaps"), "rb") as f:
        for line in f:
            if line.startswith(b"VmFlags:"):
                if current is not None and b" mw" in line:
                    out.add(current)
            elif b"-" in line.split(b" ", 1)[0] and line[:1] in _HEX:
                current = line.split(b" ", 1)[0]
    return out


_HEX = frozenset(b"0123456789abcdef"[i:i + 1] for i in range(16))


def _mapped_identity(pid_dir: str, fields: list[bytes]) -> Optional[tuple[int, int]]:
    """(st_dev, st_ino) of the file a maps line maps, as this process's stat of it would read: through
    the process's map_files link (root may follow it: any name, a deleted one too), else its path
    through the process's root (its owner may), else the maps line's own dev and inode (under
    overlayfs, another filesystem's than a stat of the box path gives)."""
    name = fields[5].decode(errors="surrogateescape")
    for via in (os.path.join(pid_dir, "map_files", fields[0].decode()),
                pid_dir + "/root" + name if name.startswith("/") and not name.endswith(_DELETED) else None):
        try:
            st = os.stat(via) if via is not None else None
        except (OSError, ValueError):
            continue  # not root (EPERM), the mapping or the name gone meanwhile, a NUL
        if st is not None:  # a device's map (a GPU's) is no box file's
            return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None
    try:
        major, minor = (int(x, 16) for x in fields[3].split(b":"))
        return os.makedev(major, minor), int(fields[4])
    except ValueError:
        return None
