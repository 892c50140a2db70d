"""`snap commit`: diff the box against its base image, build the snapshot layers, push the image.

`--base scratch` (as Docker's `FROM scratch`) is a box with no base image, a VM: the snapshot holds
the profile's `include` paths (with their parent directories), or the whole root, and no base
layer; its config is the host's platform."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tarfile
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import zstandard

from snapshotter.index import base as baseindex
from snapshotter.box import deletions
from snapshotter import progress
from snapshotter.snapshot import skeleton
from snapshotter.registry.blobsources import BlobSources, in_registry
from snapshotter.tar.compress import IterReader, decompressing_reader
from snapshotter.digests import file_digest, sha256_digest
from snapshotter.errors import IntegrityError, SnapError, UsageError
from snapshotter.index.entry import FILE, Entry, gc_paused
from snapshotter.box.scan import RACY_WINDOW_NS, Scan, ScanMemo, scan_box
from snapshotter.box.diff import Diff, diff
from snapshotter.index.indexer import apply_layer_to_index
from snapshotter.index.store import load_index, save_index
from snapshotter.oci.image import (SNAP_CONTENT, SNAP_LAYER, SNAP_MAX_LAYER, SNAP_PART, SNAP_PART_FILE,
                                   SNAP_PART_LINKS, descriptor, now_rfc3339, Image, scratch_config,
                                   secrets_annotations, snap_label, snapshot_config, snapshot_manifest)
from snapshotter.layer.generate import LayerBlob, build_layer, measure_layer, write_layer
from snapshotter.snapshot.files import last_snapshot_files
from snapshotter.snapshot.lineage import check_forward
from snapshotter.oci.mediatypes import OCI_MANIFEST
from snapshotter.layer.plan import DEFAULT_MAX_LAYER_SIZE, META_DETAIL, LayerPlan, PlanMemo, plan_layers
from snapshotter.box.profile import Profile, load_profile
from snapshotter.oci.reference import Reference
from snapshotter.registry.remote import Remote, host_platform
from snapshotter.snapshot.record import RestoreRecord, restored_at_ns
from snapshotter.layer.staging import staging_dirs
from snapshotter.state import exclusive, state_dir, sub
from snapshotter.snapshot.statcache import StatCache, note_last_commit
from snapshotter.registry.transport import TransportOptions
from snapshotter.box.writers import BEING_WRITTEN, WRITING_QUIET_S, being_written

LAYER_WORKERS = min(3, os.cpu_count() or 1)  # layers built and uploaded at once
MAX_ENGINE_LAYERS = 125  # overlayfs-based engines refuse images with more layers than about this
SCRATCH = "scratch"  # --base scratch: no base image


@dataclass
class CommitOptions:
    root: str = "/"
    profile: Profile = field(default_factory=load_profile)
    compression: Optional[str] = None  # "gzip" turns every zstd layer into gzip (for old engines)
    rehash: bool = False  # compare file contents with the base, and ignore the stat cache
    max_layer_size: int = DEFAULT_MAX_LAYER_SIZE  # bigger files are cut into part layers
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None
    # Where the changes come from instead of a walk of `root`, e.g. a container's diff (container.py):
    # called with (base image, base index), returns (Scan, Diff); file bytes are still read from `root`.
    changes: Optional[Callable] = None
    plan_memo: Optional[PlanMemo] = None  # the last plan's splits and rows, kept by `snap watch` (plan.PlanMemo)
    force: bool = False  # push even what snap refuses: a snapshot that deletes the base's system (deletions.py), a tag this box neither came from nor made (lineage.py)
    origins: tuple[str, ...] = ()  # manifest digests the box is known to come from besides lineage.py's (a container's image)
    # Files not to read now, with why (being written): given the scan, the paths to hold back. None: the
    # files some process is writing (writers.py) that changed in the last WRITING_QUIET_S seconds.
    hold: Optional[Callable[[Scan], dict[str, str]]] = None
    # Where a held file's last snapshot version is: the last snapshot's own layers of each file
    # (file_layers), asked only when a file is held. None: the target tag's snapshot (snap commit).
    previous: Optional[Callable[[], dict[str, list[tuple[dict, str]]]]] = None
    # The last snapshot's entries of changed paths (snap watch): a held file in a bundle is carried at
    # that version when the stat cache still has its layer.
    old_entries: dict[str, Entry] = field(default_factory=dict)
    stopping: Optional[threading.Event] = None  # set by another thread: the push gives up at its next chunk


@dataclass
class LayerReport:
    name: str
    digest: str
    size: int
    media_type: str
    entries: int
    status: str  # "uploaded" | "exists, skipped" | "mounted from REPO", "... (unchanged, not read)"


@dataclass
class CommitResult:
    ref: Reference
    manifest_digest: str
    base_layers: int
    layers: list[LayerReport]
    skipped_secrets: list[str]
    changed_while_read: list[str]
    deleted: int
    host_files: list[str] = field(default_factory=list)  # bind-mounted from the host (GPU driver files), and links to them
    held: dict[str, str] = field(default_factory=dict)  # files not read because they were being written, with why
    carried: list[str] = field(default_factory=list)  # of those, kept at the last snapshot's version
    snap_layers: list[tuple[dict, str]] = field(default_factory=list)  # the image's own layers: (descriptor, diff_id)


def base_index(remote: Remote, image: Image, log: Callable[[str], None],
               travelled: Optional[Remote] = None) -> dict[str, Entry]:
    """The file index of the base image: cached by manifest digest, else the one an earlier
    snapshot pushed into the `travelled` repository (baseindex.py), else read from its layer tars."""
    cache = baseindex.cache_path(image.manifest_digest)
    diff_ids = image.config.get("rootfs", {}).get("diff_ids", [])  # an index of other layers is not this base's
    index = load_index(cache, diff_ids)
    if index is not None:
        return index
    if travelled is not None and (index := baseindex.fetch(travelled, image.manifest_digest, log, diff_ids=diff_ids)) is not None:
        return index
    index = {}
    total = sum(layer["size"] for layer in image.layers)
    log(f"indexing base image {image.ref} ({len(image.layers)} layers)")
    with progress.bar("reading base layers", total) as b:
        for layer in image.layers:
            raw = IterReader(remote.iter_blob(layer["digest"], progress.safe_update(b), layer["size"]))
            stream = decompressing_reader(raw, layer["mediaType"],
                                          lambda msg, d=layer["digest"]: log(f"warning: base layer {d[:19]}: {msg}"))
            try:
                apply_layer_to_index(index, stream)
            except (tarfile.TarError, EOFError, zlib.error, zstandard.ZstdError) as e:
                raise IntegrityError(f"base image layer {layer['digest'][:19]} is not a readable tar: {e}")
            raw.drain()  # runs the digest check at the end of the blob
    save_index(index, cache, diff_ids)
    return index


def own_excludes(root: str) -> tuple[str, ...]:
    """Our own state dir, and the staging dirs of restores into this root (a stopped one keeps its
    downloads there to resume), must never end up in the snapshot."""
    own = os.path.relpath(state_dir(), root)
    return (*((own,) if not own.startswith("..") else ()), *staging_dirs(root))


def scan_root(root: str, profile: Profile, memo: Optional[ScanMemo] = None) -> Scan:
    """Walk the box as a commit sees it (the profile's excludes and snap's state dir left out);
    `memo` carries what the last such walk learnt (fsindex.ScanMemo)."""
    with progress.bar("scanning box", unit="files") as b:
        return scan_box(root, profile, own_excludes(root), progress.safe_update(b), memo=memo)


def changes_in(scan: Scan, root: str, profile: Profile, index: dict[str, Entry], rehash: bool = False) -> Diff:
    """Diff a scan of the box against the base index."""
    extra = own_excludes(root)

    def skipped(path: str) -> bool:
        return profile.leaves_out(path) or path in extra or scan.not_walked(path)

    return diff(index, scan, skipped, rehash=rehash, root=root)


def box_changes(root: str, profile: Profile, index: dict[str, Entry], rehash: bool = False) -> tuple[Scan, Diff]:
    """Walk the box and diff it against the base index."""
    scan = scan_root(root, profile)
    return scan, changes_in(scan, root, profile, index, rehash)


@dataclass
class CommitPlan:
    """What a commit would send: the box diffed against its base and split into layers, nothing
    pushed yet. `known(plan)` is the blob a layer already has (stat cache or last restore)."""

    root: str
    base_ref: Optional[Reference]  # these three are None for --base scratch
    base_remote: Optional[Remote]
    base_img: Optional[Image]
    index: dict[str, Entry]
    scan: Scan
    diff: Diff
    plans: list[LayerPlan]
    cache: StatCache
    restored: Optional[RestoreRecord]
    scan_started_ns: int
    zstd_level: int
    rehash: bool
    sources: BlobSources = field(default_factory=BlobSources)  # where blobs of this registry were seen
    # Files that must not be read (snap watch: a big file being rewritten, carried at its last
    # snapshot's version). A layer holding one is only reused whole (stat cache and registry), never
    # built; push_commit leaves out such a file whose layer cannot be, and lists it in `left_unread`.
    unreadable: set[str] = field(default_factory=set)
    left_unread: list[str] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)  # files not read (being written), with why
    carried: dict[str, list[tuple[dict, str]]] = field(default_factory=dict)  # held files kept as the last snapshot's layers
    deletes: Optional[deletions.Deletions] = None  # what the snapshot deletes of its base (None: no base)

    @property
    def base_name(self) -> str:
        return str(self.base_ref) if self.base_ref else SCRATCH

    @property
    def base_layers(self) -> int:
        return len(self.base_img.layers) if self.base_img else 0

    def known(self, plan: LayerPlan) -> Optional[dict]:
        if self.rehash:
            return None
        hit = self.cache.lookup(plan.fingerprint(self.zstd_level))
        return hit or (self.restored.blob_for(plan) if self.restored else None)


def _check_options(opts: CommitOptions) -> None:
    if opts.compression not in (None, "zstd", "gzip"):
        raise UsageError(f"--compression {opts.compression} is not known: use zstd or gzip")
    if opts.max_layer_size < 1024 * 1024:
        raise UsageError("--max-layer-size must be at least 1MiB")
    if not os.path.isdir(opts.root):
        raise UsageError(f"root {opts.root} does not exist or is not a directory")


def plan_commit(base: str, opts: CommitOptions, transport: Optional[TransportOptions] = None,
                target: Optional[Reference] = None) -> CommitPlan:
    """Read the base, walk the box, diff and plan the layers: everything a commit does before it
    reads a file's bytes or pushes anything (`snap status` stops here). The base index comes
    from the `target` repository when the state dir lacks it (an earlier snapshot pushed it)."""
    _check_options(opts)
    scratch = base == SCRATCH
    if opts.profile.include and not scratch:
        raise UsageError("--include (or the profile's include list) needs --base scratch",
                         "with a base image the snapshot already holds only what changed against it")
    base_ref = None if scratch else Reference.parse(base)
    root = os.path.realpath(opts.root)
    base_remote, base_img, index = None, None, {}
    if base_ref is not None:
        base_remote = Remote(base_ref, transport or opts.transport)
        base_img = base_remote.resolve()
        travelled = None
        if target is not None:
            travelled = base_remote if target.name == base_ref.name else _optional_remote(target, transport or opts.transport)
        index = base_index(base_remote, base_img, opts.log, travelled)
    scan_started_ns = time.time_ns()
    with gc_paused():
        scan, d, plans = _scan_and_plan(root, base_img, index, opts)
        deleted = deletions.count(index, d.deleted) if base_img else None
    if deleted is not None and not opts.force:
        deletions.refuse_commit(root, deleted)  # before anything is read or pushed
    hold = opts.hold or (lambda sc: being_written(sc, root, WRITING_QUIET_S, restored_at=restored_at_ns(root)))
    held = hold(scan)
    if scratch and not opts.profile.include:
        files = [e for e in scan.entries.values() if e.kind == FILE]
        opts.log(f"--base scratch without --include: capturing all of {root} but the profile's excludes: "
                 f"{len(files)} files, {progress.human_size(sum(e.size for e in files))}")
    # A scratch image's restore records no base (None): its stat cache is keyed apart.
    base_digest = base_img.manifest_digest if base_img else None
    cache = StatCache(root, base_digest or SCRATCH)
    restored = RestoreRecord.load(root, base_digest, opts.profile.name, opts.max_layer_size)
    cp = CommitPlan(root, base_ref, base_remote, base_img, index, scan, d, plans, cache, restored, scan_started_ns,
                    opts.profile.zstd_level, opts.rehash, deletes=deleted)
    hold_back(cp, held, opts)
    return cp


def hold_back(cp: CommitPlan, held: dict[str, str], opts: CommitOptions) -> None:
    """Keep files that are being written (`held`: path -> why) out of the layers to read, and plan
    again: each keeps the last snapshot's version where that is its own layer (carried as is, never
    read), or where its old entry's layer is in the stat cache (snap watch); else it is left out, and
    the snapshot has the base's version, if any. Never read: it would tear. Other names of a held
    file's inode are held with it (they travel in one layer)."""
    held = {p: why for p, why in held.items() if p not in cp.held}
    inodes = {cp.scan.entries[p].inode for p in held if p in cp.scan.entries and cp.scan.entries[p].inode}
    if inodes:
        why = next(iter(held.values()))
        held.update({e.path: why for e in cp.scan.entries.values() if e.inode in inodes and e.path not in held})
    changed = {e.path for e in cp.diff.changed}
    held = {p: why for p, why in held.items() if p in changed}
    if not held:
        return
    previous = opts.previous() if opts.previous else {}
    keep: list[Entry] = []
    for e in cp.diff.changed:
        if e.path not in held:
            keep.append(e)
        elif e.path in previous and not e.inode:  # a file with other names: its old layer may name others
            cp.carried[e.path] = previous[e.path]
        elif e.path in opts.old_entries:
            keep.append(opts.old_entries[e.path])
            cp.unreadable.add(e.path)
    cp.held.update(held)
    cp.diff.changed = keep
    cp.plans = _plan_layers(cp.diff, cp.scan, cp.index, opts)
    for plan in cp.plans:
        plan.fingerprint(opts.profile.zstd_level, opts.plan_memo)


