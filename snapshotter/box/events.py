"""Change notifications for the box (inotify): which directories changed since the last look, so a
watcher's next scan lists those alone (box/scan.py's `dirty`), and where notifications cannot be
trusted, so the whole box is scanned there as before.

One inotify watch per directory, added as directories appear. Through ctypes on libc: three plain
syscalls, no dependency to install on a box in a hurry. What inotify does not see, and is left to
the watcher's full scans: writes through a shared mapping (mmap), a file changed through a hard link
in a directory outside the box, changes before the watch was added, changes on network and FUSE
filesystems made elsewhere, and everything once the kernel's queue overflowed."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
from typing import Callable, Optional

from .mounts import pseudo_mounts, remote_mounts

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF = 0x400, 0x800
IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = 0x2000, 0x4000, 0x8000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_EXCL_UNLINK, IN_ISDIR = 0x01000000, 0x02000000, 0x04000000, 0x40000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
        | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name
MAX_WATCHES_FILE = "/proc/sys/fs/inotify/max_user_watches"
MAX_QUEUED_FILE = "/proc/sys/fs/inotify/max_queued_events"


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.inotify_init1.argtypes = [ctypes.c_int]
    libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    return libc


def _proc_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class EventsUnavailable(Exception):
    """inotify cannot be used here (no such syscall, the instance limit): the watcher scans."""


class ChangeEvents:
    """The box's directories under inotify. drain() says which directories changed since the last
    drain (root-relative, '' the root) and why events were lost, if they were; `gaps` names the
    directories no event will come from, with why. `max_watches` (tests) behaves as the kernel's
    limit does: the watch past it fails as ENOSPC would."""

    def __init__(self, root: str, skip: Callable[[str], bool], max_watches: Optional[int] = None):
        self.root = os.path.realpath(root)
        self.skip = skip
        self.max_watches = max_watches
        self.paths: dict[int, str] = {}  # wd -> directory
        self.wds: dict[str, int] = {}  # directory -> wd
        self.gaps: dict[str, str] = {}  # directory -> why no event comes from it (or from below it)
        self.new_gaps: list[str] = []  # gaps not told yet (the watcher says each once)
        self.pseudo = pseudo_mounts(self.root)
        self.remote = remote_mounts(self.root)
        try:
            self.libc = _libc()
            fd = self.libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        except (OSError, AttributeError) as e:
            raise EventsUnavailable(f"inotify is not available ({e})")
        if fd < 0:
            err = ctypes.get_errno()
            raise EventsUnavailable(f"inotify is not available ({os.strerror(err)})")
        self.fd = fd
        self.watch_tree("")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def complete(self) -> bool:
        """Every directory of the box sends its changes."""
        return not self.gaps

    def _gap(self, rel: str, why: str) -> None:
        if rel not in self.gaps:
            self.gaps[rel] = why
            self.new_gaps.append(rel)

    def _add(self, rel: str) -> Optional[int]:
        """A watch on the directory `rel`; None if it cannot have one (gone, or the limit)."""
        if self.max_watches is not None and len(self.wds) >= self.max_watches and rel not in self.wds:
            err = errno.ENOSPC
        else:
            path = os.path.join(self.root, rel) if rel else self.root
            wd = self.libc.inotify_add_watch(self.fd, os.fsencode(path), MASK)
            if wd >= 0:
                old = self.paths.get(wd)
                if old is not None and self.wds.get(old) == wd:
                    del self.wds[old]  # a directory moved: the kernel keeps its watch, under its new name
                self.paths[wd], self.wds[rel] = rel, wd
                return wd
            err = ctypes.get_errno()
        if err == errno.ENOSPC:
            limit = self.max_watches if self.max_watches is not None else _proc_int(MAX_WATCHES_FILE)
            self._gap(rel, f"the inotify watch limit is reached ({limit} watches: fs.inotify.max_user_watches)")
        elif err not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            self._gap(rel, f"no watch: {os.strerror(err)}")
        return None

    def watch_tree(self, top: str) -> list[str]:
        """Watch `top` and every directory below it (not excluded, not another kind of filesystem);
        the directories watched."""
        added, stack = [], [top]
        while stack:
            rel = stack.pop()
            if rel and (self.skip(rel) or rel in self.pseudo):
                continue
            if rel in self.remote:
                self._gap(rel, f"a {self.remote[rel]} mount, whose changes made elsewhere send no notification")
                continue
            if self._add(rel) is None:
                continue
            added.append(rel)
            path = os.path.join(self.root, rel) if rel else self.root
            try:
                with os.scandir(path) as it:
                    for de in it:
                        try:
                            if de.is_dir(follow_symlinks=False):  # (the directory's own type field: no stat)
                                stack.append(f"{rel}/{de.name}" if rel else de.name)
                        except OSError:
                            continue
            except OSError:
                continue
        return added

    def _forget(self, top: str) -> None:
        """A directory moved away: its watches keep coming under the new name once it is seen, or
        none (moved out of the box)."""
        prefix = top + "/"
        for rel in [r for r in self.wds if r == top or r.startswith(prefix)]:
            self.paths.pop(self.wds.pop(rel), None)

    def drain(self) -> tuple[set[str], Optional[str]]:
        """(directories changed since the last drain, why events were lost or None). A directory
        that appeared is watched before this returns, and is itself in the set (with every directory
        below it): what was written in it before its watch is found by listing it."""
        dirty: set[str] = set()
        lost = None
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            if not data:
                break
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _cookie, n = _EVENT.unpack_from(data, at)
                name = os.fsdecode(data[at + _EVENT.size:at + _EVENT.size + n].rstrip(b"\0"))
                at += _EVENT.size + n
                if mask & IN_Q_OVERFLOW:
                    queued = _proc_int(MAX_QUEUED_FILE)
                    lost = f"the kernel's event queue overflowed (more than {queued} events unread)"
                    continue
                d = self.paths.get(wd)
                if mask & IN_IGNORED:
                    if d is not None and self.wds.get(d) == wd:
                        del self.wds[d]
                    self.paths.pop(wd, None)
                    continue
                if d is None:
                    continue  # a directory moved out of the box
                if not name:  # the directory itself (attributes, deleted, moved): its entry is in its parent
                    dirty.add(d)
                    dirty.add(d.rpartition("/")[0])
                    if mask & IN_UNMOUNT:
                        lost = lost or f"{'/' + d!r} was unmounted"
                    continue
                dirty.add(d)
                if mask & IN_ISDIR:
                    rel = f"{d}/{name}" if d else name
                    if mask & IN_MOVED_FROM:
                        self._forget(rel)
                    elif mask & (IN_CREATE | IN_MOVED_TO):
                        dirty.update(self.watch_tree(rel))
        return dirty, lost
