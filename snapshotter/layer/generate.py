"""Generating layers: reproducible tars of box paths (plus whiteouts), compressed and hashed in one pass.

The same content always gives the same bytes, so an unchanged layer keeps its digest and the
registry already has it: entries sorted (whiteouts before their siblings), PAX headers with integer
mtimes and numeric owners only, deterministic compression."""

from __future__ import annotations

import fcntl
import itertools
import os
import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterator, Optional, Protocol

from snapshotter.box.openat import Beneath, NotTheScanned
from snapshotter.errors import DISK_FULL, DiskFull, StorageError
from snapshotter.index.entry import BLOCK, CHAR, DIR, FIFO, FILE, SYMLINK, Entry, stat_stamp
from snapshotter.oci.mediatypes import MEDIA_TYPE
from snapshotter.state import remove_if_there
from snapshotter.tar.compress import Compressor
from snapshotter.tar.rules import XATTR_PAX, header_bytes, layer_order, pax_mtime, whiteout_name

from .plan import LayerPlan

READ_SIZE = 1 << 20  # per read of a file's content
SETTLE_TRIES = 3  # reads of a file that keeps changing while read; the last one is kept, with a warning
BUFFERED_MAX = 8 << 20  # a file up to this size is read into memory, and read again alone if it changed
BUILDING_PREFIX = ".building-"  # a layer being built: BUILDING_PREFIX + "<pid>-<n>" in its out_dir
_builds = itertools.count()  # the <n> of this process's builds (next() is atomic: no two threads draw one)
# Called after each read of a file's content with (path, attempt), before the re-stat: lets a test
# change the file at that exact point (model.CommitHooks.after_read). None in normal runs.
AfterRead = Optional[Callable[[str, int], None]]
_TAR_TYPE = {FILE: tarfile.REGTYPE, DIR: tarfile.DIRTYPE, SYMLINK: tarfile.SYMTYPE, CHAR: tarfile.CHRTYPE,
             BLOCK: tarfile.BLKTYPE, FIFO: tarfile.FIFOTYPE}


@dataclass
class LayerBlob:
    """A built layer: the digests that name it, and the blob on disk (None when it was only measured:
    an uncompressed layer is streamed from the box again at upload instead of copied to disk)."""

    name: str
    path: Optional[str]
    digest: str  # sha256 of the blob (compressed bytes)
    diff_id: str  # sha256 of the uncompressed tar
    size: int
    media_type: str
    changed_while_read: list[str] = field(default_factory=list)  # never read whole and still (warned about)
    changed_since_scan: list[str] = field(default_factory=list)  # read whole and still, but not as the scan saw it
    unreadable: list[str] = field(default_factory=list)  # could not be opened (permissions) or read: not whole
    read_errors: dict[str, str] = field(default_factory=dict)  # of those, the ones a read failed: why (EIO...)
    # Measured (an uncompressed layer, streamed again to the registry): each file's header as
    # written, member -> (size, mtime, PAX mtime or None, stat key), for write_layer to write again.
    seen: dict[str, tuple] = field(default_factory=dict)
    # Streamed again: the box files that were no longer as measured (a log that grew), sent as
    # first seen: path -> its size then.
    grown: dict[str, int] = field(default_factory=dict)

    @property
    def not_whole(self) -> bool:
        """Whether a file of the layer is not as the scan saw it, or was not read: the blob is not sent."""
        return bool(self.changed_while_read or self.changed_since_scan or self.unreadable)


class _Torn(Exception):
    """A file streamed into the layer changed while it was read: the layer is built again."""


@dataclass
class _Reads:
    """What write_tar saw of the box files while reading them."""

    torn: list[str] = field(default_factory=list)  # changed during every read, or vanished: kept as last read
    stale: list[str] = field(default_factory=list)  # settled, but not as the scan saw it (size, mtime, ctime),
    # or no longer the scan's regular file (a symlink, a FIFO, another inode): not read
    unreadable: list[str] = field(default_factory=list)  # could not be opened or read
    read_errors: dict[str, str] = field(default_factory=dict)  # LayerBlob.read_errors
    record: bool = False  # keep `seen` (measure_layer)
    survey: bool = False  # files' headers and sizes, their bytes not read (survey_layer)
    seen: dict[str, tuple] = field(default_factory=dict)  # LayerBlob.seen, as the files are read
    as_seen: Optional[dict[str, tuple]] = None  # LayerBlob.seen to write again: headers as measured
    grown: dict[str, int] = field(default_factory=dict)  # LayerBlob.grown
    retry_streamed: bool = False  # a torn streamed file raises _Torn (the caller can start the layer again)
    on_header: Optional[Callable[[bytes, int], None]] = None  # each header as written, with its content size
    after_read: AfterRead = None  # see AfterRead


