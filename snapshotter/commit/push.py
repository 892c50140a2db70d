"""Pushing a planned commit: its layers built and uploaded (or reused unread), a file that tore while
read held back and its layer built again, then the config and the manifest under the target's tag."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Optional

from snapshotter import jsontext
from snapshotter import progress
from snapshotter.box.memo import RACY_WINDOW_NS
from snapshotter.box.writers import BEING_WRITTEN
from snapshotter.digests import sha256_digest
from snapshotter.errors import RegistryError, SnapError
from snapshotter.index import base as baseindex
from snapshotter.layer.generate import LayerBlob
from snapshotter.layer.packers import Packers
from snapshotter.layer.plan import META_DETAIL, LayerPlan
from snapshotter.oci.image import (CREATED, SNAP_CONTENT, SNAP_HEADERS, SNAP_LAYER, SNAP_MAX_LAYER, SNAP_PART,
                                   SNAP_PART_FILE, SNAP_PART_LINKS, NewImage, descriptor, scratch_config,
                                   secrets_annotations)
from snapshotter.oci.mediatypes import ENCRYPTED_SUFFIX
from snapshotter.oci.reference import Reference
from snapshotter.registry.blobsources import in_registry
from snapshotter.registry.remote import BlobsUnknown, Remote, host_platform
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot import skeleton
from snapshotter.snapshot.encryption import side_blobs, with_sealed
from snapshotter.snapshot.record import restore_mark
from snapshotter.snapshot.statcache import note_last_commit
from snapshotter.state import if_room

from .base_layers import ensure_base_layers
from .hold import hold_back
from .sender import UPLOADS, LayerSender
from .weights import note_origin, origin_counts
from .model import CommitOptions, CommitPlan, CommitResult, LayerReport, files_read, plan_commit_layers

# Less to compress than this: packed in this process (a packer process takes ~0.1 s of CPU to start).
PACK_APART_MIN = 64 << 20
MAX_ENGINE_LAYERS = 125  # Docker refuses images of more layers; podman fails at run from 126 to 133
TORN = "changed while read"
CHANGED_SINCE_SCAN = "changed since the scan"  # read whole and still, but written meanwhile: maybe half saved
UNREADABLE = "could not be read"  # refused at open (permissions), or a read failed (then with why)
SETTLE_PASSES = 3  # builds of the layers, each leaving out what tore in the one before


def target_remote(cp: CommitPlan, target_ref: Reference, transport: TransportOptions,
                  tagged: Optional[tuple[str, bytes]] = None, held: Optional[Remote] = None) -> Remote:
    """The repository the snapshot goes to (`held`: the caller's connection to it, reused), with the
    base's blobs made available in it; the blobs the manifest its tag names now lists (`tagged`:
    digest, bytes) known held there, unasked: unless --rehash, which trusts no cache, that list
    included (each blob is looked up: one the registry lost is sent again)."""
    if cp.base_img is not None and target_ref.name == cp.base_ref.name:
        remote = cp.base_remote
    else:
        remote = held or Remote(target_ref, transport)
    if tagged and not cp.rehash:
        remote.held_by(tagged[1])
    if cp.base_img is not None:
        ensure_base_layers(remote, cp.base_remote, cp.base_img, cp.sources, cp.log)
    return remote


@dataclasses.dataclass
class _Pushed:
    """What one pass of push_commit sent, and the image built of it."""

    layers: list[tuple[LayerPlan, LayerBlob, str]]
    image: NewImage
    reports: list[LayerReport]
    digest: str  # of the manifest the tag names now
    current: bool  # the tag named this very image already: no manifest was put
    travelled: list[str]  # the config's digest, then the side blobs' (_note_pushed); [] when current


def push_commit(cp: CommitPlan, target_ref: Reference, transport: TransportOptions, opts: CommitOptions,
                tagged: Optional[tuple[str, bytes]] = None, held: Optional[Remote] = None) -> CommitResult:
    """Push a planned commit: the layers, then the image built of them (config and manifest) under
    the target's tag. `tagged`: the manifest the tag names now (digest, bytes), if known: when it is
    this very image but for its creation time, nothing is pushed (CommitResult.current). `held`:
    the caller's connection to the target's repository, if it has one."""
    remote = target_remote(cp, target_ref, transport, tagged, held)
    if cp.hooks.stopping is not None:
        remote.stopping = cp.hooks.stopping
    if cp.encryption is not None:  # a new state dir keeps the encrypted blobs of the tag's snapshot
        cp.encryption.learn_previous(remote, tagged[1] if tagged else None)
    try:
        pushed = _push_image(cp, remote, target_ref, opts, tagged, look_up=cp.rehash)
    except BlobsUnknown:
        pushed = _push_again(cp, remote, target_ref, opts, tagged)
    digest, image = pushed.digest, pushed.image
    _warn_engine_limit(cp.base_layers + len(pushed.layers) + sum(len(v) for v in cp.carried.values()), opts)
    if_room(cp.cache.save, cp.log, "the stat cache")
    if cp.encryption is not None:
        cp.encryption.save(digest, str(target_ref))  # each tag keeps its last snapshot's seal
    _note_made(cp, target_ref, opts, digest)
    if not pushed.current:
        _note_pushed(cp, target_ref, image, pushed.travelled)
    grown = {path: size for _, blob, _ in pushed.layers for path, size in blob.grown.items()}
    return CommitResult(target_ref.with_digest(digest), digest, cp.base_layers, pushed.reports,
                        cp.scan.skipped_secrets, sorted(p for p, why in cp.held.items() if why == TORN),
                        len(cp.diff.deleted), cp.scan.host_files, held=dict(cp.held), carried=sorted(cp.carried),
                        snap_layers=with_sealed(image.layers, cp.encryption.unsealed or {}) if cp.encryption
                        else list(image.layers), unreadable=cp.scan.unreadable,
                        grown=grown, uploaded_bytes=sum(remote.pushed.values()), uploaded=dict(remote.pushed),
                        current=pushed.current, **origin_counts(cp, opts))


def _note_made(cp: CommitPlan, target_ref: Reference, opts: CommitOptions, digest: str,
               pending: bool = False) -> None:
    """The snapshot `digest` noted as made from the root, under its restore mark (lineage.py);
    `pending`: before the tag may name it (statcache.note_last_commit)."""
    if_room(lambda: note_last_commit(cp.root, cp.base_name, opts.moving or str(target_ref), digest,
                                     restore_mark(cp.root), pending),
            cp.log, f"that this box made {digest[:19]} (without it, the next commit is refused from the tag)")


def _push_again(cp: CommitPlan, remote: Remote, target_ref: Reference, opts: CommitOptions,
                tagged: Optional[tuple[str, bytes]]) -> _Pushed:
    """The registry refused the manifest for a blob it lacks: one the tag's snapshot lists, taken as
    held unasked (held_by), that it lost since (damaged storage, a blob deleted by hand). Once more,
    each blob looked up: the lost ones sent again (a layer built from the box again), then the manifest."""
    cp.log(f"warning: registry {remote.ref.registry!r} lacks a blob that {remote.ref.name}'s snapshot lists "
           "(lost or deleted): looking each blob up and sending the lost ones again")
    remote.forget_held()
    if cp.base_img is not None:
        ensure_base_layers(remote, cp.base_remote, cp.base_img, cp.sources, cp.log)
    return _push_image(cp, remote, target_ref, opts, tagged, look_up=True)


def _push_image(cp: CommitPlan, remote: Remote, target_ref: Reference, opts: CommitOptions,
                tagged: Optional[tuple[str, bytes]], look_up: bool) -> _Pushed:
    """The layers sent, then the image built of them under the target's tag, unless the tag names it
    already. `look_up`: no blob is taken as held unasked (--rehash, or a registry that lost one):
    those this box cannot send (_check_held) are looked up too, and so is the tag's config."""
    layers = _push_settled_layers(cp, remote, opts)
    _carry(cp, remote)
    # The layers' headers, for a restore onto a root that already holds some of them (restore/skip.py).
    sides = side_blobs(cp.encryption)  # none in clear beside encrypted layers
    headers = skeleton.push(remote, [(p, b.diff_id) for p, b, _ in layers], cp.sources) if sides else {}
    image, reports = _build_image(cp, layers, headers, opts)
    # The base's index, for a commit on a new machine and for restore (index/base.py).
    index_digest = baseindex.push(remote, cp.base_img.manifest_digest, cp.sources) if cp.base_img and sides else None
    if index_digest:
        image.annotations[baseindex.SNAP_BASE_INDEX] = index_digest
    # Weights from the origin: the references as a side blob the manifest names (origin/snapshots.py).
    refs_digest = note_origin(cp, remote, image, opts)
    if cp.encryption is not None:
        cp.encryption.seal(image)  # the paths snap's annotations name: for the recipients alone
    if look_up:
        _check_held(cp, remote)
    as_tagged = _as_tagged(image, *tagged) if tagged else None
    if as_tagged is not None:  # the tag names this box's snapshot already: no manifest sent again
        if look_up:
            remote.write_config(as_tagged)
        return _Pushed(layers, image, reports, tagged[0], True, [])
    # Noted as made before the tag names it: a commit stopped between the two leaves the box its tag.
    digest, _, config_digest = remote.write_image(image, target_ref.target,
                                                  before_tag=lambda made: _note_made(cp, target_ref, opts, made,
                                                                                     pending=True))
    travelled = ([index_digest, baseindex.EMPTY_CONFIG_DIGEST] if index_digest else []) \
        + (list(headers.values()) + [baseindex.EMPTY_CONFIG_DIGEST] if headers else []) \
        + ([refs_digest, baseindex.EMPTY_CONFIG_DIGEST] if refs_digest else [])
    return _Pushed(layers, image, reports, digest, False, [config_digest] + travelled)


