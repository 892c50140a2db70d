"""`snap restore` (extract mode): pull an image's layers, verify them, and apply them onto a directory.

Blobs download into staging directories inside the restore root (layer/staging.py: on the filesystem
each layer lands on, not the state dir's), several at once (download.py), and each layer is applied
as soon as its digest is checked and the layers before it are applied: no unverified byte reaches
the target, and the extraction of the first layers overlaps the download of the rest. The app's
layers download first, the weights after them at a lower CPU priority (AppFirst). Layers are applied
by extractors in child processes (applier.py), so that unpacking does not wait on the download
threads for Python's lock: snap's own layers several at once, one per process (--jobs), any other
alone and in order (schedule.py). Each layer's diff_id is checked at the end of its stream, before its
last entry, if a regular file, is renamed into place (layer/extract.py; a split layer's digest, checked
at download, is its diff_id). Before any download, the snap layers the root already holds, file for
file, are skipped: neither downloaded nor applied (skip.py: a pod restart whose volume kept the
weights). A journal (journal.py) records how many layers of this run's list are applied, so a restore
that was interrupted resumes where it stopped (from the first applied layer whose files are no longer
all there: resume.py). Then files cut into part layers are joined (parts.py), and the snap layers are
noted for the next commit of the root (snapshot/record.py). A full restore of an image that carries no
index of its base indexes the base's layers as it applies them (docs/commit.md).

A restore writes over what is there, so three things guard a live machine: a full image (base layers
and all) is refused onto a root that already holds an operating system, unless this restore started
there (its journal) or the caller forces it; the snapshot layers applied onto one may not delete its
system, counted from their headers before anything is written (deletion_guard.py); and the profile's
excludes (/etc/hostname, /etc/resolv.conf, /proc, /tmp, ...) are never written, whatever it holds."""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapshotter.box.clock import Stamp, stamp
from snapshotter.errors import IntegrityError, SnapError, StorageError, UsageError, storage_error
from snapshotter.index import base as baseindex
from snapshotter.jobs import resolve_jobs
from snapshotter.layer.extract import Extractor
from snapshotter.layer.extract_model import ExtractOptions, ExtractStats
from snapshotter.layer.staging import STAGING_PREFIX, StagingDirs
from snapshotter.oci.image import (BASE_DIGEST, SNAP_BASE_LAYERS, SNAP_MAX_LAYER, SNAP_PROFILE, SNAP_SKELETON, Image,
                                   Layer, select_layers, snapshot_layer_count)
from snapshotter.oci.reference import Reference
from snapshotter.origin import snapshots as origin
from snapshotter.profile import PathSet, Profile, available_profiles, load_profile
from snapshotter.progress import human_size
from snapshotter.registry.blobsources import BlobSources
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot import skeleton
from snapshotter.snapshot.decryption import open_image
from snapshotter.snapshot.record import applied_since, forget_restore, note_restore
from snapshotter.state import RootFiles, exclusive, state_dir, sub
from snapshotter.tar.compress import label_mismatch, sniff_compression, stream_head

from .applier import ExtractWorker, LayerJob, workers_memory_allows
from .deletion_guard import Claims, guard_live_root, holds_system, refuse_live_system
from .download import Blob, Downloads
from .journal import Journal, rules_digest
from .landing import Progress, app_ready_after, weight_file
from .parts import join_parts, part_files, part_links
from .priority import WeightsPriority
from .resume import first_missing
from .schedule import Scheduler, SkipsUntrusted
from .skip import RootRules, SkipPlan, plan_skips
from .skip_order import skipped_part_files