def _scan_and_plan(root: str, base_img: Optional[Image], index: dict[str, Entry],
                   opts: CommitOptions) -> tuple[Scan, Diff, list[LayerPlan]]:
    """Walk (or ask opts.changes), diff, plan, and compute the layers' stat-cache keys."""
    if opts.changes is not None:
        scan, d = opts.changes(base_img, index)
    else:
        scan, d = box_changes(root, opts.profile, index, opts.rehash)
    plans = _plan_layers(d, scan, index, opts)
    for plan in plans:
        plan.fingerprint(opts.profile.zstd_level, opts.plan_memo)
    return scan, d, plans


def _plan_layers(d: Diff, scan: Scan, index: dict[str, Entry], opts: CommitOptions) -> list[LayerPlan]:
    """The layers of a diff with the commit's options (planned once, and again by push_commit
    when it leaves files out)."""
    return plan_layers(d, scan, index, opts.profile, opts.compression, opts.max_layer_size, opts.plan_memo)


def _optional_remote(ref: Reference, transport: TransportOptions) -> Optional[Remote]:
    try:
        return Remote(ref, transport)
    except SnapError:
        return None  # only a shortcut: the push to it says what is wrong


def target_remote(cp: CommitPlan, target_ref: Reference, transport: TransportOptions) -> Remote:
    """The repository the snapshot goes to, with the base's blobs made available in it."""
    if cp.base_img is None:
        return Remote(target_ref, transport)
    remote = cp.base_remote if target_ref.name == cp.base_ref.name else Remote(target_ref, transport)
    _ensure_base_layers(remote, cp.base_remote, cp.base_img, cp.sources)
    return remote


