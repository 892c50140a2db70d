"""The watcher's change tracking: what changed in the box since the loop's last scan and since the
last snapshot. Change notifications (box/events.py) say which directories to scan again; without
them (or after some were lost) a scan is of the whole box. The loop's scans read metadata only;
a commit's scan is its own (scan_root), each with its memo (box/memo.py's ScanMemo)."""

from __future__ import annotations

import os
import threading
from typing import Callable, Optional

from snapshotter.box.events import ChangeEvents, EventsUnavailable
from snapshotter.profile import Profile
from snapshotter.box.memo import ScanMemo
from snapshotter.box.scan import Scan, scan_box
from snapshotter.box.writers import Writers, open_for_writing
from snapshotter.commit.commit import own_excludes, scan_root
from snapshotter.commit.model import CommitPlan
from snapshotter.errors import quoted_path
from snapshotter.index.entry import Entry, gc_paused, stat_stamp
from snapshotter.progress import Stopped
from snapshotter.tar.rules import WHITEOUT_PREFIX

from .options import trace


def token(e: Entry) -> tuple:
    """What a change of a path looks like in a metadata scan (stamp: inode, mtime and ctime in ns;
    a new symlink target or xattr changes the ctime, so neither is read)."""
    return (e.kind, e.mode, e.uid, e.gid, e.size, e.stamp)


