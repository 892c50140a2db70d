"""`snap watch`: keep a snapshot of the box seconds old in the registry, and flush the rest when
the box is about to be reclaimed.

The loop scans the box's metadata (no file is read) at a pace that keeps its own cost near
SCAN_BUDGET of one core, commits with the commit package's library API when something changed (at
most once per `every`, at once when a burst of writes is over), sends big files ahead as soon as
they are stable, and ends with one final commit on a signal or a provider's reclaim notice. Each
snapshot goes under an immutable tag `<tag>-<UTC time>` first; the moving tag is then put on the
same manifest bytes, so it only ever names a complete snapshot. A box that may not move the tag
(snapshot/lineage.py) pushes its snapshots to a tag of its own instead (snapshot/diverged.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Optional

from snapshotter.box.deletions import SYSTEM_TOPS, refuse_commit
from snapshotter.box.events import ChangeEvents, EventsUnavailable
from snapshotter.box.scan import Scan, ScanMemo, scan_box
from snapshotter.box.writers import being_written, last_change, open_for_writing
from snapshotter.commit.commit import changes_in, own_excludes, plan_commit, scan_root
from snapshotter.commit.model import SCRATCH, CommitOptions, CommitPlan
from snapshotter.commit.push import NOT_SENT_TORN, grown_line, push_commit, push_layers, target_remote
from snapshotter.errors import AuthError, SnapError, UsageError, exit_code_of, printable
from snapshotter.index.entry import FILE, Entry, gc_paused
from snapshotter.layer.plan import PlanMemo
from snapshotter.oci.image import BASE_DIGEST, Image, Layer, snapshot_layer_count
from snapshotter.oci.reference import Reference
from snapshotter.registry.remote import Remote
from snapshotter.snapshot.files import file_layers, last_snapshot_files
from snapshotter.snapshot.diverged import Line, own_names, prune
from snapshotter.snapshot.record import restored_at_ns
from snapshotter.state import exclusive

from .notices import NoticeWatcher

MiB = 1024 * 1024
DEFAULT_BIG = 64 * MiB  # files this big are sent ahead and never sent half-written (else: the profile's)
ACTIVE_FACTOR = 10  # scan budget multiplier while the box is changing
ASSUMED_THROUGHPUT = 50 * MiB  # bytes/s to the registry until the watcher has measured it
EVENT_POLL = 1.0  # seconds between reads of the change notifications
SAFETY_SHARE = 0.5  # of the scan budget, for the full scans while change notifications cover the box


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '1h', '1.5m' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|ms)?\s*", str(text))
    if not m:
        raise UsageError(f"duration {text!r} is not valid", "write it as 90s, 5m or 1h")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass
class WatchOptions:
    commit: CommitOptions = field(default_factory=CommitOptions)
    every: float = 300.0  # at most one snapshot per this many seconds (a burst of writes excepted)
    keep: Optional[int] = None  # immutable snapshot tags kept (oldest deleted); None: all
    grace: float = 4.0  # the final commit's time limit after a signal or notice
    notices: Optional[NoticeWatcher] = None
    # Tuning (environment variables so that tests can make them tiny):
    quiet: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_QUIET", 10.0))  # a burst is over after this
    stable: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_STABLE", 5.0))  # a big file is complete after this
    min_scan: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_MIN_SCAN", 2.0))  # seconds between scans, at least
    scan_budget: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_BUDGET", 0.005))  # of one core, for checks
    notice_poll: float = field(default_factory=lambda: _env_seconds("SNAP_NOTICE_POLL", 5.0))
    events: bool = field(default_factory=lambda: os.environ.get("SNAP_WATCH_EVENTS", "1") != "0")  # inotify
    max_watches: Optional[int] = field(default_factory=lambda: int(os.environ["SNAP_WATCH_MAX_WATCHES"])
                                       if os.environ.get("SNAP_WATCH_MAX_WATCHES") else None)  # tests: as the kernel's limit
    log: Callable[[str], None] = lambda msg: None
    clock: Callable[[], float] = time.time  # wall clock (compared with file times); injectable for tests
    cpu_clock: Callable[[], float] = time.thread_time  # CPU, not wall: on a busy machine a check waits, and waiting costs nothing


def _token(e: Entry) -> tuple:
    """What a change of a path looks like in a metadata scan (stamp: inode, mtime and ctime in ns;
    a new symlink target or xattr changes the ctime, so neither is read)."""
    return (e.kind, e.mode, e.uid, e.gid, e.size, e.stamp)


def _tokens_as_snapshotted(scanned: dict[str, tuple], held: dict[str, str], last: dict[str, tuple],
                           kept: set[str]) -> dict[str, tuple]:
    """The box's tokens as a snapshot holds it: each path as scanned (`scanned`: the scan's tokens,
    made once per snapshot), but a held file as the last snapshot had it where this one keeps that
    version (`kept`), else not at all (pending)."""
    tokens = dict(scanned)
    for p in held:
        tokens.pop(p, None)
        if p in last and p in kept:
            tokens[p] = last[p]
    return tokens


class Watcher:
    """The loop's state. tick() is one step (scan, maybe send big files ahead, maybe commit); run()
    calls it at the scan pace until stopped; final() is the last commit. Tests drive tick() with
    their own clock."""

    def __init__(self, target: str, base: str, opts: WatchOptions):
        self.opts = opts
        self.moving = Reference.parse(target)
        if self.moving.digest or not self.moving.tag:
            raise UsageError("watch needs a tag to move", f"drop the @sha256 part: {self.moving.name}:TAG")
        if len(self.moving.tag) > 128 - 20:
            raise UsageError(f"tag {self.moving.tag!r} is too long", "snapshots are tagged TAG-yyyymmddThhmmssZ: use a tag of at most 108 characters")
        if opts.keep is not None and opts.keep < 1:
            raise UsageError("--keep must be at least 1")
        if opts.every < 0 or opts.grace <= 0:
            raise UsageError("--every must be >= 0 and --grace > 0")
        if not os.path.isdir(opts.commit.root):
            raise UsageError(f"root {opts.commit.root!r} does not exist or is not a directory")
        if base != SCRATCH:
            Reference.parse(base)
        self.base = base
        self.root = os.path.realpath(opts.commit.root)
        self.transport = opts.commit.transport.credentials_only_for(self.moving.registry)
        rules = [r.file_layer_min for r in opts.commit.profile.layers if getattr(r, "file_layer_min", None)]
        self.big = min(rules) if rules else DEFAULT_BIG
        self.log = opts.log
        self.lock = threading.Lock()  # one tag move at a time; the newest snapshot wins
        self.seq = 0
        self.moved_seq = 0
        self.last_tag = ""
        self.current: Optional[str] = None  # the immutable tag the moving tag names
        self.tokens: dict[str, tuple] = {}  # the last scan
        self.entries: dict[str, Entry] = {}
        self.since: dict[str, float] = {}  # when a path got its current token
        self.committed: Optional[dict[str, tuple]] = None  # tokens of the box as of the last snapshot
        self.committed_changed: dict[str, Entry] = {}  # the last snapshot's changed paths, as its layers hold them
        self.sent_ahead: dict[str, tuple] = {}  # big files sent before a commit: path -> token sent
        self.last_commit_at = float("-inf")
        self.last_change_at = float("-inf")
        self.changed_since_commit = False  # a change seen since the last snapshot (not a held file still pending)
        self.burst_bytes = 0
        self.retry_at = float("-inf")
        self.backoff = 0.0
        self.check_cost = 0.0  # CPU seconds the last check took (its scan and the comparison with the last ones)
        self.throughput = float(ASSUMED_THROUGHPUT)
        self.prune_refused = False
        self.snapshots = 0
        self.differing: list[str] = []  # paths that differ from the last snapshot, recomputed after a scan or a commit
        self.pending_stale = True
        # What the last scans learnt of each unchanged path (box/scan.py's ScanMemo): the loop's metadata
        # scans and the commits' full ones each keep their own. On the watcher's clock (file times
        # are compared with it).
        memo_clock = lambda: int(opts.clock() * 1e9)  # noqa: E731
        self.tick_memo, self.commit_memo = ScanMemo(memo_clock), ScanMemo(memo_clock)
        self.plan_memo = PlanMemo()  # and what the last plan made of the layers that did not change
        # Change notifications (box/events.py): the directories changed since the loop's last scan and
        # since the last commit's, None where a full scan is due (no notifications yet, or some lost).
        self.events: Optional[ChangeEvents] = None
        self.events_tried = False
        self.events_lock = threading.Lock()
        self.tick_dirty: Optional[set[str]] = None
        self.commit_dirty: Optional[set[str]] = None
        self.tick_scan: Optional[Scan] = None  # the loop's last scan, and the last commit's
        self.commit_scan: Optional[Scan] = None
        self.next_full_at = float("-inf")
        self.lost_told = False
        self.committed_whole = False  # the last snapshot holds the box as its scan saw it (nothing held)
        self.committed_scan: Optional[Scan] = None  # the commit scan the last snapshot was made from
        # Where the snapshots go (the moving tag, or a diverged tag of this box's own), and the layers of one
        # file each of the snapshot that tag names, which keep a file being written at that version (hold.hold_back).
        self.line = Line(self.moving, self.transport, self.root, opts.commit.force, opts.commit.origins, self.log, opts.clock)
        self.previous_files: dict[str, list[Layer]] = {}
        self.restored_at = restored_at_ns(self.root)  # files a restore wrote are not being written
        # One commit at a time: the final snapshot waits for the loop's (and stops it first), so the two
        # never build the same layer file in the state dir at once.
        self.commit_lock = threading.Lock()
        self.final_started = threading.Event()
        self.inflight: Optional[threading.Event] = None  # the loop's commit in flight gives up once set (by final())

    # ---- scanning ------------------------------------------------------------------------------

    def _start_events(self) -> None:
        """Watch the box's directories, before its first scan (a change meanwhile is not missed)."""
        self.events_tried = True
        if not self.opts.events:
            return
        profile, extra = self.opts.commit.profile, set(own_excludes(self.root))
        try:
            self.events = ChangeEvents(self.root, lambda rel: rel in extra or bool(profile.exclude.match(rel)),
                                       self.opts.max_watches)
        except EventsUnavailable as e:
            self.log(f"change notifications: {e}; the box is scanned whole at the CPU budget")
            return
        self._tell_gaps()

    def _tell_gaps(self) -> None:
        """One line per kind of gap: which directories send no change notification, and why."""
        ev = self.events
        if ev is None or not ev.new_gaps:
            return
        by_why: dict[str, list[str]] = {}
        for rel in ev.new_gaps:
            by_why.setdefault(ev.gaps[rel], []).append(rel)
        ev.new_gaps.clear()
        for why, rels in by_why.items():
            more = f" and {len(rels) - 1} more director{'y' if len(rels) == 2 else 'ies'}" if len(rels) > 1 else ""
            self.log(f"change notifications: none from {'/' + rels[0]!r}{more} ({why}); "
                     "changes there are found by scans of the whole box at the CPU budget")

    def _drain(self) -> None:
        """Read the change notifications into both dirty sets; lost ones make both scans full."""
        if self.events is None:
            return
        with self.events_lock:
            dirty, lost = self.events.drain()
            self._tell_gaps()
            if lost:
                if not self.lost_told:
                    self.log(f"change notifications: lost ({lost}); scanning the whole box now, and at the CPU "
                             "budget from now on")
                    self.lost_told = True
                self.tick_dirty = self.commit_dirty = None
                return
            for d in (self.tick_dirty, self.commit_dirty):
                if d is not None:
                    d.update(dirty)

    @property
    def events_complete(self) -> bool:
        """Change notifications cover the whole box, none lost: full scans are the safety net only."""
        return self.events is not None and self.events.complete and not self.lost_told

    def _take_dirty(self, which: str) -> Optional[set[str]]:
        """The directories to scan again for the loop ('tick') or a commit ('commit'), None for all;
        the set starts again empty (changes from now on are kept for the next scan)."""
        with self.events_lock:
            dirty = getattr(self, f"{which}_dirty")
            setattr(self, f"{which}_dirty", set() if self.events is not None else None)
            return dirty

    def _scan(self, full: bool = True) -> Scan:
        """The loop's metadata scan: of the dirty directories only, unless `full` or none known."""
        dirty = self._take_dirty("tick")
        previous = self.tick_scan
        if full or dirty is None or previous is None:
            dirty = previous = None
        else:
            dirty = dirty | previous.racy_dirs
        try:
            with gc_paused():
                scan = scan_box(self.root, self.opts.commit.profile, own_excludes(self.root), metadata_only=True,
                                memo=self.tick_memo, previous=previous, dirty=dirty)
        except BaseException:
            with self.events_lock:
                self.tick_dirty = None
            raise
        self.tick_scan = scan
        self._trace("scan: the whole box" if dirty is None else f"scan: {len(dirty)} changed directories")
        return scan

    def _commit_scan(self, profile, final: bool = False) -> Scan:
        """A commit's scan: of the directories changed since the last commit's, where notifications
        say which (and the loop's scans saw nothing they missed: their changes are added). The final
        snapshot's is whole where notifications miss some directories: no later full scan finds a
        change made there since the loop's last."""
        self._drain()
        dirty = self._take_dirty("commit")
        previous = self.commit_scan
        if dirty is None or previous is None or (final and not self.events_complete):
            dirty = previous = None
        else:
            dirty = dirty | previous.racy_dirs | (self._mapped_dirs() if final else set())
        try:
            scan = scan_root(self.root, profile, self.commit_memo, previous, dirty)
        except BaseException:
            with self.events_lock:
                self.commit_dirty = None
            raise
        self.commit_scan = scan
        return scan

    def _observe(self, scan: Scan, now: float) -> list[str]:
        """Note a scan: paths whose token changed since the last one get `since` = now. A scan of
        some directories compares only the paths it looked at. The directories of what changed are
        scanned again by the next commit (a change only a full scan saw: a write through mmap)."""
        if scan.touched is not None and self.tokens:
            tokens = self.tokens
            changed = []
            for p in scan.touched:
                e = scan.entries.get(p)
                t = _token(e) if e is not None else None
                if tokens.get(p) != t:
                    changed.append(p)
                    if t is None:
                        del tokens[p]
                        self.since.pop(p, None)
                    else:
                        tokens[p] = t
        else:
            tokens = {p: _token(e) for p, e in scan.entries.items()}
            changed = [p for p, t in tokens.items() if self.tokens.get(p) != t] + [p for p in self.tokens if p not in tokens]
            for p in [p for p in self.since if p not in tokens]:
                del self.since[p]
        for p in changed:
            if p in tokens:
                self.since[p] = now
                self.burst_bytes += scan.entries[p].size
        if changed and self.committed is not None:
            self.last_change_at = now
            self.changed_since_commit = True
        if changed:
            with self.events_lock:
                if self.commit_dirty is not None:
                    self.commit_dirty.update(p.rpartition("/")[0] for p in changed)
        self.tokens, self.entries = tokens, scan.entries
        self.pending_stale = True
        return changed

    def _stable(self, e: Entry, now: float) -> bool:
        """Unchanged for `stable` seconds: seen so by the watcher, or its times say so (a restore's
        writing is not a change: after a restore every file has a fresh ctime)."""
        return (now - self.since.get(e.path, now) >= self.opts.stable
                or now - last_change(e, self.restored_at) >= self.opts.stable)

    def _new_big(self, entries: dict[str, Entry]) -> list[Entry]:
        """Big files that are not in the last snapshot as they are now."""
        committed = self.committed or {}
        return [e for e in entries.values() if e.kind == FILE and e.size >= self.big and e.inode is None
                and committed.get(e.path) != _token(e)]

    def _held(self, entries: dict[str, Entry], now: float, final: bool = False, writers_seen: bool = False) -> dict[str, str]:
        """Big files left out of a snapshot's reads, with why: still being written by their times
        (a download that closes between chunks), or (final) too big to send within the grace and not
        sent ahead. The final snapshot trusts the times only where /proc cannot show every writer
        (`writers_seen`: writers.being_written sees them all): a file written and closed a moment
        before the signal is complete, and taken."""
        held = {}
        budget = self.throughput * self.opts.grace / 2
        for e in self._new_big(entries):
            if not self._stable(e, now) and not (final and writers_seen):
                held[e.path] = "still being written"
            elif final and self.sent_ahead.get(e.path) != _token(e) and e.size > budget:
                held[e.path] = f"not sent yet, would not fit in the {self.opts.grace:g}s grace"
        return held

    def _differing(self) -> list[str]:
        """Paths that differ from the last snapshot (every path compared: after a scan or a commit)."""
        if self.committed is None:
            return []
        changed = [p for p, t in self.tokens.items() if self.committed.get(p) != t]
        return changed + [p for p in self.committed if p not in self.tokens]

    def _pending(self) -> list[str]:
        """Paths that differ from the last snapshot, big files being written left aside (asked at each
        step: a big file becomes stable with no new notification)."""
        if self.committed is None:
            return ["(first snapshot)"]
        entries = {p: self.entries[p] for p in self.differing if p in self.entries}
        held = self._held(entries, self.opts.clock())
        return [p for p in self.differing if p not in held]

    # ---- the loop ------------------------------------------------------------------------------

    def tick(self) -> None:
        """One step: scan; send big stable files ahead; commit if due. A registry that fails is
        retried later with a growing delay; the loop goes on."""
        now = self.opts.clock()
        if now < self.retry_at:
            return
        try:
            self._step(now)
            self.backoff = 0.0
        except UsageError:
            raise  # the user must act: retrying cannot help
        except SnapError as e:  # an outage, a registry error, or credentials that failed (a helper's hiccup)
            self.backoff = min(max(self.backoff * 2, 1.0), max(self.opts.every, 60.0))
            self.retry_at = now + self.backoff
            self.log(f"{e}; trying again in {self.backoff:g}s (the last snapshot stays current)")

    def _step(self, now: float) -> None:
        # The pace budgets the whole check, not the scan alone: comparing a scan's paths with the
        # last ones added about a fifth, and an idle watcher went over its 0.5% of a core.
        if self.final_started.is_set():
            return  # the final snapshot has the CPU to itself (a 2-core box, a 4 s grace)
        if not self.line.checked:
            self._check_lineage()
        if not self.events_tried:
            self._start_events()
        t = self.opts.cpu_clock()
        self._drain()
        full = self.events is None or self.tick_dirty is None or now >= self.next_full_at
        if full or self.tick_dirty or (self.tick_scan is not None and self.tick_scan.racy_dirs):
            self._observe(self._scan(full), now)
        if full or self.pending_stale:
            self.differing = self._differing()
            self.pending_stale = False
        pending = self._pending()
        cost = self.opts.cpu_clock() - t
        if full:
            self.check_cost = cost
            self.next_full_at = now + self._full_interval()
        if not pending:
            self.burst_bytes = 0
            return
        first = self.committed is None
        ready = set() if first else self._ready_to_send(now)
        due = now - self.last_commit_at >= self.opts.every
        # Any change is sent once the box has been quiet for `quiet` seconds (counted from the last
        # change seen: with notifications, within EVENT_POLL of the write): no reclaim notice may come.
        burst_over = self.changed_since_commit and now - self.last_change_at >= self.opts.quiet
        if not (first or ready or due or burst_over):
            return
        with self.commit_lock, exclusive(self.log):  # as a commit does: another snap process on the state dir waits
            with self.lock:
                if self.final_started.is_set():
                    return  # the final snapshot is on its way
                self.inflight = stopping = threading.Event()
            if ready:
                self._send_ahead(now, ready, stopping)
            if first or due or burst_over:
                self._snapshot(first=first, stopping=stopping)

    def _full_interval(self) -> float:
        """Seconds between full scans: a check's cost stays near the budget, ten times it while the
        box is changing (so the end of a burst is seen soon after it is over). Where change
        notifications cover the whole box, the full scan is the safety net only (a write through
        mmap): SAFETY_SHARE of the budget, never sped up."""
        if self.events_complete:
            budget = self.opts.scan_budget * SAFETY_SHARE
        else:
            changing = self.opts.clock() - self.last_change_at < 2 * self.opts.quiet or self.burst_bytes >= self.big
            budget = self.opts.scan_budget * (ACTIVE_FACTOR if changing else 1)
        return max(self.opts.min_scan, self.check_cost / max(budget, 1e-6))

    def next_interval(self) -> float:
        """Seconds to the next step: EVENT_POLL with change notifications (a step that finds none
        costs microseconds), else the next full scan's."""
        interval = min(EVENT_POLL, self._full_interval()) if self.events is not None else self._full_interval()
        wait_retry = self.retry_at - self.opts.clock()
        return max(interval, wait_retry) if wait_retry > 0 else interval

    def run(self, stop: threading.Event, on_ready: Callable[[], None] = lambda: None) -> None:
        """Ready first (a detached watcher's starter returns; the first snapshot of a big box may
        take minutes), then tick at the scan pace until stopped."""
        on_ready()
        self.tick()
        while not stop.wait(self.next_interval()):
            self.tick()

    # ---- sending -------------------------------------------------------------------------------

    def _plan(self, now: float, final: bool) -> tuple[CommitOptions, CommitPlan]:
        """A commit planned on a fresh scan, with the files being written held back (hold.hold_back):
        open for writing and changed within `stable` seconds, big ones still changing, and (final)
        big ones that would not fit in the grace. cp.held says which and why."""
        opts = self.opts.commit

        def changes(base_img: Image, index: dict[str, Entry]):
            scan = self._commit_scan(opts.profile, final)
            return scan, changes_in(scan, self.root, opts.profile, index, opts.rehash)

        def hold(scan: Scan) -> dict[str, str]:
            writers = open_for_writing()
            held = self._held(scan.entries, now, final, writers.complete)
            held.update(being_written(scan, self.root, self.opts.stable, now, writers,
                                      restored_at=restored_at_ns(self.root)))
            return held

        # force: the plan is not refused for what it deletes; _judge_deletions sends such a snapshot to a diverged tag.
        opts = dataclasses.replace(opts, force=True, changes=changes, log=self.log, plan_memo=self.plan_memo, hold=hold,
                                   previous=lambda: self.previous_files, old_entries=self.committed_changed)
        return opts, plan_commit(self.base, opts, self.transport)

    def _ready_to_send(self, now: float) -> set[str]:
        """Big new files that are complete (stable) and not sent yet (among the paths that differ)."""
        entries = {p: self.entries[p] for p in self.differing if p in self.entries}
        return {e.path for e in self._new_big(entries)
                if self._stable(e, now) and self.sent_ahead.get(e.path) != _token(e)}

    def _send_ahead(self, now: float, ready: set[str], stopping: Optional[threading.Event] = None) -> None:
        """Upload the layers of big files that are ready, before the commit that will name them:
        that commit then finds their blobs in the registry."""
        _, cp = self._plan(now, False)
        plans = [p for p in cp.plans if (p.part_of[0] if p.part_of else p.detail) in ready]
        if not plans:
            return
        remote = target_remote(cp, self.moving, self.transport)
        if stopping is not None:
            remote.stopping = stopping
        t = time.monotonic()
        results = push_layers(cp, remote, plans)
        cp.cache.save(keep_old=True)
        sent = sum(b.size for _, b, status in results if status == "uploaded")
        if sent > 16 * MiB:
            self.throughput = sent / max(time.monotonic() - t, 1e-3)
        for plan, blob, status in results:
            path = plan.part_of[0] if plan.part_of else plan.detail
            if status == NOT_SENT_TORN:
                self.log(f"not sent ahead: {plan.label!r} (a file changed while read; tried again later)")
                continue
            self.sent_ahead[path] = _token(cp.scan.entries[path])
            self.log(f"sent ahead: {plan.label!r} ({blob.size} bytes, {status})")
            for grown, size in sorted(blob.grown.items()):
                self.log(grown_line(grown, size))

    def _tag_name(self) -> str:
        stamp = datetime.fromtimestamp(self.opts.clock(), timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        name = f"{self.moving.tag}-{stamp}"
        n = 1
        while name <= self.last_tag and self.last_tag.startswith(f"{self.moving.tag}-{stamp}"):
            n += 1
            name = f"{self.moving.tag}-{stamp}-{n}"
        self.last_tag = name
        return name

    def _snapshot(self, first: bool = False, final: bool = False,
                  stopping: Optional[threading.Event] = None) -> Optional[str]:
        """Commit under a new immutable tag, then move the moving tag to it. The immutable tag's
        name, or None when the box matched the moving tag's snapshot already (first, final).
        `stopping` set: the commit gives up at its next chunk (the final snapshot wants the lock)."""
        if self.line.diverged:
            self._check_lineage()  # the moving tag again, or (after a restore here) a new diverged tag
        with self.lock:  # the worker's and the final snapshot's may overlap
            self.seq += 1
            seq = self.seq
        now = self.opts.clock()
        last = self.committed or {}
        if final and self._nothing_new():
            return None
        opts, cp = self._plan(now, final)
        self._judge_deletions(cp)
        with self.lock:
            tag = self.line.diverged or self._tag_name()
        held = cp.held
        self._trace(f"planned {len(cp.plans)} layer(s)")
        # A held file the last snapshot has stays as it was there: carried, or the base's version.
        scanned = {p: _token(e) for p, e in cp.scan.entries.items()}
        tokens = _tokens_as_snapshotted(scanned, held, last, set(held))
        if first and self._is_current(cp):
            self.current = self.current or "its snapshot made before this watcher started"
            self.log(f"{self.line.ref(self.line.tag)} already holds this box: nothing to send")
            self._committed(tokens, now, cp)
            return None
        if final and tokens == self.committed:
            return None  # one scan, the commit's own, tells: the box is as the last snapshot has it
        ref = self.line.ref(tag)
        result = push_commit(cp, ref, self.transport, dataclasses.replace(opts, stopping=stopping, moving=str(self.moving)))
        # The push may hold back more (files that tore while read) or read one after all: as pushed,
        # a held file is in this snapshot at the last one's version (kept), or pending until taken.
        kept = set(cp.carried) | (cp.unreadable - set(cp.left_unread))
        tokens = _tokens_as_snapshotted(scanned, held, last, kept)
        for path, why in sorted(held.items()):
            if path in kept:
                what = "kept the last snapshot's version"
            elif path in cp.left_unread:
                what = ("left out: the last snapshot's version shares a layer that changed, or is not in the "
                        "stat cache, and the file is not read while it is written")
            else:
                what = "left out"
            self.log(f"held back: {'/' + path!r} ({why}); {what}; the next snapshot takes it")
        for path, size in sorted(result.grown.items()):
            self.log(grown_line(path, size))
        if held:
            # A file unlike its scan may have changed with no notification (a link made and removed
            # elsewhere moves its ctime): the next scans list its directory again.
            with self.events_lock:
                for d in (self.tick_dirty, self.commit_dirty):
                    if d is not None:
                        d.update(p.rpartition("/")[0] for p in held)
        self._trace(f"pushed {tag}")
        with self.lock:
            moved = seq > self.moved_seq
            if moved:
                if tag == self.line.diverged:
                    self.line.digest = result.manifest_digest
                else:
                    self.line.move(result.manifest_digest)
                self.moved_seq, self.current = seq, tag
                self._trace(f"moved {self.line.tag} to {tag}")
        self._committed(tokens, now, cp)
        self.previous_files = file_layers(result.snap_layers)
        self.snapshots += 1
        sent = [layer for layer in result.layers if layer.status == "uploaded"]
        if self.line.diverged:
            said = f"; {self.line.note()}" + (f"; {self.line.diverged} names it" if tag != self.line.diverged else "")
        else:
            said = f"; {self.moving.tag} moved to it" if moved else ""
        self.log(f"snapshot {ref.repository}:{tag} pushed ({len(result.layers)} layers, {len(sent)} sent; "
                 f"{result.sent()}){said}")
        if self.opts.keep:
            self._prune()
        return tag

    def _judge_deletions(self, cp: CommitPlan) -> None:
        """A snapshot that deletes a system directory of the base (box/deletions.py: `rm -rf
        /usr/share/doc`) is still saved, but to the box's diverged tag, never the moving tag (unless
        --force); once the box no longer deletes it, the moving tag is the target again where this box
        may move it. One without the base's /bin, /etc or /usr is a wrong --root, not a box: refused
        (exit 2), as commit does."""
        d = cp.deletes
        if d is not None and d.deletes_system and not self.opts.commit.force:
            if any(t in SYSTEM_TOPS for t in d.top):
                refuse_commit(self.root, d)
            self.line.refuse(f"the box deletes {d.describe()}")
        elif self.line.allow():
            self._check_lineage()

    def _mapped_dirs(self) -> set[str]:
        """The directories of the box's files some process holds open for writing or maps
        shared-writable: a write through a mapping sends no notification, so the final snapshot,
        which no later full scan follows, looks at them itself."""
        return {p.rpartition("/")[0] for p in open_for_writing().under(self.root)}

    def _nothing_new(self) -> bool:
        """The box is as the last snapshot holds it, by the change notifications alone (no scan): the
        last commit scan is that snapshot's, nothing was held back from it, no notification came
        since, none was lost, no path of it changed within the memo's racy window, and no file of
        it is mapped or open for writing (see _mapped_dirs)."""
        if not (self.events_complete and self.committed_whole and self.commit_scan is not None
                and self.commit_scan is self.committed_scan and not self.commit_scan.racy_dirs
                and not self._mapped_dirs()):
            return False
        self._drain()
        with self.events_lock:
            return self.commit_dirty == set() and self.events_complete

    def _check_lineage(self) -> None:
        """Where the snapshots go (snapshot/diverged.py's Line: the moving tag while this box came from or
        made what it names, else a diverged tag of its own); when that changed, the layers of one file
        each of the snapshot the target tag names are what a file being written is kept at."""
        if self.line.check():
            self.previous_files = last_snapshot_files(self.line.remote(), self.root, self.line.digest)
            self.restored_at = restored_at_ns(self.root)

    def _trace(self, msg: str) -> None:
        """Progress markers for tests that kill the watcher at chosen moments (SNAP_WATCH_TRACE=1)."""
        if os.environ.get("SNAP_WATCH_TRACE"):
            self.log(f"trace: {msg}")

    def _committed(self, tokens: dict[str, tuple], now: float, cp: CommitPlan) -> None:
        self.committed = tokens
        self.committed_whole = not cp.held
        self.changed_since_commit = False
        self.committed_scan = cp.scan
        self.pending_stale = True
        self.committed_changed = {e.path: e for e in cp.diff.changed}
        self.last_commit_at = now
        self.burst_bytes = 0

    def _is_current(self, cp: CommitPlan) -> bool:
        """Whether the moving tag already names this box: every layer known unchanged, the same
        layers and base in its manifest."""
        known = [cp.known(p) for p in cp.plans]
        if any(k is None for k in known):
            return False
        remote = Remote(self.moving, self.transport)
        digest = remote.manifest_digest(self.line.tag)
        if digest is None:
            return False
        img = remote.resolve(digest)
        count = snapshot_layer_count(img)
        ours = [d["digest"] for d in img.layers[len(img.layers) - count:]] if count else []
        base_digest = cp.base_img.manifest_digest if cp.base_img else None
        carried = [layer.digest for layers in cp.carried.values() for layer in layers]
        return (img.manifest.get("annotations", {}).get(BASE_DIGEST) == base_digest
                and sorted(ours) == sorted([k["digest"] for k in known] + carried))

    def snapshot_tags(self, tags: list[str]) -> list[str]:
        """This watch's immutable tags among `tags`, oldest first."""
        pat = re.compile(re.escape(self.moving.tag) + r"-(\d{8}T\d{6}Z)(?:-(\d+))?$")
        found = [(m.group(1), int(m.group(2) or 1), t) for t in tags if (m := pat.match(t))]
        return [t for _, _, t in sorted(found)]

    def _prune(self) -> None:
        """Delete the oldest immutable snapshots beyond --keep, and the oldest of the diverged tags this
        box made beyond it (snapshot/diverged.py), never one that the moving tag, a kept tag or this
        box's target names."""
        if self.prune_refused:
            return
        remote = Remote(self.moving, self.transport)
        tags = remote.list_tags()
        series = [self.snapshot_tags(tags), own_names(remote, self.moving.tag, self.root, tags)]
        if not prune(remote, series, self.opts.keep, [self.moving.tag, self.line.tag], self.log):
            self.prune_refused = True
            self.log(f"--keep: registry {self.moving.registry} does not allow deleting manifests "
                     "(storage.delete.enabled in its config); older snapshots stay")

    # ---- the end -------------------------------------------------------------------------------

    def final(self, reason: str) -> int:
        """One last commit, bounded by the grace. 0 when it is in (or nothing changed), else the
        exit code of what stopped it; the moving tag names a complete snapshot either way."""
        self.log(f"{reason}: final snapshot (grace {self.opts.grace:g}s)")
        box: dict = {}
        done = threading.Event()

        def work() -> None:
            try:
                with self.lock:  # a snapshot of the loop in flight gives up: this one replaces it
                    self.final_started.set()
                    if self.inflight is not None:
                        self.inflight.set()
                with self.commit_lock, exclusive(self.log):
                    if not self.line.checked:
                        self._check_lineage()
                    box["tag"] = self._snapshot(final=True)
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="final snapshot", daemon=True).start()
        target, last = self.line.tag, "its last snapshot" if self.current == self.line.tag else self.current
        current = f"{target} still names {last}" if self.current else f"{target} was not moved"
        if not done.wait(self.opts.grace):
            self._error(f"the final snapshot did not finish within the {self.opts.grace:g}s grace ({current})")
            return 1
        if "error" in box:
            e = box["error"]
            self._error(f"the final snapshot failed: {e} ({current})")
            return exit_code_of(e)
        where, note = self.line.ref(self.line.tag), f" ({self.line.note()})" if self.line.diverged else ""
        if box["tag"] is None:
            self.log(f"nothing changed since {self.current or 'the last snapshot'}: {where} is current{note}")
        else:
            self.log(f"final snapshot {box['tag']} pushed; {where} names it{note}")
        return 0

    def _error(self, msg: str) -> None:
        self.log(f"snap: error: {msg}")


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
            found = notice.check()
            if found and not reason:
                reason.append(f"reclaim notice: {found}")
                stop.set()

    # Refused before it says it is ready (`--daemon` exits 2 or 4 with the line, not 0): a usage error, or
    # no credentials at all. Later, credentials that fail are retried (tick): the box stays protected.
    try:
        watcher._check_lineage()
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