def _check_held(cp: CommitPlan, remote: Remote) -> None:
    """Look up the image's blobs that neither push_layers nor ensure_base_layers did: the base's
    layers in the base's own repository, and the last snapshot's layers carried for files being
    written. The registry lost one: this box cannot send it again, the commit is refused."""
    base = [(d, f"layer {i + 1} of the base image {cp.base_name}", "push the base image there again")
            for i, d in enumerate(cp.base_img.layers)] if cp.base_img and remote is cp.base_remote else []
    carried = [(layer.descriptor, f"the last snapshot's layer of {'/' + path!r}, kept while the file is written",
                "commit again once the file is no longer being written: it is read then")
               for path, kept in sorted(cp.carried.items()) for layer in kept]
    for desc, what, hint in base + carried:
        if not remote.blob_exists(desc["digest"]):
            raise RegistryError(f"{what} ({desc['digest']}) is missing from {remote.ref.name} on registry "
                                f"{remote.ref.registry!r}, and this box does not hold it to send again", hint)


def _as_tagged(image: NewImage, digest: str, manifest: bytes) -> Optional[NewImage]:
    """`image` as `manifest` (`digest`) has it, if that is `image` to the byte given its creation time:
    the same layers, base, profile, annotations and config; else None. The time is all a commit of
    an unchanged box would change, and a tag is not moved for that."""
    try:
        created = jsontext.loads(manifest)["annotations"][CREATED]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(created, str):
        return None
    same = dataclasses.replace(image, created=created)
    return same if sha256_digest(same.manifest_bytes(same.config_bytes())) == digest else None


