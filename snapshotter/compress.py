"""Layer compression: which media type is which, and streaming (de)compression with hashing in the
same pass."""

from __future__ import annotations

import gzip
import hashlib
import io
from typing import BinaryIO, Callable, Iterable, Iterator, Optional

import zstandard

from .errors import UsageError
from .mediatypes import (DOCKER_LAYER_GZIP, DOCKER_LAYER_TAR, LAYER_GZIP, LAYER_TAR, LAYER_ZSTD, MEDIA_TYPE,
                         NONDISTRIBUTABLE_TAR)


def compression_of(media_type: str) -> str:
    """'none' | 'gzip' | 'zstd' for a layer media type."""
    if media_type in (LAYER_TAR, DOCKER_LAYER_TAR, NONDISTRIBUTABLE_TAR):
        return "none"
    if media_type in (LAYER_GZIP, DOCKER_LAYER_GZIP, NONDISTRIBUTABLE_TAR + "+gzip"):
        return "gzip"
    if media_type in (LAYER_ZSTD, NONDISTRIBUTABLE_TAR + "+zstd"):
        return "zstd"
    raise UsageError(f"unsupported layer media type {media_type}")


def oci_media_type(media_type: str) -> str:
    """The OCI name for a layer media type (Docker's gzip layer is the same bytes as OCI's)."""
    return MEDIA_TYPE[compression_of(media_type)]


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
        return "sha256:" + self.sha.hexdigest()


class Compressor(io.RawIOBase):
    """tar bytes in -> diff_id hash -> compressor -> blob digest hash -> file.

    Output is deterministic for the same input and settings: gzip headers carry no name or time,
    and zstd always runs in its multithreaded mode, whose frames do not depend on the thread count."""

    def __init__(self, out: Optional[BinaryIO], compression: str, zstd_level: int = 3, hashing: bool = True):
        """`hashing=False` when the digests are known already (a layer streamed again to upload)."""
        self.blob = HashingWriter(out, hashing)
        # Uncompressed, the tar is the blob: one hash serves as both digest and diff_id.
        self.tar = self.blob if compression == "none" else HashingWriter(None, hashing)
        self.compression = compression
        if compression == "zstd":
            cctx = zstandard.ZstdCompressor(level=zstd_level, threads=-1, write_checksum=True)
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

    def readinto(self, b) -> int:
        data = self.src.read(len(b))
        n = len(data)
        b[:n] = data
        self.sha.update(data)
        if self.on_bytes and n:
            self.on_bytes(n)
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


def decompressing_reader(raw: BinaryIO, media_type: str) -> BinaryIO:
    """The uncompressed tar stream of a layer blob."""
    kind = compression_of(media_type)
    if kind == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return raw

