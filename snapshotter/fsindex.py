"""File indexes: of a live box (a filesystem walk) and of an image (its layer tars), and their diff."""

from __future__ import annotations

import errno
import functools
import gc
import gzip
import json
import os
import stat
import tarfile
import threading
import time
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field, fields
from typing import BinaryIO, Callable, Optional, Sequence

from .digests import chunks_digest, file_digest
from .errors import IntegrityError, StorageError, UsageError
from .mounts import inside, read_mounts
from .profile import Profile, VenvRoots
from .state import replace_file
from .tarreader import iter_members, data_chunks
from .tarrules import (MAX_SYMLINK_HOPS, OPAQUE, SKIP_XATTRS, WHITEOUT_PREFIX, check_name, member_mtime_ns, member_xattrs,
                       whiteout_target)

FILE, DIR, SYMLINK, CHAR, BLOCK, FIFO = "file", "dir", "symlink", "char", "block", "fifo"

# Filesystems that are views of the kernel, never content of the box.
PSEUDO_FS = {
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "mqueue", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "fusectl", "configfs", "hugetlbfs", "autofs", "binfmt_misc", "nsfs", "rpc_pipefs", "efivarfs",
}


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
        if (self.kind, self.mode, self.uid, self.gid, self.mtime) != (other.kind, other.mode, other.uid, other.gid, other.mtime):
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


def read_head(path: str, n: int) -> bytes:
    """The first n bytes of a file (fewer if it is shorter; none if it is gone)."""
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except FileNotFoundError:
        return b""


# ---- the box ----------------------------------------------------------------------------------


@dataclass
class Scan:
    entries: dict[str, Entry]
    venv_roots: VenvRoots
    skipped_secrets: list[str] = field(default_factory=list)
    pseudo_mounts: set[str] = field(default_factory=set)  # kernel views (proc, sysfs, ...) not walked
    host_files: list[str] = field(default_factory=list)  # files bind-mounted from the host, and links to them

    @functools.cached_property
    def _left_out(self) -> frozenset[str]:
        return frozenset(self.pseudo_mounts.union(self.skipped_secrets, self.host_files))

    def not_walked(self, path: str) -> bool:
        """Under a pseudo mount, a left-out secret or a host file: base paths there are unknown, not deleted."""
        return any(p in self._left_out for p in self_and_parents(path))


def self_and_parents(path: str):
    """'a/b/c', 'a/b', 'a'."""
    while path:
        yield path
        path = path.rpartition("/")[0]


def pseudo_mounts(root: str) -> set[str]:
    """Root-relative mount points under `root` whose filesystem is a kernel view (proc, sysfs, ...)."""
    root = os.path.realpath(root)
    found = (inside(root, m.point) for m in read_mounts() or () if m.fstype in PSEUDO_FS)
    return {clean_path(rel) for rel in found if rel is not None}


def bind_mounted_files(root: str) -> set[str]:
    """Root-relative paths of single files mounted over a path inside `root`: what a container runtime
    injects from the host (the NVIDIA toolkit's libcuda.so.<driver version>, nvidia-smi, Docker's
    /etc/hosts). They belong to the host, not the box."""
    root = os.path.realpath(root)
    found = set()
    for m in read_mounts() or ():
        rel = inside(root, m.point)
        if rel:
            try:
                if stat.S_ISREG(os.lstat(m.point).st_mode):
                    found.add(clean_path(rel))
            except OSError:
                continue
    return found


def resolve_in_box(entries: dict[str, Entry], path: str, hops: int = 40) -> Optional[str]:
    """`path` with the symlinks of the box (its scan entries) resolved, as seen from inside the box:
    absolute targets start at the box root, `..` stops there. None for a symlink loop."""
    done: list[str] = []
    todo = list(reversed(path.split("/")))
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        e = entries.get("/".join(done + [part]))
        if e is None or e.kind != SYMLINK:
            done.append(part)
            continue
        hops -= 1
        if hops < 0:
            return None
        if e.linkname.startswith("/"):
            done = []
        todo.extend(reversed(e.linkname.split("/")))
    return "/".join(done)


