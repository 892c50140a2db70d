"""`snap commit`: diff the box against its base image, build the snapshot layers, push the image.
Here: reading the base, the walk of the box and the plan, and the verb; the push is push.py's.

`--base scratch` (as Docker's `FROM scratch`) is a box with no base image, a VM: the snapshot holds
the profile's `include` paths (with their parent directories), or the whole root, and no base
layer; its config is the host's platform."""

from __future__ import annotations

import dataclasses
import os
import tarfile
import threading
import time
import zlib
from typing import Callable, Optional

import zstandard

from snapshotter import progress
from snapshotter.box import deletions
from snapshotter.box.diff import Diff, diff
from snapshotter.box.memo import ScanMemo
from snapshotter.box.scan import Scan, scan_box
from snapshotter.box.writers import open_for_writing
from snapshotter.errors import IntegrityError, UsageError
from snapshotter.index import base as baseindex
from snapshotter.index.entry import FILE, Entry, gc_paused
from snapshotter.index.indexer import apply_layer_to_index
from snapshotter.index.store import save_index
from snapshotter.jobs import resolve_jobs
from snapshotter.layer.plan import LayerPlan
from snapshotter.layer.staging import staging_dirs
from snapshotter.oci.image import Image
from snapshotter.oci.reference import Reference
from snapshotter.origin import snapshots as origin
from snapshotter.origin.hubcache import Recognition
from snapshotter.profile import Profile
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.diverged import Line
from snapshotter.snapshot.lineage import check_forward
from snapshotter.snapshot.record import RestoreRecord
from snapshotter.snapshot.statcache import StatCache
from snapshotter.snapshot.kept import StoredWalk
from snapshotter.state import exclusive, if_room, state_dir
from snapshotter.tar.compress import IterReader, decompressing_reader

from .hold import hold_back
from .model import SCRATCH, CommitHooks, CommitOptions, CommitPlan, CommitResult, plan_commit_layers
from .push import push_commit
from .weights import weights_in_layers


def base_index(remote: Remote, image: Image, log: Callable[[str], None],
               travelled: Optional[Remote] = None) -> dict[str, Entry]:
    """The file index of the base image: the one cached that a commit into the `travelled`
    repository (the target's; None: no commit) may use, else the one an earlier snapshot pushed
    there (index/base.py: an index is trusted as far as its source), else read from its layer tars."""
    diff_ids = image.config.get("rootfs", {}).get("diff_ids", [])  # an index of other layers is not this base's
    index = baseindex.load_cached(image.manifest_digest, diff_ids, travelled.ref.name if travelled else None)
    if index is not None:
        return index
    if travelled is not None:
        index = baseindex.fetch(travelled, image.manifest_digest, log, diff_ids=diff_ids)
        if index is not None:
            return index
    index = {}
    total = sum(layer["size"] for layer in image.layers)
    log(f"indexing base image {image.ref} ({len(image.layers)} layers)")
    with progress.bar("reading base layers", total, sink=log) as b:
        for layer in image.layers:
            raw = IterReader(remote.iter_blob(layer["digest"], progress.safe_update(b), layer["size"]))
            stream = decompressing_reader(raw, layer["mediaType"],
                                          lambda msg, d=layer["digest"]: log(f"warning: base layer {d[:19]}: {msg}"))
            try:
                apply_layer_to_index(index, stream)
            except (tarfile.TarError, EOFError, zlib.error, zstandard.ZstdError) as e:
                raise IntegrityError(f"base image layer {layer['digest'][:19]} is not a readable tar: {e}")
            raw.drain()  # runs the digest check at the end of the blob
    if_room(lambda: save_index(index, baseindex.cache_path(image.manifest_digest), diff_ids), log,
            "the base's index")  # built here: trusted by every commit
    return index


def own_excludes(root: str) -> tuple[str, ...]:
    """Our own state dir, and the staging dirs of restores into this root (a stopped one keeps its
    downloads there to resume), must never end up in the snapshot."""
    own = os.path.relpath(state_dir(), root)
    return (*((own,) if not own.startswith("..") else ()), *staging_dirs(root))


