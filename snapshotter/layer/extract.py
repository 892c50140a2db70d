"""Applying a layer tar onto a directory, the way a careful container runtime does (cf. umoci, containerd).

- Every name is checked: absolute names and names with '..' are refused (the layer is hostile).
- Parents are resolved inside the root, following symlinks as if the root were '/', so a symlink
  in the tree can never lead a write outside it; the final component is never followed.
- Regular files are written to a temp name in the same directory and renamed into place, so an
  interrupted restore leaves no half-written file at an original path (unless the caller says nothing
  reads the root yet: then a file new in a directory the layer made is written at its path, noted in
  `in_place_log` for a killed run's file to be removed: inplace.py). Each is renamed when the
  next entry is read, so a layer's last entry, if a regular file, is renamed only after the caller's
  check of the whole stream (its diff_id: `check_end`); a failed check removes it.
- OCI whiteouts ('.wh.NAME') and opaque markers ('.wh..wh..opq') delete from lower layers only.
- Owners are applied when running as root; device nodes only when asked; setuid/setgid bits and
  file capabilities (the security.capability xattr) only when asked and running as root.
- Directory mtimes are set last, and directories this layer only wrote into keep their old mtime.
- A hardlink may only name a file this extractor wrote (this image's layers, in order; a resumed
  restore says what its earlier runs wrote: `count_as_written`), as Docker and podman refuse a link
  into a lower layer: a link to a file already in the root (a live box's /root/.ssh/id_rsa) would
  give it a second name, that the next commit pushes.
- Temp files a killed run left behind ('.snap-tmp-*') are removed when a run next writes into their directory.
- A directory tree is never removed (a whiteout, or a non-directory replacing it) when a filesystem
  is mounted at or below it, nor a file mounted over: a layer must not empty a mounted volume.
- Several extractors may apply layers into one root at once (restore's parallel apply), each
  marked `parallel`: they share only parent directories, made by whichever comes first. A
  parallel extractor never applies a whiteout, removes a directory, replaces a non-directory with
  one, nor makes a hardlink to a file it was not told of: it raises NeedsSerial, before changing
  anything, and the caller applies that layer again alone (another extractor may hold that
  directory resolved: removed, a symlink could take its place). Temp names carry the run's token
  (ExtractOptions.run_token): the sweep spares the other extractors' temp files.
- Onto a root that holds a live system, the caller counted what the layer deletes before anything
  was written (restore/deletion_guard.py) and says which deletions it may make (`deletions`: each
  whiteout or opaque marker, each non-directory that replaces a directory holding anything, and
  each member that replaces a link to such a directory, with where it was counted to delete): any
  other, or one that now lands elsewhere, is refused (exit 6) before it deletes. A layer whose
  bytes are not the headers that were counted deletes no more than was counted.

The parts: extract_model.py (options, counts, NeedsSerial), roottree.py (paths scoped to the root,
directory times, removals), fileops.py (the system calls on a member's file), indexing.py (a base
indexed as it is applied)."""

from __future__ import annotations

import errno
import gzip
import os
import stat
import tarfile
import zlib
from typing import BinaryIO, Callable, Iterable, Optional

import zstandard

from snapshotter.errors import IntegrityError, StorageError, quoted_path, storage_error
from snapshotter.index.entry import clean_path
from snapshotter.index.indexer import ImageIndexer
from snapshotter.profile import PathSet
from snapshotter.state import remove_if_there
from snapshotter.tar.reader import EntryCount, TarReader
from snapshotter.tar.rules import OPAQUE, WHITEOUT_PREFIX, HeadersDigest, check_name, header_key, whiteout_target

from .extract_model import DEVICE_TYPES, ExtractOptions, NeedsSerial, creates, shape_of
from .fileops import READ_BUFFER, Attrs, attrs_of, join, set_attrs, umask, utime, write_all
from .indexing import IndexingReader
from .roottree import TMP_PREFIX, RootTree