def _warn_engine_limit(count: int, opts: CommitOptions) -> None:
    if count > MAX_ENGINE_LAYERS:
        opts.log(f"warning: the image has {count} layers: Docker cannot run an image of more than about "
                 f"{MAX_ENGINE_LAYERS}, and podman fails to start one of somewhere between 126 and 133 or more "
                 "(snap restore has no such limit)")


def _build_image(cp: CommitPlan, layers: list[tuple[LayerPlan, LayerBlob, str]], headers: dict[str, str],
                 opts: CommitOptions) -> tuple[NewImage, list[LayerReport]]:
    """The snapshot image: the base's layers, then the pushed ones with the carried ones among them
    (_insert_carried); and a report of each of snap's layers."""
    base_img = cp.base_img
    descs = [_descriptor(cp, p, b, headers) for p, b, _ in layers]
    rows = [(d, b.diff_id, LayerReport(p.label, d["digest"], d["size"], d["mediaType"],
                                       len(p.entries) + len(p.whiteouts), status))
            for d, (p, b, status) in zip(descs, layers)]
    _insert_carried(rows, cp)
    image = NewImage(base_img, cp.base_name if base_img else None,
                     base_img.config if base_img else scratch_config(*host_platform()), opts.profile.name)
    for desc, diff_id, report in rows:
        image.append(desc, diff_id, report.name)
    image.annotations.update({SNAP_MAX_LAYER: str(opts.max_layer_size), **secrets_annotations(cp.scan.skipped_secrets),
                              **(cp.deletes.annotation() if cp.deletes else {})})  # for a restore onto a live root
    return image, [report for _, _, report in rows]


