"""Layer compression: streaming (de)compression with hashing in the same pass, and what a stream's
first bytes say its compression is."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import zlib
from typing import BinaryIO, Callable, Iterable, Iterator, Optional

import zstandard

from snapshotter.digests import hasher_digest
from snapshotter.errors import IntegrityError, UsageError
from snapshotter.oci.mediatypes import compression_of


class HashingWriter(io.RawIOBase):
    """Counts and sha256-hashes what passes through, writing it on to `out` (if any)."""

    def __init__(self, out: Optional[BinaryIO] = None, hashing: bool = True):
        self.out = out
        self.sha = hashlib.sha256() if hashing else None
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.sha is not None:
            self.sha.update(b)
        self.size += len(b)
        if self.out is not None:
            self.out.write(b)
        return len(b)

    @property
    def digest(self) -> str:
        return hasher_digest(self.sha)


class Compressor(io.RawIOBase):
    """tar bytes in -> diff_id hash -> compressor -> blob digest hash -> file.

    Output is deterministic for the same input and settings: gzip headers carry no name or time,
    and zstd always runs in its multithreaded mode, whose frames do not depend on the thread count
    (`zstd_threads`: -1 one per core; a layer packed beside others takes its share)."""

    def __init__(self, out: Optional[BinaryIO], compression: str, zstd_level: int = 3, hashing: bool = True,
                 zstd_threads: int = -1):
        """`hashing=False` when the digests are known already (a layer streamed again to upload)."""
        self.blob = HashingWriter(out, hashing)
        # Uncompressed, the tar is the blob: one hash serves as both digest and diff_id.
        self.tar = self.blob if compression == "none" else HashingWriter(None, hashing)
        self.compression = compression
        if compression == "zstd":
            cctx = zstandard.ZstdCompressor(level=zstd_level, threads=zstd_threads if zstd_threads >= 1 else -1,
                                           write_checksum=True)
            self._sink = cctx.stream_writer(self.blob, closefd=False)
        elif compression == "gzip":
            self._sink = gzip.GzipFile(filename="", mode="wb", fileobj=self.blob, mtime=0, compresslevel=6)
        elif compression == "none":
            self._sink = self.blob
        else:
            raise UsageError(f"unknown compression {compression!r}: use zstd, gzip or none")

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        if self.tar is not self.blob:
            self.tar.write(b)
        self._sink.write(b)
        return len(b)

    def finish(self) -> None:
        if self._sink is not self.blob:
            self._sink.close()


class IterReader(io.RawIOBase):
    """A file-like view of an iterator of byte chunks (a streamed HTTP body)."""

    def __init__(self, chunks: Iterable[bytes]):
        self._it: Iterator[bytes] = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def drain(self) -> None:
        for _ in self._it:
            pass


class HashingReader(io.RawIOBase):
    """Reads through `src`, hashing what is read (used to check a layer's diff_id while extracting)."""

    def __init__(self, src: BinaryIO, on_bytes: Optional[Callable[[int], None]] = None):
        self.src = src
        self.sha = hashlib.sha256()
        self.on_bytes = on_bytes

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        """The source's bytes as they come (RawIOBase.read would copy them twice: into a buffer
        of its own, then out of it; a restore reads each layer's whole tar this way)."""
        data = self.src.read(n)
        self.sha.update(data)
        if self.on_bytes and data:
            self.on_bytes(len(data))
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        n = len(data)
        b[:n] = data
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    @property
    def digest(self) -> str:
        return hasher_digest(self.sha)


_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_SNIFF = tarfile.BLOCKSIZE  # enough for the magic numbers, and for a tar's first header


def sniff_compression(head: bytes) -> Optional[str]:
    """'zstd' | 'gzip' | 'none' by a blob's first bytes, as engines decide; None if they are none
    of these (not even a tar header with a valid checksum, nor an end-of-archive block)."""
    if head.startswith(_ZSTD_MAGIC) or (len(head) >= 4 and head[1:4] == b"\x2a\x4d\x18" and head[0] & 0xF0 == 0x50):
        return "zstd"  # a zstd frame, or a skippable frame before one
    if head.startswith(_GZIP_MAGIC):
        return "gzip"
    if len(head) == tarfile.BLOCKSIZE:
        if head.count(0) == tarfile.BLOCKSIZE:
            return "none"  # an empty archive
        try:
            if tarfile.nti(head[148:156]) in tarfile.calc_chksums(head):
                return "none"
        except (tarfile.HeaderError, ValueError):
            pass
    return None


def label_mismatch(media_type: str, actual: str) -> Optional[str]:
    """A one-line note when a layer's media type says another compression than its bytes."""
    if compression_of(media_type) == actual:
        return None
    name = {"none": "a plain tar", "gzip": "gzip", "zstd": "zstd"}[actual]
    return f"labelled {media_type} but its bytes are {name} (relabelled by a tool such as docker push): read as {name}"


class _Prefixed(io.RawIOBase):
    """`head` (bytes already read), then the rest of `raw`."""

    def __init__(self, head: bytes, raw: BinaryIO):
        self.head, self.raw = head, raw

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        """As readinto, without RawIOBase.read's two copies."""
        if not self.head:
            return self.raw.read(n)
        data = self.head if n < 0 or n >= len(self.head) else self.head[:n]
        self.head = self.head[len(data):]
        return data + self.raw.read() if n < 0 else data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


def stream_head(raw: BinaryIO, n: int = _SNIFF) -> bytes:
    """Up to n first bytes of a stream (fewer only at its end)."""
    head = b""
    while len(head) < n:
        data = raw.read(n - len(head))
        if not data:
            break
        head += data
    return head


def decompressing_reader(raw: BinaryIO, media_type: str, note: Optional[Callable[[str], None]] = None) -> BinaryIO:
    """The uncompressed tar stream of a layer blob, decompressed by what its bytes are (zstd, gzip or
    a plain tar), not by its media type: `docker push` relabels plain-tar layers as gzip. `note`
    gets one line when the label and the bytes disagree."""
    compression_of(media_type)  # an unknown type is refused (one of snap's known types here), not sniffed
    head = stream_head(raw)
    kind = sniff_compression(head)
    if kind is None:
        raise IntegrityError(f"layer ({media_type}) is neither zstd, gzip nor a tar archive")
    if note is not None and (msg := label_mismatch(media_type, kind)):
        note(msg)
    stream = _Prefixed(head, raw)
    if kind == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True, closefd=False)
    if kind == "gzip":
        return gzip.GzipFile(fileobj=stream, mode="rb")
    return stream

def check_layer(raw: BinaryIO, media_type: str, diff_id: str, label: str,
                consume: Callable[[BinaryIO, Callable[[], None]], None],
                note: Optional[Callable[[str], None]] = None) -> None:
    """Decompress a layer blob and hand its tar stream to `consume(stream, check)`. `check()` reads
    the stream to its end and checks it against the layer's diff_id (IntegrityError, as for data
    that does not decompress): `consume` may call it before it makes its last entry visible (the
    extractor does), and it is called once more after `consume` returns. The one way restore's
    applier and verify read a layer. `note`: see decompressing_reader."""
    stream = HashingReader(decompressing_reader(raw, media_type, note))

    def check() -> None:
        stream.drain()
        if stream.digest != diff_id:
            raise IntegrityError(f"layer {label} does not match its diff_id in the image config")

    try:
        consume(stream, check)
        check()
    except (EOFError, zlib.error, gzip.BadGzipFile, zstandard.ZstdError) as e:
        raise IntegrityError(f"layer {label} does not decompress: {e}") from None
