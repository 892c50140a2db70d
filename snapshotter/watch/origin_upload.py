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
from snapshotter.commit.push import NOT_SENT_TORN, push_layers, target_remote
from snapshotter.errors import SnapError
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
    """The background send of the referenced weights: `owed` after a snapshot with references, then
    running, then `sent` (the next snapshot holds them) or failed (told at the next tick, retried)."""

    def __init__(self, commit_lock: threading.Lock, log: Callable[[str], None]):
        self.commit_lock, self.log = commit_lock, log
        self.owed = False  # the last snapshot keeps hub weights as references
        self.sent = False  # every referenced weight's layer is in the registry
        self.stopping = threading.Event()  # the final snapshot started: the send gives up at its next chunk
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[SnapError] = None

    def snapshotted(self, references: bool) -> None:
        """A snapshot is in: whether it keeps weights as references (then they are owed, if not sent)."""
        self.owed = references and not self.sent

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
        if not plans:
            self.sent = True  # nothing to send: the next snapshot holds the box as it is
            return
        remote = target_remote(cp, target, transport)
        remote.stopping = self.stopping
        self.log(f"sending {len(plans)} layer(s) of hub weights to the registry in the background")
        self.thread = threading.Thread(target=self._send, args=(cp, remote, plans), name="origin upload", daemon=True)
        self.thread.start()

    def _send(self, cp: CommitPlan, remote, plans: list[LayerPlan]) -> None:
        try:
            results = push_layers(cp, remote, plans)
        except SnapError as e:
            self.error = e
            return
        except BaseException as e:  # noqa: BLE001 - stopped by the final snapshot, or a bug: told, tried again
            self.error = SnapError(f"the hub weights were not sent: {type(e).__name__}: {e}")
            return
        # Recorded after any snapshot made meanwhile (each keeps only the layers it used): the next
        # snapshot's plan finds the weights' layers in the stat cache, and their blobs in the registry.
        with self.commit_lock, exclusive(self.log):
            cache = StatCache(cp.root, cp.cache.key["base"])
            cache.new.update(cp.cache.new)
            cache.save(keep_old=True)
        torn = [plan.label for plan, _, status in results if status == NOT_SENT_TORN]
        if torn:
            self.log(f"hub weights not sent: {torn!r} changed while read; tried again later")
            return
        self.sent = True
        self.log(f"hub weights sent to the registry ({sum(b.size for _, b, _ in results)} bytes): "
                 "the next snapshot holds them")
