"""Layer skeletons: what a restore needs to tell, without downloading a layer, whether the root
already holds it (restore onto a pod whose volume survived: restore/skip.py).

A snap layer is a reproducible tar (layer/generate.py): its header blocks exactly as written, each regular
file's content padded to 512 bytes, then the end-of-archive blocks. Its skeleton is that tar with
the contents left out: each member's header bytes and its content size, made from the plan
(layer.tar_headers) without reading a file, so a layer reused from the stat cache gets one too.
Each snap layer's skeleton is a blob of its own (a "headers" blob), named by the layer descriptor's
annotation dev.snap.headers and naming the layer's diff_id (the sha256 of the whole tar, which a
restore recomputes from the headers and the bytes on disk): an unchanged layer's headers blob is
the same blob, never sent again, so a commit sends the headers of the layers it changed and no
more. The blobs are pushed into the snapshot's repository and kept referenced by an artifact
manifest tagged snap-skeletons (the last commit's: index/base.py's push_artifact). Snapshots made
before held all their layers' skeletons in one blob, named by the manifest annotation
dev.snap.skeleton: a restore still reads that.

Format: gzip members (one per blob; the old one-blob form, one per layer), each holding MAGIC, then
per member its header length (u32), header bytes and content size (u64), then a zero length and the
diff_id (71 ASCII bytes, last: a commit knows it once the layer is written). A commit takes each
built layer's headers as layer.write_tar writes them (the very bytes, even of a file that changed
since the scan). A restore reads it digest-checked and size-capped, its members capped as the
image's are (SNAP_MAX_ENTRIES, with their header bytes: tar/reader.py); anything malformed or past
a cap is ignored (the restore then downloads, where the same caps hold). The state dir keeps each
layer's gzip member by diff_id (built, or restored), so a commit makes one from the plan only for a
layer it reuses and has none of."""

from __future__ import annotations

import os
import struct
import tarfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from snapshotter.digests import DIGEST_BYTES, sha256_digest
from snapshotter.errors import IntegrityError, NotFound, SnapError
from snapshotter.index.base import push_artifact
from snapshotter.layer.generate import tar_headers
from snapshotter.layer.plan import LayerPlan
from snapshotter.oci.image import SNAP_SKELETON, Image, select_layers
from snapshotter.oci.mediatypes import SKELETON, SKELETON_ARTIFACT
from snapshotter.registry.blobsources import BlobSources
from snapshotter.registry.remote import Remote
from snapshotter.state import open_own, replace_file, sub
from snapshotter.tar.reader import LAYER_MAX_ENTRIES, META_PER_ENTRY, max_entries
from snapshotter.tar.rules import header_bytes

ARTIFACT_TAG = "snap-skeletons"  # the tag of the artifact manifest that keeps the last commit's skeletons referenced
MAGIC = b"snap-skeleton-v1\n"
MAX_BLOB = 256 << 20  # compressed: a 200k-file box's headers compress to a few MB
FETCHES = 8  # headers blobs fetched at once: each a round trip
MAX_TOTAL = 2 << 30  # uncompressed: a gzip bomb stops here
INFLATE_STEP = 16 << 20  # a blob is inflated this much at a time, each step counted first
MAX_HEADER = 8 << 20  # one member's header bytes (PAX records included)
_U32, _U64 = struct.Struct(">I"), struct.Struct(">Q")

Skeleton = list[tuple[bytes, int]]  # (header bytes, content size) per member, in layer order


class PieceWriter:
    """One layer's gzip member, compressed as the headers come (layer.HeaderSink): a 200k-file
    layer's headers are 100 MB, its piece a few."""

    def start(self) -> None:
        self._z = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip, with no name and mtime 0
        self._out = [self._z.compress(MAGIC)]

    def add(self, header: bytes, size: int) -> None:
        self._out.append(self._z.compress(_U32.pack(len(header)) + header + _U64.pack(size)))

    def finish(self, diff_id: str) -> bytes:
        self._out += [self._z.compress(_U32.pack(0) + diff_id.encode()), self._z.flush()]
        return b"".join(self._out)


def layer_piece(plan: LayerPlan, diff_id: str) -> bytes:
    """The gzip member of one layer from its plan: its headers as layer.write_tar writes them."""
    piece = PieceWriter()
    piece.start()
    for ti, e in tar_headers(plan):
        size = ti.size if e is not None and ti.type == tarfile.REGTYPE else 0
        piece.add(header_bytes(ti), size)
    return piece.finish(diff_id)


