"""The snapshot layers a directory holds whole, for `snap verify`: found by their skeletons (headers
blobs) and the directory's bytes (skip.hold_layer) before any layer is read, so that their blobs
are not downloaded and each of their files is read once."""

from __future__ import annotations

import tarfile
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from snapshotter import progress
from snapshotter.oci.image import Layer, layer_label
from snapshotter.registry.remote import Remote
from snapshotter.tar.reader import EntryCount
from snapshotter.tar.rules import check_name

from .rebuild import members_of
from .skip import RootPaths, RootRules, hold_layer

Members = list[tuple[tarfile.TarInfo, Optional[str]]]  # a layer's, each regular one's with its content digest


class HeldLayers:
    """The snapshot layers the directory holds whole, found by their headers blobs and its bytes
    (skip.hold_layer) before any layer is read, `jobs` at once and the biggest first, so that their
    blobs are not downloaded; the digests of the files it read (each file's bytes are read once: one
    hash for the layer's tar, one for the file)."""

    def __init__(self, skeletons: dict, rules: RootRules):
        self.skeletons, self.rules = skeletons, rules
        self.root = RootPaths(rules.root)
        self.found: dict[str, list[Optional[str]]] = {}  # diff_id -> its members' digests, as read
        self.read: dict[str, str] = {}  # path -> the digest of the bytes read there
        self._held: list[str] = []  # (appended to by the index's threads: a list's append is atomic)

    def find(self, layers: list[Layer], jobs: int) -> None:
        todo = sorted({layer.diff_id: layer for layer in layers if layer.diff_id in self.skeletons}.values(),
                      key=lambda layer: -sum(size for _, size in self.skeletons[layer.diff_id]))
        total = sum(size for layer in todo for _, size in self.skeletons[layer.diff_id])
        with progress.bar("checking the directory against the layers' headers", total) as bar:
            update = progress.safe_update(bar)

            def one(layer: Layer) -> None:
                i, desc, diff_id = layer
                got = hold_layer(self.skeletons[diff_id], desc, diff_id, self.rules, self.root, layer_label(desc, i),
                                 update)
                if got is not None:
                    self.found[diff_id] = got

            with ThreadPoolExecutor(max(1, jobs)) as pool:
                list(pool.map(one, todo))

    def hold(self, remote: Remote, layer: Layer, entries: EntryCount) -> Optional[Members]:
        """A held layer's members (counted as the image's, as when read), or None: read it."""
        i, desc, diff_id = layer
        # Taken, not looked up: its skeleton is freed once parsed (a second layer of the same diff_id is read).
        digests, skeleton = self.found.pop(diff_id, None), self.skeletons.pop(diff_id, None)
        # A blob the registry lost is reported as when it is read (a restore needs it).
        if digests is None or skeleton is None or not remote.blob_exists(desc["digest"]):
            return None
        members = members_of(skeleton, layer_label(desc, i), entries)
        del skeleton
        self.read.update((check_name(m.name), d) for m, d in zip(members, digests) if d)
        self._held.append(diff_id)
        return list(zip(members, digests))

    @property
    def held(self) -> int:
        return len(self._held)

    def done(self) -> None:
        """The index is built: the skeletons are not needed any more (a 200k-file layer's are ~300 MB)."""
        self.skeletons, self.found = {}, {}