def push_layers(cp: CommitPlan, remote: Remote, plans: list[LayerPlan]) -> list[tuple[LayerPlan, LayerBlob, str]]:
    """Build and upload some of a plan's layers (all of them for a commit)."""
    return _push_layers(plans, remote, cp)


def commit_box(target: str, base: str, opts: Optional[CommitOptions] = None) -> CommitResult:
    """Commit the box to `target`, holding the state dir's lock (state.exclusive)."""
    opts = opts or CommitOptions()
    with exclusive(opts.log):
        return _commit_box(target, base, opts)


def _commit_box(target: str, base: str, opts: CommitOptions) -> CommitResult:
    _check_options(opts)
    target_ref = Reference.parse(target)
    if target_ref.digest:
        raise UsageError("commit needs a tag to push to", f"drop the @sha256 part: {target_ref.name}:{target_ref.tag or 'TAG'}")
    transport = opts.transport.credentials_only_for(target_ref.registry)  # --username is for the target's registry
    remote = Remote(target_ref, transport)
    root = os.path.realpath(opts.root)
    current = check_forward(remote, target_ref, root, opts.force, opts.origins)
    if opts.previous is None:
        opts = dataclasses.replace(opts, previous=functools.cache(lambda: last_snapshot_files(remote, root, current)))
    cp = plan_commit(base, opts, transport, target_ref)
    return push_commit(cp, target_ref, transport, opts)