def _piece_path(diff_id: str) -> str:
    return os.path.join(sub("skeletons"), diff_id.split(":", 1)[1] + ".gz")


def _cached_piece(plan: LayerPlan, diff_id: str) -> bytes:
    """layer_piece, kept in the state dir by diff_id: the same diff_id is the same tar, so the same headers."""
    path = _piece_path(diff_id)
    try:
        with open_own(path, "rb") as f:
            return f.read()
    except OSError:
        pass
    piece = layer_piece(plan, diff_id)
    keep(diff_id, piece)
    return piece


def push(remote: Remote, layers: list[tuple[LayerPlan, str]], sources: BlobSources) -> dict[str, str]:
    """Push the headers blob of each of a snapshot's layers ([(plan, diff_id)]) that the registry
    lacks into `remote`'s repository, with an artifact manifest that keeps them referenced.
    Returns {diff_id: headers blob digest}, for the layers' annotations (a layer whose blob would
    be too big has none: a restore then downloads it)."""
    pieces = {diff_id: piece for plan, diff_id in layers if len(piece := _cached_piece(plan, diff_id)) <= MAX_BLOB}
    if not pieces:
        return {}
    named = {diff_id: sha256_digest(piece) for diff_id, piece in pieces.items()}
    # One tag per repository, moved by each commit: `snap watch` commits under a new tag every few
    # minutes, and a tag per snapshot would pile up. An older snapshot's headers that a garbage
    # collection then deletes only make its restores download those layers.
    push_artifact(remote, [(pieces[diff_id], digest) for diff_id, digest in named.items()], SKELETON,
                  SKELETON_ARTIFACT, ARTIFACT_TAG, {}, sources, "headers", jobs=FETCHES)
    return named


def image_skeletons(remote: Remote, image: Image, log: Callable[[str], None], kept: bool = True
                    ) -> dict[str, Skeleton]:
    """The skeletons of a snapshot's layers, by diff_id: from each layer's headers blob, or an older
    snapshot's one skeleton blob; {} for an image without. `kept`: each layer's piece is kept in the
    state dir too (a restore's, for the next commit of the root)."""
    named = headers_blobs(image)
    if named:
        return fetch_headers(remote, named, log, kept)
    digest = image.annotated_digest(SNAP_SKELETON)
    return fetch(remote, digest, log, kept) if digest else {}


def headers_blobs(image: Image) -> dict[str, str]:
    """{diff_id: headers blob digest} of the image's layers that name one (dev.snap.headers)."""
    return {layer.diff_id: layer.headers for layer in select_layers(image, False) if layer.headers}


def fetch_headers(remote: Remote, named: dict[str, str], log: Callable[[str], None],
                  kept: bool = True) -> dict[str, Skeleton]:
    """{diff_id: skeleton} from the headers blobs `named` ({diff_id: digest}), FETCHES at once, each
    digest-checked, size-capped and naming its own layer; a blob missing or not usable is left out
    (never trusted: that layer then downloads), with one warning line for them all."""
    budget = Budget()  # one for all the image's blobs

    def one(item: tuple[str, str]) -> tuple[str, Optional[Skeleton], str]:
        diff_id, digest = item
        try:
            got = parse(_read(remote, digest), keep if kept else None, budget)
            if list(got) != [diff_id]:
                raise ValueError(f"it names another layer than {diff_id[:19]}")
            return diff_id, got[diff_id], ""
        except NotFound:
            return diff_id, None, "missing"
        except (SnapError, ValueError, struct.error, OSError, zlib.error, EOFError) as e:
            return diff_id, None, str(e)

    with ThreadPoolExecutor(FETCHES) as pool:
        results = list(pool.map(one, named.items()))
    bad = [why for _, skel, why in results if skel is None and why != "missing"]
    if bad:
        log(f"warning: {len(bad)} layer header blob(s) in {remote.ref.name} are not usable ({bad[0]}): "
            "downloading those layers")
    return {diff_id: skel for diff_id, skel, _ in results if skel is not None}


def fetch(remote: Remote, digest: str, log: Callable[[str], None], kept: bool = True) -> dict[str, Skeleton]:
    """{diff_id: skeleton} from an older snapshot's one skeleton blob `digest`, digest-checked and
    size-capped; {} when it is missing or malformed (never trusted: the layers then download)."""
    try:
        return parse(_read(remote, digest), keep if kept else None)
    except NotFound:
        return {}
    except (SnapError, ValueError, struct.error, OSError, zlib.error, EOFError) as e:
        log(f"warning: the layer skeletons in {remote.ref.name} are not usable ({e}): downloading every layer")
        return {}