class HeaderSink(Protocol):
    """Where _emit sends the headers of the layer it writes (skeleton.PieceWriter): `start` at
    each try of the layer, then `add(header bytes, content size)` per member."""

    def start(self) -> None: ...

    def add(self, header: bytes, size: int) -> None: ...


def _put_header(put: Callable[[bytes], None], ti: tarfile.TarInfo, reads: _Reads, size: int) -> None:
    header = header_bytes(ti)
    put(header)
    if reads.on_header is not None:
        reads.on_header(header, size)


def _stat_key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read_exactly(fd: Optional[int], offset: int, size: int, put: Callable[[bytes], None],
                  on_bytes: Optional[Callable[[int], None]], failed: Optional[list[OSError]] = None) -> bool:
    """Pass `size` bytes of the file from `offset` to `put`, zeros where the file ends too soon (the
    tar header promised that size), for no file (None), or from a read that failed (an I/O error of
    the box's disk: added to `failed`). False if it did not give them all."""
    whole = fd is not None
    while size:
        try:
            data = os.pread(fd, min(size, READ_SIZE), offset) if whole else b""
        except OSError as e:
            if failed is None:
                raise
            failed.append(e)
            data = b""
        if not data:  # the end of the file, no file, or a failed read
            whole = False
            data = bytes(min(size, READ_SIZE))
        put(data)
        offset += len(data)
        size -= len(data)
        if on_bytes:
            on_bytes(len(data))
    return whole


def _open_scanned(box: Beneath, source: str, e: Entry, reads: _Reads) -> Optional[int]:
    """The file `source` open for reading if it is the regular file the scan saw; else None, and
    it is reported: deleted (torn), swapped (stale), or refused (unreadable)."""
    try:
        return box.open_scanned(source, int(e.stamp.split(":", 1)[0]) if e.stamp else None)
    except FileNotFoundError:  # deleted while we committed
        reads.torn.append(source)
    except NotTheScanned:  # swapped since the scan: another file, a symlink, a directory, a FIFO...
        reads.stale.append(source)
    except OSError:  # unreadable, or a path the kernel refuses
        reads.unreadable.append(source)
    return None


def _put_file(put: Callable[[bytes], None], ti: tarfile.TarInfo, e: Entry, box: Beneath, source: str, offset: int,
              fixed_size: bool, reads: _Reads, on_bytes: Optional[Callable[[int], None]]) -> None:
    """The header and content of one regular file, read so that it is not torn: the file is stat'ed
    before and after each read (size, mtime, ctime) and read again if it changed, as GNU tar warns
    "file changed as we read it". A whole file's header takes the size and mtime of the read kept
    (a part layer's size is fixed by its plan); the content is always exactly the header's size.
    The file is opened below the root following no symlink, without blocking, and read only if it
    is the regular file the scan saw (box/openat.py): else, if it cannot be opened, or if a read
    fails, its bytes are zeros and it is reported (the layer is not sent; push holds the file back)."""
    fd = _open_scanned(box, source, e, reads)
    if fd is None:  # not read: keep the archive well-formed (it is reported)
        _put_header(put, ti, reads, ti.size)
        _read_exactly(None, 0, ti.size, put, on_bytes)
        put(bytes(-ti.size % tarfile.BLOCKSIZE))
        return
    first = reads.as_seen.get(e.path) if reads.as_seen is not None else None
    failed: list[OSError] = []  # a read the disk refused (EIO): the file is reported, never read again
    with os.fdopen(fd, "rb", buffering=0):
        for attempt in range(SETTLE_TRIES if first is None else 1):  # as measured: read once, as it is
            before = os.fstat(fd)
            if not fixed_size:
                _size_and_time(ti, e, before, first)
            if ti.size <= BUFFERED_MAX:
                chunks: list[bytes] = []
                whole = _read_exactly(fd, offset, ti.size, chunks.append, None, failed)
            else:  # too big to hold: streamed into the layer, which is built again if it tore
                _put_header(put, ti, reads, ti.size)
                whole = _read_exactly(fd, offset, ti.size, put, on_bytes, failed)
            if reads.after_read:
                reads.after_read(e.path, attempt)
            if failed:
                break
            settled = whole and _stat_key(os.fstat(fd)) == _stat_key(before)
            if ti.size > BUFFERED_MAX:
                if not settled and reads.retry_streamed:
                    raise _Torn(e.path)
                break
            if settled:
                break
        if failed:
            reads.unreadable.append(source)
            reads.read_errors[source] = failed[0].strerror or str(failed[0])
        elif first is not None:
            if not whole or _stat_key(os.fstat(fd)) != first[3]:
                reads.grown[source] = first[3][0]  # the bytes sent are those measured if it only grew
        elif not settled:
            reads.torn.append(source)
        elif _not_as_scanned(e, before, fixed_size):
            reads.stale.append(source)
        elif reads.record:
            reads.seen[e.path] = _seen(ti, before)
        if ti.size <= BUFFERED_MAX:
            _put_header(put, ti, reads, ti.size)
            for chunk in chunks:
                put(chunk)
            if on_bytes:
                on_bytes(ti.size)
    put(bytes(-ti.size % tarfile.BLOCKSIZE))