def push_commit(cp: CommitPlan, target_ref: Reference, transport: TransportOptions, opts: CommitOptions) -> CommitResult:
    """Push a planned commit: the layers, the config, then the manifest under the target's tag."""
    remote = target_remote(cp, target_ref, transport)
    if opts.stopping is not None:
        remote.stopping = opts.stopping
    base_img = cp.base_img
    layers = _push_settled_layers(cp, remote, opts)
    count = cp.base_layers + len(layers) + sum(len(v) for v in cp.carried.values())
    if count > MAX_ENGINE_LAYERS:
        opts.log(f"warning: the image has {count} layers; Docker cannot run images "
                 f"with more than about {MAX_ENGINE_LAYERS} (snap restore has no such limit)")

    created = now_rfc3339()
    base_config = base_img.config if base_img else scratch_config(*host_platform())
    rows = [(p.label, b.diff_id, descriptor(b.media_type, b.digest, b.size, _annotations(p)), status,
             len(p.entries) + len(p.whiteouts)) for p, b, status in layers]
    _insert_carried(rows, cp)
    config = snapshot_config(base_config, [(label, diff_id) for label, diff_id, *_ in rows], created)
    layer_descs = [desc for _, _, desc, *_ in rows]
    extra = {SNAP_MAX_LAYER: str(opts.max_layer_size), **secrets_annotations(cp.scan.skipped_secrets),
             **(cp.deletes.annotation() if cp.deletes else {})}  # read by a restore onto a live system
    # The base's index, for a commit on a new machine and for restore (baseindex.py).
    index_digest = baseindex.push(remote, base_img.manifest_digest, cp.sources) if base_img else None
    if index_digest:
        extra[baseindex.SNAP_BASE_INDEX] = index_digest
    # The layers' headers, for a restore onto a root that already holds some of them (skip.py).
    skeleton_digest = skeleton.push(remote, [(p, b.diff_id) for p, b, _ in layers], cp.sources)
    if skeleton_digest:
        extra[skeleton.SNAP_SKELETON] = skeleton_digest
    manifest = snapshot_manifest(base_img, cp.base_name if base_img else None, config, layer_descs, opts.profile.name,
                                 created, extra)
    config_digest = sha256_digest(config)
    if not remote.blob_exists(config_digest):
        remote.upload_from(lambda out: out.write(config), config_digest, len(config))
    # The tag moves only now, after every blob is in.
    digest = remote.put_manifest(manifest, OCI_MANIFEST, target_ref.target)
    cp.cache.save()
    note_last_commit(cp.root, cp.base_name, str(target_ref), digest)
    own = [d["digest"] for d in json.loads(manifest)["layers"]] + [config_digest]
    cp.sources.note(target_ref.api_host, target_ref.repository,
                    own + ([base_img.manifest["config"]["digest"]] if base_img else [])
                    + ([index_digest, baseindex.EMPTY_CONFIG_DIGEST] if index_digest else [])
                    + ([skeleton_digest, baseindex.EMPTY_CONFIG_DIGEST] if skeleton_digest else []))
    cp.sources.save()

    reports = [LayerReport(label, desc["digest"], desc["size"], desc["mediaType"], entries, status)
               for label, _, desc, status, entries in rows]
    return CommitResult(target_ref.with_digest(digest), digest, cp.base_layers, reports,
                        cp.scan.skipped_secrets, sorted(p for p, why in cp.held.items() if why == TORN),
                        len(cp.diff.deleted), cp.scan.host_files, held=dict(cp.held), carried=sorted(cp.carried),
                        snap_layers=[(desc, diff_id) for _, diff_id, desc, *_ in rows])