def _read(remote: Remote, digest: str) -> bytes:
    """A headers or skeleton blob, whole, up to MAX_BLOB (iter_blob checks its digest)."""
    got, size = [], 0
    for chunk in remote.iter_blob(digest):
        size += len(chunk)
        if size > MAX_BLOB:
            raise IntegrityError(f"the skeleton blob {digest[:19]} is bigger than {MAX_BLOB} bytes")
        got.append(chunk)
    return b"".join(got)


class Budget:
    """What the skeletons of one image may hold, all its blobs together (fetched several at once):
    their bytes as decompressed and their entries, bounded by the figures that bound its layers'
    headers (tar/reader.py's EntryCount: entries, and BLOCKSIZE + META_PER_ENTRY bytes per entry).
    Parsing holds a blob's inflated bytes and its headers' copies at once: up to about twice this."""

    def __init__(self):
        self.cap = max_entries()
        self.bytes_left = min(MAX_TOTAL, self.cap * (tarfile.BLOCKSIZE + META_PER_ENTRY))
        self.entries_left = self.cap
        self._lock = threading.Lock()

    def take(self, nbytes: int = 0, entries: int = 0) -> None:
        with self._lock:
            self.bytes_left -= nbytes
            self.entries_left -= entries
            if self.bytes_left < 0:
                raise ValueError("the skeletons are too big")
            if self.entries_left < 0:
                raise ValueError(f"the skeletons list more than {self.cap} entries (SNAP_MAX_ENTRIES)")


def parse(data: bytes, keep: Optional[Callable[[str, bytes], None]] = None,
          budget: Optional[Budget] = None) -> dict[str, Skeleton]:
    """The skeletons of a blob; ValueError (or zlib.error, struct.error) for anything not as
    `layer_piece` writes it, or past the `budget` (this blob's alone by default). `keep(diff_id,
    piece)` is given each layer's gzip member."""
    out: dict[str, Skeleton] = {}
    budget = budget or Budget()
    layer_cap = min(budget.cap, LAYER_MAX_ENTRIES)
    pos = 0
    while pos < len(data):
        d = zlib.decompressobj(wbits=31)
        raw, rest = bytearray(), memoryview(data)[pos:]
        while True:  # in steps, each counted: a gzip bomb stops at the budget
            part = d.decompress(rest, INFLATE_STEP)
            budget.take(len(part))
            raw += part  # (one buffer: a list of steps and their join held the blob twice)
            rest = d.unconsumed_tail
            if d.eof or (not rest and len(part) < INFLATE_STEP):  # (a full step may leave output pending)
                break
        if not d.eof:
            raise ValueError("a skeleton is truncated")
        end = len(data) - len(d.unused_data)
        diff_id, skeleton = _parse_piece(raw)
        del raw
        if len(skeleton) > layer_cap:
            raise ValueError(f"a layer's skeleton lists more than {layer_cap} entries")
        budget.take(entries=len(skeleton))
        out[diff_id] = skeleton
        if keep is not None:
            keep(diff_id, data[pos:end])
        pos = end
    return out


def keep(diff_id: str, piece: bytes) -> None:
    """Keep a layer's piece (built or restored) in the state dir, for the next commit here."""
    try:
        replace_file(_piece_path(diff_id), lambda f: f.write(piece), mode="wb")
    except OSError:
        pass  # an optimisation only


def _parse_piece(raw: bytearray) -> tuple[str, Skeleton]:
    if not raw.startswith(MAGIC):
        raise ValueError("not a layer skeleton of this version")
    view = memoryview(raw)  # each header copied out once
    pos = len(MAGIC)
    members: Skeleton = []
    while True:
        (n,), pos = _U32.unpack_from(raw, pos), pos + 4
        if n == 0:
            break
        if n % tarfile.BLOCKSIZE or n > MAX_HEADER or pos + n + 8 > len(raw):
            raise ValueError("a malformed member in a layer skeleton")
        header, pos = view[pos:pos + n].tobytes(), pos + n
        (size,), pos = _U64.unpack_from(raw, pos), pos + 8
        members.append((header, size))
    diff_id = view[pos:].tobytes()
    view.release()
    if not DIGEST_BYTES.fullmatch(diff_id):
        raise ValueError("a layer skeleton names no diff_id")
    return diff_id.decode(), members