def _not_as_scanned(e: Entry, st: os.stat_result, fixed_size: bool) -> bool:
    """Whether a file read (or surveyed) is no longer as the scan saw it: its stamp, a whole file's size."""
    return bool(e.stamp) and (stat_stamp(st) != e.stamp or not fixed_size and st.st_size != e.size)


def _seen(ti: tarfile.TarInfo, st: os.stat_result) -> tuple:
    """A file's row in LayerBlob.seen: its header's size and mtimes, and its stat key then."""
    return ti.size, ti.mtime, ti.pax_headers.get("mtime"), _stat_key(st)


def _survey_file(put: Callable[[bytes], None], ti: tarfile.TarInfo, e: Entry, box: Beneath, source: str,
                 fixed_size: bool, reads: _Reads) -> None:
    """A file's header as it is now and its size counted in zeros, unread: `seen` as measure_layer
    records it, for write_layer to read the file once (survey_layer). One that cannot be opened as
    the scan's is reported as _put_file reports it."""
    fd = _open_scanned(box, source, e, reads)
    if fd is not None:
        with os.fdopen(fd, "rb", buffering=0):
            before = os.fstat(fd)
        if not fixed_size:
            _size_and_time(ti, e, before, None)
        if _not_as_scanned(e, before, fixed_size):
            reads.stale.append(source)
        else:
            reads.seen[e.path] = _seen(ti, before)
    _put_header(put, ti, reads, ti.size)
    zeros = memoryview(bytes(min(ti.size, READ_SIZE)))  # counted, not kept: one buffer for the whole file
    for at in range(0, ti.size, READ_SIZE):
        put(zeros[:min(READ_SIZE, ti.size - at)])
    put(bytes(-ti.size % tarfile.BLOCKSIZE))


def _size_and_time(ti: tarfile.TarInfo, e: Entry, before: os.stat_result, first: Optional[tuple]) -> None:
    """A whole file's header size and mtime: as it is now, or as measured (`first`: LayerBlob.seen's)."""
    if first is not None:
        ti.size, ti.mtime, mtime_text, _ = first
    else:
        ti.size, ti.mtime = before.st_size, int(before.st_mtime)
        mtime_text = pax_mtime(before.st_mtime_ns) if e.mtime_ns is not None else None
    if mtime_text is not None:
        ti.pax_headers = {**ti.pax_headers, "mtime": mtime_text}


def _tarinfo(e: Entry, linkname_for_hardlink: Optional[str]) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(e.path + ("/" if e.kind == DIR else ""))
    ti.mode = e.mode
    ti.uid, ti.gid = e.uid, e.gid
    ti.uname = ti.gname = ""
    ti.mtime = int(e.mtime)
    if e.xattrs:
        ti.pax_headers = {XATTR_PAX + k: v for k, v in sorted(e.xattrs.items())}
    if e.mtime_ns is not None:  # an edit within its base file's second (box/diff.py): a restore puts its ns back
        ti.pax_headers = {**ti.pax_headers, "mtime": pax_mtime(e.mtime_ns)}
    if linkname_for_hardlink is not None:
        ti.type = tarfile.LNKTYPE
        ti.linkname = linkname_for_hardlink
        return ti
    ti.type = _TAR_TYPE[e.kind]
    if e.kind == FILE:
        ti.size = e.size
    elif e.kind == SYMLINK:
        ti.linkname = e.linkname
    elif e.kind in (CHAR, BLOCK):
        ti.devmajor, ti.devminor = os.major(e.rdev), os.minor(e.rdev)
    return ti