TORN = "changed while read"
CHANGED_SINCE_SCAN = "changed since the scan"  # read whole and still, but written meanwhile: maybe half saved
NOT_SENT_TORN = "not sent: a file changed while read or since the scan"
SETTLE_PASSES = 3  # builds of the layers, each leaving out what tore in the one before


def _push_settled_layers(cp: CommitPlan, remote: Remote, opts: CommitOptions) -> list[tuple[LayerPlan, LayerBlob, str]]:
    """Build and upload the planned layers; a file that kept changing while it was read (layer.py
    reads it up to 3 times), or that was read whole but changed since the scan (a save in chunks
    that paused), is held back as one being written (hold_back) and its layer built again without
    it: no snapshot holds a torn file. Refused after SETTLE_PASSES builds that each tore."""
    for _ in range(SETTLE_PASSES):
        if cp.unreadable:
            _leave_out_unreadable(cp, remote, opts)
        layers = push_layers(cp, remote, cp.plans)
        torn = {path: CHANGED_SINCE_SCAN for _, blob, _ in layers for path in blob.changed_since_scan}
        torn.update({path: TORN for _, blob, _ in layers for path in blob.changed_while_read})
        if not torn:
            return layers
        hold_back(cp, torn, opts)
    raise SnapError(f"files kept changing while they were read, {SETTLE_PASSES} times: nothing was pushed",
                    "commit again once the box is quieter")