@dataclass
class RestoreOptions:
    only_snapshot: bool = False
    extract: ExtractOptions = field(default_factory=ExtractOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None
    seed_stat_cache: bool = True  # record the snap layers, so that the next commit reads no unchanged one
    force: bool = False  # apply a full image, or a snapshot's deletion of the system, onto a root that holds one
    profile: Optional[str] = None  # whose `exclude` is never written; None: the image's own, if snap ships it
    # Called once every layer but the weights is applied (landing.py): `snap restore --then` starts the app.
    on_app_ready: Optional[Callable[[], None]] = None
    jobs: Optional[int] = None  # layers applied at once (jobs.py: --jobs, else SNAP_JOBS, else the cores)
    decryption_keys: list = field(default_factory=list)  # private keys that open an encrypted image


@dataclass
class RestoreResult:
    ref: Reference
    manifest_digest: str
    applied: list[str]  # layer names (or digests for base layers) applied now
    resumed: int  # layers skipped because an earlier run had applied them
    files: int
    bytes: int
    skipped_devices: list[str]
    stripped_setuid: list[str]
    # snap layers the next commit of this root will know without reading them (snapshot/record.py)
    seeded_layers: int = 0
    skipped_devices_count: int = 0  # all of them (the lists keep the first extract.NAMES_KEPT names)
    stripped_setuid_count: int = 0
    skipped_layers: int = 0  # layers the root already held: neither downloaded nor applied (skip.py)
    skipped_bytes: int = 0  # their blobs' bytes
    hashed_bytes: int = 0  # bytes of the root read to tell
    origin_fetched: int = 0  # weights fetched from the origin (references: origin/snapshots.py)
    origin_present: int = 0  # and those already in place, not fetched


def _state_sub(name: str) -> str:
    try:
        return sub(name)
    except OSError as e:
        raise storage_error(e, f"snap's state dir {state_dir()!r}",
                            hint="point SNAP_STATE_DIR at a writable directory") from e


# ---- restore ----------------------------------------------------------------------------------------


def restore_image(ref: str, root: str, opts: Optional[RestoreOptions] = None) -> RestoreResult:
    """Restore `ref` into `root`, holding the state dir's lock (state.exclusive)."""
    opts = opts or RestoreOptions()
    with exclusive(opts.log):
        return _restore_image(ref, root, opts)


@dataclass
class _Run:
    """One restore's working set: made by _open_run, then handed through its phases."""

    reference: Reference
    files: RootFiles  # the root's files in the state dir: journal, progress, restore record
    remote: Remote
    image: Image
    todo: list[Layer]  # the layers this run applies, in order
    journal: Journal
    extractor: Extractor
    profile: Profile
    base_layers: int  # how many of todo are the base's (0 for --only-snapshot)
    parts: dict[str, int]  # files cut into part layers, to join: their part counts (parts.py)
    links: dict[str, list[str]]  # their other names
    skeletons: Callable[[], dict[str, skeleton.Skeleton]]
    claims: Optional[Claims]  # onto a live root: what each layer may delete (deletion_guard.py)
    # The weights' download threads, the registry's and the origin's: below the app's unpacking (priority.py)
    weights_priority: WeightsPriority = field(default_factory=lambda: WeightsPriority(app_in=False))


def _restore_image(ref: str, root: str, opts: RestoreOptions) -> RestoreResult:
    progress = Progress(RootFiles(root))  # before anything: the last run's file must not answer --wait
    with progress.stopped_on_failure():
        run = _open_run(ref, root, opts)
        resumed = _resume(run, root, opts.log)
    parts = run.parts  # every file cut into parts; one whose part layers are all skipped is not joined
    skips = _planned_skips(run, resumed, parts)
    weights = {r.name for r in run.profile.layers if r.weights}
    progress.running(run.todo, weights)
    ready_at = app_ready_after(run.todo, weights)

    def after_layer(count: int, layer: Optional[Layer]) -> None:
        if layer is not None:
            progress.landed(layer, weights)
        if count == ready_at:  # before the app starts: the weights no longer yield to its unpacking
            run.weights_priority.app_in()
            if opts.on_app_ready is not None:
                opts.on_app_ready()

    weights_fetch = origin.start_fetch(run.extractor.root, run.remote, run.image.annotations, opts.log, run.profile,
                                       run.weights_priority.lower)
    forget_restore(run.files)  # until this one finishes, the root did not come from any image (snapshot/lineage.py)
    started = stamp()
    staging = StagingDirs(root, run.image.manifest_digest, opts.log)
    try:
        if resumed >= ready_at:
            after_layer(ready_at, None)
        # A resumed restore applied some base layers in an earlier run: it cannot index the base.
        index_to = _base_index_to_build(run.image, run.base_layers) if not resumed else None
        applied, headers, stats, skips = _apply_checked(run, staging, opts, after_layer,
                                                        (run.base_layers, index_to) if index_to else None, ready_at,
                                                        frozenset(weights), skips, parts)
        if skips.skipped:  # said once applied: a layer checked again may have been applied after all
            opts.log(f"skipped {len(skips.skipped)} layer(s) ({human_size(skips.skipped_bytes)}) already in "
                     f"{run.extractor.root}: not downloaded")
        staging.remove()  # the layers are applied: the root holds nothing of ours
        if run.parts:
            join_parts(run.extractor, run.parts, run.links, opts.extract.fsync, run.journal)
        if ready_at > len(run.todo):
            after_layer(ready_at, None)
        # Weights from the origin: failed, the layers are in but the restore unfinished; a rerun fetches the rest.
        report = weights_fetch.finish() if weights_fetch is not None else None
    except BaseException as e:
        progress.finish(ok=False)
        run.journal.sweep(opts.log)  # the extraction processes are stopped: a file one was writing goes
        # Kept for the next run, unless the image is refused or the disk is full (a rerun needs the room back).
        staging.remove(keep_downloads=not isinstance(e, (IntegrityError, UsageError, StorageError)))
        raise
    seeded = _finish(run, headers if opts.seed_stat_cache else {}, started, opts)
    progress.finish(ok=True)
    return _result(run, applied, resumed, stats, seeded, skips, report)


def _open_run(ref: str, root: str, opts: RestoreOptions) -> _Run:
    """Resolve the image, refuse what may not be restored into `root` (before anything is
    written), and open the root for extraction."""
    reference = Reference.parse(ref)
    if os.path.exists(root) and not os.path.isdir(root):
        raise UsageError(f"restore target {root!r} exists and is not a directory")
    files = RootFiles(root)
    remote = Remote(reference, opts.transport)
    image, remote = open_image(remote.resolve(), remote, opts.decryption_keys)  # before anything is written
    todo = select_layers(image, opts.only_snapshot)
    parts, links = part_files(todo), part_links(todo)  # a malformed image is refused before anything is written
    profile = restore_profile(image, opts.profile)
    # A layer never writes into a staging dir: it holds the verified blobs of the layers after it.
    # The run's token, in its temp names: one extraction process does not sweep another's (layer/extract.py).
    extract = dataclasses.replace(opts.extract, never_write=(*profile.exclude.patterns, f"{STAGING_PREFIX}*"),
                                  run_token=secrets.token_hex(4))
    journal = Journal(_state_sub("restore-journal"), files, image.manifest_digest, [layer.digest for layer in todo],
                      extract.fsync, rules_digest(extract))
    base_layers = len(todo) - snapshot_layer_count(image) if not opts.only_snapshot else 0
    if base_layers > 0 and not opts.force and not journal.started_here():
        refuse_live_system(root, image, base_layers)
    # Snapshot layers onto a live system: never its deletion (a snapshot of a wrong --root holds
    # whiteouts of /bin, /etc, /usr), counted from the layers before anything is written. A full
    # restore onto one is refused above, or forced.
    live = holds_system(root) if base_layers == 0 and not opts.force else None
    # Fetched once, when the guard or skip.py first needs them.
    skeletons = functools.cache(lambda: skeleton.image_skeletons(remote, image, opts.log))
    joins = {rel: links.get(rel, []) for rel in parts}
    claims = guard_live_root(remote, image, todo, skeletons(), root, live, PathSet(extract.never_write),
                             opts.extract.allow_devices, joins, opts.log) if live else None
    extractor = _open_root(root, dataclasses.replace(extract, in_place_log=journal.in_place_log))
    return _Run(reference, files, remote, image, todo, journal, extractor, profile, base_layers, parts, links,
                skeletons, claims)


def _resume(run: _Run, root: str, log: Callable[[str], None]) -> int:
    """How many layers an earlier run applied that this one need not: the journal's, rewound to the
    first of them whose files are no longer all in the root (resume.py)."""
    run.journal.load(log)
    lost = first_missing(root, run.journal, run.todo) if run.journal.applied else None
    if lost is not None:
        log(f"an earlier restore applied layer {lost[0]}, but {lost[1]}: applying layers {lost[0]} to {len(run.todo)} "
            "again")
        run.journal.rewind(lost[0] - 1)
    resumed = run.journal.applied
    if resumed:
        log(f"resuming: {resumed} layer(s) already applied by an earlier run")
    return resumed


def _finish(run: _Run, headers: dict[str, str], started: Stamp, opts: RestoreOptions) -> int:
    """Every layer is in: make it durable, drop the journal, and note what the root now holds.
    Returns how many snap layers the next commit of the root knows without reading them."""
    if opts.extract.fsync:
        os.sync()  # all of it durable before the journal goes (the last renames' directories too)
    run.journal.remove()
    seeded = note_restore(run.files, run.image, headers, started)  # first: the root came from it
    _note_sources(run.reference, run.image)
    _keep_base_index(run.remote, run.image, opts.log)
    return seeded


def _result(run: _Run, applied: list[str], resumed: int, stats: ExtractStats, seeded: int,
            skips: SkipPlan, weights: Optional[origin.FetchReport]) -> RestoreResult:
    stats.files += run.extractor.stats.files  # the joins
    stats.bytes += run.extractor.stats.bytes
    stats.add_stripped(run.extractor.stats)
    return RestoreResult(run.image.ref, run.image.manifest_digest, applied, resumed, stats.files, stats.bytes,
                         stats.skipped_devices, stats.stripped_setuid, seeded,
                         stats.skipped_devices_count, stats.stripped_setuid_count,
                         len(skips.skipped), skips.skipped_bytes, skips.hashed_bytes,
                         *((len(weights.fetched), len(weights.present)) if weights else ()))


def _planned_skips(run: _Run, resumed: int, parts: dict[str, int]) -> SkipPlan:
    """_skips(), and the files to join (run.parts) those of `parts` not all skipped."""
    skips = _skips(run, resumed)
    done = skipped_part_files(run.todo, skips.skipped)  # nothing to join: the file is there
    run.parts = {rel: n for rel, n in parts.items() if rel not in done}
    return skips


def _apply_checked(run: _Run, staging: StagingDirs, opts: RestoreOptions,
                   after_layer: Callable[[int, Optional[Layer]], None], index_base: Optional[tuple[int, str]],
                   ready_at: int, weights: frozenset[str], skips: SkipPlan, parts: dict[str, int]
                   ) -> tuple[list[str], dict[str, str], ExtractStats, SkipPlan]:
    """_apply_layers, with the skips planned; and where a layer applied was not what its skeleton
    said (a layer above it was skipped on its word: schedule.SkipsUntrusted), again from where the
    journal stands, with the layers above checked again against the root as it is now (a resume's
    plan: the misdescribed layer is below it). Each round starts higher: it ends. Returns
    _apply_layers' three, and the skips of all the rounds."""
    applied: list[str] = []
    headers: dict[str, str] = {}
    stats = ExtractStats()
    while True:
        try:
            more, more_headers = _apply_layers(run, staging, opts, after_layer, stats, index_base, ready_at, weights,
                                               skips)
            return applied + more, {**headers, **more_headers}, stats, skips
        except SkipsUntrusted as e:
            opts.log(f"{e}: the layers above it are checked again")
            applied += e.applied
            headers.update(e.headers)
            done = run.journal.applied
            kept = {n: h for n, h in skips.skipped.items() if n < done}  # recorded as skipped
            again = _planned_skips(run, done, parts)
            skipped = {**kept, **again.skipped}
            skips = SkipPlan(skipped, sum(run.todo[n].size for n in skipped),
                             skips.hashed_bytes + again.hashed_bytes, again.reasons, again.headers_said)
            index_base = None  # the base's layers, if any, are applied


def _skips(run: _Run, resumed: int) -> SkipPlan:
    """The pending layers the root already holds (skip.py), by the skeletons the snapshot carries.
    None while base layers are still to apply: what they write is not known (a full restore goes
    into a root without a system, refuse_live_system, where little is in place anyway)."""
    root = run.extractor.root
    if resumed < run.base_layers or _empty(root) or not run.skeletons():
        return SkipPlan({})
    try:
        max_layer: Optional[int] = int(run.image.annotations.get(SNAP_MAX_LAYER, ""))
    except ValueError:
        max_layer = None
    ex = run.extractor.opts
    rules = RootRules(root, PathSet(ex.never_write), ex.same_owner, ex.allow_setuid and os.geteuid() == 0,
                      max_layer, run.links)
    return plan_skips(run.todo, resumed, run.skeletons(), rules,
                      lambda desc, headers: applied_since(run.files, desc["digest"], headers))


def _empty(root: str) -> bool:
    """A first restore into an empty root: nothing there to check."""
    try:
        with os.scandir(root) as it:
            return next(it, None) is None
    except OSError:
        return False


def _open_root(root: str, opts: ExtractOptions) -> Extractor:
    try:
        return Extractor(root, opts)
    except OSError as e:
        raise StorageError(f"cannot create the restore root {root!r}: {e.strerror or e}",
                           "restore into a directory on a writable filesystem") from e


def _apply_layers(run: _Run, staging: StagingDirs, opts: RestoreOptions,
                  after_layer: Callable[[int, Optional[Layer]], None], stats: ExtractStats,
                  index_base: Optional[tuple[int, str]] = None, ready_at: int = 0,
                  weights: frozenset[str] = frozenset(), skips: Optional[SkipPlan] = None
                  ) -> tuple[list[str], dict[str, str]]:
    """Apply the layers the journal does not list as applied, each once its blob is downloaded and
    verified while the later ones still download (download.py), snap's own several at once
    (schedule.py), noting them in the journal in order (telling `after_layer` how many are applied).
    `index_base` (n, path), for a restore from the first layer: the applier indexes the first n
    layers, the base's, and saves the index at path. Returns (labels of the layers applied, {layer
    digest: digest of its tar headers} for snap's own layers), the extraction's counts added to
    `stats`. The first `ready_at` layers are the app's (`--then` starts it once they are applied): their
    blobs download first, the weights' below their unpacking (priority.py), and those not `weights`
    write their new files in place. The layers `skips` skips (skip.py) are neither downloaded nor
    applied, and count as applied once the layers below them are seen to be as it said."""
    resumed, journal = run.journal.applied, run.journal
    pending = run.todo[resumed:]
    skips = skips or SkipPlan({})
    skipped = {n - resumed: headers for n, headers in skips.skipped.items() if n >= resumed}
    said = {n - resumed: headers for n, headers in skips.headers_said.items() if n >= resumed}
    fetched = [layer for n, layer in enumerate(pending) if n not in skipped]
    downloads = Downloads(run.remote, fetched, {layer.digest for n, layer in enumerate(pending)
                                                if n not in skipped and n < ready_at - resumed},
                          staging, opts.extract.fsync, run.weights_priority)

    def layer_job(n: int, blob: Blob) -> LayerJob:
        # Nothing runs from the root until the app's layers are applied: their new files are written in place.
        # Weights always land whole (one may come before the app's last layer, or all before the joins of parts).
        in_place = resumed + n < ready_at and weight_file(pending[n], weights) is None
        job = _layer_job(pending, n, blob, in_place, index_base)
        if run.claims is not None:
            job.deletions = run.claims.get(pending[n].digest, {})
        return job

    alone = {n for n, layer in enumerate(pending) if not layer.snap_label or downloads.kept_split(layer.digest)
             or (index_base is not None and n < index_base[0])}
    # One extraction process per layer applied at once, each holding one layer's stream (schedule.py).
    count = max(1, min(resolve_jobs(opts.jobs), workers_memory_allows(),
                       sum(1 for n in range(len(pending)) if n not in alone and n not in skipped)))
    with ExitStack() as stack:
        # Started before the download threads (a fork copies only the thread that forks), and stopped
        # first: after an error or a Ctrl-C they must not go on writing while running downloads finish.
        # A layer's hardlink may name what earlier runs wrote.
        workers = [ExtractWorker(run.extractor, journal.written) for _ in range(count)]
        stack.enter_context(downloads)
        for worker in workers:
            stack.enter_context(worker)
        scheduler = Scheduler(pending, alone, skipped, resumed, downloads, layer_job, workers, journal, after_layer,
                              run.extractor, lambda layer, blob, label: _note_mislabelled(layer, blob, label, opts.log),
                              said)
        try:
            return _run_scheduler(scheduler, downloads, journal, len(run.todo), staging, opts.log)
        finally:
            for worker in workers:
                stats.add(worker.stats)


def _run_scheduler(scheduler: Scheduler, downloads: Downloads, journal: Journal, total: int, staging: StagingDirs,
                   log: Callable[[str], None]) -> tuple[list[str], dict[str, str]]:
    """Run the apply loop; on a failure, stop the downloads and say how far it got."""
    resumed = journal.applied
    try:
        return scheduler.run()
    except SkipsUntrusted:
        downloads.stop()  # this run goes on from where the journal stands (_apply_checked)
        raise
    except BaseException as e:
        downloads.stop()
        if journal.applied > resumed:
            log(f"stopped with {journal.applied} of {total} layer(s) applied: "
                "the next restore into this root resumes after them")
        if isinstance(e, OSError) and e.errno is not None:
            raise storage_error(e, f"a staging dir of the restore root {staging.root!r}", " while downloading layers",
                                "free space on the target's disk, and run the restore again: it resumes") from e
        raise


def _layer_job(pending: list[Layer], n: int, blob: Blob, in_place: bool,
               index_base: Optional[tuple[int, str]]) -> LayerJob:
    """What the applier needs to apply pending[n] from its verified blob (applier.py)."""
    layer = pending[n]
    job = LayerJob(blob.path, layer.media_type, layer.diff_id, blob.split, layer.label,
                   record=bool(layer.snap_label),  # snap's own: its headers teach the next commit
                   in_place=in_place)
    if index_base is not None and n < index_base[0]:
        job.base_layer = n
        if n == index_base[0] - 1:
            job.save_index, job.index_diff_ids = index_base[1], tuple(p.diff_id for p in pending[:n + 1])
    return job


def _keep_base_index(remote: Remote, image: Image, log: Callable[[str], None]) -> None:
    """Cache the index of the snapshot's base that came with it (index/base.py, a small blob), so
    that the first commit on this machine into the same repository neither downloads nor reads the
    base's layers again. Kept as that repository's, which a commit into another does not trust,
    unless it is the one a full restore built from the base's layers (_base_index_to_build)."""
    base, digest = image.annotated_digest(BASE_DIGEST), image.annotated_digest(baseindex.SNAP_BASE_INDEX)
    if base and digest:
        try:
            baseindex.keep_carried(remote, base, digest, log)
        except SnapError as e:  # an optimisation only, after every layer is in: the next commit reads the base
            log(f"warning: the snapshot's base index was not kept ({e})")


def _base_index_to_build(image: Image, base_layers: int) -> Optional[str]:
    """Where a full restore saves the index of the image's base (baseindex.cache_path), built as it
    applies the base's layers, so that the first commit on this machine, into any repository, reads
    none of them again; built even when the image carries one, which serves only commits into its
    own repository (index/base.py). None when the state dir has it, or no base layer is applied."""
    ann = image.annotations
    if base_layers <= 0:
        return None
    # A snapshot names its base; any other image is its own base (all its layers are).
    base = image.annotated_digest(BASE_DIGEST) if SNAP_BASE_LAYERS in ann else image.manifest_digest
    if not base:
        return None
    path = baseindex.cache_path(base)
    return None if os.path.exists(path) else path


def _note_sources(reference: Reference, image: Image) -> None:
    """Remember that this repository holds the image's blobs: a later commit to another repository
    of the registry mounts them from here instead of uploading them (registry/blobsources.py)."""
    ann = image.annotations
    travelled = [d for d in (ann.get(baseindex.SNAP_BASE_INDEX), ann.get(SNAP_SKELETON)) if isinstance(d, str)]
    travelled += list(skeleton.headers_blobs(image).values())
    travelled += [baseindex.EMPTY_CONFIG_DIGEST] if travelled else []
    sources = BlobSources()
    sources.note(reference.api_host, reference.repository,
                 [d["digest"] for d in image.layers] + [image.config_digest] + travelled)
    try:
        sources.save()
    except OSError:
        pass  # an optimisation only: the next commit uploads instead of mounting


def restore_profile(image: Image, name: Optional[str] = None) -> Profile:
    """The profile whose excludes a restore never writes: `name`, else the one the snapshot was
    committed with when snap ships it, else the default."""
    if name is None:
        committed = image.annotations.get(SNAP_PROFILE)
        name = committed if committed in available_profiles() else "default"
    return load_profile(name)


def _note_mislabelled(layer: Layer, blob: Blob, label: str, log: Callable[[str], None]) -> None:
    """Say it in one line when a layer's bytes are not what its media type says (the extractor
    reads them by their bytes all the same)."""
    if blob.split:
        kind = "none"
    else:
        with open(blob.path, "rb") as f:
            kind = sniff_compression(stream_head(f))
    if kind is not None and (msg := label_mismatch(layer.media_type, kind)):
        log(f"warning: {label}: {msg}")
