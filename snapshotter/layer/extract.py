"""Applying a layer tar onto a directory, the way a careful container runtime does (cf. umoci, containerd).

- Every name is checked: absolute names and names with '..' are refused (the layer is hostile).
- Parents are resolved inside the root, following symlinks as if the root were '/', so a symlink
  in the tree can never lead a write outside it; the final component is never followed.
- Regular files are written to a temp name in the same directory and renamed into place, so an
  interrupted restore leaves no half-written file at an original path (unless the caller says
  nothing reads the root yet: then a file new in a directory the layer made is written at its
  path, and a killed run leaves it half-written there for the next run to apply again). Each is renamed when the
  next entry is read, so a layer's last entry, if a regular file, is renamed only after the
  caller's check of the whole stream (its diff_id: `check_end`); a failed check removes it.
- OCI whiteouts ('.wh.NAME') and opaque markers ('.wh..wh..opq') delete from lower layers only.
- Owners are applied when running as root; device nodes only when asked; setuid/setgid bits and
  file capabilities (the security.capability xattr) only when asked and running as root.
- Directory mtimes are set last, and directories this layer only wrote into keep their old mtime.
- A hardlink may only name a file this extractor wrote (this image's layers, in order; a resumed
  restore says what its earlier runs wrote: `count_as_written`), as Docker and podman refuse a link
  into a lower layer: a link to a file already in the root (a live box's /root/.ssh/id_rsa) would
  give it a second name, that the next commit pushes.
- Temp files a killed run left behind ('.snap-tmp-*') are removed when a run next writes into
  their directory.
- A directory tree is never removed (a whiteout, or a non-directory replacing it) when a filesystem
  is mounted at or below it, nor a file mounted over: a layer must not empty a mounted volume.
- Several extractors may apply layers into one root at once (restore's parallel apply), each
  marked `parallel`: they share only parent directories, made by whichever comes first. A
  parallel extractor never applies a whiteout, removes a directory, replaces a non-directory with
  one, nor makes a hardlink to a file it was not told of:
  it raises NeedsSerial, before changing anything, and the caller applies that layer again alone
  (another extractor may hold that directory resolved: removed, a symlink could take its place).
  Temp names carry the run's token (ExtractOptions.run_token): the sweep spares the other
  extractors' temp files.
- Onto a root that holds a live system, the caller counted what the layer deletes before anything
  was written (restore/deletion_guard.py) and says which deletions it may make (`deletions`: each
  whiteout or opaque marker, each non-directory that replaces a directory holding anything, and
  each member that replaces a link to such a directory, with where it was counted to delete): any
  other, or one that now lands elsewhere, is refused (exit 6) before it deletes. A layer whose bytes are not the headers that were counted deletes
  no more than was counted.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import re
import shutil
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterable, Optional

import zstandard

from snapshotter.box.mounts import inside, read_mounts
from snapshotter.digests import file_digest, hasher_digest
from snapshotter.errors import IntegrityError, StorageError, quoted_path, storage_error
from snapshotter.index.entry import clean_path
from snapshotter.index.indexer import ImageIndexer
from snapshotter.index.paths import resolve_in_root
from snapshotter.profile import PathSet
from snapshotter.tar.reader import EntryCount, TarReader
from snapshotter.tar.rules import (OPAQUE, SKIP_XATTRS, WHITEOUT_PREFIX, XATTR_PAX, HeadersDigest, check_name,
                                   header_key, member_mtime_ns, whiteout_target)

TMP_PREFIX = ".snap-tmp-"
READ_BUFFER = 1 << 20
XATTR_NAME_MAX, XATTR_SIZE_MAX = 255, 1 << 16  # Linux's limits (limits.h)
_STALE_TMP = re.compile(r"\.snap-tmp-(?:join-)?\d+(?:-.*)?", re.S)  # ours (and restore's part joins), any pid
_CAPABILITY = "security.capability"
_PLAIN_TYPES = frozenset((*tarfile.REGULAR_TYPES, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE))
_DEVICE_TYPES = frozenset((tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE))
_ON_FD: dict = {}
_NOFOLLOW = {"follow_symlinks": False}


@dataclass
class ExtractOptions:
    same_owner: bool = field(default_factory=lambda: os.geteuid() == 0)
    allow_devices: bool = False
    allow_setuid: bool = False
    fsync: bool = False  # fsync each file before its rename (power-loss safety; slower)
    # Globs (the profile's `exclude`: /etc/hostname, /etc/resolv.conf, /proc, /tmp, ...) of paths the
    # machine owns: never written, replaced or deleted, whatever the layers hold.
    never_write: tuple[str, ...] = ()
    run_token: str = ""  # in this run's temp names: the sweep spares them (other extractors of the run write them)


class NeedsSerial(Exception):
    """A layer applied beside others holds a whiteout, would remove a directory or put one where a
    non-directory is (or finds one a layer applied meanwhile put there), or links to a file it was
    not told of: raised before that entry changes anything; the caller applies it again, alone."""


NAMES_KEPT = 1000  # names kept per kind for the report; the counts go on, so memory stays flat for any layer


@dataclass
class ExtractStats:
    files: int = 0
    bytes: int = 0
    skipped_devices: list[str] = field(default_factory=list)  # the first NAMES_KEPT of them
    stripped_setuid: list[str] = field(default_factory=list)  # setuid/setgid bits or file capabilities (first NAMES_KEPT)
    stale_tmp_removed: int = 0
    left_alone: int = 0  # entries skipped because they are under ExtractOptions.never_write
    skipped_devices_count: int = 0
    stripped_setuid_count: int = 0

    def skipped_device(self, path: str) -> None:
        self.skipped_devices_count += 1
        if len(self.skipped_devices) < NAMES_KEPT:
            self.skipped_devices.append(path)

    def stripped(self, path: str) -> None:
        self.stripped_setuid_count += 1
        if len(self.stripped_setuid) < NAMES_KEPT:
            self.stripped_setuid.append(path)

    def add(self, other: "ExtractStats") -> None:
        """Fold in another extractor's counts (restore applies layers in several at once)."""
        self.files += other.files
        self.bytes += other.bytes
        self.stale_tmp_removed += other.stale_tmp_removed
        self.left_alone += other.left_alone
        self.skipped_devices_count += other.skipped_devices_count
        self.skipped_devices += other.skipped_devices[:max(0, NAMES_KEPT - len(self.skipped_devices))]
        self.add_stripped(other)

    def add_stripped(self, other: "ExtractStats") -> None:
        """Fold in another extractor's setuid strips (restore's part joins run beside the applier)."""
        self.stripped_setuid_count += other.stripped_setuid_count
        self.stripped_setuid += other.stripped_setuid[:max(0, NAMES_KEPT - len(self.stripped_setuid))]