def links_to(entries: dict[str, Entry], targets: set[str]) -> list[str]:
    """The symlinks of the box that lead (directly or through other links) to one of `targets`."""
    if not targets:
        return []
    return [rel for rel, e in entries.items() if e.kind == SYMLINK and resolve_in_box(entries, rel) in targets]


_KIND_OF_MODE = {stat.S_IFREG: FILE, stat.S_IFDIR: DIR, stat.S_IFLNK: SYMLINK, stat.S_IFCHR: CHAR,
                 stat.S_IFBLK: BLOCK, stat.S_IFIFO: FIFO}  # sockets are not content
_KIND_OF_TAR = {**{t: FILE for t in tarfile.REGULAR_TYPES}, tarfile.DIRTYPE: DIR, tarfile.SYMTYPE: SYMLINK,
                tarfile.CHRTYPE: CHAR, tarfile.BLKTYPE: BLOCK, tarfile.FIFOTYPE: FIFO}


def entry_from_stat(rel: str, st: os.stat_result, linkname: str = "") -> Optional[Entry]:
    mode = st.st_mode  # S_IFMT and S_IMODE by hand: a scan calls this once per path
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


RACY_WINDOW_NS = 2 * 10**9  # a path changed this close to a scan is not trusted to its stat data next time


def _memo_stamp(st: os.stat_result) -> str:
    """A secret's mark in the ScanMemo: what _unchanged compares for an entry, as one string."""
    return f"{stat_stamp(st)}:{st.st_size}:{st.st_mode}:{st.st_uid}:{st.st_gid}"


def _unchanged(last, st: os.stat_result) -> bool:
    """Is the path the one the last scan saw (ScanMemo)? Same inode, mtime and ctime in ns (the
    entry's stamp, the stat cache's rule), type, permissions and owner, and a file of the same size.
    (Type, permissions and owner are compared too: sshfs and some other FUSE mounts report a ctime
    that a chmod or chown does not move.) `last` is its entry, or for a secret its _memo_stamp."""
    if isinstance(last, str):
        return last == _memo_stamp(st)
    mode = st.st_mode
    return (last.stamp == stat_stamp(st) and last.mode == mode & 0o7777 and last.uid == st.st_uid and last.gid == st.st_gid
            and last.kind == _KIND_OF_MODE.get(mode & 0o170000) and (last.kind != FILE or last.size == st.st_size))


class ScanMemo:
    """What one scan learnt of each path, kept for the next scan of the same root with the same
    profile and options (`snap watch` keeps one): a path whose lstat is the same as then (_unchanged)
    keeps its entry, its symlink target, xattrs, readability and secret verdict, none of which is
    read again. The rule is the stat cache's: chmod, chown, a write, an xattr or ACL change, a new
    link all move the ctime, which cannot be set back, and a symlink's target changes only with a
    new inode. A path whose ctime is within RACY_WINDOW_NS of the scan is not kept (a later change
    in the same clock tick could leave the same stat data). Every directory is still listed and
    every path still lstat'ed: a name created, deleted or renamed is seen whatever the directory's
    times say, and no rule about directory mtimes is relied on."""

    def __init__(self, clock: Callable[[], int] = time.time_ns):
        self.clock = clock  # ns; injectable for tests
        # The last finished scan's context and paths, swapped as one: a watcher's final snapshot
        # may scan while its loop does, and a scan that fails leaves the memo as it was.
        self._last: tuple[Optional[tuple], dict[str, Entry | str]] = (None, {})

    @property
    def seen(self) -> dict[str, Entry | str]:
        """path -> its entry (for a secret, its _memo_stamp), as the last finished scan left them."""
        return self._last[1]

    def start(self, context: tuple) -> tuple[dict, dict, int]:
        """(last scan's paths, this scan's, the ctime before which a path is kept) for a scan with
        `context`; a memo made under another context is not used."""
        last_context, seen = self._last
        return seen if last_context == context else {}, {}, self.clock() - RACY_WINDOW_NS

    def finish(self, context: tuple, seen: dict) -> None:
        self._last = (context, seen)


