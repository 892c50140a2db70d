"""An image's file index, built from its layer tars as an extractor would apply them."""

from __future__ import annotations

import tarfile
from typing import BinaryIO, Callable, Optional

from snapshotter.digests import chunks_digest
from snapshotter.errors import IntegrityError
from snapshotter.tar.reader import data_chunks, iter_members
from snapshotter.tar.rules import OPAQUE, WHITEOUT_PREFIX, check_name, whiteout_target

from .entry import DIR, FILE, Entry, entry_from_member
from .paths import entry_links, resolve_in_root


def _under(path: str, roots: set[str]) -> bool:
    """Is `path` one of `roots` or below one of them?"""
    while path:
        if path in roots:
            return True
        path = path.rpartition("/")[0]
    return False


def resolve_parent(index: dict[str, Entry], layer: dict[str, Entry], rel: str, name: str = "") -> str:
    """Where an extractor writes `rel` (a checked name): its parent directories resolved through
    the image's symlinks as if the root were '/' (paths.py; layer/extract.py does the same on disk), the
    final component not followed. Refuses a loop, as restore does."""
    parent, _, base = rel.rpartition("/")
    resolved = resolve_in_root(parent, entry_links(layer, index))
    if resolved is None:
        raise IntegrityError(f"too many symlinks resolving {name or rel!r}: refusing a hostile layer")
    return f"{resolved}/{base}" if resolved else base


def apply_layer_to_index(index: dict[str, Entry], tar_stream: BinaryIO, label: str = "layer") -> set[str]:
    """Apply one layer's tar (uncompressed stream) to an image index (ImageIndexer's rules).
    Returns the paths it removed."""
    indexer = ImageIndexer(index)
    for reader, m in iter_members(tar_stream, label):
        indexer.add(m, lambda: chunks_digest(data_chunks(reader)))
    return indexer.end_layer()


class ImageIndexer:
    """An image's index built one layer at a time, its members fed one by one as they are read: by
    apply_layer_to_index from a layer stream (a commit reading its base), and by the extractor as it
    applies a layer (a full restore: layer/extract.py). Applies them as an extractor would, with the same
    checks (names, whiteouts, hardlinks, symlink loops): whiteouts and opaque markers hide lower
    paths, a non-directory replaces a lower directory tree, a path below a symlink lands where the
    symlink leads. Linear in the index and the layer."""

    def __init__(self, index: Optional[dict[str, Entry]] = None, links: Optional[dict[str, object]] = None):
        self.index: dict[str, Entry] = {} if index is None else index
        # path -> a key its file's other names share, for the paths the layers make hardlinks of one
        # file (`snap verify` checks they share an inode); kept across layers by the caller's dict.
        self.links = links
        self._start_layer()

    def _start_layer(self) -> None:
        self._layer: dict[str, Entry] = {}
        self._whiteouts: set[str] = set()
        self._opaques: set[str] = set()

    def add(self, m: tarfile.TarInfo, content_digest: Callable[[], str]) -> None:
        """One member of the current layer. `content_digest()` gives the digest of its data; it is
        called (once) only for a regular file's own content (not a hardlink's, a whiteout's)."""
        index, layer = self.index, self._layer
        rel = check_name(m.name)
        if not rel:
            return
        if "/" in rel:
            rel = resolve_parent(index, layer, rel, m.name)
        parent, _, base = rel.rpartition("/")
        if base.startswith(WHITEOUT_PREFIX):
            if base == OPAQUE:
                self._opaques.add(parent)
            else:
                name = whiteout_target(base)
                self._whiteouts.add(f"{parent}/{name}" if parent else name)
            return
        if m.islnk():
            target = check_name(m.linkname)
            if "/" in target:
                target = resolve_parent(index, layer, target, m.linkname)
            src = layer.get(target) or index.get(target)
            if not target or src is None or src.kind == DIR:
                raise IntegrityError(f"hardlink {m.name!r} points at {m.linkname!r}, which is not a file in the image: "
                                     "refusing a hostile layer")
            if src.kind != FILE:
                return
            e = Entry(rel, FILE, src.mode, src.uid, src.gid, src.size, src.mtime, digest=src.digest, xattrs=src.xattrs,
                      mtime_ns=src.mtime_ns)
            if self.links is not None:  # one key per file: a later file at `target` is another one
                self.links[rel] = self.links.setdefault(target, object())
        else:
            e = entry_from_member(m, rel)
            if e is None:
                return
            if e.kind == FILE:
                e.digest = content_digest()
            if self.links is not None:
                self.links.pop(rel, None)  # a new path: no link of what was there before
        layer[rel] = e

    def end_layer(self) -> set[str]:
        """Apply the current layer (its whiteouts, opaque markers and replaced trees hide lower
        paths) and start the next. Returns the paths it removed."""
        index, layer = self.index, self._layer
        whiteouts, opaques = self._whiteouts, self._opaques
        # What this layer replaces: a lower directory tree under a non-directory.
        replaced = {rel for rel, e in layer.items() if e.kind != DIR and rel in index and index[rel].kind == DIR}
        removed: set[str] = set()
        if whiteouts or opaques or replaced:
            for rel in [r for r in index if _gone(r, whiteouts, opaques, replaced)]:
                del index[rel]
                removed.add(rel)
        for rel, e in layer.items():
            index[rel] = e
        self._start_layer()
        removed -= index.keys()
        if self.links:
            for rel in removed:
                self.links.pop(rel, None)
        return removed


def _gone(rel: str, whiteouts: set[str], opaques: set[str], replaced: set[str]) -> bool:
    """Does a lower path go with this layer's whiteouts, opaque markers, or replaced trees?"""
    parent = rel.rpartition("/")[0]
    return _under(rel, whiteouts) or _under(parent, replaced) or _under_opaque(rel, opaques)


def _under_opaque(rel: str, opaques: set[str]) -> bool:
    """Below (not at) a directory marked opaque ('' is the root)."""
    if "" in opaques:
        return True
    parent = rel.rpartition("/")[0]
    return _under(parent, opaques)
