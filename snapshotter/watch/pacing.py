"""When the watcher looks and when it snapshots: a check's CPU kept near the scan budget (ten times it
while the box is changing), a snapshot at most once per `every` unless a burst of writes has been
over for `quiet` seconds, and a registry that fails retried with a growing delay."""

from __future__ import annotations

from typing import Callable

from snapshotter.errors import SnapError

from .options import WatchOptions

ACTIVE_FACTOR = 10  # scan budget multiplier while the box is changing
EVENT_POLL = 1.0  # seconds between reads of the change notifications
SAFETY_SHARE = 0.5  # of the scan budget, for the full scans while change notifications cover the box


class Pacing:
    """The times the loop goes by (on the watcher's clock)."""

    def __init__(self, opts: WatchOptions, big: int, log: Callable[[str], None]):
        self.opts, self.big, self.log = opts, big, log
        self.last_commit_at = float("-inf")
        self.last_change_at = float("-inf")
        self.changed_since_commit = False  # a change seen since the last snapshot (not a held file still pending)
        self.burst_bytes = 0
        self.retry_at = float("-inf")
        self.backoff = 0.0
        self.check_cost = 0.0  # CPU seconds the last check took (its scan and the comparison with the last ones)
        self.next_full_at = float("-inf")

    def saw(self, changed_bytes: int, after_first: bool, now: float) -> None:
        """A scan found changes (`changed_bytes`: the sizes of the paths that are there now)."""
        self.burst_bytes += changed_bytes
        if after_first:
            self.last_change_at = now
            self.changed_since_commit = True

    def checked(self, cost: float, full: bool, now: float, events_complete: bool) -> None:
        """A check took `cost` CPU seconds; a full one sets when the next full one is due."""
        if full:
            self.check_cost = cost
            self.next_full_at = now + self.full_interval(events_complete)

    def due(self, now: float) -> bool:
        return now - self.last_commit_at >= self.opts.every

    def burst_over(self, now: float) -> bool:
        """Any change is sent once the box has been quiet for `quiet` seconds (counted from the last
        change seen: with notifications, within EVENT_POLL of the write): no reclaim notice may come."""
        return self.changed_since_commit and now - self.last_change_at >= self.opts.quiet

    def snapshotted(self, now: float) -> None:
        self.last_commit_at = now
        self.changed_since_commit = False
        self.burst_bytes = 0

    def full_interval(self, events_complete: bool) -> float:
        """Seconds between full scans: a check's cost stays near the budget, ten times it while the
        box is changing (so the end of a burst is seen soon after it is over). Where change
        notifications cover the whole box, the full scan is the safety net only (a write through
        mmap): SAFETY_SHARE of the budget, never sped up."""
        if events_complete:
            budget = self.opts.scan_budget * SAFETY_SHARE
        else:
            changing = self.opts.clock() - self.last_change_at < 2 * self.opts.quiet or self.burst_bytes >= self.big
            budget = self.opts.scan_budget * (ACTIVE_FACTOR if changing else 1)
        return max(self.opts.min_scan, self.check_cost / max(budget, 1e-6))

    def next_interval(self, events_on: bool, events_complete: bool) -> float:
        """Seconds to the next step: EVENT_POLL with change notifications (a step that finds none
        costs microseconds), else the next full scan's."""
        full = self.full_interval(events_complete)
        interval = min(EVENT_POLL, full) if events_on else full
        wait_retry = self.retry_at - self.opts.clock()
        return max(interval, wait_retry) if wait_retry > 0 else interval

    def waiting(self, now: float) -> bool:
        """A failed step waits out its backoff."""
        return now < self.retry_at

    def succeeded(self) -> None:
        self.backoff = 0.0

    def failed(self, now: float, e: SnapError) -> None:
        """An outage, a registry error, or credentials that failed (a helper's hiccup): tried again
        later, with a growing delay; the loop goes on."""
        self.backoff = min(max(self.backoff * 2, 1.0), max(self.opts.every, 60.0))
        self.retry_at = now + self.backoff
        self.log(f"{e}; trying again in {self.backoff:g}s (the last snapshot stays current)")
