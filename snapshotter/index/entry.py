"""One path of a tree as a layer carries it (Entry), made from a stat or a tar header; the
kinds of path a layer holds."""

from __future__ import annotations

import gc
import os
import stat
import tarfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

from snapshotter.tar.rules import member_mtime_ns, member_xattrs

FILE, DIR, SYMLINK, CHAR, BLOCK, FIFO = "file", "dir", "symlink", "char", "block", "fifo"


@dataclass(slots=True)
class Entry:
    """One path of a filesystem tree, relative to its root, with the metadata a layer carries."""

    path: str
    kind: str
    mode: int  # permission bits, including setuid/setgid/sticky
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime: int = 0  # whole seconds: what a reproducible tar header holds
    linkname: str = ""  # symlink target
    rdev: int = 0
    digest: Optional[str] = None  # sha256 of a regular file's content, where known
    inode: Optional[str] = None  # "dev:ino" of a box file with more than one link
    stamp: str = ""  # box only: "ino:mtime_ns:ctime_ns", what the stat cache keys on (ctime cannot be faked)
    xattrs: Optional[dict[str, str]] = None  # extended attributes (values as surrogate-escaped text, as in PAX)
    # The exact mtime where whole seconds cannot tell: an image's file whose tar header has one (PAX),
    # a box file edited within its base file's second (its layer carries it: a restore puts it back).
    mtime_ns: Optional[int] = None

    def image_mtime_ns(self) -> int:
        """An image entry's mtime in ns: as its tar header has it."""
        return self.mtime * 1_000_000_000 if self.mtime_ns is None else self.mtime_ns

    @property
    def ctime_ns(self) -> int:
        return int(self.stamp.rsplit(":", 1)[1])

    def same_as(self, other: "Entry", compare_content: bool = False) -> bool:
        mine = (self.kind, self.mode, self.uid, self.gid, self.mtime)
        if mine != (other.kind, other.mode, other.uid, other.gid, other.mtime):
            return False
        if (self.xattrs or None) != (other.xattrs or None):
            return False
        if self.kind == FILE:
            if self.size != other.size:
                return False
            if compare_content and self.digest and other.digest:
                return self.digest == other.digest
            return True
        if self.kind == SYMLINK:
            return self.linkname == other.linkname
        if self.kind in (CHAR, BLOCK):
            return self.rdev == other.rdev
        return True


_gc_lock = threading.Lock()


_gc_pausers = 0


_gc_was_enabled = True


@contextmanager
def gc_paused():
    """Python's cycle collector off for the block (and on again after the last of several threads
    leaves it): a scan, diff and plan of a big box make a million small objects (entries, paths,
    tuples) that hold no cycles and that reference counting frees, but each of the collector's full
    passes walks all of them again as they grow: a fifth of the CPU of a 200k-file commit."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()  # a library user may have turned it off: left so
        _gc_pausers += 1
        gc.disable()
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def clean_path(name: str) -> str:
    """A tar member name as a root-relative path ('./a/b/' -> 'a/b'); '' is the root itself."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    return "/".join(parts)


def self_and_parents(path: str):
    """'a/b/c', 'a/b', 'a'."""
    while path:
        yield path
        path = path.rpartition("/")[0]


_KIND_OF_MODE = {stat.S_IFREG: FILE, stat.S_IFDIR: DIR, stat.S_IFLNK: SYMLINK, stat.S_IFCHR: CHAR,
                 stat.S_IFBLK: BLOCK, stat.S_IFIFO: FIFO}  # sockets are not content
_KIND_OF_TAR = {**{t: FILE for t in tarfile.REGULAR_TYPES}, tarfile.DIRTYPE: DIR, tarfile.SYMTYPE: SYMLINK,
                tarfile.CHRTYPE: CHAR, tarfile.BLKTYPE: BLOCK, tarfile.FIFOTYPE: FIFO}


def kind_of_mode(mode: int) -> Optional[str]:
    """The kind of path an st_mode is (FILE, DIR, ...); None for what is not content (a socket)."""
    return _KIND_OF_MODE.get(mode & 0o170000)


def entry_from_stat(rel: str, st: os.stat_result, linkname: str = "") -> Optional[Entry]:
    mode = st.st_mode  # S_IFMT and S_IMODE by hand, kind_of_mode inlined: a scan calls this once per path
    kind = _KIND_OF_MODE.get(mode & 0o170000)
    if kind is None:
        return None
    return Entry(
        path=rel,
        kind=kind,
        mode=mode & 0o7777,
        uid=st.st_uid,
        gid=st.st_gid,
        size=st.st_size if kind == FILE else 0,
        mtime=int(st.st_mtime),
        linkname=linkname,
        rdev=st.st_rdev if kind in (CHAR, BLOCK) else 0,
        inode=f"{st.st_dev}:{st.st_ino}" if kind == FILE and st.st_nlink > 1 else None,
        stamp=stat_stamp(st),
    )


def stat_stamp(st: os.stat_result) -> str:
    """An entry's stamp: inode, mtime and ctime in ns (the stat cache's and the scan memo's rule)."""
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def entry_from_member(m: tarfile.TarInfo, rel: str) -> Optional[Entry]:
    kind = _KIND_OF_TAR.get(m.type)
    if kind is None:
        return None
    return Entry(
        path=rel, kind=kind, mode=m.mode & 0o7777, uid=m.uid, gid=m.gid,
        size=m.size if kind == FILE else 0, mtime=int(m.mtime), linkname=m.linkname if kind == SYMLINK else "",
        rdev=os.makedev(m.devmajor, m.devminor) if kind in (CHAR, BLOCK) else 0,
        xattrs=member_xattrs(m), mtime_ns=member_mtime_ns(m) if kind == FILE else None,
    )
