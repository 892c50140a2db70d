"""The watcher's big files (weights, checkpoints): one is never read while it is being written,
is sent ahead of the snapshot that will name it once it is stable, and is left out of a final
snapshot it would not fit in (the grace)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from snapshotter.box.writers import last_change
from snapshotter.commit.model import CommitPlan
from snapshotter.commit.push import grown_line, push_layers, target_remote
from snapshotter.commit.sender import NOT_SENT_TORN
from snapshotter.index.entry import FILE, Entry
from snapshotter.oci.reference import Reference
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.record import restored_at_ns

from .options import WatchOptions
from .tracking import ChangeTracker, token

MiB = 1024 * 1024
DEFAULT_BIG = 64 * MiB  # files this big are sent ahead and never sent half-written (else: the profile's)
ASSUMED_THROUGHPUT = 50 * MiB  # bytes/s to the registry until the watcher has measured it


class BigFiles:
    """Which big files are stable, held back or ready to send ahead, by the tracker's view of the box."""

    def __init__(self, opts: WatchOptions, root: str, changes: ChangeTracker, log: Callable[[str], None]):
        self.opts, self.changes, self.log = opts, changes, log
        rules = [r.file_layer_min for r in opts.commit.profile.layers if getattr(r, "file_layer_min", None)]
        self.big = min(rules) if rules else DEFAULT_BIG
        self.throughput = float(ASSUMED_THROUGHPUT)
        self.sent_ahead: dict[str, tuple] = {}  # big files sent before a commit: path -> token sent
        self.restored_at = restored_at_ns(root)  # files a restore wrote are not being written

    def stable(self, e: Entry, now: float) -> bool:
        """Unchanged for `stable` seconds: seen so by the watcher, or its times say so (a restore's
        writing is not a change: after a restore every file has a fresh ctime)."""
        return (now - self.changes.since.get(e.path, now) >= self.opts.stable
                or now - last_change(e, self.restored_at) >= self.opts.stable)

    def new(self, entries: dict[str, Entry]) -> list[Entry]:
        """Big files that are not in the last snapshot as they are now."""
        committed = self.changes.committed or {}
        return [e for e in entries.values() if e.kind == FILE and e.size >= self.big and e.inode is None
                and committed.get(e.path) != token(e)]

    def held(self, entries: dict[str, Entry], now: float, final: bool = False,
             writers_seen: bool = False) -> dict[str, str]:
        """Big files left out of a snapshot's reads, with why: still being written by their times
        (a download that closes between chunks), or (final) too big to send within the grace and not
        sent ahead. The final snapshot trusts the times only where /proc cannot show every writer
        (`writers_seen`: writers.being_written sees them all): a file written and closed a moment
        before the signal is complete, and taken."""
        held = {}
        budget = self.throughput * self.opts.grace / 2
        for e in self.new(entries):
            if not self.stable(e, now) and not (final and writers_seen):
                held[e.path] = "still being written"
            elif final and self.sent_ahead.get(e.path) != token(e) and e.size > budget:
                held[e.path] = f"not sent yet, would not fit in the {self.opts.grace:g}s grace"
        return held

    def pending(self) -> list[str]:
        """Paths that differ from the last snapshot, big files being written left aside (asked at each
        step: a big file becomes stable with no new notification)."""
        if self.changes.committed is None:
            return ["(first snapshot)"]
        held = self.held(self.changes.differing_entries(), self.opts.clock())
        return [p for p in self.changes.differing if p not in held]

    def ready(self, now: float) -> set[str]:
        """Big new files that are complete (stable) and not sent yet (among the paths that differ)."""
        return {e.path for e in self.new(self.changes.differing_entries())
                if self.stable(e, now) and self.sent_ahead.get(e.path) != token(e)}

    def send_ahead(self, cp: CommitPlan, ready: set[str], target: Reference, transport: TransportOptions,
                   stopping: Optional[threading.Event] = None) -> None:
        """Upload the layers of big files that are ready (planned in `cp`), before the commit that will
        name them: that commit then finds their blobs in the registry."""
        plans = [p for p in cp.plans if (p.part_of[0] if p.part_of else p.detail) in ready]
        if not plans:
            return
        remote = target_remote(cp, target, transport)
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
            self.sent_ahead[path] = token(cp.scan.entries[path])
            self.log(f"sent ahead: {plan.label!r} ({blob.size} bytes, {status})")
            for grown, size in sorted(blob.grown.items()):
                self.log(grown_line(grown, size))
