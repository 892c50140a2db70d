"""Opening a box path safely: relative to a directory handle under the root, following no symlink
(a leaf or a directory on the way swapped for one since the scan is not followed out of the root, nor
to a secret under another name), without blocking (a FIFO swapped in opens at once), and reading
only the regular file the scan saw (its inode, on its directory's device).

openat2(2) with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS where the kernel has it (one syscall); else,
or for a path longer than PATH_MAX, an O_NOFOLLOW walk one component at a time."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import stat
from typing import Optional

# open_how.resolve (linux/openat2.h)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437, "arm64": 437}.get(platform.machine())
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
# A path that is not the one the scan saw: a symlink (ELOOP), a file on the way (ENOTDIR), out
# of the root (EXDEV), a socket (ENXIO), a leased file (EAGAIN), a device without its driver. (A
# path gone stays a FileNotFoundError.)
CHANGED_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EXDEV, errno.ENXIO, errno.EAGAIN, errno.EISDIR,
                            errno.ENODEV})


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_syscall = None
if _SYS_OPENAT2 is not None:
    try:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
    except (OSError, AttributeError):
        _syscall = None


def _openat2(dir_fd: int, rel: str, flags: int) -> Optional[int]:
    """openat2 beneath `dir_fd` following no symlink; None where the kernel (or a seccomp filter)
    does not have it, for good."""
    global _syscall
    if _syscall is None:
        return None
    how = _OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    while True:
        fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(rel), ctypes.byref(how),
                      ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG):  # no such syscall, or seccomp refuses it
            _syscall = None
            return None
        if err == errno.ENAMETOOLONG:
            return None  # over PATH_MAX: the walk takes it a component at a time
        if err == errno.EAGAIN and flags & os.O_NONBLOCK == 0:
            return None  # RESOLVE_CACHED is not asked for; never expected
        raise OSError(err, os.strerror(err), rel)


def _walk(dir_fd: int, rel: str, flags: int) -> int:
    """The fallback: each directory on the way opened with O_NOFOLLOW relative to the last."""
    *dirs, leaf = rel.split("/")
    fd = dir_fd
    try:
        for name in dirs:
            if name in ("", ".", ".."):
                raise OSError(errno.EXDEV, "not a plain path below the root", rel)
            nfd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = nfd
        if leaf in ("", ".", ".."):
            raise OSError(errno.EXDEV, "not a plain path below the root", rel)
        return os.open(leaf, flags | os.O_NOFOLLOW, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def open_beneath(dir_fd: int, rel: str, flags: int = READ_FLAGS) -> int:
    """Open `rel` (a plain relative path: no '..', no leading '/') below the directory `dir_fd`,
    following no symlink anywhere on the way; an OSError otherwise (ELOOP for a symlink met)."""
    fd = _openat2(dir_fd, rel, flags | os.O_NOFOLLOW)
    return fd if fd is not None else _walk(dir_fd, rel, flags)


def open_root(root: str) -> int:
    """The handle of the box's root, which every path is opened below (--root may be a symlink)."""
    return os.open(root, DIR_FLAGS)


class NotTheScanned(Exception):
    """The path is no longer the regular file the scan saw: swapped for another file, a symlink, a
    directory, a FIFO or a device, or gone. Not read; the caller treats it as a file that changed."""


def _changed(e: OSError, rel: str) -> Exception:
    return NotTheScanned(rel) if e.errno in CHANGED_ERRNOS else e


def open_leaf(dir_fd: int, name: str, ino: Optional[int], dev: Optional[int] = None) -> int:
    """A read-only handle on the regular file `name` in the directory `dir_fd`, if it is still the
    inode `ino` (None: any), on the device `dev` if given (the scan's lstat of that very file: on
    an overlay of several filesystems a file's device is not its directory's): NotTheScanned
    otherwise (a symlink is not followed, a FIFO does not block), PermissionError if unreadable."""
    try:
        fd = os.open(name, READ_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except PermissionError:
        raise
    except OSError as e:
        raise _changed(e, name) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (ino is not None and st.st_ino != ino) \
                or (dev is not None and st.st_dev != dev):
            raise NotTheScanned(name)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Beneath:
    """Box files opened below the root's handle (open_scanned), the directory of the last one kept
    open: files are read in path order, a directory's in a row."""

    def __init__(self, root: str):
        self.root_fd = open_root(root)
        self._root_dir = ("", self.root_fd)
        self._dir: tuple[str, int] = self._root_dir

    def open_scanned(self, rel: str, ino: Optional[int]) -> int:
        """A read-only handle on the regular file the scan saw at `rel` (inode `ino`, None: any;
        with its stamp's times, which the reader compares, that names the file the scan saw).
        NotTheScanned if it is not that file any more; PermissionError if unreadable."""
        parent, _, name = rel.rpartition("/")
        if parent != self._dir[0]:
            self._close_dir()
            if parent:
                try:
                    fd = open_beneath(self.root_fd, parent, DIR_FLAGS)
                except PermissionError:
                    raise
                except OSError as e:
                    raise _changed(e, rel) from e
                self._dir = (parent, fd)
        return open_leaf(self._dir[1], name, ino)

    def _close_dir(self) -> None:
        if self._dir[1] != self.root_fd:
            os.close(self._dir[1])
        self._dir = self._root_dir

    def close(self) -> None:
        self._close_dir()
        os.close(self.root_fd)

    def __enter__(self) -> "Beneath":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def file_head(path: str, n: int) -> bytes:
    """The first n bytes of a regular file (fewer if it is shorter; none if it is gone, or is a
    symlink, a FIFO or a device now: not followed, not waited on)."""
    try:
        fd = os.open(path, READ_FLAGS | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return b""
    except OSError as e:
        if e.errno == errno.ELOOP:
            return b""
        raise
    try:
        return os.pread(fd, n, 0) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


def head_at(dir_fd: int, name: str, st: os.stat_result, n: int) -> bytes:
    """The first n bytes of the file `name` in the directory `dir_fd` (fewer if it is shorter), if
    it is still the regular file `st` (lstat): none if it is gone or another file, a symlink or a
    FIFO swapped in (not followed, not waited on: box/openat.py). Its read then says it changed."""
    try:
        fd = open_leaf(dir_fd, name, st.st_ino, st.st_dev)
    except (FileNotFoundError, NotTheScanned):
        return b""
    try:
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)
