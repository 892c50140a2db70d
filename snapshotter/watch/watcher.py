"""`snap watch`: keep a snapshot of the box seconds old in the registry, and flush the rest when
the box is about to be reclaimed.

The loop scans the box's metadata (no file is read) at a pace that keeps its own cost near
SCAN_BUDGET of one core, commits with the commit package's library API when something changed (at
most once per `every`, at once when a burst of writes is over), sends big files ahead as soon as
they are stable, and ends with one final commit on a signal or a provider's reclaim notice. Here
the loop, which composes the parts: tracking.py (what changed), pacing.py (when to look and to
snapshot), bigfiles.py (files being written, sent ahead), tags.py (the immutable tag, then the
moving or the diverged one), hooks.py (what a commit asks of the watcher) and final.py (the end)."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from datetime import datetime, timezone
from typing import Callable, Optional

from snapshotter.box.memo import ScanMemo
from snapshotter.box.scan import Scan
from snapshotter.commit.commit import plan_commit
from snapshotter.commit.model import SCRATCH, CommitOptions, CommitPlan, CommitResult
from snapshotter.commit.push import grown_line, push_commit
from snapshotter.errors import AuthError, SnapError, UsageError, exit_code_of, printable
from snapshotter.layer.memo import PlanMemo
from snapshotter.oci.reference import Reference
from snapshotter.snapshot.files import file_layers
from snapshotter.snapshot.record import restored_at_ns
from snapshotter.state import exclusive

from .bigfiles import BigFiles
from .final import Handover, final_snapshot
from .hooks import WatchHooks
from .options import WatchOptions, trace
from .origin_upload import OriginUpload
from .pacing import Pacing
from .tags import TagMover
from .tracking import ChangeTracker, token, tokens_as_snapshotted


def _target(target: str) -> Reference:
    moving = Reference.parse(target)
    if moving.digest or not moving.tag:
        raise UsageError("watch needs a tag to move", f"drop the @sha256 part: {moving.name}:TAG")
    if len(moving.tag) > 128 - 20:
        raise UsageError(f"tag {moving.tag!r} is too long",
                         "snapshots are tagged TAG-yyyymmddThhmmssZ: use a tag of at most 108 characters")
    return moving


class Watcher:
    """The loop. tick() is one step (scan, maybe send big files ahead, maybe commit); run() calls it
    at the scan pace until stopped; final() is the last commit. Tests drive tick() with their own
    clock."""

    def __init__(self, target: str, base: str, opts: WatchOptions):
        self.opts, self.moving = opts, _target(target)
        opts.check()
        if base != SCRATCH:
            Reference.parse(base)
        self.base, self.root, self.log = base, os.path.realpath(opts.commit.root), opts.log
        self.transport = opts.commit.transport.credentials_only_for(self.moving.registry)
        # force: the plan is not refused for what it deletes; TagMover.judge_deletions sends such a
        # snapshot to a diverged tag. moving: the tag the immutable tags are for.
        self.commit_opts = dataclasses.replace(opts.commit, force=True, log=self.log, moving=str(self.moving))
        # What the last scans learnt of each unchanged path (box/memo.py's ScanMemo): the loop's metadata
        # scans and the commits' full ones each keep their own. On the watcher's clock (file times
        # are compared with it). And what the last plan made of the layers that did not change.
        memo_clock = lambda: int(opts.clock() * 1e9)  # noqa: E731
        self.commit_memo, self.plan_memo = ScanMemo(memo_clock), PlanMemo()
        self.changes = ChangeTracker(self.root, opts.commit.profile, ScanMemo(memo_clock), self.commit_memo, self.log)
        self.big = BigFiles(opts, self.root, self.changes, self.log)
        self.pacing = Pacing(opts, self.big.big, self.log)
        self.tags = TagMover(self.moving, self.transport, self.root, opts.commit.force, opts.commit.origins,
                             self.log, opts.clock)
        self.handover = Handover()
        self.snapshots = 0
        self.origin_uploaded = False  # a snapshot uploaded the hub weights (--weights-from-origin): _options
        self.origin = OriginUpload(self.handover.commit_lock, self.log)  # the referenced weights, sent behind

    # ---- the loop ------------------------------------------------------------------------------

    def tick(self) -> None:
        """One step: scan; send big stable files ahead; commit if due. A registry that fails is
        retried later with a growing delay; the loop goes on."""
        now = self.opts.clock()
        if self.pacing.waiting(now):
            return
        try:
            self._step(now)
            self.pacing.succeeded()
        except UsageError:
            raise  # the user must act: retrying cannot help
        except SnapError as e:  # an outage, a registry error, or credentials that failed (a helper's hiccup)
            self.pacing.failed(now, e)

    def _step(self, now: float) -> None:
        if self.handover.final_started.is_set():
            return  # the final snapshot has the CPU to itself (a 2-core box, a 4 s grace)
        self.tags.line.reconnect()
        if not self.tags.line.checked:
            self.check_lineage()
        if not self.changes.events_tried:
            self.changes.start_events(self.opts.events, self.opts.max_watches)
        if not self._check(now):
            self._origin_step(now)
            return
        first = self.changes.committed is None
        ready = set() if first else self.big.ready(now)
        due, burst_over = self.pacing.due(now), self.pacing.burst_over(now)
        if not (first or ready or due or burst_over):
            return
        with self.handover.commit_lock, exclusive(self.log):  # as a commit: another snap process waits
            stopping = self.handover.loop_commit()
            if stopping is None:
                return  # the final snapshot is on its way
            if ready:
                plan = self._plan(now, False, self._options(), stopping)
                self.big.send_ahead(plan, ready, self.moving, self.transport, stopping)
            if first or due or burst_over:
                self.snapshot(first=first, stopping=stopping)

    def _origin_step(self, now: float) -> None:
        """Nothing else pending (the lowest priority): the weights a snapshot keeps as references are
        sent in the background (origin_upload.py), and once they are in, the snapshot that holds them."""
        up = self.origin
        up.check()
        if not up.referenced or up.running() or self.origin_uploaded:
            return
        with self.handover.commit_lock, exclusive(self.log):
            stopping = self.handover.loop_commit()
            if stopping is None:
                return  # the final snapshot is on its way
            if up.sent:
                self.snapshot(stopping=stopping)
            else:
                up.start(self._plan(now, False, self._options(upload=True), stopping), self.moving, self.transport)

    def _check(self, now: float) -> bool:
        """Scan what may have changed and compare: whether anything is pending. The pace budgets the
        whole check, not the scan alone: comparing a scan's paths with the last ones added about a
        fifth, and an idle watcher went over its 0.5% of a core."""
        t = self.opts.cpu_clock()
        ch = self.changes
        ch.drain()
        full = ch.events is None or ch.tick_dirty is None or now >= self.pacing.next_full_at
        if full or ch.tick_dirty or (ch.tick_scan is not None and ch.tick_scan.racy_dirs):
            self._observe(ch.scan(full), now)
        ch.refresh_differing(full)
        pending = self.big.pending()
        self.pacing.checked(self.opts.cpu_clock() - t, full, now, ch.complete)
        if not pending:
            self.pacing.burst_bytes = 0
        return bool(pending)

    def _observe(self, scan: Scan, now: float) -> list[str]:
        """Note a scan (ChangeTracker.observe) and what it says of the pace."""
        changed = self.changes.observe(scan, now)
        if changed:
            size = sum(scan.entries[p].size for p in changed if p in self.changes.tokens)
            self.pacing.saw(size, self.changes.committed is not None, now)
        return changed

    def next_interval(self) -> float:
        """Seconds to the next step (pacing.py)."""
        return self.pacing.next_interval(self.changes.events is not None, self.changes.complete)

    def run(self, stop: threading.Event, on_ready: Callable[[], None] = lambda: None) -> None:
        """Ready first (a detached watcher's starter returns; the first snapshot of a big box may
        take minutes), then tick at the scan pace until stopped."""
        on_ready()
        self.tick()
        while not stop.wait(self.next_interval()):
            self.tick()

    def check_lineage(self) -> None:
        """Where the snapshots go (tags.py); when that changed, files a restore wrote are read again
        as not being written."""
        if self.tags.check():
            self.big.restored_at = restored_at_ns(self.root)
            if self.commit_opts.weights_from_origin:  # as the target's snapshot has them, never back to references
                self.origin_uploaded = self.origin_uploaded or self.tags.holds_weights()

    # ---- snapshots -----------------------------------------------------------------------------

    def _plan(self, now: float, final: bool, opts: CommitOptions,
              stopping: Optional[threading.Event] = None) -> CommitPlan:
        """A commit planned on a fresh scan, with the files being written held back (hooks.py)."""
        hooks = WatchHooks(self.opts, self.changes, self.big, self.tags, self.plan_memo, now, final, stopping)
        # The target's repository: an index fetched from it serves this watch (index/base.py)
        return plan_commit(self.base, opts, self.transport, self.tags.line.remote(), hooks=hooks)

    def _options(self, upload: bool = False, final: bool = False) -> CommitOptions:
        """With --weights-from-origin the snapshots keep the hub weights as references (a 40 GB box is
        saved in a minute) until the weights are sent in the background (_origin_step); from then on
        they hold them (--upload-origin: self-contained, so an origin that deletes or gates a model
        cannot lose the box), sending nothing big. A final snapshot before that keeps the references,
        to fit in the grace."""
        opts = self.commit_opts
        upload = opts.weights_from_origin and (upload or self.origin_uploaded or (self.origin.sent and not final))
        return dataclasses.replace(opts, upload_origin=True) if upload else opts

    def snapshot(self, first: bool = False, final: bool = False,
                 stopping: Optional[threading.Event] = None) -> Optional[str]:
        """Commit under a new immutable tag, then move the moving tag to it. The immutable tag's
        name, or None when the box matched the moving tag's snapshot already (first, final).
        `stopping` set: the commit gives up at its next chunk (the final snapshot wants the lock)."""
        if self.tags.line.diverged or self.tags.line.restored() or self.tags.stale:
            # Diverged: the moving tag again, or (after a restore here) a new diverged tag. On the moving
            # tag: a restore wrote into the root since the last look (failed half-way: the box no longer
            # came from the tag's snapshot), so the lineage is decided again, as `snap commit` would.
            # Stale: the last look failed before it read the target's snapshot.
            self.check_lineage()
        seq = self.tags.begin()
        now = self.opts.clock()
        last = self.changes.committed or {}
        if final and self.changes.nothing_new():
            return None
        opts = self._options(final=final)  # one view of the weights' send for the plan and the push
        cp = self._plan(now, final, opts, stopping)
        if self.tags.judge_deletions(cp):
            self.check_lineage()
        tag = self.tags.target()
        trace(self.log, f"planned {len(cp.plans)} layer(s)")
        # A held file the last snapshot has stays as it was there: carried, or the base's version.
        # The box as scanned, with what a commit takes out of its layers: the token files, and the weights
        # kept as references (no change: _origin_step sends them behind the changes).
        scanned = {p: token(e) for p, e in {**cp.scan.entries, **(cp.origin.taken if cp.origin else {})}.items()}
        tokens = tokens_as_snapshotted(scanned, cp.held, last, set(cp.held))
        if first and self.tags.is_current(cp):
            self.tags.current = self.tags.current or "its snapshot made before this watcher started"
            self.log(f"{self.tags.line.ref(self.tags.line.tag)} already holds this box: nothing to send")
            self._snapshotted(tokens, now, cp)
            return None
        if final and tokens == self.changes.committed and not (cp.writing or cp.held or self.changes.racy()):
            # One scan, the commit's own, tells: the box is as the last snapshot has it. Not while
            # a file is mapped for writing (its writes after the first change no stat data), nor
            # with a file held back (it is in no snapshot as it is: the line says so), nor with a path
            # changed within the scans' racy window (a later write in its clock tick moves no time).
            return None
        result = push_commit(cp, self.tags.line.ref(tag), self.transport, opts)
        self.origin_uploaded = self.origin_uploaded or opts.upload_origin
        self._pushed(cp, result, tag, seq, scanned, last, now, final)
        return tag

    def _pushed(self, cp: CommitPlan, result: CommitResult, tag: str, seq: int, scanned: dict[str, tuple],
                last: dict[str, tuple], now: float, final: bool) -> None:
        """A snapshot is in the registry under `tag`: say what was held back, move the target tag."""
        # The push may hold back more (files that tore while read) or read one after all: as pushed,
        # a held file is in this snapshot at the last one's version (kept), or pending until taken.
        kept = set(cp.carried) | (cp.unreadable - set(cp.left_unread))
        tokens = tokens_as_snapshotted(scanned, cp.held, last, kept)
        self._tell_held(cp, kept)
        for path, size in sorted(result.grown.items()):
            self.log(grown_line(path, size))
        if cp.held:
            # A file unlike its scan may have changed with no notification (a link made and removed
            # elsewhere moves its ctime): the next scans list its directory again.
            self.changes.mark_dirty(p.rpartition("/")[0] for p in cp.held)
        trace(self.log, f"pushed {tag}")
        moved = self.tags.move(seq, tag, result.manifest_digest)
        if final and moved:
            self.handover.moved = tag  # the box is saved: final.py says so, whatever comes after
        self._snapshotted(tokens, now, cp)
        self.tags.previous_files = file_layers(result.snap_layers)
        self.snapshots += 1
        sent = [layer for layer in result.layers if layer.status == "uploaded"]
        self.log(f"snapshot {result.ref.repository}:{tag} pushed ({len(result.layers)} layers, {len(sent)} sent; "
                 f"{result.sent()}){self.tags.said(tag, moved)}")
        if self.opts.keep and not final:  # round trips the grace has no room for: the next watcher prunes
            self.tags.prune(self.opts.keep)

    def _tell_held(self, cp: CommitPlan, kept: set[str]) -> None:
        for path, why in sorted(cp.held.items()):
            if path in kept:
                what = "kept the last snapshot's version"
            elif path in cp.left_unread:
                what = ("left out: the last snapshot's version shares a layer that changed, or is not in the "
                        "stat cache, and the file is not read while it is written")
            else:
                what = "left out"
            self.log(f"held back: {'/' + path!r} ({why}); {what}; the next snapshot takes it")

    def _snapshotted(self, tokens: dict[str, tuple], now: float, cp: CommitPlan) -> None:
        self.changes.snapshotted(tokens, cp)
        self.origin.snapshotted({p for p in cp.origin.taken if p not in cp.origin.secrets} if cp.origin else set())
        self.pacing.snapshotted(now)

    def final(self, reason: str) -> int:
        """One last commit, bounded by the grace (final.py). The exit code."""
        self.origin.stopping.set()  # the weights' send gives the link to the final snapshot
        return final_snapshot(self, reason)


# ---- running it: signals, notices, exit --------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def watch(target: str, base: str, opts: WatchOptions, on_ready: Callable[[], None] = lambda: None) -> int:
    """Watch until a signal or a reclaim notice, then make the final snapshot. The exit code."""
    watcher = Watcher(target, base, opts)
    stop = threading.Event()
    reason: list[str] = []
    failed: list[BaseException] = []

    def on_signal(signum, _frame) -> None:
        if not reason:
            reason.append(f"signal {signal.Signals(signum).name}")
        stop.set()

    for s in STOP_SIGNALS:
        signal.signal(s, on_signal)

    def loop() -> None:
        try:
            watcher.run(stop, on_ready)
        except BaseException as e:  # a usage or auth error (or a bug): the loop cannot go on
            failed.append(e)
            stop.set()

    def notices() -> None:
        notice = opts.notices
        while notice is not None and not stop.wait(opts.notice_poll):
            found = notice.check(opts.log)
            if found and not reason:
                reason.append(f"reclaim notice: {found}")
                stop.set()

    # Refused before it says it is ready (`--daemon` exits 2 or 4 with the line, not 0): a usage error, or
    # no credentials at all. Later, credentials that fail are retried (tick): the box stays protected.
    try:
        watcher.check_lineage()
    except (UsageError, AuthError):
        raise
    except SnapError:
        pass  # the registry is not reachable yet: the loop checks before its first snapshot, retrying
    threading.Thread(target=loop, name="watch loop", daemon=True).start()
    threading.Thread(target=notices, name="notices", daemon=True).start()
    while not stop.wait(1.0):
        pass
    if failed and not reason:
        # The loop cannot go on (a usage error, or a bug): the box's work is still saved, where it may go,
        # before the exit, whose code says why the loop stopped.
        e = failed[0]
        opts.log(f"snap: error: {e}" if isinstance(e, SnapError) else f"snap: internal error: {type(e).__name__}: {e}")
        if not isinstance(e, UsageError):  # a usage error (a wrong --root, a name no layer holds) would end it too
            watcher.final("the watch loop stopped")
        return exit_code_of(e)
    return watcher.final(reason[0] if reason else "stopped")


def exit_now(code: int) -> None:
    """Exit at once: threads still uploading (a big file sent ahead) are not waited for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def log_line(msg: str, stream=None) -> None:
    """A watch log line: UTC time first (the daemon's log is read after the fact)."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    out, msg = stream or sys.stderr, printable(msg)  # escaped: it carries names from the box and the registry
    out.write(f"{stamp} {msg}\n" if not msg.startswith("snap: error: ") else f"{msg}\n")
    out.flush()