def _descriptor(cp: CommitPlan, plan: LayerPlan, blob: LayerBlob, headers: dict[str, str]) -> dict:
    """A pushed layer's descriptor: its blob's, or the encrypted blob pushed for it; snap's annotations."""
    ann = _annotations(plan, headers.get(blob.diff_id))
    if cp.encryption is None:
        return descriptor(blob.media_type, blob.digest, blob.size, ann)
    sealed = cp.encryption.lookup(blob.digest, blob.diff_id, blob.media_type)
    if sealed is None:
        raise SnapError(f"layer {plan.label!r} was not encrypted: nothing was pushed under the tag")
    return {**sealed, "annotations": {**sealed["annotations"], **ann}}


def _note_pushed(cp: CommitPlan, target_ref: Reference, image: NewImage, also: list[str]) -> None:
    """Remember that the target's repository now holds the image's blobs (registry/blobsources.py)."""
    base = image.base
    own = [d["digest"] for d in (base.layers if base else [])] + [layer.digest for layer in image.layers]
    cp.sources.note(target_ref.api_host, target_ref.repository,
                    own + also[:1] + ([base.config_digest] if base else []) + also[1:])
    if_room(cp.sources.save, cp.log, "where the blobs were pushed")


def _push_settled_layers(cp: CommitPlan, remote: Remote, opts: CommitOptions) -> list[tuple[LayerPlan, LayerBlob, str]]:
    """Build and upload the planned layers; a file that kept changing while it was read (layer/generate.py
    reads it up to 3 times), or that was read whole but changed since the scan (a save in chunks
    that paused), is held back as one being written (hold_back) and its layer built again without
    it: no snapshot holds a torn file. Refused after SETTLE_PASSES builds that each tore."""
    for _ in range(SETTLE_PASSES):
        if cp.unreadable:
            _leave_out_unreadable(cp, remote, opts)
        layers = push_layers(cp, remote, cp.plans)
        torn = {path: CHANGED_SINCE_SCAN for _, blob, _ in layers for path in blob.changed_since_scan}
        torn.update({path: TORN for _, blob, _ in layers for path in blob.changed_while_read})
        torn.update({path: f"{UNREADABLE}: {blob.read_errors[path]}" if path in blob.read_errors else UNREADABLE
                     for _, blob, _ in layers for path in blob.unreadable})
        if not torn:
            return layers
        hold_back(cp, torn, opts)
    raise SnapError(f"files kept changing while they were read, {SETTLE_PASSES} times: nothing was pushed",
                    "commit again once the box is quieter")


def _carry(cp: CommitPlan, remote: Remote) -> None:
    """Each carried file's layers as this snapshot can hold them: encrypted for its recipients
    (Encryption.carry), or in a clear one, clear (an encrypted last snapshot's layer would make it
    unrestorable). A file one of whose layers cannot be is left out, reported, never claimed kept."""
    for path, kept in list(cp.carried.items()):
        carried = [cp.encryption.carry(remote, layer, cp.sources) if cp.encryption is not None
                   else None if layer.media_type.endswith(ENCRYPTED_SUFFIX) else layer for layer in kept]
        if all(carried):
            cp.carried[path] = carried
        else:
            del cp.carried[path]


