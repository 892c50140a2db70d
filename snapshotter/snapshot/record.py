"""The restore record: what `snap restore` leaves for the next commit of its root.

After a restore, the image's snap layers are noted per root (their digests and the digest of the
tar headers extracted, restore/applier.py), with the time the restore ended. The next commit of that root
takes a planned layer from here without reading it when its tar headers are the extracted ones
and none of its files changed since (ctime): a reclaim's commit right after a restore reads no
model bytes. The stat cache then learns those layers as usual (statcache.py).

The file names its format version: one of another version, or whose layers are not laid out as
this version writes them, is not used."""

from __future__ import annotations

import os
import time
from typing import Optional

from snapshotter.layer.generate import tar_headers
from snapshotter.layer.plan import DEFAULT_MAX_LAYER_SIZE, LayerPlan
from snapshotter.oci.image import BASE_DIGEST, SNAP_MAX_LAYER, SNAP_PROFILE, Image, snap_label
from snapshotter.oci.mediatypes import MEDIA_TYPE
from snapshotter.state import read_versioned, root_key, sub, write_versioned
from snapshotter.tar.rules import header_key, headers_digest

from .statcache import blob_entry

VERSION = 1
# Written files get a ctime from the kernel's coarse clock, which lags the fine one by up to a tick
# (10 ms at HZ=100): a restore waits this long after noting its end, so that any later write gets
# a ctime past it.
CLOCK_TICK_S = 0.02


def _path(root: str) -> str:
    return os.path.join(sub("restored"), root_key(root) + ".json")


def note_restore(root: str, image: Image, applied_headers: dict[str, str]) -> int:
    """Note that `image` was restored into `root`, whole (lineage.py: the box came from it), and its
    snap layers just extracted (`applied_headers`: layer digest -> digest of its tar headers).
    Returns how many layers; 0 if the record could not be written (the next commit then reads the
    layers instead, and cannot move the image's tag without --force)."""
    ann = image.manifest.get("annotations") or {}
    try:
        max_layer = int(ann.get(SNAP_MAX_LAYER, DEFAULT_MAX_LAYER_SIZE))
    except ValueError:
        return 0
    diff_ids = dict(zip((desc["digest"] for desc in image.layers), image.config["rootfs"]["diff_ids"]))
    layers = {}
    for desc in image.layers:
        label, headers = snap_label(desc), applied_headers.get(desc["digest"])
        if label and headers is not None:
            layers[label] = {"digest": desc["digest"], "diff_id": diff_ids[desc["digest"]], "size": desc["size"],
                             "media_type": desc["mediaType"], "headers": headers}
    doc = {"root": os.path.realpath(root), "manifest": image.manifest_digest,
           "base": ann.get(BASE_DIGEST),
           "profile": ann.get(SNAP_PROFILE), "max_layer": max_layer, "restored_at_ns": time.time_ns(), "layers": layers}
    try:
        write_versioned(_path(root), VERSION, doc)
    except OSError:
        return 0
    time.sleep(CLOCK_TICK_S)  # later writes get ctimes past restored_at_ns
    return len(layers)


def forget_restore(root: str) -> None:
    """A restore that starts writing into `root` makes the last record untrue until it finishes:
    a restore that fails or stops half-way must not look like a finished one (lineage.py). The
    record becomes the mark of this start, which no image is read from: a box that diverged
    (diverged.py) sees that a restore wrote into it since, even where none had finished before."""
    try:
        write_versioned(_path(root), VERSION, {"root": os.path.realpath(root), "started_ns": time.time_ns()})
    except OSError:
        try:
            os.unlink(_path(root))
        except FileNotFoundError:
            pass


def restore_mark(root: str) -> tuple:
    """What tells the restores into `root` apart: the last finished one's image and end, or the
    start of one that has not finished (running, failed or stopped)."""
    doc = _load(root) or {}
    return doc.get("manifest"), doc.get("restored_at_ns"), doc.get("started_ns")


def _load(root: str) -> Optional[dict]:
    doc = read_versioned(_path(root), VERSION)
    return doc if doc and doc.get("root") == os.path.realpath(root) else None


def restored_from(root: str) -> Optional[str]:
    """The manifest digest of the image the last finished restore into `root` wrote, if any."""
    doc = _load(root)
    digest = doc.get("manifest") if doc else None
    return digest if isinstance(digest, str) else None


def restored_at_ns(root: str) -> Optional[int]:
    """When the last finished restore into `root` ended: a file whose ctime is older was last
    changed by that restore (or before it), never since."""
    doc = _load(root)
    at = doc.get("restored_at_ns") if doc else None
    return at if type(at) is int else None


class RestoreRecord:
    """The record of the last restore into a root, as the next commit reads it."""

    def __init__(self, doc: dict):
        self.layers: dict = doc["layers"]
        self.restored_at_ns: int = doc["restored_at_ns"]

    @classmethod
    def load(cls, root: str, base_digest: Optional[str], profile: str, max_layer_size: int) -> Optional["RestoreRecord"]:
        """The record of the last restore into `root`, if it fits this commit (same base image,
        profile and part-layer cap); else None."""
        doc = _load(root)
        fits = (doc is not None and doc.get("base") == base_digest and doc.get("profile") == profile
                and doc.get("max_layer") == max_layer_size and type(doc.get("restored_at_ns")) is int
                and isinstance(doc.get("layers"), dict))
        return cls(doc) if fits else None

    def blob_for(self, plan: LayerPlan) -> Optional[dict]:
        """The blob of `plan` if the restore extracted exactly its tar headers and none of its
        files changed since (their ctime is older than the restore's end)."""
        layer = self.layers.get(plan.label)
        if not isinstance(layer, dict) or layer.get("media_type") != MEDIA_TYPE[plan.compression]:
            return None
        if any(e.ctime_ns > self.restored_at_ns for e in plan.entries if e.stamp):  # parent copies: no stamp
            return None
        if layer.get("headers") != headers_digest([header_key(ti) for ti, _ in tar_headers(plan)]):
            return None
        return blob_entry(layer)


def applied_at(root: str, digest: str, headers: str) -> Optional[int]:
    """When the last restore into `root` ended (ns), if it applied (or found in place) the layer
    blob `digest` with exactly these tar headers; else None. A restore uses it to trust, without
    hashing them, the files of such a layer that did not change since (restore/skip.py)."""
    doc = _load(root)
    if not (doc is not None and type(doc.get("restored_at_ns")) is int and isinstance(doc.get("layers"), dict)):
        return None
    for layer in doc["layers"].values():
        if isinstance(layer, dict) and layer.get("digest") == digest and layer.get("headers") == headers:
            return doc["restored_at_ns"]
    return None
