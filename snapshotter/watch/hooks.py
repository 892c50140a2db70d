"""What the watcher answers at a commit's named points (commit/model.py's CommitHooks): the commit
scans what the change tracker says changed, holds back the files being written (big ones by the
watcher's own view, the rest as commit does), and keeps a held file at the version of the snapshot
the target tag names."""

from __future__ import annotations

import threading
from typing import Optional

from snapshotter.box.scan import Scan
from snapshotter.box.writers import being_written, open_for_writing
from snapshotter.commit.commit import changes_in
from snapshotter.commit.model import CommitHooks
from snapshotter.index.entry import Entry
from snapshotter.layer.memo import PlanMemo
from snapshotter.oci.image import Image, Layer
from snapshotter.progress import Stopped
from snapshotter.snapshot.record import restored_at_ns

from .bigfiles import BigFiles
from .options import WatchOptions
from .tags import TagMover
from .tracking import ChangeTracker


class WatchHooks(CommitHooks):
    """One commit's answers, at `now` on the watcher's clock; `final`: the final snapshot's."""

    def __init__(self, opts: WatchOptions, changes: ChangeTracker, big: BigFiles, tags: TagMover, memo: PlanMemo,
                 now: float, final: bool, stopping: Optional[threading.Event] = None):
        super().__init__(opts.after_read)
        self.opts, self.tracker, self.big, self.tags = opts, changes, big, tags
        self.now, self.final = now, final
        self.plan_memo, self.stopping = memo, stopping
        self.scan: Optional[Scan] = None  # the commit scan this commit is planned from (changes)

    def changes(self, base_img: Optional[Image], index: dict[str, Entry]):
        # A loop's commit gives up as soon as the final snapshot wants the lock: not only at its push,
        # after a scan and a plan the final then makes again, in its grace.
        scan = self.scan = self.tracker.commit_scan_now(self.final, self.writers, self.stopping)
        if self.stopping is not None and self.stopping.is_set():
            raise Stopped()
        commit = self.opts.commit
        return scan, changes_in(scan, self.tracker.root, commit.profile, index, commit.rehash)

    def hold(self, scan: Scan, root: str) -> dict[str, str]:
        """Open for writing and changed within `stable` seconds, big ones still changing, and (final)
        big ones that would not fit in the grace."""
        writers = self.writers or open_for_writing()
        held = self.big.held(scan.entries, self.now, self.final, writers.complete)
        held.update(being_written(scan, root, self.opts.stable, self.now, writers, restored_at=restored_at_ns(root)))
        return held

    def previous_files(self) -> dict[str, list[Layer]]:
        return self.tags.previous_files

    def old_entry(self, path: str) -> Optional[Entry]:
        return self.tracker.committed_changed.get(path)
