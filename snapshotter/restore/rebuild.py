"""A layer's tar rebuilt from its headers (its skeleton: snapshot/skeleton.py) and the bytes on
disk, for the skip check (skip.py): its members as the extractor's reader reads them, and the
rebuilt tar's digest, to hold against the layer's diff_id."""

from __future__ import annotations

import hashlib
import os
import tarfile
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from snapshotter import progress
from snapshotter.digests import hasher_digest
from snapshotter.errors import IntegrityError
from snapshotter.snapshot.skeleton import Skeleton
from snapshotter.tar.reader import READ_BUFFER, EntryCount, ForwardStream, TarReader


@dataclass
class Source:
    """Where a regular member's content is on disk."""

    path: str
    offset: int
    size: int
    st: os.stat_result



class _VirtualTar:
    """The layer's tar as the reader sees it: the header bytes, and zeros where contents go (skipped unread)."""

    def __init__(self, members: Skeleton):
        self.segments: list[tuple[Optional[bytes], int]] = []
        total = 0
        for header, size in members:
            self.segments += [(header, len(header)), (None, size + (-size % tarfile.BLOCKSIZE))]
            total += len(header) + size + (-size % tarfile.BLOCKSIZE)
        self.segments.append((None, _trailer(total)))
        self.i, self.at = 0, 0

    def read(self, n: int) -> bytes:
        while self.i < len(self.segments) and self.at >= self.segments[self.i][1]:
            self.i, self.at = self.i + 1, 0
        if self.i == len(self.segments):
            return b""
        data, length = self.segments[self.i]
        k = min(n, length - self.at, READ_BUFFER)
        out = data[self.at:self.at + k] if data is not None else bytes(k)
        self.at += k
        return out

    def skip(self, n: int) -> int:
        done = 0
        while done < n and self.i < len(self.segments):
            k = min(n - done, self.segments[self.i][1] - self.at)
            self.at += k
            done += k
            if self.at >= self.segments[self.i][1]:
                self.i, self.at = self.i + 1, 0
        return done



def _trailer(length: int) -> int:
    """The end-of-archive bytes layer.write_tar puts after `length` bytes of members."""
    end = length + 2 * tarfile.BLOCKSIZE
    return 2 * tarfile.BLOCKSIZE + (-end % tarfile.RECORDSIZE)



def members_of(skeleton: Skeleton, label: str, entries: Optional[EntryCount] = None) -> list[tarfile.TarInfo]:
    """The members of a skeleton, read by the extractor's own tar reader (the same meaning as when
    the layer is applied); IntegrityError unless each skeleton entry is exactly one member whose
    content size is the one the skeleton gives. `entries`: the image's count (past its cap, the
    skeletons are not used: the layers are downloaded, and the extractor refuses them)."""
    reader = TarReader(ForwardStream(_VirtualTar(skeleton)), f"the skeleton of layer {label}", entries)
    out: list[tarfile.TarInfo] = []
    at = 0
    for m in reader:
        if len(out) == len(skeleton):
            raise IntegrityError(f"the skeleton of layer {label} holds more members than it lists")
        header, size = skeleton[len(out)]
        if m.offset != at or m.offset_data != at + len(header) or (m.size if m.isreg() else 0) != size:
            raise IntegrityError(f"the skeleton of layer {label} does not match its headers")
        at += len(header) + size + (-size % tarfile.BLOCKSIZE)
        out.append(m)
    if len(out) != len(skeleton):
        raise IntegrityError(f"the skeleton of layer {label} holds fewer members than it lists")
    return out



def rebuilt_diff_id(skeleton: Skeleton, sources: list[Optional[Source]], root: str,
                    on_bytes: Callable[[int], None], stop: threading.Event,
                    contents: Optional[list[Optional[str]]] = None) -> Optional[str]:
    """The sha256 of the layer's tar rebuilt from its headers and the bytes on disk; None if a file
    changed while it was read (or went away). With `contents`, the digest of each member's bytes
    read from disk is appended to it (None for a member without): what a verify compares with."""
    h = hashlib.sha256()
    total = 0
    for (header, size), source in zip(skeleton, sources):
        h.update(header)
        total += len(header) + size + (-size % tarfile.BLOCKSIZE)
        own = hashlib.sha256() if contents is not None and source is not None else None
        if source is not None and not _hash_content((h, own) if own else (h,), os.path.join(root, source.path),
                                                    source, on_bytes, stop):
            return None
        if contents is not None:
            contents.append(hasher_digest(own) if own else None)
        h.update(bytes(-size % tarfile.BLOCKSIZE))
    h.update(bytes(_trailer(total)))
    return hasher_digest(h)


def _hash_content(hashers: tuple, path: str, source: Source, on_bytes: Callable[[int], None],
                  stop: threading.Event) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        before = os.fstat(fd)
        if (before.st_ino, before.st_dev) != (source.st.st_ino, source.st.st_dev):
            return False
        offset, left = source.offset, source.size
        while left:
            if stop.is_set():
                raise progress.Stopped()
            data = os.pread(fd, min(left, 4 * READ_BUFFER), offset)
            if not data:
                return False
            for h in hashers:
                h.update(data)
            offset += len(data)
            left -= len(data)
            on_bytes(len(data))
        after = os.fstat(fd)
        return (after.st_size, after.st_mtime_ns, after.st_ctime_ns) == \
            (before.st_size, before.st_mtime_ns, before.st_ctime_ns)
    finally:
        os.close(fd)
