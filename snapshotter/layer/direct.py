"""Writing a big file past the page cache (O_DIRECT), where its filesystem is a local disk's.

A restore writes each weight once, and nothing reads it before the app loads it. Through the page
cache, every page of a weight is first filled by the CPU (the kernel's copy: 0.8-2.2 s per GiB on a
VM whose memory is backed lazily, more than the weight's download and hashing together), then
written back to the disk. Written with O_DIRECT from one reused, page-aligned buffer,
the disk reads it by DMA: that CPU goes to the app's unpacking, and the weights no longer push the
app's fresh files out of the cache. The app then reads a weight from the disk the first time it
loads it.

Only where the filesystem is a local disk's (DIRECT_FS): a network or FUSE filesystem may take
O_DIRECT as one round trip per write. Anywhere a direct write is refused (EINVAL), the file goes on
through the page cache from where it was, so it is always written."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from typing import Optional

from snapshotter.box.mounts import filesystem_type

DIRECT_MIN = 64 << 20  # smaller files go through the page cache: a weight is hundreds of MiB to GBs
BUFFER = 8 << 20  # one direct write; a multiple of any disk's logical block size
BLOCK = 4096  # the tail is written through the page cache from the last multiple of this
DIRECT_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "overlay"}


def direct_allowed(directory: str) -> bool:
    """Whether big files written into `directory` should go past the page cache."""
    return filesystem_type(os.path.realpath(directory)) in DIRECT_FS


class DirectFile:
    """A file written in order, past the page cache where the filesystem lets it: `write` gathers
    bytes into a page-aligned buffer and writes it whole with O_DIRECT; `close` writes the tail
    (under a block) through the page cache. Owns `fd` (opened for writing, at offset 0)."""

    def __init__(self, fd: int, buffer: int = BUFFER):
        self.fd = fd
        buf: Optional[mmap.mmap] = None
        try:
            buf = self._buf = mmap.mmap(-1, buffer)  # page-aligned, as O_DIRECT wants
            self._filled = 0
            self.direct = _set_direct(fd, True)
        except BaseException:
            if buf is not None:
                buf.close()  # its `buffer` bytes now, not whenever the traceback lets it go
            os.close(fd)
            raise

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> None:
        view = memoryview(data)
        size = len(self._buf)
        while view:
            n = min(len(view), size - self._filled)
            self._buf[self._filled:self._filled + n] = view[:n]
            self._filled += n
            view = view[n:]
            if self._filled == size:
                self._write_out(size)

    def flush(self) -> None:
        """Write out what the buffer holds (before an fsync): its whole blocks directly, the rest
        through the page cache, as are any writes after it (the file's end is no longer aligned)."""
        whole = self._filled - self._filled % BLOCK
        if whole:
            self._write_out(whole)
        if self._filled:  # under a block, at the start of the buffer now
            if self.direct:
                self.direct = _set_direct(self.fd, False)
            self._write_out(self._filled)

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.flush()
        finally:
            self.discard()

    def discard(self) -> None:
        """Close without writing what the buffer holds (the file is given up: an error)."""
        if self.fd >= 0:
            self._buf.close()
            os.close(self.fd)
            self.fd = -1

    def _write_out(self, n: int) -> None:
        """Write the buffer's first n bytes, move what follows them to its start."""
        with memoryview(self._buf) as buf:
            done = 0
            while done < n:
                try:
                    done += os.write(self.fd, buf[done:n])
                except OSError as e:
                    if e.errno != errno.EINVAL or not self.direct:
                        raise
                    self.direct = _set_direct(self.fd, False)  # refused here: on through the page cache
            rest = self._filled - n
            buf[:rest] = buf[n:self._filled]
        self._filled = rest


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; whether it is on after. Turning it on may be refused (then
    it stays off); turning it off may not: the writes that follow are those O_DIRECT refuses."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        if not on:  # left on, the caller would retry the refused write for ever
            raise OSError(e.errno, "the filesystem refuses both a direct write and turning direct writes off") from e
        return bool(flags & os.O_DIRECT)
    return on