def _insert_carried(rows: list[tuple[dict, str, LayerReport]], cp: CommitPlan) -> None:
    """Put the layers carried from the last snapshot among the weights' single-file layers: before
    the weights' last small layer (directories and deletions), which must stay on top of them."""
    carried = [(layer.descriptor, layer.diff_id,
                LayerReport(layer.snap_label or layer.digest[:19], layer.digest, layer.size, layer.media_type, 1,
                            "kept from the last snapshot (being written, not read)"))
               for path in sorted(cp.carried) for layer in cp.carried[path]]
    if carried:
        at = len(rows) - (1 if cp.plans and cp.plans[-1].detail == META_DETAIL else 0)
        rows[at:at] = carried


def _annotations(plan: LayerPlan, headers: Optional[str]) -> dict:
    ann = {SNAP_LAYER: plan.name}
    if headers:
        ann[SNAP_HEADERS] = headers
    if plan.detail:
        ann[SNAP_CONTENT] = plan.detail
    if plan.part_of:
        path, i, n = plan.part_of
        ann[SNAP_PART] = f"{i}/{n}"
        ann[SNAP_PART_FILE] = path
    if plan.part_links:
        ann[SNAP_PART_LINKS] = json.dumps(plan.part_links)
    return ann


def _cacheable(cp: CommitPlan, plan: LayerPlan, blob: LayerBlob) -> bool:
    """Whether a built layer may go into the stat cache. Not if a file changed while it was read
    (the blob may hold a torn copy) or since the scan (the blob is not what its stat data says), nor
    if a file changed just before the scan: within a coarse ctime tick a later write can leave the
    same stat (git's "racy clean" rule); nor if it read a file some process maps shared-writable: its
    next writes may leave the same stat (CommitPlan.writing), after the writer is gone too."""
    if blob.not_whole or cp.reads_writing(plan):
        return False
    return all(e.ctime_ns < cp.scan_started_ns - RACY_WINDOW_NS for e in plan.entries if e.stamp)


def _reused(cp: CommitPlan, remote: Remote, plan: LayerPlan) -> tuple[Optional[dict], str]:
    """The blob a layer already has (stat cache or last restore) and where the registry has it:
    "" when the layer must be built, its files read."""
    hit = cp.known(plan)
    if hit and cp.encryption is not None:  # the encrypted blob pushed for it, if any, not the clear one
        sealed = cp.encryption.lookup(hit["digest"], hit["diff_id"], hit["media_type"])
        return hit, (in_registry(remote, sealed["digest"], cp.sources) if sealed else "")
    return hit, (in_registry(remote, hit["digest"], cp.sources) if hit else "")


def _leave_out_unreadable(cp: CommitPlan, remote: Remote, opts: CommitOptions) -> None:
    """For each held file carried at its old entry whose layer would have to be built after all (it
    shares a changed bundle, or the stat cache lost it): one held only because a process has it open
    (BEING_WRITTEN) is read as it is now, the read checking that it holds still (else it tears and
    is left out then): leaving it out would drop the last snapshot's version of a database kept open
    and written now and then from every snapshot. One that tore is left out. Then plan again:
    leaving one out can change the layer of another (a bundle of two), hence the loop."""
    while True:
        stuck = {path for plan in cp.plans if (paths := files_read(plan) & cp.unreadable)
                 and not _reused(cp, remote, plan)[1] for path in paths}
        if not stuck:
            return
        cp.unreadable -= stuck
        read_now = {p for p in stuck if cp.held.get(p) == BEING_WRITTEN and p in cp.scan.entries}
        for p in read_now:
            del cp.held[p]
        cp.left_unread.extend(sorted(stuck - read_now))
        cp.diff.changed = sorted([e for e in cp.diff.changed if e.path not in stuck]
                                 + [cp.scan.entries[p] for p in read_now], key=lambda e: e.path)
        cp.plans = plan_commit_layers(cp.diff, cp.scan, cp.index, opts, cp.base_layers, cp.hooks.plan_memo)


