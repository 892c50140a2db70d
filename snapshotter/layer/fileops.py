"""The file system calls of applying a layer (extract.py): a member's attributes set on an open fd
or a path never followed, whole writes, removals, and where a mount lies below a directory."""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from typing import Callable, Optional

from snapshotter.box.mounts import inside, read_mounts
from snapshotter.errors import IntegrityError
from snapshotter.tar.rules import CAPABILITY, SKIP_XATTRS, XATTR_PAX, member_mtime_ns

READ_BUFFER = 1 << 20
XATTR_NAME_MAX, XATTR_SIZE_MAX = 255, 1 << 16  # Linux's limits (limits.h)
_ON_FD: dict = {}
_NOFOLLOW = {"follow_symlinks": False}
Attrs = tuple[int, int, int]  # (mode, uid, gid) a path has: set_attrs's `created`
DEFAULT_ACL = "system.posix_acl_default"


def attrs_of(st: os.stat_result) -> Attrs:
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def set_attrs(path, m: tarfile.TarInfo, same_owner: bool, keep_privileges: bool,
              stripped: Callable[[], None], created: Optional[Attrs] = None,
              set_time: bool = True) -> None:
    """Owner, mode, xattrs, mtime on a path (never followed) or an open fd; setuid/setgid bits and
    file capabilities only with keep_privileges (else stripped() is called). `created`: the (mode,
    uid, gid) the file has now (just created with, or read by lstat): an owner or mode it already
    has is not set again (two system calls of the six a venv's small file cost; a directory's, set
    again by each layer that holds it). `set_time` False: the caller sets its times later (a
    directory's, once what it holds is written)."""
    mode = m.mode & 0o7777
    xattrs = {k[len(XATTR_PAX):]: v for k, v in m.pax_headers.items() if k.startswith(XATTR_PAX)} \
        if m.pax_headers else {}
    strip = False
    if mode & (stat.S_ISUID | stat.S_ISGID) and not m.isdir() and not keep_privileges:
        mode &= ~(stat.S_ISUID | stat.S_ISGID)
        strip = True
    if xattrs and CAPABILITY in xattrs and not keep_privileges:
        del xattrs[CAPABILITY]  # file capabilities are setuid by another name
        strip = True
    if strip:
        stripped()
    nofollow = _ON_FD if isinstance(path, int) else _NOFOLLOW
    if same_owner and (created is None or created[1:] != (m.uid, m.gid)):
        os.chown(path, m.uid, m.gid, **nofollow)
        if mode & (stat.S_ISUID | stat.S_ISGID):
            created = None  # chown clears setuid bits: the mode is set after it
    if m.type != tarfile.SYMTYPE and (created is None or created[0] != mode):
        os.chmod(path, mode)
    for name, value in xattrs.items():
        set_xattr(path, name, value, nofollow)
    if not set_time:
        return
    # A PAX mtime to the ns, as Docker sets it: the next commit's diff tells an untouched base file by it.
    ns = member_mtime_ns(m) if m.pax_headers else None
    ns = int(m.mtime) * 1_000_000_000 if ns is None else ns
    os.utime(path, ns=(ns, ns), **nofollow)


def umask() -> Optional[int]:
    """This process's umask, read without changing it (os.umask would, for every thread); None if unknown."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


def has_default_acl(directory: str) -> bool:
    """Whether `directory` has a default ACL: what is made in it then gets its mode from the ACL, not
    the umask (and a directory made in it inherits the ACL). Not known: True (a chmod too many)."""
    try:
        os.getxattr(directory, DEFAULT_ACL, follow_symlinks=False)
    except OSError as e:
        return e.errno not in (errno.ENODATA, errno.ENOTSUP)
    return True


def set_xattr(path, name: str, value: str, nofollow: dict) -> None:
    """One xattr (a PAX value: surrogate-escaped text) on a path or fd; one the disk refuses is left out."""
    if name.startswith(SKIP_XATTRS):
        return
    data = value.encode("utf-8", "surrogateescape")
    if len(name.encode("utf-8", "surrogateescape")) > XATTR_NAME_MAX or len(data) > XATTR_SIZE_MAX:
        raise IntegrityError(f"extended attribute {name[:64]!r} ({len(data)} bytes) is larger than Linux allows: "
                             "refusing a hostile layer")
    try:
        os.setxattr(path, name, data, **nofollow)
    except OSError as e:
        if e.errno in (errno.E2BIG, errno.ERANGE, errno.EINVAL):
            raise IntegrityError(f"extended attribute {name[:64]!r} cannot be set: {e.strerror}: "
                                 "refusing a hostile layer") from None
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EACCES):
            raise


def join(directory: str, name: str) -> str:
    """os.path.join(directory, name) for a name without "/", for a fraction of its cost (twice per member)."""
    return f"{directory.rstrip('/')}/{name}"


def write_all(fd: int, data: bytes) -> None:
    n = os.write(fd, data)
    if n < len(data):  # a short write (a signal, a nearly full disk): the rest, or the error
        view = memoryview(data)[n:]
        while view:
            view = view[os.write(fd, view):]


def utime(path: str, at: int, mt: int) -> None:
    try:
        os.utime(path, ns=(at, mt), follow_symlinks=False)
    except FileNotFoundError:
        pass


def mount_below(path: str) -> Optional[str]:
    """A mount point at or below directory `path` (a real path), or None."""
    mounts = read_mounts()
    if mounts is not None:
        return next((m.point for m in mounts if inside(path, m.point) is not None), None)
    # No /proc: another filesystem below shows as another st_dev (bind mounts of the same one do not).
    dev = os.lstat(path).st_dev
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            full = os.path.join(dirpath, d)
            try:
                if os.lstat(full).st_dev != dev:
                    return full
            except FileNotFoundError:
                pass
    return None
