"""Downloaded layers kept the way extraction wants them.

A compressed layer is kept as its blob. An uncompressed layer (model weights: GBs) is split while
it downloads: the content of each regular file of at least STAGE_MIN bytes goes to a file of its
own, everything else of the tar (headers, small files, padding) to a "skeleton" file. The blob's
digest is still checked over the whole stream, and `SplitLayer` gives the extractor the exact
bytes of the blob back. But the extractor can also `take` a member's content file and rename
it into place: the weights are written once, not downloaded to one file and copied to another, and
the disk holds them once.

The split is an optimisation only: the extractor takes a content file only when it is exactly the
data of the member the tar reader parsed (same offset, same size), so a tar the splitter reads
differently (a hostile one) is extracted by copying, from the same verified bytes.

A restore downloads its layers into a staging directory inside the restore root (`StagingDirs`),
at the top of the filesystem each lands on, not into snap's state dir: the weights are renamed into place
on the same filesystem, and the restore needs room for what it restores once, on the target, whatever the
state dir's disk holds.
A staging dir is written through only if it is this restore's: a directory (not a symlink) of its
user's, mode 0700, which only that user can change. One that is not (planted by an image, or by
another user of a shared root) is replaced, never written through.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import stat
import tarfile
from typing import BinaryIO, Callable, Iterable, Optional

from snapshotter import jsontext
from snapshotter.box.mounts import inside, read_mounts
from snapshotter.digests import file_digest
from snapshotter.errors import IntegrityError, quoted_path
from snapshotter.layer.direct import DIRECT_MIN, DirectFile
from snapshotter.state import versioned, write_versioned
from snapshotter.tar.reader import MAX_META, header_number, pax_records

STAGE_MIN = 1 << 20  # smaller contents stay in the skeleton: a rename saves nothing on them
SPLIT_SUFFIX = ".split"
SEGMENTS_VERSION = 1  # of segments.json: a split layer of another version is downloaded again
# + 16 hex digits of the manifest digest, at the top of a filesystem in a restore root
STAGING_PREFIX = ".snap-staging-"
_STAGING = re.compile(r"\.snap-staging-[0-9a-f]{16}")
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_META = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


class _Splitter:
    """Consumes a tar stream in arbitrary pieces and writes it to `dirpath` as skeleton + contents
    (those of DIRECT_MIN or more past the page cache if `direct`: layer/direct.py)."""

    def __init__(self, dirpath: str, durable: bool, direct: bool):
        self.dir, self.durable, self.direct = dirpath, durable, direct
        self.skeleton = open(os.path.join(dirpath, "skeleton"), "wb")
        self.segments: list[list] = []  # ["s", length] (from the skeleton) | ["c", name, length]
        self.offset = 0  # in the tar stream
        self.pending = b""  # bytes of a header block not complete yet
        self.state = "header"  # | "data" (to a content file) | "skip" (to the skeleton)
        self.left = 0  # bytes of the current data or skip region
        self.pad = 0  # zeros after the current content
        self.pax: Optional[bytes] = None  # PAX records being collected
        self.pax_size: Optional[int] = None  # the "size" record for the next member
        self.content: Optional[BinaryIO | DirectFile] = None

    # -- output
    def _skel(self, data: bytes) -> None:
        if not data:
            return
        self.skeleton.write(data)
        if self.segments and self.segments[-1][0] == "s":
            self.segments[-1][1] += len(data)
        else:
            self.segments.append(["s", len(data)])

    def _content_start(self, size: int) -> None:
        name = f"c{len(self.segments)}"
        # 0600 like the extractor's temp files: the file is renamed into place before its mode is set
        fd = os.open(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.content = DirectFile(fd) if self.direct and size >= DIRECT_MIN else os.fdopen(fd, "wb")
        self.segments.append(["c", name, size])

    def _content_end(self) -> None:
        if self.durable:
            self.content.flush()
            os.fsync(self.content.fileno())
        self.content.close()
        self.content = None

    # -- input
    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.state == "header":  # collect a whole block
                n = min(len(view), tarfile.BLOCKSIZE - len(self.pending))
                self.pending += bytes(view[:n])
                view = view[n:]
                if len(self.pending) == tarfile.BLOCKSIZE:
                    block, self.pending = self.pending, b""
                    self._skel(block)
                    self._header(block)
                continue
            n = min(len(view), self.left)
            piece, view, self.left = view[:n], view[n:], self.left - n
            if self.state == "data":
                self.content.write(piece)
                if not self.left:
                    self._content_end()
                    self.state, self.left = "skip", self.pad
            else:  # "skip": padding and data kept in the skeleton; PAX records parsed on the way
                self._skel(bytes(piece))
                if self.pax is not None:
                    self.pax += bytes(piece)
                if not self.left and self.pax is not None:
                    self.pax_size, self.pax = _pax_size(self.pax), None
            if not self.left:
                self.state = "header"

    def _header(self, block: bytes) -> None:
        """What follows a header block, as tarfile reads it: data only after PAX and GNU name
        headers, regular files, and types tarfile does not know."""
        if block.count(0) == tarfile.BLOCKSIZE:
            return  # an end-of-archive block: whatever follows stays in the skeleton
        try:
            size = header_number(block[124:136])
        except ValueError:
            return  # not a header the reader takes: the rest goes to the skeleton block by block
        kind = block[156:157]
        pax_size, self.pax_size = self.pax_size, None
        if kind in _META:
            if kind == tarfile.XHDTYPE and 0 < size <= MAX_META:
                self.pax = b""
            self.state, self.left = "skip", _padded(size)
        elif kind in _REGULAR or kind not in tarfile.SUPPORTED_TYPES:
            if pax_size is not None:
                size = pax_size
            if kind in _REGULAR and size >= STAGE_MIN:
                self._content_start(size)
                self.state, self.left, self.pad = "data", size, _padded(size) - size
            elif size > 0:
                self.state, self.left = "skip", _padded(size)

    def finish(self) -> None:
        if self.pending:
            self._skel(self.pending)
            self.pending = b""
        if self.content is not None:  # the stream ended inside a file: keep what came, as it came
            self.content.close()
            self.segments[-1][2] = os.path.getsize(os.path.join(self.dir, self.segments[-1][1]))
            self.content = None
        if self.durable:
            self.skeleton.flush()
            os.fsync(self.skeleton.fileno())
        self.skeleton.close()
        write_versioned(os.path.join(self.dir, "segments.json"), SEGMENTS_VERSION, {"segments": self.segments})

    def close(self) -> None:
        """Close what is still open (an error: the split is given up), writing nothing more."""
        if isinstance(self.content, DirectFile):
            self.content.discard()
        for f in (self.content, self.skeleton):
            if f is not None and not f.closed:
                f.close()


def _pax_size(data: bytes) -> Optional[int]:
    """The "size" record of PAX extended header data, if any (files over 8 GiB carry it)."""
    try:
        size = pax_records(data).get("size")
    except ValueError:
        return None
    return int(size) if size is not None and size.isdigit() else None


def download_split(chunks: Iterable[bytes], dest: str, durable: bool = False, direct: bool = False) -> None:
    """Write a verified-as-it-ends uncompressed layer stream to the directory `dest`, split (its big
    files past the page cache if `direct`). `chunks` must raise at its end if the bytes do not match
    their digest (Remote.iter_blob): only then is `dest.part` renamed to `dest`."""
    part = dest + ".part"
    if os.path.islink(part):
        os.unlink(part)  # planted: never written through
    shutil.rmtree(part, ignore_errors=True)
    os.makedirs(part, 0o700)
    try:
        splitter = _Splitter(part, durable, direct)
        try:
            for chunk in chunks:
                splitter.feed(chunk)
            splitter.finish()
        finally:
            splitter.close()
        os.rename(part, dest)
    finally:
        shutil.rmtree(part, ignore_errors=True)


class SplitLayer(io.RawIOBase):
    """The tar stream of a split layer, read back from its skeleton and content files. Moves
    forward only; skipping a content file does not read it, and `take` hands it over."""

    def __init__(self, dirpath: str, on_bytes: Optional[Callable[[int], None]] = None):
        self.dir, self.on_bytes = dirpath, on_bytes
        with open(os.path.join(dirpath, "segments.json")) as f:
            doc = jsontext.loads(f.read())
        if versioned(doc, SEGMENTS_VERSION) is None:
            raise ValueError(f"{dirpath} is a split layer of another format version")
        segs = doc["segments"]
        # (start in the stream, length, content name or None, start in the skeleton)
        self.segments: list[tuple[int, int, Optional[str], int]] = []
        pos = skel = 0
        for seg in segs:
            if seg[0] == "s":
                self.segments.append((pos, seg[1], None, skel))
                skel += seg[1]
                pos += seg[1]
            else:
                self.segments.append((pos, seg[2], seg[1], 0))
                pos += seg[2]
        self.size = pos
        self.contents = {start: (name, length) for start, length, name, _ in self.segments if name}
        self.taken: dict[str, BinaryIO] = {}  # content files handed over: their open handles
        self.skeleton = open(os.path.join(dirpath, "skeleton"), "rb")
        self.pos = 0
        self.i = 0  # index of the segment holding self.pos
        self.file: Optional[BinaryIO] = None  # open content file of segment i

    def readable(self) -> bool:
        return True

    def take(self, offset: int, size: int) -> Optional[str]:
        """The path of the content file holding exactly the member data at `offset` (`size`
        bytes), now the caller's to rename; None if there is none (the data is read instead)."""
        hit = self.contents.get(offset)
        if hit is None or hit[1] != size or offset < self.pos or hit[0] in self.taken \
                or not os.path.exists(os.path.join(self.dir, hit[0])):
            return None
        path = os.path.join(self.dir, hit[0])
        # Still readable after its rename through this handle: tarfile reads the byte before
        # each header to check the data is there, the last byte of this content when it fills its blocks.
        self.taken[hit[0]] = open(path, "rb")
        return path

    def readinto(self, b) -> int:
        # One segment at a time: a read never runs on into a content file the caller may take.
        while self.i < len(self.segments):
            start, length, name, skel = self.segments[self.i]
            within = self.pos - start
            if within >= length:
                self._next_segment()
                continue
            n = min(len(b), length - within)
            if name is None:
                self.skeleton.seek(skel + within)
                got = self.skeleton.readinto(memoryview(b)[:n])
            else:
                f = self.taken.get(name)
                if f is None:
                    if self.file is None:
                        self.file = open(os.path.join(self.dir, name), "rb")
                    f = self.file
                f.seek(within)
                got = f.readinto(memoryview(b)[:n])
            if not got:
                raise IntegrityError(f"split layer {self.dir} is incomplete")
            self.pos += got
            if self.on_bytes:
                self.on_bytes(got)
            return got
        return 0

    def skip(self, n: int) -> int:
        """Move n bytes forward without reading (tarreader.ForwardStream calls it to pass over a
        content file it took); returns how far it got."""
        n = min(n, self.size - self.pos)
        if self.on_bytes:
            self.on_bytes(n)
        self.pos += n
        while self.i < len(self.segments) and self.pos >= self.segments[self.i][0] + self.segments[self.i][1]:
            self._next_segment()
        return n

    def _next_segment(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        name = self.segments[self.i][2]
        if name in self.taken:
            self.taken.pop(name).close()
        self.i += 1

    def close(self) -> None:
        for f in (self.file, self.skeleton, *self.taken.values()):
            if f is not None:
                f.close()
        self.taken.clear()
        super().close()

    def digest(self) -> str:
        """sha256 of the whole stream, contents included (to check a split left by an earlier run)."""
        return file_digest(self)


def is_staging_name(name: str) -> bool:
    """Whether a name is a restore's staging directory."""
    return bool(_STAGING.fullmatch(name))


def not_ours(path: str) -> Optional[str]:
    """Why `path` is not a staging dir this restore made (what it is), or None: this restore makes a
    directory of its user's, mode 0700 (which a umask cannot widen); a symlink, another user's
    directory or one others may write into could lead a download anywhere."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_uid != os.geteuid():
        return f"a directory of uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"a directory of mode {stat.S_IMODE(st.st_mode):o}"
    return None


def _identity(path: str) -> tuple[int, int]:
    st = os.lstat(path)
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else (-1, -1)


def _remove_any(path: str) -> None:
    """Remove a staging dir of another restore, or something planted under such a name: a tree
    (rmtree follows no symlink in it), else the name itself (never followed)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _mount_points(root: str) -> list[str]:
    """The mount points inside `root` (a real path), itself included, as real paths."""
    return sorted({root} | {os.path.join(root, rel) for m in read_mounts() or []
                            if (rel := inside(root, m.point)) is not None and rel})


def staging_dirs(root: str) -> list[str]:
    """The staging directories in `root` (at its top and at the top of each filesystem mounted in
    it), relative to it: a commit leaves them out."""
    root = os.path.realpath(root)
    found = []
    for top in _mount_points(root):
        try:
            with os.scandir(top) as it:
                found += [os.path.relpath(de.path, root) for de in it
                          if is_staging_name(de.name) and de.is_dir(follow_symlinks=False)]
        except OSError:
            pass
    return found


class StagingDirs:
    """Where a restore of `manifest_digest` downloads its layers: a hidden directory at the top of the
    filesystem each layer lands on, inside the restore root (the root's own, or a volume mounted in
    it), so that a weight is renamed into place, never copied, and the state dir's disk holds no
    layer. Named after the image, so that a restore that was stopped finds the verified blobs it
    left; the staging directories of other images there (a killed run's) are removed on first use.
    Removed at the end, with the times of the directories they were made in put back."""

    def __init__(self, root: str, manifest_digest: str, log: Callable[[str], None] = lambda msg: None):
        self.root, self.log = os.path.realpath(root), log
        self.name = STAGING_PREFIX + manifest_digest.split(":", 1)[1][:16]
        self._mounts = set(_mount_points(self.root))
        self._made: dict[str, tuple[int, int]] = {}  # staging dir: the times of the directory it is in
        self._ids: dict[str, tuple[int, int]] = {}  # staging dir: its (device, inode) once made or kept

    def for_path(self, rel: Optional[str]) -> str:
        """The staging dir for a layer whose files land at `rel` (a hint: None or a wrong one means
        the root's filesystem), made if need be."""
        top = self._filesystem_top(rel or "")
        path = os.path.join(top, self.name)
        if path not in self._made:
            st = os.stat(top)
            for name in os.listdir(top):
                if is_staging_name(name) and name != self.name:
                    _remove_any(os.path.join(top, name))
            self._make(path)
            self._made[path] = (st.st_atime_ns, st.st_mtime_ns)
        return path

    def _make(self, path: str) -> None:
        """Make the staging dir `path`, or keep the one a stopped run of this restore left there;
        one this restore did not make is replaced (never followed, never written into)."""
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            why = not_ours(path)
            if why is not None:
                self.log(f"warning: {quoted_path(path)} is {why}, which this restore did not make: replaced")
                _remove_any(path)
                os.mkdir(path, 0o700)
        # What this restore made (or kept) is known by its identity from here on: the owner and mode a
        # filesystem gives a new directory are its own (NFS squashes root, CIFS and FUSE fix modes).
        self._ids[path] = _identity(path)

    def check(self, path: str) -> None:
        """Raise unless staging dir `path` is still the directory this restore made or kept (checked
        again before each download): not a symlink or another directory swapped in since."""
        if _identity(path) != self._ids.get(path):
            raise IntegrityError(f"the staging dir {quoted_path(path)} is not the one this restore made now: "
                                 "refusing to write through it", "is another user writing into the restore root?")

    def _filesystem_top(self, rel: str) -> str:
        """The top of the filesystem holding the deepest existing directory of `rel` inside the root,
        reached without following a symlink (the staging dir must stay inside the root)."""
        cur = top = self.root
        dev = os.lstat(cur).st_dev
        for part in rel.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                break
            nxt = os.path.join(cur, part)
            try:
                st = os.lstat(nxt)
            except OSError:
                break
            if not stat.S_ISDIR(st.st_mode):
                break
            if st.st_dev != dev or nxt in self._mounts:
                top, dev = nxt, st.st_dev
            cur = nxt
        return top

    def remove(self, keep_downloads: bool = False) -> None:
        """Remove them; with `keep_downloads` (a restore that stopped) only those holding nothing to resume from."""
        for path, times in self._made.items():
            if keep_downloads:
                try:
                    os.rmdir(path)
                except OSError:
                    continue  # not empty: verified blobs the next run reuses
            else:
                shutil.rmtree(path, ignore_errors=True)
            try:  # the extractor keeps the times of directories it only wrote into: so does this
                os.utime(os.path.dirname(path), ns=times, follow_symlinks=False)
            except OSError:
                pass
