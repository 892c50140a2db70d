"""Indexing a base as it is applied: the extractor's reader that hashes each file's data as it
is written (index/indexer.py's ImageIndexer builds the base's index from it)."""

from __future__ import annotations

import hashlib
import tarfile
from typing import Callable, Optional

from snapshotter.digests import file_digest, hasher_digest
from snapshotter.errors import IntegrityError
from snapshotter.index.indexer import ImageIndexer
from snapshotter.tar.reader import TarReader

from .fileops import READ_BUFFER


class IndexingReader:
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
