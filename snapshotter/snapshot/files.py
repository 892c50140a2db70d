"""Which layers of a snapshot hold each file on its own: a file's single-file layer, or all its
part layers. A commit keeps a file that is being written at the last snapshot's version by naming
those layers again, without reading the file."""

from __future__ import annotations

from typing import Optional

from snapshotter.errors import IntegrityError, NotFound, SnapError
from snapshotter.layer.plan import holds_one_file, parse_part_annotation
from snapshotter.oci.image import SNAP_CONTENT, SNAP_PART, Image, Layer, annotations_of, snapshot_layer_count
from snapshotter.registry.remote import Remote

from .encryption import RECIPIENTS, SEALED, with_sealed
from .encryption_state import kept_seal
from .record import restored_from


def file_layers(layers: list[Layer]) -> dict[str, list[Layer]]:
    """A snapshot's layers of one file each, by that file's path: its single-file layer, or all its
    part layers in order (oci/image.py's annotations). Bundles hold other files too: not listed."""
    single: dict[str, list[Layer]] = {}
    parts: dict[str, dict[int, Layer]] = {}
    counts: dict[str, int] = {}
    for layer in layers:
        ann = layer.annotations
        content, part_file = ann.get(SNAP_CONTENT), layer.part_file
        if part_file is not None and (part := parse_part_annotation(ann.get(SNAP_PART))):
            parts.setdefault(part_file, {})[part[0]] = layer
            counts[part_file] = part[1]
        elif content is not None and holds_one_file(content):
            single[content] = [layer]
    for path, got in parts.items():
        if sorted(got) == list(range(1, counts[path] + 1)):
            single[path] = [got[i] for i in sorted(got)]
    return single


def last_snapshot_files(remote: Remote, root: str, current: Optional[str]) -> dict[str, list[Layer]]:
    """file_layers of the box's last snapshot in `remote`'s repository: the one its tag names
    (`current`), else, for a new tag, the image the root was restored from, if this repository has
    it (its blobs are then there to reuse)."""
    digest = current or restored_from(root)
    if digest is None:
        return {}
    try:
        return image_file_layers(remote.resolve(digest))
    except (NotFound, IntegrityError):  # gone, or not an image snap can read: no versions to keep
        return {}


def image_file_layers(image: Image) -> dict[str, list[Layer]]:
    """file_layers of an image's own layers (none for an image snap did not make). An encrypted
    snapshot's annotations that name files are sealed: read from what this state dir kept of the
    seal when it pushed the snapshot (none kept: none known)."""
    try:
        count = snapshot_layer_count(image)
        ann = annotations_of(image.manifest, "the last snapshot")
    except SnapError:
        return {}
    diff_ids = image.config.get("rootfs", {}).get("diff_ids", [])
    if not count or len(diff_ids) != len(image.layers):
        return {}
    start = len(image.layers) - count
    layers = [Layer(i, image.layers[i], diff_ids[i]) for i in range(start, len(diff_ids))]
    if SEALED in ann:
        sealed = kept_seal(ann.get(RECIPIENTS), image.manifest_digest)
        layers = with_sealed(layers, sealed) if sealed else []
    return file_layers(layers)