def scan_root(root: str, profile: Profile, memo: Optional[ScanMemo] = None, previous: Optional[Scan] = None,
              dirty: Optional[set[str]] = None, sink: progress.Sink = progress.to_stderr,
              mapped: frozenset[tuple[int, int]] = frozenset(), leave_out_whiteouts: bool = False,
              stopping: Optional[threading.Event] = None) -> Scan:
    """Walk the box as a commit sees it (the profile's excludes and snap's state dir left out);
    `memo` carries what the last such walk learnt (box/memo.py's ScanMemo); `previous` and `dirty`,
    the directories changed since that walk (a watcher's change notifications). Without a `memo`, the
    last commit's, kept in the state dir (snapshot/kept.py). `mapped`: the files (st_dev, st_ino) some
    process maps shared-writable, which the memo does not keep (scan_box). `stopping` set: the walk
    gives up at its next directory (progress.Stopped)."""
    extra = own_excludes(root)
    stored = StoredWalk(root, profile, extra) if memo is None else None
    with progress.bar("scanning box", unit="files", sink=sink) as b:
        update = progress.safe_update(b)
        update = progress.stoppable(update, stopping) if stopping is not None else update
        scan = scan_box(root, profile, extra, update, memo=stored.memo() if stored else memo,
                        previous=previous, dirty=dirty, mapped=mapped, leave_out_whiteouts=leave_out_whiteouts)
    if stored is not None:
        stored.save(scan)
    return scan


def changes_in(scan: Scan, root: str, profile: Profile, index: dict[str, Entry], rehash: bool = False) -> Diff:
    """Diff a scan of the box against the base index."""
    extra = own_excludes(root)

    def skipped(path: str) -> bool:
        return profile.leaves_out(path) or path in extra or scan.not_walked(path)

    return diff(index, scan, skipped, rehash=rehash, root=root)


def box_changes(root: str, profile: Profile, index: dict[str, Entry], rehash: bool = False,
                sink: progress.Sink = progress.to_stderr, mapped: frozenset[tuple[int, int]] = frozenset()
                ) -> tuple[Scan, Diff]:
    """Walk the box and diff it against the base index."""
    scan = scan_root(root, profile, sink=sink, mapped=mapped)
    return scan, changes_in(scan, root, profile, index, rehash)


def check_options(opts: CommitOptions) -> None:
    if opts.compression not in (None, "zstd", "gzip"):
        raise UsageError(f"--compression {opts.compression!r} is not known", "use zstd or gzip")
    if opts.max_layer_size < 1024 * 1024:
        raise UsageError("--max-layer-size must be at least 1MiB")
    if not os.path.isdir(opts.root):
        raise UsageError(f"root {opts.root!r} does not exist or is not a directory")
    resolve_jobs(opts.jobs)  # a bad --jobs or SNAP_JOBS before anything is read


def plan_commit(base: str, opts: CommitOptions, transport: Optional[TransportOptions] = None,
                target: Optional[Remote] = None, hooks: Optional[CommitHooks] = None) -> CommitPlan:
    """Read the base, walk the box, diff and plan the layers: everything a commit does before it
    reads a file's bytes or pushes anything (`snap status` stops here). The base index comes
    from the `target` repository (the caller's connection to it) when the state dir lacks it (an
    earlier snapshot pushed it).
    `hooks`: what the caller answers at the commit's named points (model.CommitHooks)."""
    check_options(opts)
    hooks = hooks or CommitHooks()
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
        travelled = base_remote if target is not None and target.ref.name == base_ref.name else target
        index = base_index(base_remote, base_img, opts.log, travelled)
    # Once, before the walk: the hold rule's writers, and the files whose stat data says nothing of
    # their bytes (a write through a shared mapping may change none): never trusted to it (CommitPlan.known).
    hooks.writers = open_for_writing()
    mapped = frozenset(hooks.writers.mapped_ids)
    scan_started_ns = time.time_ns()
    with gc_paused():
        scan, d, plans, found = _scan_and_plan(root, base_img, index, opts, hooks, mapped)
        deleted = deletions.count(index, d.deleted) if base_img else None
    if deleted is not None and not opts.force:
        deletions.refuse_commit(root, deleted)  # before anything is read or pushed
    held = hooks.hold(scan, root)
    if scratch and not opts.profile.include:
        files = [e for e in scan.entries.values() if e.kind == FILE]
        opts.log(f"--base scratch without --include: capturing all of {root} but the profile's excludes: "
                 f"{len(files)} files, {progress.human_size(sum(e.size for e in files))}")
    # A scratch image's restore records no base (None): its stat cache is keyed apart.
    base_digest = base_img.manifest_digest if base_img else None
    cache = StatCache(root, base_digest or SCRATCH)
    restored = RestoreRecord.load(root, base_digest, opts.profile.name, opts.max_layer_size)
    cp = CommitPlan(root, base_ref, base_remote, base_img, index, scan, d, plans, cache, restored, scan_started_ns,
                    opts.profile.zstd_level, opts.rehash, deletes=deleted, jobs=resolve_jobs(opts.jobs), hooks=hooks,
                    log=opts.log, encryption=opts.encryption, origin=found,
                    writing=frozenset(p for p in scan.unkept if p in scan.entries and scan.entries[p].kind == FILE))
    hold_back(cp, held, opts)
    return cp