def tar_headers(plan: LayerPlan) -> Iterator[tuple[tarfile.TarInfo, Optional[Entry]]]:
    """The tar headers of a plan in layer order, each with its entry (None for a whiteout):
    sorted, whiteouts before their siblings, later paths of a hardlinked inode as links. Made one
    at a time as they are asked for: the headers of a 200k-file layer held at once would take 150 MB."""
    items = [(e.path, False) for e in plan.entries] + [(w, True) for w in plan.whiteouts]
    items.sort(key=layer_order)
    by_path = {e.path: e for e in plan.entries}
    first_of_inode: dict[str, str] = {}
    for path, is_whiteout in items:
        if is_whiteout:
            ti = tarfile.TarInfo(whiteout_name(path))
            ti.mode, ti.mtime, ti.uname, ti.gname = 0o644, 0, "", ""
            yield ti, None
            continue
        e = by_path[path]
        link_to = first_of_inode.get(e.inode) if e.inode else None
        if e.inode and link_to is None:
            first_of_inode[e.inode] = e.path
        yield _tarinfo(e, link_to), e


def write_tar(out: BinaryIO, root: str, plan: LayerPlan, on_bytes: Optional[Callable[[int], None]] = None,
              reads: Optional[_Reads] = None) -> _Reads:
    """Write the plan as a tar stream to `out`. Returns what changed while being read.

    The bytes are those of tarfile's PAX writer (each header is TarInfo.tobuf, then the content
    padded to 512, then two zero blocks and zeros up to a 10 KiB record), but contents go from the
    file to `out` in 1 MiB reads instead of tarfile's 16 KiB copies re-cut into 10 KiB records:
    at tens of GB that copying is most of the CPU."""
    reads = reads or _Reads()
    written = 0

    def put(data: bytes) -> None:
        nonlocal written
        out.write(data)
        written += len(data)

    with Beneath(root) as box:
        _write_members(put, box, plan, reads, on_bytes)
    put(bytes(2 * tarfile.BLOCKSIZE))
    if written % tarfile.RECORDSIZE:
        put(bytes(tarfile.RECORDSIZE - written % tarfile.RECORDSIZE))
    return reads


def _write_members(put: Callable[[bytes], None], box: Beneath, plan: LayerPlan, reads: _Reads,
                   on_bytes: Optional[Callable[[int], None]]) -> None:
    for ti, e in tar_headers(plan):
        if e is None or ti.type != tarfile.REGTYPE:
            _put_header(put, ti, reads, 0)
            continue
        source, offset = plan.slices.get(e.path, (e.path, 0))
        if reads.survey:
            _survey_file(put, ti, e, box, source, bool(plan.slices), reads)
        else:
            _put_file(put, ti, e, box, source, offset, bool(plan.slices), reads, on_bytes)


def _emit(out: Optional[BinaryIO], root: str, plan: LayerPlan, zstd_level: int,
          on_bytes: Optional[Callable[[int], None]], hashing: bool = True,
          headers: Optional[HeaderSink] = None, zstd_threads: int = -1,
          as_seen: Optional[dict[str, tuple]] = None, record: bool = False, after_read: AfterRead = None,
          survey: bool = False) -> LayerBlob:
    """Tar -> compress -> hash in one pass, writing the blob to `out` (or nowhere), and its headers
    to `headers`. A big file that changes while it is streamed makes the layer start again, where
    `out` can be rewound (a file, or nowhere), up to SETTLE_TRIES times; the last build is kept."""
    rewindable = out is None or (hashing and out.seekable())
    for attempt in range(SETTLE_TRIES if rewindable else 1):
        if attempt and out is not None:
            out.seek(0)
            out.truncate()
        if headers is not None:
            headers.start()
        comp = Compressor(out, plan.compression, zstd_level, hashing, zstd_threads)
        try:
            reads = _Reads(retry_streamed=rewindable and attempt < SETTLE_TRIES - 1,
                           on_header=headers.add if headers else None, as_seen=as_seen, record=record,
                           after_read=after_read, survey=survey)
            write_tar(comp, root, plan, on_bytes, reads)
            break
        except _Torn:
            comp.finish()  # closed now: nothing of it may reach `out` after the rewind
            continue
    comp.finish()
    report = {"changed_while_read": reads.torn, "changed_since_scan": reads.stale, "unreadable": reads.unreadable,
              "read_errors": reads.read_errors, "seen": reads.seen, "grown": reads.grown}
    if not hashing:
        return LayerBlob(plan.name, None, "", "", comp.blob.size, MEDIA_TYPE[plan.compression], **report)
    return LayerBlob(plan.name, None, comp.blob.digest, comp.tar.digest, comp.blob.size,
                     MEDIA_TYPE[plan.compression], **report)


