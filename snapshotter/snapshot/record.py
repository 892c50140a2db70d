"""The restore record: what `snap restore` leaves for the next commit of its root.

After a restore, the image's snap layers are noted per root (their digests and the digest of the
tar headers extracted, restore/applier.py), with when the restore began and ended (box/clock.py's
stamps). The next commit of that root takes a planned layer from here without reading it when its
tar headers are the extracted ones and none of its files changed since (ctime): a reclaim's commit
right after a restore reads no model bytes. The stat cache then learns those layers as usual
(statcache.py); the next restore skips such a layer without hashing it (restore/skip.py).

A ctime says "unchanged since the end" only if the clock ran forward since, so the times are
trusted (`Since`) only when the record was written in this boot, its start and end agree, its end
does not lie ahead of the clock, and the wall clock was not stepped back since (box/clock.py);
a file's ctime is read with its filesystem's granularity, and one on a network or FUSE filesystem
(whose ctimes come from another machine's clock) is never taken as unchanged. Otherwise the
files are read or hashed, as with no record.

The file names its format version: one of another version, or whose layers are not laid out as
this version writes them, is not used."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from snapshotter.box.clock import SYSTEM, Clock, Stamp, changed_since, consistent, stamp, stepped_back_since
from snapshotter.box.mounts import remote_mounts
from snapshotter.layer.generate import tar_headers
from snapshotter.layer.plan import DEFAULT_MAX_LAYER_SIZE, LayerPlan
from snapshotter.oci.image import BASE_DIGEST, SNAP_MAX_LAYER, SNAP_PROFILE, Image, select_layers
from snapshotter.oci.mediatypes import MEDIA_TYPE
from snapshotter.state import RootFiles, read_versioned, remove_if_there, sub, write_versioned
from snapshotter.tar.rules import header_key, headers_digest

from .reserve import write_note
from .statcache import NO_RESTORE, blob_entry

VERSION = 1


def _path(files: RootFiles) -> str:
    return files.file_in(sub("restored"))


def note_restore(files: RootFiles, image: Image, applied_headers: dict[str, str], started: Stamp,
                 clock: Clock = SYSTEM) -> int:
    """Note that `image` was restored into a root (`files`), whole (lineage.py: the box came from it), and its
    snap layers just extracted (`applied_headers`: layer digest -> digest of its tar headers), by a
    restore that began at `started` and ends now (its last write done).
    Returns how many layers; 0 if the record could not be written (the next commit then reads the
    layers instead, and cannot move the image's tag without --force)."""
    ann = image.annotations
    try:
        max_layer = int(ann.get(SNAP_MAX_LAYER, DEFAULT_MAX_LAYER_SIZE))
    except ValueError:
        return 0
    layers = {}
    for layer in select_layers(image, False):
        label, headers = layer.snap_label, applied_headers.get(layer.digest)
        if label and headers is not None:
            layers[label] = {"digest": layer.digest, "diff_id": layer.diff_id, "size": layer.size,
                             "media_type": layer.media_type, "headers": headers}
    ended = stamp(clock)
    doc = {"root": files.real, "manifest": image.manifest_digest,
           "base": ann.get(BASE_DIGEST), "profile": ann.get(SNAP_PROFILE), "max_layer": max_layer,
           "started": started.to_json(), "ended": ended.to_json(), "restored_at_ns": ended.wall_ns, "layers": layers}
    try:
        write_note(_path(files), VERSION, doc)
    except OSError:
        return 0
    return len(layers)


def forget_restore(files: RootFiles) -> None:
    """A restore that starts writing into a root makes the last record untrue until it finishes:
    a restore that fails or stops half-way must not look like a finished one (lineage.py). The
    record becomes the mark of this start, which no image is read from: a box that diverged
    (diverged.py) sees that a restore wrote into it since, even where none had finished before."""
    try:
        write_versioned(_path(files), VERSION, {"root": files.real, "started_ns": time.time_ns()})
    except OSError:
        remove_if_there(_path(files))


def restore_mark(root: str) -> tuple:
    """What tells the restores into `root` apart: the last finished one's image and end, or the
    start of one that has not finished (running, failed or stopped)."""
    doc = _load(RootFiles(root))
    if not doc:
        return NO_RESTORE
    return doc.get("manifest"), doc.get("restored_at_ns"), doc.get("started_ns")


def _load(files: RootFiles) -> Optional[dict]:
    doc = read_versioned(_path(files), VERSION)
    return doc if doc and doc.get("root") == files.real else None


def restored_from(root: str) -> Optional[str]:
    """The manifest digest of the image the last finished restore into `root` wrote, if any."""
    doc = _load(RootFiles(root))
    digest = doc.get("manifest") if doc else None
    return digest if isinstance(digest, str) else None


@dataclass(frozen=True)
class Since:
    """The end of the last restore into a root, as far as its times can be trusted (see the module's doc)."""

    root: str
    end_ns: int
    remote: tuple[str, ...]  # network and FUSE mount points in the root: their ctimes come from another clock

    def unchanged(self, rel: str, ctime_ns: int) -> bool:
        """Was the file at /rel, with this ctime, last changed before the restore ended (by it, or before it)?"""
        if any(rel == m or rel.startswith(m + "/") or not m for m in self.remote):
            return False
        return not changed_since(ctime_ns, self.end_ns)


def _since(doc: Optional[dict], clock: Clock) -> Optional[Since]:
    """The record's end, if its times can be trusted; else None (box/clock.py says why)."""
    if doc is None:
        return None
    start, end = Stamp.from_json(doc.get("started")), Stamp.from_json(doc.get("ended"))
    if start is None or end is None or consistent(start, end) or stepped_back_since(end, clock):
        return None
    if doc.get("restored_at_ns") != end.wall_ns:  # the plain end time (what older readers know) says otherwise
        return None
    return Since(doc["root"], end.wall_ns, tuple(remote_mounts(doc["root"])))


def restored_since(root: str, clock: Clock = SYSTEM) -> Optional[Since]:
    """When the last finished restore into `root` ended: a file `unchanged` by that measure was last
    changed by that restore (or before it), never since. None when there is no such restore, or
    when its times cannot be trusted."""
    return _since(_load(RootFiles(root)), clock)


def restored_at_ns(root: str, clock: Clock = SYSTEM) -> Optional[int]:
    """restored_since's end, in ns."""
    since = restored_since(root, clock)
    return since.end_ns if since is not None else None


class RestoreRecord:
    """The record of the last restore into a root, as the next commit reads it."""

    def __init__(self, doc: dict, since: Since):
        self.layers: dict = doc["layers"]
        self.since = since

    @classmethod
    def load(cls, root: str, base_digest: Optional[str], profile: str, max_layer_size: int,
             clock: Clock = SYSTEM) -> Optional["RestoreRecord"]:
        """The record of the last restore into `root`, if it fits this commit (same base image,
        profile and part-layer cap) and its times can be trusted; else None."""
        doc = _load(RootFiles(root))
        fits = (doc is not None and doc.get("base") == base_digest and doc.get("profile") == profile
                and doc.get("max_layer") == max_layer_size and isinstance(doc.get("layers"), dict))
        since = _since(doc, clock) if fits else None
        return cls(doc, since) if since is not None else None

    def blob_for(self, plan: LayerPlan) -> Optional[dict]:
        """The blob of `plan` if the restore extracted exactly its tar headers and none of its
        files changed since (Since.unchanged)."""
        layer = self.layers.get(plan.label)
        if not isinstance(layer, dict) or layer.get("media_type") != MEDIA_TYPE[plan.compression]:
            return None
        # parent copies have no stamp
        if not all(self.since.unchanged(e.path, e.ctime_ns) for e in plan.entries if e.stamp):
            return None
        if layer.get("headers") != headers_digest([header_key(ti) for ti, _ in tar_headers(plan)]):
            return None
        return blob_entry(layer)


def applied_since(files: RootFiles, digest: str, headers: str, clock: Clock = SYSTEM) -> Optional[Since]:
    """When the last restore into a root (`files`) ended, if it applied (or found in place) the layer blob
    `digest` with exactly these tar headers and its times can be trusted; else None. A restore
    uses it to trust, without hashing them, the files of such a layer unchanged since (restore/skip.py)."""
    doc = _load(files)
    if doc is None or not isinstance(doc.get("layers"), dict):
        return None
    for layer in doc["layers"].values():
        if isinstance(layer, dict) and layer.get("digest") == digest and layer.get("headers") == headers:
            return _since(doc, clock)
    return None
