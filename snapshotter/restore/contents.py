"""verify's reading of file contents: the sha256 of many files, several at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from snapshotter.digests import file_digest

RUN_BYTES, RUN_FILES = 1 << 20, 64  # what one thread hashes before it takes the next run


def files_digests(files: list[tuple[str, int]], jobs: int, on_bytes: Callable[[int], None]) -> list[str]:
    """The digest of each of `files` (path, size), in order, or why it could not be read; `jobs` at
    once: threads, as hashlib and file reads let go of Python's lock (measured: bench.py's verify),
    each holding one read buffer; `on_bytes` is told what is read (progress). The files go to the
    threads in runs (_runs): a task per small file cost more in the pool's locks than its hash."""
    def digests(run: list[tuple[str, int]]) -> list[str]:
        return [_digest(path, on_bytes) for path, _ in run]

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return [digest for run in pool.map(digests, _runs(files)) for digest in run]


def _runs(files: list[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    """`files` in order, cut into runs of RUN_BYTES or RUN_FILES, whichever comes first."""
    run: list[tuple[str, int]] = []
    size = 0
    for f in files:
        run.append(f)
        size += f[1]
        if size >= RUN_BYTES or len(run) >= RUN_FILES:
            yield run
            run, size = [], 0
    if run:
        yield run


def _digest(path: str, on_bytes: Callable[[int], None]) -> str:
    """The file's digest, or why it could not be read (permissions, an I/O error of the disk):
    a difference of its own path, and the others are compared all the same."""
    try:
        return file_digest(path, on_bytes)
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