def tokens_as_snapshotted(scanned: dict[str, tuple], held: dict[str, str], last: dict[str, tuple],
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


class ChangeTracker:
    """The box's paths as the loop last saw them (tokens, since when), as the last snapshot holds
    them (committed), and the directories each next scan must look at again (dirty sets, None for
    all)."""

    def __init__(self, root: str, profile: Profile, tick_memo: ScanMemo, commit_memo: ScanMemo,
                 log: Callable[[str], None]):
        self.root, self.profile, self.log = root, profile, log
        self.tick_memo, self.commit_memo = tick_memo, commit_memo
        self.tokens: dict[str, tuple] = {}  # the last scan
        self.entries: dict[str, Entry] = {}
        self.since: dict[str, float] = {}  # when a path got its current token
        self.committed: Optional[dict[str, tuple]] = None  # tokens of the box as of the last snapshot
        self.committed_changed: dict[str, Entry] = {}  # the last snapshot's changed paths, as its layers hold them
        self.committed_whole = False  # the last snapshot holds the box as its scan saw it (nothing held)
        self.committed_scan: Optional[Scan] = None  # the commit scan the last snapshot was made from
        self.differing: list[str] = []  # paths that differ from the last snapshot, recomputed after a scan or commit
        self.pending_stale = True
        self._linked: tuple[Optional[Scan], list[str]] = (None, [])  # a commit scan's files of more than one name
        # Change notifications: the directories changed since the loop's last scan and since the last
        # commit's, None where a full scan is due (no notifications yet, or some lost).
        self.events: Optional[ChangeEvents] = None
        self.events_tried = False
        self.events_lock = threading.Lock()
        self.tick_dirty: Optional[set[str]] = None
        self.commit_dirty: Optional[set[str]] = None
        self.tick_scan: Optional[Scan] = None  # the loop's last scan, and the last commit's
        self.commit_scan: Optional[Scan] = None
        self.lost_told = False
        self.whiteouts_told: set[str] = set()  # `.wh.*` paths left out and said so (_tell_whiteouts)

    # ---- change notifications ----------------------------------------------------------------

    def start_events(self, enabled: bool, max_watches: Optional[int]) -> None:
        """Watch the box's directories, before its first scan (a change meanwhile is not missed)."""
        self.events_tried = True
        if not enabled:
            return
        profile, extra = self.profile, set(own_excludes(self.root))
        try:
            self.events = ChangeEvents(self.root, lambda rel: rel in extra or bool(profile.exclude.match(rel)),
                                       max_watches)
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

    def drain(self) -> None:
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
    def complete(self) -> bool:
        """Change notifications cover the whole box, none lost: full scans are the safety net only."""
        return self.events is not None and self.events.complete and not self.lost_told

    def mark_dirty(self, dirs) -> None:
        """The next scans (the loop's and the commit's) list these directories again."""
        with self.events_lock:
            for d in (self.tick_dirty, self.commit_dirty):
                if d is not None:
                    d.update(dirs)

    def _take_dirty(self, which: str) -> Optional[set[str]]:
        """The directories to scan again for the loop ('tick') or a commit ('commit'), None for all;
        the set starts again empty (changes from now on are kept for the next scan)."""
        with self.events_lock:
            dirty = getattr(self, f"{which}_dirty")
            setattr(self, f"{which}_dirty", set() if self.events is not None else None)
            return dirty

    # ---- scans --------------------------------------------------------------------------------

    def scan(self, full: bool = True) -> Scan:
        """The loop's metadata scan: of the dirty directories only, unless `full` or none known."""
        dirty = self._take_dirty("tick")
        previous = self.tick_scan
        if full or dirty is None or previous is None:
            dirty = previous = None
        else:
            dirty = dirty | previous.racy_dirs
        try:
            with gc_paused():
                scan = scan_box(self.root, self.profile, own_excludes(self.root), metadata_only=True,
                                memo=self.tick_memo, previous=previous, dirty=dirty, leave_out_whiteouts=True)
        except BaseException:
            with self.events_lock:
                self.tick_dirty = None  # what was taken is lost: the next scan is full
            raise
        self.tick_scan = scan
        self._tell_whiteouts(scan)
        trace(self.log, "scan: the whole box" if dirty is None else f"scan: {len(dirty)} changed directories")
        return scan

    def commit_scan_now(self, final: bool, writers: Optional[Writers] = None,
                        stopping: Optional[threading.Event] = None) -> Scan:
        """A commit's scan: of the directories changed since the last commit's, where notifications
        say which (and the loop's scans saw nothing they missed: their changes are added). The final
        snapshot's is whole where notifications miss some directories: no later full scan finds a
        change made there since the loop's last. The directories of the files some process maps
        shared-writable (`writers`, the commit's: see mapped_dirs) are listed again, and the memo
        keeps none of those files, found by identity (box/scan.py's scan_box). `stopping` set: the
        scan gives up at its next directory (the final snapshot wants the lock)."""
        self.drain()
        dirty = self._take_dirty("commit")
        previous = self.commit_scan
        writers = writers or open_for_writing()
        if dirty is None or previous is None or (final and not self.complete):
            dirty = previous = None
        else:
            dirty = dirty | previous.racy_dirs | self.mapped_dirs(writers) | self.moved_links()
        try:
            scan = scan_root(self.root, self.profile, self.commit_memo, previous, dirty, sink=self.log,
                             mapped=frozenset(writers.mapped_ids), leave_out_whiteouts=True, stopping=stopping)
        except BaseException as e:
            with self.events_lock:
                # Given up for the final snapshot: what was taken is put back, so that its scan too
                # is of the changed directories, not the whole box. Else lost: the next scan is whole.
                gave_up = isinstance(e, Stopped) and dirty is not None and self.commit_dirty is not None
                self.commit_dirty = self.commit_dirty | dirty if gave_up else None
            raise
        self.commit_scan = scan
        self._tell_whiteouts(scan)
        return scan

    def _tell_whiteouts(self, scan: Scan) -> None:
        """Name each path left out for its `.wh.` name, once: `snap commit` refuses such a box, but a
        watcher that stopped for one name would leave the rest of the box unsaved."""
        for rel in scan.whiteout_named:
            if rel not in self.whiteouts_told:
                self.whiteouts_told.add(rel)
                self.log(f"left out: {quoted_path(rel)} (named as an OCI whiteout, {WHITEOUT_PREFIX!r} first: no "
                         f"layer can hold it); rename it to have it in the snapshots")

    def observe(self, scan: Scan, now: float) -> list[str]:
        """Note a scan: paths whose token changed since the last one get `since` = now. A scan of
        some directories compares only the paths it looked at. The directories of what changed are
        scanned again by the next commit (a change only a full scan saw: a write through mmap)."""
        if scan.touched is not None and self.tokens:
            tokens = self.tokens
            changed = []
            for p in scan.touched:
                e = scan.entries.get(p)
                t = token(e) if e is not None else None
                if tokens.get(p) != t:
                    changed.append(p)
                    if t is None:
                        del tokens[p]
                        self.since.pop(p, None)
                    else:
                        tokens[p] = t
        else:
            tokens = {p: token(e) for p, e in scan.entries.items()}
            changed = [p for p, t in tokens.items() if self.tokens.get(p) != t] + [p for p in self.tokens
                                                                                   if p not in tokens]
            for p in [p for p in self.since if p not in tokens]:
                del self.since[p]
        for p in changed:
            if p in tokens:
                self.since[p] = now
        if changed:
            with self.events_lock:
                if self.commit_dirty is not None:
                    self.commit_dirty.update(p.rpartition("/")[0] for p in changed)
        self.tokens, self.entries = tokens, scan.entries
        self.pending_stale = True
        return changed

    def refresh_differing(self, full: bool) -> None:
        """Paths that differ from the last snapshot, compared again after a full scan or a change."""
        if not (full or self.pending_stale):
            return
        self.pending_stale = False
        if self.committed is None:
            self.differing = []
            return
        changed = [p for p, t in self.tokens.items() if self.committed.get(p) != t]
        self.differing = changed + [p for p in self.committed if p not in self.tokens]

    def differing_entries(self) -> dict[str, Entry]:
        return {p: self.entries[p] for p in self.differing if p in self.entries}

    def mapped_dirs(self, writers: Optional[Writers] = None) -> set[str]:
        """The directories of the last commit scan's files some process maps shared-writable (matched
        by inode: the mapping may have been made through another name, a hard link outside the root
        or a bind mount): a write through a mapping sends no notification (and after its first,
        changes no stat data), so the commits look at such files themselves (commit_scan_now). A
        file new since that scan notified its directory when it came."""
        if self.commit_scan is None:
            return set()
        found = (writers or open_for_writing()).maybe_mapped(self.commit_scan.entries)
        return {p.rpartition("/")[0] for p in found}

    def moved_links(self) -> set[str]:
        """The directories of the last commit scan's files of more than one name whose stat data
        moved since: a write through a name no notification covers (a hard link in an excluded
        directory, such as /tmp or a package manager's cache, or outside the root) notifies nothing
        here, so the commits look at those files themselves (an lstat each)."""
        scan = self.commit_scan
        if scan is None:
            return set()
        if self._linked[0] is not scan:
            self._linked = (scan, [p for p, e in scan.entries.items() if e.inode is not None])
        moved = set()
        for p in self._linked[1]:
            try:
                same = stat_stamp(os.lstat(os.path.join(self.root, p))) == scan.entries[p].stamp
            except OSError:
                same = False
            if not same:
                moved.add(p.rpartition("/")[0])
        return moved

    def nothing_new(self) -> bool:
        """The box is as the last snapshot holds it, by the change notifications alone (no scan): the
        last commit scan is that snapshot's, nothing was held back from it, no notification came
        since, none was lost, no path of it changed within the memo's racy window, and no file of
        it is mapped or open for writing (see mapped_dirs), nor of more than one name and moved
        (moved_links)."""
        if not (self.complete and self.committed_whole and self.commit_scan is not None
                and self.commit_scan is self.committed_scan and not self.commit_scan.racy_dirs
                and not self.mapped_dirs() and not self.moved_links()):
            return False
        self.drain()
        with self.events_lock:
            return self.commit_dirty == set() and self.complete

    def racy(self) -> bool:
        """Whether the last snapshot's scan or the last commit scan saw a path changed within the
        memo's racy window: its stat data may be as then while its bytes are not."""
        return any(s is not None and s.racy_dirs for s in (self.committed_scan, self.commit_scan))

    def snapshotted(self, tokens: dict[str, tuple], cp: CommitPlan) -> None:
        """A snapshot is in: the box as it holds it (`tokens`), made from `cp`."""
        self.committed = tokens
        self.committed_whole = not cp.held
        # The scan it was planned from: with --weights-from-origin cp.scan is a copy without the weights.
        self.committed_scan = getattr(cp.hooks, "scan", None) or cp.scan
        self.pending_stale = True
        self.committed_changed = {e.path: e for e in cp.diff.changed}