def _insert_carried(rows: list, cp: CommitPlan) -> None:
    """Put the layers carried from the last snapshot among the weights' single-file layers: before
    the weights' last small layer (directories and deletions), which must stay on top of them."""
    carried = [(snap_label(desc) or desc["digest"][:19], diff_id, desc, "kept from the last snapshot (being written, not read)",
                1) for path in sorted(cp.carried) for desc, diff_id in cp.carried[path]]
    if not carried:
        return
    at = len(rows)
    if cp.plans and cp.plans[-1].detail == META_DETAIL:
        at -= 1
    rows[at:at] = carried


def _annotations(plan: LayerPlan) -> dict:
    ann = {SNAP_LAYER: plan.name}
    if plan.detail:
        ann[SNAP_CONTENT] = plan.detail
    if plan.part_of:
        path, i, n = plan.part_of
        ann[SNAP_PART] = f"{i}/{n}"
        ann[SNAP_PART_FILE] = path
    if plan.part_links:
        ann[SNAP_PART_LINKS] = json.dumps(plan.part_links)
    return ann


def _cacheable(plan: LayerPlan, blob: LayerBlob, scan_started_ns: int) -> bool:
    """Whether a built layer may go into the stat cache. Not if a file changed while it was read
    (the blob may hold a torn copy) or since the scan (the blob is not what its stat data says), nor
    if a file changed just before the scan: within a coarse ctime tick a later write can leave the
    same stat (git's "racy clean" rule)."""
    if blob.changed_while_read or blob.changed_since_scan:
        return False
    return all(e.ctime_ns < scan_started_ns - RACY_WINDOW_NS for e in plan.entries if e.stamp)