def scan_box(root: str, profile: Profile, extra_excludes: tuple[str, ...] = (),
             progress: Optional[Callable[[int], None]] = None, metadata_only: bool = False,
             memo: Optional[ScanMemo] = None) -> Scan:
    """Walk the live box. Excluded paths and pseudo filesystems are not descended into; secrets are
    left out (and listed) unless the profile opts in, and so are files bind-mounted from the host.
    `metadata_only` (a watcher looking for changes) reads no symlink targets, xattrs or permissions:
    a change of those changes the ctime. With the profile's `include` (root-relative paths) only those are walked, and their parent
    directories are entries of their own. With a `memo` (ScanMemo) what an unchanged path held at
    the last scan is taken from it."""
    if not os.path.isdir(root):
        raise UsageError(f"root {root} does not exist or is not a directory")
    root = os.path.realpath(root)
    skip_mounts = pseudo_mounts(root)
    mounted = bind_mounted_files(root)
    host_files: list[str] = []
    extra = {clean_path(e) for e in extra_excludes}
    context = (root, profile, frozenset(extra), metadata_only)
    old, new, settled_ns = (memo or ScanMemo()).start(context)
    if memo is None:
        settled_ns = -1  # nothing to keep
    entries: dict[str, Entry] = {}
    venvs = VenvRoots()
    secrets: list[str] = []
    unreadable: list[str] = []
    stack: list[str] = []

    def visit(rel: str, path: str, walk: bool = True) -> int:
        """Add the entry of `rel` (at `path`), unless the profile leaves it out; a directory is
        walked if `walk`. The number of entries added (0 or 1)."""
        last = old.get(rel)  # a path the last scan kept was not excluded (a path-only verdict)
        if rel in extra or rel in skip_mounts or (last is None and profile.exclude.match(rel)):
            return 0
        if rel in mounted:
            host_files.append(rel)
            return 0
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return 0
        except PermissionError:
            unreadable.append(rel)
            return 0
        if last is not None and _unchanged(last, st):
            e = None if isinstance(last, str) else last
        else:
            try:
                e = _new_entry(rel, path, st, profile, metadata_only)
            except FileNotFoundError:
                return 0
            except PermissionError:
                unreadable.append(rel)
                return 0
            if e is _UNREADABLE:
                unreadable.append(rel)
                return 0
            if e is _NOT_CONTENT:
                return 0
        if st.st_ctime_ns < settled_ns:
            new[rel] = e if e is not None else _memo_stamp(st)
        if e is None:
            secrets.append(rel)
            return 0
        entries[rel] = e
        if e.kind == DIR and walk:
            stack.append(rel)
        elif e.kind == FILE and rel.rpartition("/")[2] == "pyvenv.cfg":
            venvs.add(rel.rpartition("/")[0])
        return 1

    if profile.include:
        for rel in profile.include:
            _check_include(root, rel, profile)
            for parent in reversed(list(self_and_parents(rel))[1:]):
                if parent not in entries:
                    visit(parent, os.path.join(root, parent), walk=False)
            visit(rel, os.path.join(root, rel))
        if progress:
            progress(len(entries))
    else:
        stack.append("")
    while stack:
        rel_dir = stack.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        try:
            # Opened without following: a directory swapped for a symlink (or a file) since its
            # lstat is not walked (a symlink's target is not the box's content there).
            # (The root itself may be a symlink: --root names it.)
            fd = os.open(abs_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if rel_dir else 0))
            try:
                with os.scandir(fd) as it:
                    names = [de.name for de in it]
            finally:
                os.close(fd)
        except PermissionError:
            unreadable.append(rel_dir or "/")
            continue
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed or replaced while we walked
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            continue  # replaced by a symlink while we walked
        prefix = f"{rel_dir}/" if rel_dir else ""
        base = f"{abs_dir}/" if rel_dir else os.path.join(root, "")
        added = sum(visit(prefix + name, base + name) for name in names)
        if progress and added:
            progress(added)  # once per directory: a call per file costs as much as its lstat
    if memo is not None:
        memo.finish(context, new)
    host_files.extend(links_to(entries, mounted))
    for rel in host_files:
        entries.pop(rel, None)
    if unreadable:
        shown = ", ".join("/" + u for u in sorted(unreadable)[:3])
        more = f" and {len(unreadable) - 3} more" if len(unreadable) > 3 else ""
        raise StorageError(f"cannot read {shown}{more} in the box",
                           "run snap as root, or add the paths to the profile's exclude list")
    return Scan(entries, venvs, sorted(secrets), skip_mounts, sorted(host_files))