SYMLINK_SHAPE, LINK_SHAPE, OTHER_SHAPE = -1, -2, -3  # shape_of a non-directory that is not a file of a known size


def shape_of(m: tarfile.TarInfo) -> int:
    """What a non-directory member leaves at its path: a regular file's size; a symlink; a hardlink
    (a regular file, of its target's size); a device node or FIFO."""
    if m.isreg():
        return m.size
    return SYMLINK_SHAPE if m.issym() else LINK_SHAPE if m.islnk() else OTHER_SHAPE


class Extractor:
    def __init__(self, root: str, options: Optional[ExtractOptions] = None):
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self._root_prefix = os.path.join(self.root, "")  # a resolved path, less this, is root-relative
        self.opts = options or ExtractOptions()
        self.stats = ExtractStats()
        self._cleaned: set[str] = set()  # directories already swept for stale temp files this run
        # Resolved parent directories (rel -> real path). Resolution only goes through existing
        # directories, so only removing or replacing a directory or a symlink can change an
        # answer: those clear the cache.
        self._dir_cache: dict[str, str] = {}
        self.record: Optional[HeadersDigest] = None  # set to digest the headers of the next layer
        self.indexer: Optional[ImageIndexer] = None  # set to index the layers applied (a restore's base: _Indexing)
        self._take: Optional[Callable[[int, int], Optional[str]]] = None  # see apply()
        # (temp, path) of the last regular file, not yet renamed; (None, path) if written in place
        self._held: Optional[tuple[Optional[str], str]] = None
        self._in_place = False  # see apply()
        self._never = PathSet(self.opts.never_write)
        self._room = 0  # bytes still free on the target at the last look, less what was written since
        self._keep_privileges = self.opts.allow_setuid and os.geteuid() == 0
        # Real paths of the non-directories written (by any layer, or counted: count_as_written):
        # the only files a hardlink may name. A path a layer then deletes stays: nothing but the
        # image can write there again.
        self._image_files: set[str] = set()
        self.layer_files: list[str] = []  # those the last layer applied wrote, as paths relative to the root
        self.layer_shapes: list[int] = []  # what each of them is (shape_of), for a resumed restore's check
        self.layer_gone: list[str] = []  # what its whiteouts hid (relative to the root; an opaque directory's ends in /)
        self.entries = EntryCount()  # members of the layers this extractor applied: _image_files and the like grow with them
        self.parallel = False  # other extractors write into the root meanwhile (see NeedsSerial)
        # {member path: where it was counted to delete}: the only deletions the next layer may make; None: any
        self.deletions: Optional[dict[str, Optional[str]]] = None
        # Of the last layer applied: the directories it set ([(path relative to the root, its header)])
        # and those it only wrote into ({path relative to the root: their times before}), for settle_dirs.
        self.layer_dir_headers: list[tuple[str, tarfile.TarInfo]] = []
        self.layer_touched_dirs: dict[str, tuple[int, int]] = {}
        self._reset_dir_times()

    def _reset_dir_times(self) -> None:
        self._dir_times: dict[str, tuple[int, int]] = {}  # dirs we only wrote into: their times before
        self._layer_dirs: dict[str, tuple[int, int]] = {}  # dirs this layer defines: their header times
        self._written: set[str] = set()  # real paths this layer created (whiteouts must spare them)
        self._new_dirs: set[str] = set()  # directories this layer created: they hold only what it wrote

    def put_back_dir_times(self) -> None:
        """Put back the times of directories we only wrote into, then set this layer's own directory
        times (deepest first, since setting a child can touch its parent)."""
        for path, (at, mt) in self._dir_times.items():
            if path not in self._layer_dirs:
                _utime(path, at, mt)
        for path in sorted(self._layer_dirs, key=lambda p: p.count("/"), reverse=True):
            at, mt = self._layer_dirs[path]
            _utime(path, at, mt)
        self.layer_touched_dirs = {self._rel(p): times for p, times in self._dir_times.items() if p not in self._layer_dirs}
        self._reset_dir_times()

    def settle_dirs(self, headers: dict[str, tarfile.TarInfo], touched: dict[str, tuple[int, int]]) -> None:
        """After layers applied at once (each extractor `parallel`): give each directory they set
        the owner, mode and times its topmost header says (`headers`, by path relative to the root),
        and put back the times of those they only wrote into (`touched`: the earliest times any of
        them saw), as applying them one after the other would have left them. Nothing is created:
        a path that is no longer a directory is left as it is."""
        self._dir_cache.clear()
        for rel, (at, mt) in touched.items():
            if rel not in headers and self._is_dir(self._real(rel)):
                _utime(self._real(rel), at, mt)
        for rel, m in headers.items():
            path = self._real(rel)
            if self._is_dir(path):
                self._set_attrs(path, m, rel)
                _utime(path, int(m.mtime) * 10**9, int(m.mtime) * 10**9)

    def _is_dir(self, path: str) -> bool:
        """A real directory inside the root, reached without a symlink."""
        rel = self._rel(path)
        try:
            return self._resolve_dir(rel, create=False) == path
        except (FileNotFoundError, NotADirectoryError):
            return False

    def _rel(self, path: str) -> str:
        return path[len(self._root_prefix):] if path != self.root else ""

    # ---- the tree outside a layer (restore/parts.py joins part layers) ---------------------------------

    def parent_dir(self, rel: str) -> str:
        """The real directory that holds /rel, resolved inside the root, made by nothing (a
        missing one raises FileNotFoundError); stale temp files there are swept."""
        return self._locate(rel, create=False)[0]

    def will_change(self, pdir: str) -> None:
        """`pdir`'s entries are about to change: its times are put back after (put_back_dir_times)."""
        self._note_parent(pdir)

    def forget_dirs(self) -> None:
        """Resolve parent directories anew: other extractors changed the tree since."""
        self._dir_cache.clear()

    def count_as_written(self, rels: Iterable[str]) -> None:
        """Let hardlinks name these files (real paths relative to the root, as `layer_files` lists
        them): what an earlier run of the same restore wrote."""
        self._image_files.update(self._real(rel) for rel in rels)

    def note_written(self, rel: str) -> None:
        """/rel (its parent resolved inside the root) is a file this restore wrote outside a layer (a
        join of part layers: restore/parts.py): hardlinks may name it."""
        parent, _, base = rel.rpartition("/")
        self._image_files.add(_join(self._resolve_dir(parent, create=False), base))

    def dir_at(self, rel: str) -> Optional[str]:
        """The real directory /rel is, or leads to (a link to one), resolved inside the root; else None."""
        try:
            return self._resolve_dir(rel, create=False)
        except (FileNotFoundError, NotADirectoryError, IntegrityError):
            return None

    def add_hardlink(self, rel: str, target: str) -> None:
        """Link /rel to /target as a layer's hardlink entry is made (inside the root, never over a
        directory, only to a file this extractor wrote or was told of: note_written)."""
        link = tarfile.TarInfo(rel)
        link.type, link.linkname = tarfile.LNKTYPE, target
        self._apply_member(None, link)  # a hardlink entry: no data to read

    # ---- path resolution, scoped to the root ------------------------------------------------

    def _resolve_dir(self, rel: str, create: bool = True) -> str:
        """Real path of directory `rel`, following symlinks as if self.root were '/' (index/paths.py).
        Missing directories are created (0755, as the runtimes do)."""
        resolved = resolve_in_root(rel, lambda here: self._dir_on_the_way(here, create))
        if resolved is None:
            raise IntegrityError(f"too many symlinks resolving /{rel}: refusing a hostile layer")
        return self._real(resolved)

    def _dir_on_the_way(self, here: str, create: bool) -> Optional[str]:
        """The target of the symlink at `here` (a resolved path on the way to a directory); else
        `here` is made a directory if it is not one (with create=False, FileNotFoundError)."""
        path = self._real(here)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                raise
            self._note_parent(self._real(here.rpartition("/")[0]))
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                if not self.parallel:
                    raise
                return self._dir_on_the_way(here, create)  # another extractor made it meanwhile
            self._made_dir(path)
            return None
        if stat.S_ISLNK(st.st_mode):
            return os.readlink(path)
        if not stat.S_ISDIR(st.st_mode):
            if not create:
                raise FileNotFoundError(path)
            # A non-directory stands where a directory is needed: the new layer replaces it.
            if self.parallel:
                raise NeedsSerial(here)  # perhaps an upper layer's, applied meanwhile
            self._note_parent(self._real(here.rpartition("/")[0]))
            os.unlink(path)
            os.mkdir(path, 0o755)
            self._made_dir(path)
        return None

    def _real(self, rel: str) -> str:
        """The path on disk of `rel`, a path relative to the root with its symlinks resolved."""
        return os.path.join(self.root, rel) if rel else self.root

    def _made_dir(self, path: str) -> None:
        """Note a directory this layer made: it holds only what the layer writes, and no temp file
        of a killed run: no sweep, which saves a directory read per new directory."""
        self._new_dirs.add(path)
        self._cleaned.add(path)

    def _locate(self, rel: str, create: bool = True) -> tuple[str, str]:
        """(real parent dir, final path) for a member; the final component is not followed.
        With create=False a missing parent raises FileNotFoundError instead of being made."""
        parent, _, base = rel.rpartition("/")
        pdir = self._dir_cache.get(parent)
        if pdir is None:
            pdir = self._dir_cache[parent] = self._resolve_dir(parent, create)
        if pdir not in self._cleaned:
            self._cleaned.add(pdir)
            self._sweep_stale_tmp(pdir)
        return pdir, _join(pdir, base)

    def _sweep_stale_tmp(self, pdir: str) -> None:
        """Remove temp files an interrupted run left in `pdir` (this extractor has none open there
        yet; other extractors of this run, whose names end in its token, may)."""
        own = f"-{self.opts.run_token}" if self.opts.run_token else None
        with os.scandir(pdir) as it:
            stale = [de.path for de in it if de.name.startswith(TMP_PREFIX) and _STALE_TMP.fullmatch(de.name)
                     and not (own and de.name.endswith(own))]
        for path in stale:
            self._note_parent(pdir)
            self._remove_any(path)
            self.stats.stale_tmp_removed += 1

    # ---- directory mtimes ---------------------------------------------------------------------

    def _note_parent(self, pdir: str) -> None:
        """Remember a directory's times before we change its contents, to put them back."""
        if pdir not in self._dir_times and pdir not in self._layer_dirs:
            try:
                st = os.lstat(pdir)
                self._dir_times[pdir] = (st.st_atime_ns, st.st_mtime_ns)
            except FileNotFoundError:
                pass

    # ---- applying a layer ------------------------------------------------------------------------

    def apply(self, tar_stream: BinaryIO, take: Optional[Callable[[int, int], Optional[str]]] = None,
              layer: str = "layer", check_end: Optional[Callable[[], None]] = None, in_place: bool = False) -> None:
        """Apply one layer (an uncompressed tar stream). `take(offset, size)`, if given, may hand
        over a file holding a regular file's data (a split layer: staging.py), to be renamed into
        place instead of copied; the stream then skips that data without reading it (its `skip`).
        `check_end`, if given, is called once the stream is read to its end, before the layer's
        last entry, if a regular file, is renamed into place: what it raises leaves that file
        unseen (its temp removed). A last entry of another kind is in place by then.

        `in_place`: nothing reads the root yet (the app has not started: restore/restore.py), so a regular
        file new in a directory this layer made is written at its path, not in a temp file renamed
        there: a venv is tens of thousands of files, and the rename was a tenth of applying it.
        Killed midway, such a file is half-written at its path, and the layer (not recorded as
        applied) is applied again over it. The layer's last file is still removed if check_end fails."""
        self._reset_dir_times()
        self.layer_files, self.layer_shapes, self.layer_gone = [], [], []
        self.layer_dir_headers = []
        self._take = take
        self._in_place = in_place
        name = ""
        counted, done = self.entries.total, False
        try:
            reader = TarReader(tar_stream, layer, self.entries)
            indexing = _Indexing(self.indexer, reader, take) if self.indexer is not None else None
            if indexing is not None:
                reader, self._take = indexing, indexing.take  # the data hashed as it is written
            for m in reader:
                self._finish_held()
                name = m.name
                if self.record is not None:
                    self.record.add(header_key(m))
                self._apply_member(reader, m)
                if indexing is not None:
                    indexing.add(m)
            reader.stream.drain()  # read to the end here, so a corrupt tail is caught below
            if check_end is not None:
                check_end()
            self._finish_held()
            if indexing is not None:
                self.indexer = indexing.end_layer()
            done = True
        except (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as e:
            raise IntegrityError(f"{layer} does not decompress: {e}")  # checked before OSError: BadGzipFile is one
        except OSError as e:
            raise storage_error(e, repr(self.root), f" while writing {quoted_path(clean_path(name))}" if name else "") from e
        finally:
            if not done:  # not applied: applied again (NeedsSerial, a resumed run), it counts once
                self.entries.rewind(counted, layer)
            if self._held is not None:  # a layer that failed: its held-back file never shows (or stays)
                tmp, path = self._held
                _remove(tmp if tmp is not None else path)
                self._held = None
            self._take = None
            self.put_back_dir_times()

    def _finish_held(self) -> None:
        """Rename the regular file held back by the last entry into place (before the next entry,
        which may link to it or reuse its temp name)."""
        if self._held is not None:
            tmp, path = self._held
            if tmp is not None:
                self._rename(tmp, path)
            self._held = None

    def _rename(self, tmp: str, path: str) -> None:
        """Put `tmp` in place at `path` (no directory: it was not one when this entry began)."""
        try:
            os.rename(tmp, path)
        except IsADirectoryError:
            if not self.parallel:
                raise
            raise NeedsSerial(path) from None  # a layer applied meanwhile made a directory there

    def _apply_member(self, reader: TarReader, m: tarfile.TarInfo) -> None:
        rel = check_name(m.name)
        if not rel:
            return  # the root entry itself: the root keeps its own attributes
        parent, _, base = rel.rpartition("/")
        if base.startswith(WHITEOUT_PREFIX):
            if self.parallel:
                raise NeedsSerial(rel)  # what it deletes depends on the layers below it being all in
            self._dir_cache.clear()
            self._whiteout(rel, parent, base)
            return
        if self._never.match(rel) and self._leave_alone(rel, m):
            self.stats.left_alone += 1
            return
        if not creates(m, self.opts.allow_devices):
            if m.type in _DEVICE_TYPES:
                self.stats.skipped_device("/" + rel)
            return  # skipped before anything is touched: the path keeps what lower layers put there
        pdir, path = self._locate(rel)
        landed = path[len(self._root_prefix):]
        if landed != rel and self._never.match(landed) and self._leave_alone(landed, m):
            self.stats.left_alone += 1  # reached through a symlink: where it lands decides, not its name
            return
        self._note_parent(pdir)
        try:
            # In a directory this layer created, only what this layer wrote (or made on the way: a
            # directory implied by a path below it) can be there.
            old = os.lstat(path) if pdir not in self._new_dirs or path in self._written or path in self._new_dirs else None
        except FileNotFoundError:
            old = None
        if old is not None and (stat.S_ISLNK(old.st_mode) or (stat.S_ISDIR(old.st_mode) and not m.isdir())):
            self._dir_cache.clear()  # a symlink or a directory is about to be replaced
        if old is not None and stat.S_ISLNK(old.st_mode) and self.deletions is not None and \
                self.deletions.get(rel) != landed and not (m.issym() and m.linkname == os.readlink(path)):
            there = self.dir_at(landed)  # replaced by whatever the member is (a directory too): /bin -> usr/bin
            if there is not None and os.listdir(there):
                self._uncounted(f"{quoted_path(rel)} would replace the link {quoted_path(landed)} to a directory")

        if m.isdir():
            if old is not None and not stat.S_ISDIR(old.st_mode):
                if self.parallel:
                    raise NeedsSerial(rel)  # perhaps an upper layer's, applied meanwhile
                os.unlink(path)
                old = None
            if old is None:
                try:
                    os.mkdir(path, 0o700)
                    self._made_dir(path)
                except FileExistsError:
                    if not self.parallel:
                        raise
                    if not stat.S_ISDIR(os.lstat(path).st_mode):
                        raise NeedsSerial(rel) from None  # a layer applied meanwhile put a non-directory there
                    # another extractor made it meanwhile: a parent directory both layers hold
            self._set_attrs(path, m, rel)
            self._layer_dirs[path] = (int(m.mtime) * 10**9, int(m.mtime) * 10**9)
            if self.parallel:
                self.layer_dir_headers.append((landed, m))
            self._dir_times.pop(path, None)
            self._written.add(path)
            return

        if old is not None and stat.S_ISDIR(old.st_mode):
            if self.deletions is not None and self.deletions.get(rel) != landed and os.listdir(path):
                self._uncounted(f"{quoted_path(rel)} would replace the directory {quoted_path(landed)}")
            self._remove_tree(path)  # a non-directory replaces a whole lower tree

        # A short name: the member's own name may already be NAME_MAX bytes long.
        # No leftover can be there: _locate swept the directory of stale temp files on first use.
        tmp = _join(pdir, f"{TMP_PREFIX}{os.getpid()}-{self.opts.run_token or 0}")
        in_place = self._in_place and old is None and m.isreg() and pdir in self._new_dirs  # see apply()
        dest = path if in_place else tmp
        renamed = False
        try:
            attrs_set = False
            if m.isreg():
                try:
                    attrs_set = self._write_file(reader, m, dest, rel)
                except FileExistsError:
                    if not in_place:
                        raise
                    # The name is there after all: the directory folds case (ext4 +F, vfat) and
                    # holds it under another case. Replaced by a rename, as any existing file is.
                    dest, in_place = tmp, False
                    attrs_set = self._write_file(reader, m, dest, rel)
            elif m.issym():
                os.symlink(m.linkname, tmp)
            elif m.islnk():
                self._hardlink(m, tmp)
            elif m.ischr() or m.isblk():
                kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
                os.mknod(tmp, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            else:
                os.mkfifo(tmp, 0o600)
            if not m.islnk() and not (m.isreg() and attrs_set):
                self._set_attrs(dest, m, rel)
            if m.isreg():
                # renamed by _finish_held, or removed by apply
                self._held, renamed = (None if in_place else tmp, path), True
            else:
                self._rename(tmp, path)
                # A rename onto another link of the same inode does nothing and leaves tmp in place:
                # only a hardlink can be that (when `path` already links to its target).
                renamed = not m.islnk()
        finally:
            if not renamed:
                _remove(dest)  # in place: a regular file this layer began there
        self._written.add(path)
        self._image_files.add(path)
        self.layer_files.append(path[len(self.root):].lstrip("/"))
        self.layer_shapes.append(shape_of(m))

    def _reserve(self, size: int, rel: str) -> None:
        """Stop before a file the disk cannot hold (a decompression bomb, or an image bigger than
        the disk): the free space is asked again only once what was free at the last look is used."""
        self._room -= size
        if self._room >= 0:
            return
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise StorageError(f"disk full in {self.root!r}: layer entry {quoted_path(rel)} needs {size} bytes, {free} are free: "
                               "stopping before writing it (an image bigger than the disk, or a decompression bomb)",
                               "free space, or restore onto a bigger disk: the restore resumes")
        self._room = free - size

    def _write_file(self, reader: TarReader, m: tarfile.TarInfo, tmp: str, rel: str) -> bool:
        """Write a regular file's data to `tmp` (a temp name, or its path if written in place: apply). True if its attributes were set too (on the open fd:
        no path lookups)."""
        staged = self._take(m.offset_data, m.size) if self._take else None
        if staged is not None:
            try:
                os.rename(staged, tmp)  # verified at download; written once
                self.stats.files += 1
                self.stats.bytes += m.size
                return False
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                # The state dir is on another filesystem than this directory: copied below.
        self._reserve(m.size, rel)
        # Written with os.write on the fd, not through a file object: a venv is tens of thousands
        # of small files, and a buffered writer per file cost more than the writes themselves.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if staged is not None:
                with open(staged, "rb") as src:
                    while chunk := src.read(READ_BUFFER):
                        _write_all(fd, chunk)
            else:
                while chunk := reader.read_data(READ_BUFFER):
                    _write_all(fd, chunk)
                    if len(chunk) == m.size:
                        break  # all of it (a venv's files are small): no read for the end
            if self.opts.fsync:
                os.fsync(fd)
            self._set_attrs(fd, m, rel)
        finally:
            os.close(fd)
        self.stats.files += 1
        self.stats.bytes += m.size
        return True

    def _hardlink(self, m: tarfile.TarInfo, tmp: str) -> None:
        target_rel = check_name(m.linkname)
        if not target_rel:
            raise IntegrityError(f"hardlink {m.name!r} points at the root: refusing a hostile layer")
        tparent, _, tbase = target_rel.rpartition("/")
        try:
            # Scoped like any path, and never creating or replacing anything on the way.
            target = _join(self._resolve_dir(tparent, create=False), tbase)
            tst = os.lstat(target)
        except (FileNotFoundError, NotADirectoryError):
            if self.parallel:
                raise NeedsSerial(m.name) from None  # perhaps a file of a layer applied meanwhile
            raise IntegrityError(f"hardlink {m.name!r} points at {m.linkname!r}, which is not in the image")
        if target not in self._image_files:
            if self.parallel:
                raise NeedsSerial(m.name)  # perhaps a file of a layer applied meanwhile
            raise IntegrityError(f"hardlink {m.name!r} points at {m.linkname!r}, a file the image did not write: "
                                 "refusing a hostile layer")
        if stat.S_ISDIR(tst.st_mode):
            raise IntegrityError(f"hardlink {m.name!r} points at a directory: refusing a hostile layer")
        os.link(target, tmp, follow_symlinks=False)

    def _leave_alone(self, rel: str, m: tarfile.TarInfo) -> bool:
        """Whether to skip an entry under never_write. Only the top of such a tree, a directory
        (/proc, /tmp: mount points), is made when it is missing, so that the tree can boot."""
        parent = rel.rpartition("/")[0]
        if not m.isdir() or (parent and self._never.match(parent)):
            return True
        return os.path.lexists(self._locate(rel)[1])

    def _whiteout(self, rel: str, parent: str, base: str) -> None:
        if self.deletions is not None and rel not in self.deletions:
            self._uncounted(f"whiteout {quoted_path(rel)} deletes")
        try:
            pdir = self._resolve_dir(parent, create=False)
        except FileNotFoundError:
            return  # nothing below to hide
        hidden = parent if base == OPAQUE else f"{parent}/{base[len(WHITEOUT_PREFIX):]}".lstrip("/")
        if hidden and self._never.match(hidden):
            self.stats.left_alone += 1
            return
        gone = pdir if base == OPAQUE else os.path.join(pdir, whiteout_target(base))
        self.layer_gone.append(self._rel(gone) + "/" if base == OPAQUE else self._rel(gone))
        if self.deletions is not None:
            lands = self._rel(pdir) if base == OPAQUE else f"{self._rel(pdir)}/{whiteout_target(base)}".lstrip("/")
            if self.deletions[rel] != lands:
                self._uncounted(f"whiteout {quoted_path(rel)} would delete {quoted_path(lands)}")
        if base == OPAQUE:
            for name in os.listdir(pdir):
                path = os.path.join(pdir, name)
                if self._never.match(f"{parent}/{name}".lstrip("/")):
                    continue  # the machine's own (/etc/hostname under an opaque /etc) stays
                if path not in self._written:
                    self._note_parent(pdir)
                    self._remove_any(path)
            return
        name = whiteout_target(base)
        path = os.path.join(pdir, name)
        if path in self._written:
            return  # a whiteout never deletes from its own layer
        self._note_parent(pdir)
        self._remove_any(path)  # the final component is removed, never followed

    def _uncounted(self, what: str) -> None:
        """Refuse a deletion that is not one counted before the restore onto a live root began."""
        raise IntegrityError(f"a layer's {what} in {self.root!r}, which holds a live system, and that is not a "
                             "deletion counted from its headers before the restore began: refusing a hostile layer",
                             "its bytes are not the headers its snapshot's skeleton gives; pass --force to apply it anyway")

    def _remove_any(self, path: str) -> None:
        """Remove a path of any type; the final component is never followed."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            self._remove_tree(path)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # another extractor of this run swept it first
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            shown = "/" + os.path.relpath(path, self.root)
            raise StorageError(f"the image deletes or replaces {shown}, but a file is mounted over it: refusing",
                               "unmount it, or restore into another directory") from e

    def _remove_tree(self, path: str) -> None:
        """shutil.rmtree, refused when a filesystem is mounted at or below `path`: rmtree would
        empty the mounted volume before failing on the mount point itself."""
        if self.parallel:
            raise NeedsSerial(path)
        mp = mount_below(path)
        if mp is not None:
            shown = "/" + os.path.relpath(path, self.root)
            raise StorageError(f"the image deletes or replaces the directory {shown}, but {mp} is a mount point: "
                               "refusing to empty a mounted filesystem",
                               "unmount it, or restore into another directory")
        self._dir_cache.clear()
        shutil.rmtree(path)

    def _set_attrs(self, path, m: tarfile.TarInfo, rel: str) -> None:
        """Owner, mode, xattrs, mtime on a path (never followed) or an open fd."""
        mode = m.mode & 0o7777
        keep_privileges = self._keep_privileges
        xattrs = {k[len(XATTR_PAX):]: v for k, v in m.pax_headers.items() if k.startswith(XATTR_PAX)} if m.pax_headers else {}
        stripped = False
        if mode & (stat.S_ISUID | stat.S_ISGID) and not m.isdir() and not keep_privileges:
            mode &= ~(stat.S_ISUID | stat.S_ISGID)
            stripped = True
        if xattrs and _CAPABILITY in xattrs and not keep_privileges:
            del xattrs[_CAPABILITY]  # file capabilities are setuid by another name
            stripped = True
        if stripped:
            self.stats.stripped("/" + rel)
        nofollow = _ON_FD if isinstance(path, int) else _NOFOLLOW
        if self.opts.same_owner:
            os.chown(path, m.uid, m.gid, **nofollow)
        if m.type != tarfile.SYMTYPE:
            os.chmod(path, mode)  # after chown: chown clears setuid bits
        for name, value in xattrs.items():
            self._set_xattr(path, name, value, nofollow)
        # A PAX mtime to the ns, as Docker sets it: the next commit's diff tells an untouched base file by it.
        ns = member_mtime_ns(m) if m.pax_headers else None
        ns = int(m.mtime) * 1_000_000_000 if ns is None else ns
        os.utime(path, ns=(ns, ns), **nofollow)

    def _set_xattr(self, path, name: str, value: str, nofollow: dict) -> None:
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


class _Indexing:
    """The extractor's hook for an ImageIndexer (index/indexer.py): stands for the TarReader, hashing each
    regular file's data as the extractor reads it to write it, and the rest of it (all of it for an
    entry left alone) when the member is indexed; a content file a split layer hands over (`take`)
    is hashed before it is renamed into place (a read; copying it instead would write the weight
    again and need its room twice)."""

    def __init__(self, indexer: ImageIndexer, reader: TarReader,
                 take: Optional[Callable[[int, int], Optional[str]]]):
        self.indexer, self.reader, self._take = indexer, reader, take
        self.stream = reader.stream
        self._hash = hashlib.sha256()
        self._taken: Optional[str] = None  # the digest of the content file taken for this member
        self.failed = False  # the index refused the layer (a hardlink to a path not in the image)

    def __iter__(self):
        for m in self.reader:
            self._hash, self._taken = hashlib.sha256(), None
            yield m

    def read_data(self, n: int) -> bytes:
        data = self.reader.read_data(n)
        self._hash.update(data)
        return data

    def take(self, offset: int, size: int) -> Optional[str]:
        staged = self._take(offset, size) if self._take else None
        if staged is not None:
            self._taken = file_digest(staged)
        return staged

    def add(self, m: tarfile.TarInfo) -> None:
        if self.failed:
            return
        try:
            self.indexer.add(m, self._content_digest)
        except IntegrityError:
            self.failed = True  # what the extractor accepted stays applied; there is just no index

    def end_layer(self) -> Optional[ImageIndexer]:
        """The indexer, the layer applied to it; None if it refused the layer."""
        if self.failed:
            return None
        self.indexer.end_layer()
        return self.indexer

    def _content_digest(self) -> str:
        if self._taken is not None:
            return self._taken
        while self.read_data(READ_BUFFER):
            pass
        return hasher_digest(self._hash)


def creates(m: tarfile.TarInfo, allow_devices: bool) -> bool:
    """Does the extractor make something for member `m` (not a whiteout)? A plain type; a device node
    with --allow-devices as root; a FIFO (which a reader can block on) with --allow-devices. Other
    tar types (GNU sparse etc.) carry nothing a rootfs needs."""
    if m.type in _PLAIN_TYPES:
        return True
    return m.type in _DEVICE_TYPES and allow_devices and (m.isfifo() or os.geteuid() == 0)


def _join(directory: str, name: str) -> str:
    """os.path.join(directory, name) for a name without "/", for a fraction of its cost (twice per member)."""
    return f"{directory.rstrip('/')}/{name}"


def _write_all(fd: int, data: bytes) -> None:
    n = os.write(fd, data)
    if n < len(data):  # a short write (a signal, a nearly full disk): the rest, or the error
        view = memoryview(data)[n:]
        while view:
            view = view[os.write(fd, view):]


def _utime(path: str, at: int, mt: int) -> None:
    try:
        os.utime(path, ns=(at, mt), follow_symlinks=False)
    except FileNotFoundError:
        pass


def _remove(path: str) -> None:
    try:
        os.unlink(path)
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
