"""Git-like verbs over the snapshots: `snap log` (the snapshots of a repository, newest first, with
what each added) and `snap status` (what a commit would send now, without pushing anything)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapshotter.digests import DIGEST
from snapshotter.errors import IntegrityError, NotFound, RegistryError, UsageError
from snapshotter.oci.image import (BASE_NAME, CREATED, SNAP_BASE_LAYERS, manifest_annotations, snap_label,
                                   snapshot_layers_of)
from snapshotter.oci.mediatypes import MANIFEST_TYPES
from snapshotter.oci.reference import Reference, is_tag
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.statcache import last_base

from .commit import plan_commit
from .model import CommitOptions

MALFORMED_SHOWN, MALFORMED_SHOWN_CHARS = 5, 200  # a hostile list of thousands stays one short line


@dataclass
class LayerInfo:
    label: str
    size: int
    digest: str


@dataclass
class SnapshotInfo:
    tags: list[str]
    digest: str
    created: str  # UTC, RFC 3339, from the manifest's annotation
    size: int  # every blob of the image: config and all layers, the base's included
    base: str
    layers: list[LayerInfo]  # snap's layers
    new: list[LayerInfo] = field(default_factory=list)  # snap's layers the snapshot before did not have


def snapshot_log(target: str, transport: Optional[TransportOptions] = None,
                 log: Callable[[str], None] = lambda msg: None) -> list[SnapshotInfo]:
    """The snapshots (images made by snap) in TARGET's repository, newest first. Names in the
    registry's tag list that are no tags are never asked for (one could name another path of the
    API): `log` names them, escaped, in one line."""
    ref = Reference.parse(target)
    remote = Remote(ref, transport)
    by_digest: dict[str, list[str]] = {}
    tags = remote.list_tags()
    malformed = [t for t in tags if not is_tag(t)]
    if malformed:
        named = ", ".join(repr(t[:MALFORMED_SHOWN_CHARS]) for t in malformed[:MALFORMED_SHOWN])  # repr: escaped
        more = f" and {len(malformed) - MALFORMED_SHOWN} more" if len(malformed) > MALFORMED_SHOWN else ""
        log(f"warning: the registry lists {len(malformed)} name(s) in {ref.name} that are not tags, "
            f"left out: {named}{more}")
    for tag in tags:
        if not is_tag(tag):
            continue
        digest = remote.manifest_digest(tag)
        if digest is not None and not (isinstance(digest, str) and DIGEST.fullmatch(digest)):
            raise RegistryError(f"the registry names {ref.name}:{tag} by a malformed digest {digest!r}")
        if digest:
            by_digest.setdefault(digest, []).append(tag)
    found = []
    for digest, tags in by_digest.items():
        body, media, _ = remote.get_manifest(digest)
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            continue
        if not isinstance(doc, dict) or (media or doc.get("mediaType")) not in MANIFEST_TYPES:
            continue  # not a snapshot (an index)
        where = f"image {ref.name}@{digest}"
        layers, config = doc.get("layers") or [], doc.get("config") or {}
        if not (isinstance(layers, list) and isinstance(config, dict) and type(config.get("size", 0)) is int
                and all(isinstance(d, dict) and type(d.get("size", 0)) is int and isinstance(d.get("digest", ""), str)
                        for d in layers)):
            raise IntegrityError(f"{where} has a malformed manifest (config or layers): refusing a hostile image")
        ann = manifest_annotations(doc, where)
        if SNAP_BASE_LAYERS not in ann:
            continue  # not a snapshot (a base image)
        ours = layers[len(layers) - snapshot_layers_of(doc, where):]
        found.append(SnapshotInfo(
            sorted(tags, key=lambda t: (t == ref.tag, t)), digest, ann.get(CREATED, ""),
            sum(d.get("size", 0) for d in layers) + config.get("size", 0), ann.get(BASE_NAME, ""),
            [LayerInfo(snap_label(d), d.get("size", 0), d.get("digest", "")) for d in ours]))
    if not found:
        raise NotFound(f"no snapshots in {ref.name}", "snap commit or snap watch pushes them")
    found.sort(key=lambda s: (s.created, s.tags[-1]), reverse=True)
    for newer, older in zip(found, found[1:] + [None]):
        before = {layer.digest for layer in older.layers} if older else set()
        newer.new = [layer for layer in newer.layers if layer.digest not in before]
    return found


# ---- status -----------------------------------------------------------------------------------


@dataclass
class LayerStatus:
    label: str
    changed: bool  # False: the stat cache (or the last restore) knows its blob; nothing to read
    size: int  # the blob's size when unchanged, else the bytes of its files (before compression)
    entries: int


@dataclass
class BoxStatus:
    root: str
    base: str
    layers: list[LayerStatus]
    deleted: int
    skipped_secrets: list[str]

    @property
    def to_send(self) -> int:
        return sum(layer.size for layer in self.layers if layer.changed)


def box_status(base: Optional[str], opts: CommitOptions) -> BoxStatus:
    """What a commit of opts.root would send now: commit's own planning, nothing read or pushed."""
    if not os.path.isdir(opts.root):
        raise UsageError(f"root {opts.root!r} does not exist or is not a directory")
    base = base or last_base(opts.root)
    if base is None:
        raise UsageError(f"--base is required: {opts.root!r} was never committed",
                         "name the image the box was started from, e.g. --base registry.example.com/me/base:1")
    cp = plan_commit(base, opts)
    layers = []
    for plan in cp.plans:
        hit = cp.known(plan)
        layers.append(LayerStatus(plan.label, hit is None, hit["size"] if hit else plan.content_size,
                                  len(plan.entries) + len(plan.whiteouts)))
    return BoxStatus(cp.root, base, layers, len(cp.diff.deleted), cp.scan.skipped_secrets)