_UNREADABLE, _NOT_CONTENT = object(), object()


def _new_entry(rel: str, path: str, st: os.stat_result, profile: Profile, metadata_only: bool):
    """The entry of a path not known from the last scan: None for a secret the profile leaves out,
    _NOT_CONTENT for a socket, _UNREADABLE for a file snap cannot read."""
    link = os.readlink(path) if stat.S_ISLNK(st.st_mode) and not metadata_only else ""
    e = entry_from_stat(rel, st, link)
    if e is None:
        return _NOT_CONTENT
    if profile.is_secret(rel, e.kind == DIR, e.kind == FILE, functools.partial(read_head, path)):
        return None
    if not metadata_only:
        e.xattrs = read_xattrs(path)
        if e.kind == FILE and not os.access(path, os.R_OK):
            return _UNREADABLE
    return e


def _check_include(root: str, rel: str, profile: Profile) -> None:
    """An included path must exist, lie below no symlink (its parents are captured as directories),
    and not be left out by the profile."""
    path = os.path.join(root, rel)
    if not os.path.lexists(path):
        raise UsageError(f"--include {'/' + rel!r} does not exist in {root!r}")
    for parent in list(self_and_parents(rel))[1:]:
        if os.path.islink(os.path.join(root, parent)):
            raise UsageError(f"--include {'/' + rel!r} lies below the symlink {'/' + parent!r}",
                             "include the path the symlink points to")
    if any(profile.leaves_out(p) for p in self_and_parents(rel)):
        raise UsageError(f"--include {'/' + rel!r} is left out by the profile (its exclude or secrets list)")


# ---- an image -----------------------------------------------------------------------------------