class Extractor(RootTree):
    def __init__(self, root: str, options: Optional[ExtractOptions] = None):
        super().__init__(root, options)
        self.record: Optional[HeadersDigest] = None  # set to digest the headers of the next layer
        self.indexer: Optional[ImageIndexer] = None  # to index the layers applied (a restore's base: IndexingReader)
        self._take: Optional[Callable[[int, int], Optional[str]]] = None  # see apply()
        self._held: Optional[tuple[Optional[str], str]] = None  # the last file: (temp, path), (None, path) in place
        self._in_place = False  # see apply()
        self._never = PathSet(self.opts.never_write)
        self._room = 0  # bytes still free on the target at the last look, less what was written since
        self._keep_privileges = self.opts.allow_setuid and os.geteuid() == 0
        self._umask = umask()
        self._tmp_name = f"{TMP_PREFIX}{os.getpid()}-{self.opts.run_token or 0}"  # in a forked worker: its own pid
        self._owner = (os.geteuid(), os.getegid())
        # Directories this layer made and set from their header without the setgid bit: a directory
        # made in one is owned by this process's user and group (see _mkdir).
        self._plain_dirs: set[str] = set()
        # Real paths of the non-directories written (by any layer, or counted: count_as_written): the only
        # files a hardlink may name. A path a layer then deletes stays: only the image can write there again.
        self._image_files: set[str] = set()
        self.layer_files: list[str] = []  # those the last layer applied wrote, as paths relative to the root
        self.layer_shapes: list[int] = []  # what each of them is (shape_of), for a resumed restore's check
        self.layer_links: dict[str, str] = {}  # its hardlinks -> their targets (real, relative): that check too
        self._link_target = ""  # the last hardlink's target
        self.layer_gone: list[str] = []  # what its whiteouts hid (relative to the root; an opaque directory's: /)
        # members of the layers this extractor applied: _image_files and the like grow with them
        self.entries = EntryCount()
        # {member path: where it was counted to delete}: the only deletions the next layer may make; None: any
        self.deletions: Optional[dict[str, Optional[str]]] = None
        # Of the last layer applied: the directories it set ([(path relative to the root, its header)])
        # and those it only wrote into ({path relative to the root: their times before}), for settle_dirs.
        self.layer_dir_headers: list[tuple[str, tarfile.TarInfo]] = []

    def settle_dirs(self, headers: dict[str, tarfile.TarInfo], touched: dict[str, tuple[int, int]]) -> None:
        """After layers applied at once (each extractor `parallel`): give each directory they set
        the owner, mode and times its topmost header says (`headers`, by path relative to the root),
        and put back the times of those they only wrote into (`touched`: the earliest times any of
        them saw), as applying them one after the other would have left them. Nothing is created:
        a path that is no longer a directory is left as it is."""
        self._dir_cache.clear()
        # Each is read once (lstat): what it has already (most have all of it) is not set again.
        for rel, (at, mt) in touched.items():
            st = self._dir_stat(self._real(rel)) if rel not in headers else None
            if st is not None and (st.st_atime_ns, st.st_mtime_ns) != (at, mt):
                utime(self._real(rel), at, mt)
        for rel, m in headers.items():
            st = self._dir_stat(path := self._real(rel))
            if st is not None:
                self._set_attrs(path, m, rel, attrs_of(st), set_time=False)
                ns = int(m.mtime) * 10**9
                if (st.st_atime_ns, st.st_mtime_ns) != (ns, ns):
                    utime(path, ns, ns)

    def count_as_written(self, rels: Iterable[str]) -> None:
        """Let hardlinks name these files (real, relative to the root, as `layer_files`): an earlier run's."""
        self._image_files.update(self._real(rel) for rel in rels)

    def note_written(self, rel: str) -> None:
        """/rel (its parent resolved inside the root) is a file this restore wrote outside a layer (a
        join of part layers: restore/parts.py): hardlinks may name it."""
        parent, _, base = rel.rpartition("/")
        self._image_files.add(join(self._resolve_dir(parent, create=False), base))

    def add_hardlink(self, rel: str, target: str) -> None:
        """Link /rel to /target as a layer's hardlink entry is made (inside the root, never over a
        directory, only to a file this extractor wrote or was told of: note_written)."""
        link = tarfile.TarInfo(rel)
        link.type, link.linkname = tarfile.LNKTYPE, target
        self._apply_member(None, link)  # a hardlink entry: no data to read

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
        file new in a directory this layer made is written at its path, not to a temp file renamed
        there (the rename was a tenth of applying a venv). Killed midway, it is half-written at its path
        until the next run removes it (inplace.py). The last file is still removed if check_end fails."""
        self._reset_dir_times()
        self.layer_files, self.layer_shapes, self.layer_gone, self.layer_links = [], [], [], {}
        self.layer_dir_headers = []
        self._take = take
        self._in_place = in_place
        name = ""
        counted, done = self.entries.total, False
        try:
            reader = TarReader(tar_stream, layer, self.entries)
            indexing = IndexingReader(self.indexer, reader, take) if self.indexer is not None else None
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
            where = f" while writing {quoted_path(clean_path(name))}" if name else ""
            raise storage_error(e, repr(self.root), where) from e
        finally:
            if not done:  # not applied: applied again (NeedsSerial, a resumed run), it counts once
                self.entries.rewind(counted, layer)
            if self._held is not None:  # a layer that failed: its held-back file never shows (or stays)
                remove_if_there(self._held[0] if self._held[0] is not None else self._held[1])
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

    def _apply_member(self, reader: Optional[TarReader], m: tarfile.TarInfo) -> None:
        rel = check_name(m.name)
        if not rel or self._skipped(rel, m):
            return  # the root entry itself keeps the root's own attributes
        pdir, path = self._locate(rel)
        landed = path[len(self._root_prefix):]
        if landed != rel and self._never.match(landed) and self._leave_alone(landed, m):
            self.stats.left_alone += 1  # reached through a symlink: where it lands decides, not its name
            return
        old = self._old_at(pdir, path, m, rel, landed)
        if not (m.isdir() and old is not None and stat.S_ISDIR(old.st_mode)):
            self._note_parent(pdir)  # its entries change: its times are put back after
        if m.isdir():
            self._make_dir(path, old, m, rel, landed)
            return
        if old is not None and stat.S_ISDIR(old.st_mode):
            if self.deletions is not None and self.deletions.get(rel) != landed and os.listdir(path):
                self._uncounted(f"{quoted_path(rel)} would replace the directory {quoted_path(landed)}")
            self._remove_tree(path)  # a non-directory replaces a whole lower tree
        self._make_non_dir(reader, m, pdir, path, old is None, rel)
        self._written.add(path)
        self._image_files.add(path)
        self.layer_files.append(path[len(self.root):].lstrip("/"))
        self.layer_shapes.append(shape_of(m))
        if m.islnk():
            self.layer_links[self.layer_files[-1]] = self._link_target

    def _skipped(self, rel: str, m: tarfile.TarInfo) -> bool:
        """A whiteout (applied here), or a member that makes nothing: a path the machine owns, a
        device node not allowed. Skipped before anything is touched: the path keeps what lower
        layers put there."""
        parent, _, base = rel.rpartition("/")
        if base.startswith(WHITEOUT_PREFIX):
            if self.parallel:
                raise NeedsSerial(rel)  # what it deletes depends on the layers below it being all in
            self._dir_cache.clear()
            self._whiteout(rel, parent, base)
            return True
        if self._never.match(rel) and self._leave_alone(rel, m):
            self.stats.left_alone += 1
            return True
        if not creates(m, self.opts.allow_devices):
            if m.type in DEVICE_TYPES:
                self.stats.skipped_device("/" + rel)
            return True
        return False

    def _old_at(self, pdir: str, path: str, m: tarfile.TarInfo, rel: str, landed: str) -> Optional[os.stat_result]:
        """What is at `path` now (None: nothing), a link to a directory refused where its replacement
        is not a deletion counted onto a live root."""
        try:
            # In a directory this layer created, only what this layer wrote (or made on the way: a
            # directory implied by a path below it) can be there.
            old = os.lstat(path) if pdir not in self._new_dirs or path in self._written or path in self._new_dirs \
                else None
        except FileNotFoundError:
            return None
        if old is not None and (stat.S_ISLNK(old.st_mode) or (stat.S_ISDIR(old.st_mode) and not m.isdir())):
            self._dir_cache.clear()  # a symlink or a directory is about to be replaced
        if old is not None and stat.S_ISLNK(old.st_mode) and self.deletions is not None and \
                self.deletions.get(rel) != landed and not (m.issym() and m.linkname == os.readlink(path)):
            there = self.dir_at(landed)  # replaced by whatever the member is (a directory too): /bin -> usr/bin
            if there is not None and os.listdir(there):
                self._uncounted(f"{quoted_path(rel)} would replace the link {quoted_path(landed)} to a directory")
        return old

    def _make_dir(self, path: str, old: Optional[os.stat_result], m: tarfile.TarInfo, rel: str, landed: str) -> None:
        if old is not None and not stat.S_ISDIR(old.st_mode):
            if self.parallel:
                raise NeedsSerial(landed)  # perhaps an upper layer's, applied meanwhile
            os.unlink(path)
            old = None
        attrs = self._mkdir(path, m, landed) if old is None else attrs_of(old)
        # An owner or mode it has is not set again; its times once what it holds is in (put_back_dir_times).
        self._set_attrs(path, m, landed, attrs, set_time=False)
        if m.mode & stat.S_ISGID:
            self._plain_dirs.discard(path)
        else:
            self._plain_dirs.add(path)
        times = self._layer_dirs[path] = (int(m.mtime) * 10**9, int(m.mtime) * 10**9)
        if old is not None and (old.st_atime_ns, old.st_mtime_ns) == times:
            self._times_right.add(path)  # not set again unless a member changes what it holds
        if self.parallel:
            self.layer_dir_headers.append((landed, m))
        self._header_applied(path)
        self._written.add(path)
        self._dir_cache[rel] = path  # a real directory now: its members' parent, resolved without a lookup

    def _mkdir(self, path: str, m: tarfile.TarInfo, landed: str) -> Optional[Attrs]:
        """Make `m`'s directory at `path` with its mode, as this process's; its attributes then (None: unknown)."""
        mode = m.mode & 0o777 if self._umask is not None else 0o700
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            if not self.parallel:
                raise
            if not stat.S_ISDIR((st := os.lstat(path)).st_mode):
                raise NeedsSerial(landed) from None  # a layer applied meanwhile put a non-directory there
            return attrs_of(st)  # another extractor made it meanwhile: a parent directory both layers hold
        self._made_dir(path)
        if self._umask is None or path.rpartition("/")[0] not in self._plain_dirs or not self._umask_rules(path):
            return None  # a setgid parent may give it its group and its setgid bit; a default ACL, its mode
        return mode & ~self._umask, *self._owner

    def _make_non_dir(self, reader: Optional[TarReader], m: tarfile.TarInfo, pdir: str, path: str, new: bool,
                      rel: str) -> None:
        """Make a non-directory member at `path` (nothing, or no directory, there now: `new` if nothing)."""
        # A short name (the member's own may be NAME_MAX bytes long). No leftover can be there: _locate swept
        # the directory of stale temp files on first use.
        tmp = join(pdir, self._tmp_name)
        # See apply(); a file to be left with no permission bits goes by a temp name: a half-written one is 000
        in_place = self._in_place and new and m.isreg() and pdir in self._new_dirs and m.mode & 0o777 != 0
        dest = path if in_place else tmp
        renamed = False
        try:
            attrs_set = False
            if m.isreg():
                try:
                    attrs_set = self._write_file(reader, m, dest, rel, pdir)
                except FileExistsError:
                    if not in_place:
                        raise
                    # The name is there after all: the directory folds case (ext4 +F, vfat) and
                    # holds it under another case. Replaced by a rename, as any existing file is.
                    dest, in_place = tmp, False
                    attrs_set = self._write_file(reader, m, dest, rel, pdir)
            else:
                self._make_special(m, tmp)
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
                remove_if_there(dest)  # in place: a regular file this layer began there

    def _make_special(self, m: tarfile.TarInfo, tmp: str) -> None:
        """A symlink, hardlink, device node or FIFO at `tmp`."""
        if m.issym():
            os.symlink(m.linkname, tmp)
        elif m.islnk():
            self._hardlink(m, tmp)
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            os.mknod(tmp, kind | 0o600, os.makedev(m.devmajor, m.devminor))
        else:
            os.mkfifo(tmp, 0o600)

    def _reserve(self, size: int, rel: str) -> None:
        """Stop before a file the disk cannot hold (a decompression bomb, or an image bigger than
        the disk): the free space is asked again only once what was free at the last look is used."""
        self._room -= size
        if self._room >= 0:
            return
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise StorageError(f"disk full in {self.root!r}: layer entry {quoted_path(rel)} needs {size} bytes, "
                               f"{free} are free: stopping before writing it (an image bigger than the disk, "
                               "or a decompression bomb)",
                               "free space, or restore onto a bigger disk: the restore resumes")
        self._room = free - size

    def _write_file(self, reader: TarReader, m: tarfile.TarInfo, tmp: str, rel: str, pdir: str) -> bool:
        """Write a regular file's data to `tmp` in `pdir` (a temp name, or its path if written in place: apply).
        True if its attributes were set too (on the open fd: no path lookups)."""
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
        # Written with os.write on the fd, not through a file object: in a venv's tens of thousands of
        # small files, a buffered writer per file cost more than the writes. A file is created with its
        # mode, and what it got (fstat) is not set again: no chmod or chown after, mostly. One noted as
        # written at its path (apply) is made 000 until whole: inplace.py.
        mode, noted = m.mode & 0o7777, self.in_place_log is not None and tmp.rpartition("/")[2] != self._tmp_name
        create = 0 if noted else mode if mode <= 0o777 and self._umask is not None else 0o600
        if noted:
            self.in_place_log.writing(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, create)
        created = attrs_of(os.fstat(fd))  # as made: a default ACL or a setgid directory may have changed it
        try:
            if staged is not None:
                with open(staged, "rb") as src:
                    while chunk := src.read(READ_BUFFER):
                        write_all(fd, chunk)
            else:
                while chunk := reader.read_data(READ_BUFFER):
                    write_all(fd, chunk)
                    if len(chunk) == m.size:
                        break  # all of it (a venv's files are small): no read for the end
            if self.opts.fsync:
                os.fsync(fd)
            self._set_attrs(fd, m, rel, created)
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
            target = join(self._resolve_dir(tparent, create=False), tbase)
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
        self._link_target = target[len(self.root):].lstrip("/")

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
                             "its bytes are not the headers its snapshot's skeleton gives; "
                             "pass --force to apply it anyway")

    def _set_attrs(self, path, m: tarfile.TarInfo, rel: str, created: Optional[Attrs] = None,
                   set_time: bool = True) -> None:
        """Owner, mode, xattrs, mtime on a path (never followed) or an open fd (fileops.set_attrs)."""
        set_attrs(path, m, self.opts.same_owner, self._keep_privileges, lambda: self.stats.stripped("/" + rel),
                  created, set_time)