def push_layers(cp: CommitPlan, remote: Remote, plans: list[LayerPlan]) -> list[tuple[LayerPlan, LayerBlob, str]]:
    """Build and upload planned layers (some of a plan's for the watcher, all for a commit), several
    at once. A layer whose fingerprint is in the stat cache (or that the last restore into this root
    wrote and nothing changed since), and whose blob the registry has (or mounts from another
    repository), is neither read nor uploaded."""
    results, todo = _reuse(cp, remote, plans)
    todo.sort(key=lambda t: -t[1].content_size)  # the biggest first: the last to finish is a small one
    apart = [plan for _, plan, _ in todo if plan.compression != "none"]
    # Packers only where they run side by side: one layer alone packs as fast here, without the start.
    packers = min(cp.jobs, len(apart)) if sum(p.content_size for p in apart) >= PACK_APART_MIN else 0
    packers = packers if packers > 1 else 0
    with progress.bar("packing", sum(p.content_size for _, p, _ in todo), sink=cp.log) as pack, \
            progress.bar("uploading", sink=cp.log) as up, ThreadPoolExecutor(cp.jobs + UPLOADS) as pool, \
            Packers(packers, progress.Stopped) as apart_packers:
        # An error or Ctrl-C sets remote.stopping: layers being read or sent give up at their next
        # chunk, and the exit does not wait for a weight to finish on a slow link.
        sender = LayerSender(cp, remote, apart_packers if packers else None, packers,
                              progress.stoppable(progress.safe_update(pack), remote.stopping),
                              progress.stoppable(progress.safe_update(up), remote.stopping))
        futures = {}
        try:  # a Ctrl-C while the layers are still being handed out must stop the ones already started
            for i, plan, fp in todo:
                futures[pool.submit(sender.produce, plan)] = (i, plan, fp)
            for fut in as_completed(futures):  # the first error stops the rest, whichever layer it is
                i, plan, fp = futures[fut]
                blob, status = fut.result()
                results[i] = (plan, blob, status)
                if _cacheable(cp, plan, blob):
                    cp.cache.record(fp, {"digest": blob.digest, "diff_id": blob.diff_id, "size": blob.size,
                                         "media_type": blob.media_type})
        except BaseException:
            remote.stopping.set()
            apart_packers.stop()
            for f in futures:
                f.cancel()
            raise
    return [results[i] for i in range(len(plans))]


def _reuse(cp: CommitPlan, remote: Remote, plans: list[LayerPlan]
           ) -> tuple[dict[int, tuple[LayerPlan, LayerBlob, str]], list[tuple[int, LayerPlan, str]]]:
    """({place: the layer as reused, unread} for the plans the registry has already, [(place, plan,
    fingerprint)] for those to build)."""
    results: dict[int, tuple[LayerPlan, LayerBlob, str]] = {}
    todo: list[tuple[int, LayerPlan, str]] = []
    for i, plan in enumerate(plans):
        fp = plan.fingerprint(cp.zstd_level)
        hit, there = _reused(cp, remote, plan)
        if there:
            blob = LayerBlob(plan.name, None, hit["digest"], hit["diff_id"], hit["size"], hit["media_type"])
            results[i] = (plan, blob, f"{there} (unchanged, not read)")
            cp.cache.record(fp, hit)
        elif unread := sorted(files_read(plan) & cp.unreadable):  # the registry lost the blob since push_commit looked
            raise SnapError(f"layer {plan.label!r} would have to read {'/' + unread[0]!r}, which is being rewritten",
                            "nothing was pushed; the next try leaves the file out")
        else:
            todo.append((i, plan, fp))
    return results, todo


def grown_line(path: str, size: int) -> str:
    """The warning for a file that kept growing through a commit (LayerBlob.grown)."""
    return (f"warning: {'/' + path!r} kept growing while it was sent: the snapshot has it as first seen "
            f"({size} bytes); the next commit takes the rest")