def _files_read(plan: LayerPlan) -> set[str]:
    """The box files whose bytes building the layer reads (a part layer reads its slice's file)."""
    return {plan.slices.get(e.path, (e.path, 0))[0] for e in plan.entries if e.kind == FILE}


def _reused(cp: CommitPlan, remote: Remote, plan: LayerPlan) -> tuple[Optional[dict], str]:
    """The blob a layer already has (stat cache or last restore) and where the registry has it:
    "" when the layer must be built, its files read."""
    hit = cp.known(plan)
    return hit, (in_registry(remote, hit["digest"], cp.sources) if hit else "")


def _leave_out_unreadable(cp: CommitPlan, remote: Remote, opts: CommitOptions) -> None:
    """For each held file carried at its old entry whose layer would have to be built after all (it
    shares a changed bundle, or the stat cache lost it): one held only because a process has it open
    (BEING_WRITTEN) is read as it is now, the read checking that it holds still (else it tears and
    is left out then): leaving it out would drop the last snapshot's version of a database kept open
    and written now and then from every snapshot. One that tore is left out. Then plan again:
    leaving one out can change the layer of another (a bundle of two), hence the loop."""
    while True:
        stuck = {path for plan in cp.plans if (paths := _files_read(plan) & cp.unreadable)
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
        cp.plans = _plan_layers(cp.diff, cp.scan, cp.index, opts)


def _push_layers(plans: list[LayerPlan], remote: Remote, cp: CommitPlan) -> list[tuple[LayerPlan, LayerBlob, str]]:
    """Build and upload every planned layer, several at once. A layer whose fingerprint is in the
    stat cache (or that the last restore into this root wrote and nothing changed since), and
    whose blob the registry has (or mounts from another repository), is neither read nor uploaded."""
    root, zstd_level, sources = cp.root, cp.zstd_level, cp.sources
    results: dict[int, tuple[LayerPlan, LayerBlob, str]] = {}
    todo: list[tuple[int, LayerPlan, str]] = []
    for i, plan in enumerate(plans):
        fp = plan.fingerprint(zstd_level)
        hit, there = _reused(cp, remote, plan)
        if there:
            blob = LayerBlob(plan.name, None, hit["digest"], hit["diff_id"], hit["size"], hit["media_type"])
            results[i] = (plan, blob, f"{there} (unchanged, not read)")
            cp.cache.record(fp, hit)
        elif unread := sorted(_files_read(plan) & cp.unreadable):  # the registry lost the blob since push_commit looked
            raise SnapError(f"layer {plan.label!r} would have to read {'/' + unread[0]!r}, which is being rewritten",
                            "nothing was pushed; the next try leaves the file out")
        else:
            todo.append((i, plan, fp))
    out_dir = sub("layers")
    with progress.bar("packing", sum(p.content_size for _, p, _ in todo)) as pack, \
            progress.bar("uploading") as up, ThreadPoolExecutor(LAYER_WORKERS) as pool:
        # An error or Ctrl-C sets remote.stopping: layers being read or sent give up at their next
        # chunk, and the exit does not wait for a weight to finish on a slow link.
        on_pack = progress.stoppable(progress.safe_update(pack), remote.stopping)
        on_up = progress.stoppable(progress.safe_update(up), remote.stopping)

        def produce(plan: LayerPlan) -> tuple[LayerBlob, str]:
            headers = skeleton.PieceWriter()  # the layer's skeleton, as its tar is written
            blob, status = _produce(plan, headers)
            skeleton.keep(blob.diff_id, headers.finish(blob.diff_id))
            return blob, status

        def _produce(plan: LayerPlan, headers: skeleton.PieceWriter) -> tuple[LayerBlob, str]:
            if plan.compression == "none":
                # Stored as is: hash it in one read, then stream it again to the registry only if
                # the registry lacks it. No copy of tens of GB on the box's (often full) disk.
                blob = measure_layer(root, plan, zstd_level, on_pack, headers)
                if blob.changed_while_read or blob.changed_since_scan:
                    return blob, NOT_SENT_TORN
                if there := in_registry(remote, blob.digest, sources):
                    return blob, there
                remote.upload_from(lambda out: write_layer(out, root, plan, zstd_level), blob.digest, blob.size, on_up)
                return blob, "uploaded"
            blob = build_layer(root, plan, out_dir, zstd_level, on_pack, headers)
            try:
                if blob.changed_while_read or blob.changed_since_scan:
                    return blob, NOT_SENT_TORN
                if there := in_registry(remote, blob.digest, sources):
                    return blob, there
                remote.upload_blob(blob.path, blob.digest, blob.size, on_up)
                return blob, "uploaded"
            finally:
                os.unlink(blob.path)  # the registry has it now; the local copy was only for the upload

        futures = {}
        try:  # a Ctrl-C while the layers are still being handed out must stop the ones already started
            for i, plan, fp in todo:
                futures[pool.submit(produce, plan)] = (i, plan, fp)
            for fut, (i, plan, fp) in futures.items():
                blob, status = fut.result()
                results[i] = (plan, blob, status)
                if _cacheable(plan, blob, cp.scan_started_ns):
                    cp.cache.record(fp, {"digest": blob.digest, "diff_id": blob.diff_id, "size": blob.size,
                                         "media_type": blob.media_type})
        except BaseException:
            remote.stopping.set()
            for f in futures:
                f.cancel()
            raise
    return [results[i] for i in range(len(plans))]


def _ensure_base_layers(target: Remote, source: Remote, base: Image, sources: BlobSources) -> None:
    """Make the base's blobs available in the target repository: nothing to do in the same repo,
    a cross-repository mount on the same registry (from the base's repository or another known to
    hold the blob), else a copy through the local disk."""
    if target is source:
        return
    missing = [d for d in base.layers + [base.manifest["config"]] if not target.blob_exists(d["digest"])]
    if not missing:
        return
    same_registry = target.ref.api_host == source.ref.api_host
    if same_registry:
        sources.note(source.ref.api_host, source.ref.repository, [d["digest"] for d in missing])
    tmp_dir = sub("blobs")
    with progress.bar("copying base layers", sum(d["size"] for d in missing)) as b:
        for d in missing:
            if in_registry(target, d["digest"], sources):
                b.update(d["size"])
                continue
            path = os.path.join(tmp_dir, d["digest"].split(":", 1)[1])
            if not (os.path.exists(path) and file_digest(path) == d["digest"]):  # a killed run's: checked first
                source.download_blob(d["digest"], path, size=d["size"])
            target.upload_blob(path, d["digest"], d["size"], progress.safe_update(b))
            os.unlink(path)  # only a stop on the way to the other registry
