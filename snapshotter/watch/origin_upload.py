"""`snap watch --weights-from-origin`: after a snapshot that keeps the hub weights as references, their
layers are sent to the registry in the background, at the lowest priority (started only when no
change is pending, and never holding the commit lock while it sends: a change made meanwhile gets its
snapshot at once). Once every one is in, the watcher's next snapshot holds them (--upload-origin) and
sends nothing big: it finds their blobs in the registry through the stat cache, as a big file sent
ahead (bigfiles.py)."""

from __future__ import annotations

import threading
from typing import Callable, Optional

from snapshotter.commit.model import CommitPlan
from snapshotter.commit.push import push_layers, target_remote
from snapshotter.commit.sender import NOT_SENT_TORN
from snapshotter.errors import SnapError, storage_error
from snapshotter.layer.plan import LayerPlan
from snapshotter.oci.reference import Reference
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.statcache import StatCache
from snapshotter.state import exclusive


def weight_plans(cp: CommitPlan) -> list[LayerPlan]:
    """The layers of a plan made with --upload-origin that hold a hub blob the box keeps as a reference."""
    blobs = {r.blob_path for r in cp.origin.references} if cp.origin else set()
    return [p for p in cp.plans if (p.part_of and p.part_of[0] in blobs) or any(e.path in blobs for e in p.entries)]


class OriginUpload:
    """The background send of the referenced weights: owed after a snapshot with references, then
    running, then `sent` (the next snapshot holds them) or failed (told at the next tick, retried,
    reading only the layers that did not go up: the stat cache keeps those that did)."""

    def __init__(self, commit_lock: threading.Lock, log: Callable[[str], None]):
        self.commit_lock, self.log = commit_lock, log
        self.referenced: set[str] = set()  # the hub blobs the last snapshot keeps as references
        self.sent_blobs: set[str] = set()  # those whose layers a finished send put in the registry
        # Set by the final snapshot: the send gives up at its next chunk. One per send: a failed send
        # sets its own (push_layers stops its other layers), which must not stop the next try.
        self.stopping = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[SnapError] = None

    @property
    def sent(self) -> bool:
        """Every weight the last snapshot keeps as a reference is in the registry: the next snapshot
        may hold them without sending them (a blob downloaded since is owed until a send covers it)."""
        return bool(self.referenced) and self.referenced <= self.sent_blobs

    def snapshotted(self, referenced: set[str]) -> None:
        """A snapshot is in, keeping these hub blobs as references (none once it holds them)."""
        self.referenced = set(referenced)

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def check(self) -> None:
        """A send that failed: its error, once (the tick backs off and the next idle one tries again)."""
        if self.error is not None and not self.running():
            error, self.error, self.thread = self.error, None, None
            raise error

    def start(self, cp: CommitPlan, target: Reference, transport: TransportOptions) -> None:
        """Send the weights' layers of `cp` (planned with --upload-origin) in a thread of their own."""
        plans = weight_plans(cp)
        covered = {r.blob_path for r in cp.origin.references} if cp.origin else set()
        if not plans:
            self.sent_blobs |= covered  # nothing to send: the next snapshot holds the box as it is
            return
        remote = target_remote(cp, target, transport)
        self.stopping = remote.stopping = threading.Event()
        self.log(f"sending {len(plans)} layer(s) of hub weights to the registry in the background")
        self.thread = threading.Thread(target=self._send, args=(cp, remote, plans, covered), name="origin upload",
                                       daemon=True)
        self.thread.start()

    def _send(self, cp: CommitPlan, remote, plans: list[LayerPlan], covered: set[str]) -> None:
        results = None
        try:
            results = push_layers(cp, remote, plans)
        except SnapError as e:
            self.error = e
        except BaseException as e:  # noqa: BLE001 - stopped by the final snapshot, or a bug: told, tried again
            self.error = SnapError(f"the hub weights were not sent: {type(e).__name__}: {e}")
        torn = [plan.label for plan, _, status in results or [] if status == NOT_SENT_TORN]
        # Recorded after any snapshot made meanwhile (each keeps only the layers it used): the next
        # snapshot's plan finds the weights' layers in the stat cache, and their blobs in the registry.
        # A failed send's too: push_layers notes a layer there only once the registry has its blob,
        # so a retry reads only the weights of the layers that did not go up.
        # Noted sent under the commit lock: a snapshot plans and pushes with one view of it.
        try:
            with self.commit_lock, exclusive(self.log):
                cache = StatCache(cp.root, cp.cache.key["base"])
                cache.new.update(cp.cache.new)
                cache.save(keep_old=True)
                if results is not None and not torn:
                    self.sent_blobs |= covered
        except (SnapError, OSError) as e:  # the stat cache's file on a full disk: an error, not a dead thread
            self.error = self.error or (e if isinstance(e, SnapError) else storage_error(e, "the state dir"))
        if results is None or self.error is not None:
            return
        if torn:
            self.log(f"hub weights not sent: {torn!r} changed while read; tried again later")
            return
        self.log(f"hub weights sent to the registry ({sum(b.size for _, b, _ in results)} bytes): "
                 "the next snapshot holds them")