def read_xattrs(path: str) -> Optional[dict[str, str]]:
    """A path's extended attributes worth carrying (not trusted.*, not SELinux labels: the host's)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return None  # a filesystem without xattrs
    out = {}
    for name in names:
        if name.startswith(SKIP_XATTRS):
            continue
        try:
            out[name] = os.getxattr(path, name, follow_symlinks=False).decode("utf-8", "surrogateescape")
        except OSError:
            continue
    return out or None


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


def _under(path: str, roots: set[str]) -> bool:
    """Is `path` one of `roots` or below one of them?"""
    while path:
        if path in roots:
            return True
        path = path.rpartition("/")[0]
    return False


def resolve_parent(index: dict[str, Entry], layer: dict[str, Entry], rel: str, name: str = "") -> str:
    """Where an extractor writes `rel` (a checked name): its parent directories resolved through
    the image's symlinks as if the root were '/' (extract.py does the same on disk), the final
    component not followed. Refuses a loop, as restore does."""
    parent, _, base = rel.rpartition("/")
    parts = [p for p in parent.split("/") if p]
    out: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if out:
                out.pop()
            continue
        here = "/".join((*out, part))
        e = layer.get(here) or index.get(here)
        if e is not None and e.kind == SYMLINK:
            hops += 1
            if hops > MAX_SYMLINK_HOPS:
                raise IntegrityError(f"too many symlinks resolving {name or rel!r}: refusing a hostile layer")
            if e.linkname.startswith("/"):
                out = []
            parts = [p for p in e.linkname.split("/") if p and p != "."] + parts
            continue
        out.append(part)
    return "/".join((*out, base))


def apply_layer_to_index(index: dict[str, Entry], tar_stream: BinaryIO, label: str = "layer") -> set[str]:
    """Apply one layer's tar (uncompressed stream) to an image index (ImageIndexer's rules).
    Returns the paths it removed."""
    indexer = ImageIndexer(index)
    for reader, m in iter_members(tar_stream, label):
        indexer.add(m, lambda: chunks_digest(data_chunks(reader)))
    return indexer.end_layer()


class ImageIndexer:
    """An image's index built one layer at a time, its members fed one by one as they are read: by
    apply_layer_to_index from a layer stream (a commit reading its base), and by the extractor as it
    applies a layer (a full restore: extract.py). Applies them as an extractor would, with the same
    checks (names, whiteouts, hardlinks, symlink loops): whiteouts and opaque markers hide lower
    paths, a non-directory replaces a lower directory tree, a path below a symlink lands where the
    symlink leads. Linear in the index and the layer."""

    def __init__(self, index: Optional[dict[str, Entry]] = None):
        self.index: dict[str, Entry] = {} if index is None else index
        self._start_layer()

    def _start_layer(self) -> None:
        self._layer: dict[str, Entry] = {}
        self._whiteouts: set[str] = set()
        self._opaques: set[str] = set()

    def add(self, m: tarfile.TarInfo, content_digest: Callable[[], str]) -> None:
        """One member of the current layer. `content_digest()` gives the digest of its data; it is
        called (once) only for a regular file's own content (not a hardlink's, a whiteout's)."""
        index, layer = self.index, self._layer
        rel = check_name(m.name)
        if not rel:
            return
        if "/" in rel:
            rel = resolve_parent(index, layer, rel, m.name)
        parent, _, base = rel.rpartition("/")
        if base.startswith(WHITEOUT_PREFIX):
            if base == OPAQUE:
                self._opaques.add(parent)
            else:
                name = whiteout_target(base)
                self._whiteouts.add(f"{parent}/{name}" if parent else name)
            return
        if m.islnk():
            target = check_name(m.linkname)
            if "/" in target:
                target = resolve_parent(index, layer, target, m.linkname)
            src = layer.get(target) or index.get(target)
            if not target or src is None or src.kind == DIR:
                raise IntegrityError(f"hardlink {m.name!r} points at {m.linkname!r}, which is not a file in the image: "
                                     "refusing a hostile layer")
            if src.kind != FILE:
                return
            e = Entry(rel, FILE, src.mode, src.uid, src.gid, src.size, src.mtime, digest=src.digest, xattrs=src.xattrs,
                      mtime_ns=src.mtime_ns)
        else:
            e = entry_from_member(m, rel)
            if e is None:
                return
            if e.kind == FILE:
                e.digest = content_digest()
        layer[rel] = e

    def end_layer(self) -> set[str]:
        """Apply the current layer (its whiteouts, opaque markers and replaced trees hide lower
        paths) and start the next. Returns the paths it removed."""
        index, layer = self.index, self._layer
        whiteouts, opaques = self._whiteouts, self._opaques
        # What this layer replaces: a lower directory tree under a non-directory.
        replaced = {rel for rel, e in layer.items() if e.kind != DIR and rel in index and index[rel].kind == DIR}
        removed: set[str] = set()
        if whiteouts or opaques or replaced:
            for rel in [r for r in index if _gone(r, whiteouts, opaques, replaced)]:
                del index[rel]
                removed.add(rel)
        for rel, e in layer.items():
            index[rel] = e
        self._start_layer()
        return removed - index.keys()


def _gone(rel: str, whiteouts: set[str], opaques: set[str], replaced: set[str]) -> bool:
    """Does a lower path go with this layer's whiteouts, opaque markers, or replaced trees?"""
    parent = rel.rpartition("/")[0]
    return _under(rel, whiteouts) or _under(parent, replaced) or _under_opaque(rel, opaques)


def _under_opaque(rel: str, opaques: set[str]) -> bool:
    """Below (not at) a directory marked opaque ('' is the root)."""
    if "" in opaques:
        return True
    parent = rel.rpartition("/")[0]
    return _under(parent, opaques)


# The base-index cache holds each Entry positionally (astuple: compact, quick to load). Its first
# line names the format version and Entry's fields: a cache of another version or field layout is
# rebuilt, never read into the wrong fields. Version 1 had no such line.
INDEX_VERSION = 4  # 3: the header names the diff_ids of the layers indexed; 4: files' exact PAX mtimes (mtime_ns)


