"""Git-like verbs over the snapshots: `snap log` (the snapshots of a repository, newest first, with
what each added), `snap status` (what a commit would send now, without pushing anything, and where
it would go) and `snap tag` (put a tag on the snapshot another names: adopt a diverged tag)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapshotter import jsontext
from snapshotter.digests import DIGEST
from snapshotter.errors import IntegrityError, NotFound, RegistryError, SnapError, UsageError
from snapshotter.oci.image import (BASE_NAME, CREATED, SNAP_BASE_LAYERS, manifest_annotations, snap_label,
                                   snapshot_layers_of)
from snapshotter.oci.mediatypes import MANIFEST_TYPES
from snapshotter.oci.reference import Reference, is_tag
from snapshotter.origin import snapshots as origin
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.diverged import DivergedTag, listing, names
from snapshotter.snapshot.lineage import movable
from snapshotter.snapshot.statcache import last_base, last_target

from .commit import plan_commit
from .model import SCRATCH, CommitOptions

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
    # of its tags, the diverged tags of TARGET's (snapshot/diverged.py)
    diverged: list[str] = field(default_factory=list)
    # hub files it keeps as references, and their bytes: a restore fetches them from the origin
    origin_files: int = 0
    origin_bytes: int = 0


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
    of_target = set(names(ref.tag, tags)) if ref.tag else set()  # REPO@DIGEST: the repository, as REPO
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
            doc = jsontext.loads(body)
        except ValueError:
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
        refs = origin.noted(ann) or {"files": 0, "bytes": 0}
        found.append(SnapshotInfo(
            sorted(tags, key=lambda t: (t == ref.tag, t)), digest, ann.get(CREATED, ""),
            sum(d.get("size", 0) for d in layers) + config.get("size", 0), ann.get(BASE_NAME, ""),
            [LayerInfo(snap_label(d), d.get("size", 0), d.get("digest", "")) for d in ours],
            diverged=sorted(t for t in tags if t in of_target), origin_files=refs["files"], origin_bytes=refs["bytes"]))
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
    tag: Optional[str] = None  # the tag the last commit or watch of the root was for
    tag_digest: Optional[str] = None  # what it names now
    movable: Optional[bool] = None  # whether this box may move it (snapshot/lineage.py); else it diverges
    diverged: list[DivergedTag] = field(default_factory=list)  # its diverged tags, oldest first
    tags_error: str = ""  # why the tags were not looked at (the registry unreachable)
    references: int = 0  # hub files a commit would keep as references (--weights-from-origin)
    tag_origin_files: int = 0  # hub files the tag's snapshot keeps as references: it depends on the origin

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
    tag = last_target(opts.root)
    cp = plan_commit(base, opts, target=_index_source(tag, base, opts.transport))
    layers = []
    for plan in cp.plans:
        hit = cp.known(plan)
        layers.append(LayerStatus(plan.label, hit is None, hit["size"] if hit else plan.content_size,
                                  len(plan.entries) + len(plan.whiteouts)))
    st = BoxStatus(cp.root, base, layers, len(cp.diff.deleted), cp.scan.skipped_secrets, tag)
    st.references = len(cp.origin.references) if cp.origin and not opts.upload_origin else 0
    if st.tag:
        _tag_status(st, opts)
    return st


def _index_source(tag: Optional[str], base: str, transport: TransportOptions) -> Optional[Remote]:
    """The last commit's repository, where a base's index may be fetched from (index/base.py); None
    when there is no base to index, or the registry cannot be reached: the status reads the box, and
    the base's own repository serves its index."""
    if not tag or base == SCRATCH:
        return None
    try:
        return Remote(Reference.parse(tag), transport)
    except SnapError:
        return None


def _tag_status(st: BoxStatus, opts: CommitOptions) -> None:
    """What the root's tag names, whether this box may move it, and its diverged tags; a registry
    that cannot say is one line in tags_error, not a failed status."""
    try:
        ref = Reference.parse(st.tag)
        remote = Remote(ref, opts.transport)
        st.tag_digest, st.movable = movable(remote, ref, st.root, opts.force, opts.origins)
        st.diverged = listing(remote, ref.tag, st.root)
        if st.tag_digest:
            st.tag_origin_files = _origin_files(remote, st.tag_digest, st.tag)
    except SnapError as e:
        st.tags_error = str(e)


def _origin_files(remote: Remote, digest: str, where: str) -> int:
    """How many hub files the snapshot `digest` keeps as references (origin/snapshots.py)."""
    try:
        doc = jsontext.loads(remote.get_manifest(digest)[0])
    except ValueError:
        return 0  # not a manifest snap reads: nothing of it is the origin's
    note = origin.noted(manifest_annotations(doc, where)) if isinstance(doc, dict) else None
    return note["files"] if note else 0


# ---- tag --------------------------------------------------------------------------------------


def retag(source: str, dest: str, transport: Optional[TransportOptions] = None,
          force: bool = False) -> tuple[Reference, str, Optional[str]]:
    """Put DEST (a tag of SOURCE's repository, or a reference in it) on the snapshot SOURCE names,
    the manifest's bytes as they are. (DEST, the digest, what DEST named before: None if new.)
    A DEST that names another snapshot already is moved only with `force`."""
    src = Reference.parse(source)
    dst = Reference(src.registry, src.repository, dest) if is_tag(dest) else Reference.parse(dest)
    if dst.digest or dst.name != src.name:
        raise UsageError(f"snap tag puts a tag in the repository of {src.name}, not on {dest!r}",
                         f"name a tag of it: snap tag {source} TAG")
    remote = Remote(src, transport)
    body, media, digest = remote.get_manifest(src.target)
    before = remote.manifest_digest(dst.tag)
    if before not in (None, digest) and not force:
        raise UsageError(f"{dst} names {before[:19]} already: moving it would leave that snapshot without this tag",
                         "pass --force to move it (the line then says how to put it back)")
    remote.put_manifest(body, media, dst.tag)
    return dst, digest, before
