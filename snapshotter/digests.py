"""Content digests as OCI writes them (`sha256:<hex>`): the one place they are computed, for bytes in
memory, a file, a stream of chunks, or a hasher fed along the way (by the code that streams the bytes
anyway, so nothing is read twice); and the form a sha256 digest must have where an image names one."""

from __future__ import annotations

import hashlib
import re
import threading
from typing import BinaryIO, Callable, Iterable, Optional, Union

# A sha256 digest as an image may name one. Only this form is accepted, which also makes a digest
# safe as a file name (a restore's staging dir names blobs by theirs).
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
DIGEST_BYTES = re.compile(DIGEST.pattern.encode())  # the same, in bytes read from a file


def hasher_digest(h) -> str:
    """The digest a hasher has reached, named by its algorithm (`sha256:...`, or `sha512:...` for a
    reference pinned with another algorithm)."""
    return f"{h.name}:{h.hexdigest()}"


def sha256_digest(data: bytes) -> str:
    return hasher_digest(hashlib.sha256(data))


def file_digest(file: Union[str, BinaryIO], on_bytes: Optional[Callable[[int], None]] = None) -> str:
    """The sha256 of a file, by path or of a binary file object read to its end; `on_bytes` is told
    each read's size (progress)."""
    if isinstance(file, str):
        with open(file, "rb", buffering=0) as f:  # read into _read_buffer: no buffer of open's own
            return file_digest(f, on_bytes)
    h = hashlib.sha256()
    view = _read_buffer()
    while True:
        n = file.readinto(view)
        if not n:
            return hasher_digest(h)
        h.update(view[:n])
        if on_bytes is not None:
            on_bytes(n)


_buffers = threading.local()


def _read_buffer() -> memoryview:
    """This thread's read buffer (hashlib.file_digest's size), made once: a new one per file cost more
    than hashing a small file (verify reads 200k of them)."""
    view = getattr(_buffers, "view", None)
    if view is None:
        view = _buffers.view = memoryview(bytearray(2 ** 18))
    return view


def chunks_digest(chunks: Iterable[bytes]) -> str:
    """The sha256 of the bytes an iterable yields, consumed to its end."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return hasher_digest(h)