def _index_header(diff_ids: Sequence[str]) -> dict:
    return {"version": INDEX_VERSION, "fields": [f.name for f in fields(Entry)], "diff_ids": list(diff_ids)}


def save_index(index: dict[str, Entry], path: str, diff_ids: Sequence[str]) -> None:
    """Save the index of the layers `diff_ids` (their uncompressed digests, in order)."""
    def write(f) -> None:
        f.write(json.dumps(_index_header(diff_ids)) + "\n")
        for e in index.values():
            f.write(json.dumps(astuple(e), separators=(",", ":")))
            f.write("\n")

    replace_file(path, write, lambda p, m: gzip.open(p, m, compresslevel=1), "wt")


def load_index(path: str, diff_ids: Optional[Sequence[str]] = None) -> Optional[dict[str, Entry]]:
    """The index saved at `path`; None if it is missing, damaged, of another version or layout, or,
    given `diff_ids`, of other layers than those: an image that names a base it does not hold (a
    hostile one, restored here) must not stand for that base in the next commit's diff."""
    try:
        with gzip.open(path, "rt") as f, gc_paused():
            header = json.loads(f.readline() or "null")
            if not isinstance(header, dict) or not isinstance(header.get("diff_ids"), list) or \
                    header != _index_header(header["diff_ids"] if diff_ids is None else diff_ids):
                return None
            width = len(header["fields"])
            index = {}
            for line in f:
                row = json.loads(line)
                if not isinstance(row, list) or len(row) != width:
                    return None
                e = Entry(*row)
                index[e.path] = e
            return index
    except (OSError, ValueError, TypeError, EOFError):
        return None  # a missing or damaged cache is rebuilt


# ---- the diff -----------------------------------------------------------------------------------


@dataclass
class Diff:
    changed: list[Entry]  # added or modified paths of the box, sorted
    deleted: list[str]  # base paths gone from the box (only the top-most of a deleted tree)


def within_its_second(e: Entry, old: Entry) -> bool:
    """Is box file `e`, whose metadata matches its base entry `old` (same_as: size, whole-second
    mtime, ...), not at the base's mtime to the nanosecond? Then an edit of the same size within
    that second looks unchanged, and only its content tells (git's racy entries). A file the base's
    tar made is at the header's exact time: never read."""
    return bool(e.stamp) and old.digest is not None and e.kind == FILE and \
        int(e.stamp.split(":")[1]) != old.image_mtime_ns()


def diff(base: dict[str, Entry], scan: Scan, skipped: Callable[[str], bool], rehash: bool = False,
         root: str = "/") -> Diff:
    """Compare the box with its base image. `skipped(path)` says a path was not scanned (excluded or
    a secret): such base paths are unknown, not deleted. A file that matches its base entry but
    for the fraction of its mtime's second is compared by content (within_its_second)."""
    box = scan.entries
    changed: list[Entry] = []
    for rel in sorted(box):
        e = box[rel]
        old = base.get(rel)
        if old is not None and rehash and e.kind == FILE and old.kind == FILE and old.digest:
            e.digest = file_digest(os.path.join(root, rel))
        if old is None or not e.same_as(old, compare_content=rehash):
            changed.append(e)
        elif not rehash and within_its_second(e, old):
            try:
                e.digest = file_digest(os.path.join(root, rel))
            except FileNotFoundError:
                e.digest = None  # deleted since the scan: the layer says so (layer.py)
            if e.digest != old.digest:
                e.mtime_ns = int(e.stamp.split(":")[1])  # else a restore of it would look unchanged next time
                changed.append(e)
    deleted: list[str] = []
    for rel in sorted(base):
        if rel in box or skipped(rel):
            continue
        parent = rel.rpartition("/")[0]
        if parent and (parent not in box or box[parent].kind != DIR):
            continue  # the parent's own whiteout or replacement covers it
        deleted.append(rel)
    return Diff(changed, deleted)