def _scan_and_plan(root: str, base_img: Optional[Image], index: dict[str, Entry], opts: CommitOptions,
                   hooks: CommitHooks, mapped: frozenset[tuple[int, int]]
                   ) -> tuple[Scan, Diff, list[LayerPlan], Optional[Recognition]]:
    """Walk (or take hooks.changes), diff, plan, and compute the layers' stat-cache keys; with
    --weights-from-origin, the box's hub caches recognised and their references left out. `mapped`:
    the files (st_dev, st_ino) some process maps shared-writable, which the walk's memo does not keep."""
    scan, d = hooks.changes(base_img, index) or box_changes(root, opts.profile, index, opts.rehash, opts.log,
                                                            mapped)
    # Hub blobs as references (with --weights-from-origin, not --upload-origin); the token files never pushed.
    found = origin.recognise_box(root, opts.profile.leaves_out) if opts.weights_from_origin else origin.box_tokens(root)
    references = opts.weights_from_origin and not weights_in_layers(opts)
    if opts.profile.include_secrets:  # the profile keeps secrets: the token files too
        found.secrets = []
    scan, d, found.taken = origin.leave_out(scan, d, found, references=references)
    plans = plan_commit_layers(d, scan, index, opts, len(base_img.layers) if base_img else 0, hooks.plan_memo)
    for plan in plans:
        plan.fingerprint(opts.profile.zstd_level, hooks.plan_memo)
    return scan, d, plans, found


def commit_box(target: str, base: str, opts: Optional[CommitOptions] = None,
               hooks: Optional[CommitHooks] = None) -> CommitResult:
    """Commit the box to `target`, holding the state dir's lock (state.exclusive). `hooks`: what the
    caller answers at the commit's named points (model.CommitHooks; None: snap commit's own)."""
    opts = opts or CommitOptions()
    # The collector paused to the end, not only for the scan and plan (plan_commit): the push
    # allocates little, but each collection of it walked every entry the scan made, ~0.02 s a commit.
    with exclusive(opts.log), gc_paused():
        return _commit_box(target, base, opts, hooks or CommitHooks())


def _commit_box(target: str, base: str, opts: CommitOptions, hooks: CommitHooks) -> CommitResult:
    check_options(opts)
    target_ref = Reference.parse(target)
    if target_ref.digest:
        raise UsageError("commit needs a tag to push to",
                         f"drop the @sha256 part: {target_ref.name}:{target_ref.tag or 'TAG'}")
    transport = opts.transport.credentials_only_for(target_ref.registry)  # --username is for the target's registry
    remote = Remote(target_ref, transport)
    root = os.path.realpath(opts.root)
    if opts.diverge:  # the tag if this box may move it, else a tag of its own
        line = Line(target_ref, transport, root, opts.force, opts.origins, opts.log)
        line.check()
        target_ref, current, tagged = line.ref(line.tag), line.digest, None
        opts = dataclasses.replace(opts, moving=opts.moving or str(line.main))
    else:
        tagged = check_forward(remote, target_ref, root, opts.force, opts.origins)
        current = tagged[0] if tagged else None
    hooks.pushing_to(remote, root, current)  # a held file keeps the version its snapshot has
    cp = plan_commit(base, opts, transport, remote, hooks)
    return push_commit(cp, target_ref, transport, opts, tagged, remote)