def measure_layer(root: str, plan: LayerPlan, zstd_level: int = 3,
                  on_bytes: Optional[Callable[[int], None]] = None, headers: Optional[HeaderSink] = None,
                  after_read: AfterRead = None) -> LayerBlob:
    """Digests and size of a layer without keeping its bytes (stream it again with write_layer)."""
    return _emit(None, root, plan, zstd_level, on_bytes, headers=headers, record=True, after_read=after_read)


def survey_layer(root: str, plan: LayerPlan) -> LayerBlob:
    """A layer stored as is, its files opened and stat'ed but not read: its size and `seen` (no
    digest), as measure_layer's, for write_layer to stream it once. Files no longer as the scan saw
    them, or unreadable, are reported as measure_layer reports them."""
    return _emit(None, root, plan, 0, None, hashing=False, record=True, survey=True)


def write_layer(out: BinaryIO, root: str, plan: LayerPlan, zstd_level: int = 3,
                on_bytes: Optional[Callable[[int], None]] = None,
                as_seen: Optional[dict[str, tuple]] = None, after_read: AfterRead = None,
                headers: Optional[HeaderSink] = None) -> LayerBlob:
    """Write the layer blob's bytes to `out`: the upload stream of a measured layer, not hashed
    again (the registry checks the bytes against the digest measured before). With `as_seen`
    (the measured blob's `seen`) each file's header is written as measured and its bytes read up
    to the size measured: a file that grew since is sent as first seen (and named in `grown`)."""
    return _emit(out, root, plan, zstd_level, on_bytes, hashing=False, as_seen=as_seen, after_read=after_read,
                 headers=headers)


def build_layer(root: str, plan: LayerPlan, out_dir: str, zstd_level: int = 3,
                on_bytes: Optional[Callable[[int], None]] = None, headers: Optional[HeaderSink] = None,
                zstd_threads: int = -1, after_read: AfterRead = None) -> LayerBlob:
    """Build one layer blob into `out_dir`: a temp name, renamed when complete to "<digest hex>-<pid>-<n>",
    this build's own. Two builds of one layer (a watcher's background send and a commit of the same
    root, or two threads) each keep their file: one's removal after its upload, or its encryption
    in place, never reaches the file the other sends."""
    build = f"{os.getpid()}-{next(_builds)}"
    tmp = os.path.join(out_dir, BUILDING_PREFIX + build)
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(tmp, "wb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # live: a sweep leaves it (state.py's _in_use)
            blob = _emit(f, root, plan, zstd_level, on_bytes, headers=headers, zstd_threads=zstd_threads,
                         after_read=after_read)
            f.flush()  # a full disk fails here, before the rename, so no torn blob is named
            blob.path = os.path.join(out_dir, f"{blob.digest.split(':', 1)[1]}-{build}")
            os.replace(tmp, blob.path)  # still locked: unlocked only from here to its user's holding()
    except OSError as e:
        remove_if_there(tmp)
        full = e.errno in DISK_FULL  # the commit then sends the layer as it compresses it (commit/sender.py)
        raise (DiskFull if full else StorageError)(
            f"cannot write layer {plan.name} to {out_dir!r}: {e.strerror}",
            "free disk space" if full else "check that disk, or point SNAP_STATE_DIR at a writable directory") from e
    except BaseException:
        remove_if_there(tmp)
        raise
    return blob
