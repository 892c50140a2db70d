"""The watcher's end: one last snapshot after a signal or a reclaim notice, bounded by the grace.
It stops the loop's snapshot in flight and waits for it (one commit at a time: the two never build
the same layer file in the state dir at once); the moving tag names a complete snapshot either way."""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol

from snapshotter.errors import exit_code_of
from snapshotter.state import exclusive

from .options import WatchOptions
from .tags import TagMover


class Handover:
    """Between the loop's snapshots and the final one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.commit_lock = threading.Lock()  # one commit at a time
        self.final_started = threading.Event()
        self.inflight: Optional[threading.Event] = None  # the loop's commit in flight gives up once set
        self.moved: Optional[str] = None  # the final snapshot's tag, once the target tag names it

    def loop_commit(self) -> Optional[threading.Event]:
        """A commit of the loop may start (its `stopping` event), unless the final snapshot has (None)."""
        with self.lock:
            if self.final_started.is_set():
                return None
            self.inflight = threading.Event()
            return self.inflight

    def take_over(self) -> None:
        """The final snapshot starts: a snapshot of the loop in flight gives up, this one replaces it."""
        with self.lock:
            self.final_started.set()
            if self.inflight is not None:
                self.inflight.set()


class Snapshots(Protocol):
    """What the final snapshot needs of the watcher (watcher.py's Watcher)."""

    opts: WatchOptions
    log: Callable[[str], None]
    tags: TagMover
    handover: Handover

    def check_lineage(self) -> None: ...

    def snapshot(self, first: bool = False, final: bool = False,
                 stopping: Optional[threading.Event] = None) -> Optional[str]: ...


def final_snapshot(w: Snapshots, reason: str) -> int:
    """One last commit, bounded by the grace. 0 when it is in (or nothing changed), else the exit
    code of what stopped it (errors.exit_code_of)."""
    grace, line = w.opts.grace, w.tags.line
    w.log(f"{reason}: final snapshot (grace {grace:g}s)")
    box: dict = {}
    done = threading.Event()

    def work() -> None:
        try:
            w.handover.take_over()
            with w.handover.commit_lock, exclusive(w.log):
                line.reconnect()  # not the loop's connection: it may have sat idle for --every
                if not line.checked:
                    w.check_lineage()
                box["tag"] = w.snapshot(final=True)
        except BaseException as e:  # handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="final snapshot", daemon=True).start()
    finished = done.wait(grace)
    where, note = line.ref(line.tag), f" ({line.note()})" if line.diverged else ""
    if not finished or "error" in box:
        return _unfinished(w, box.get("error"), f"{where}{note}")
    if box["tag"] is None:
        w.log(f"nothing changed since {w.tags.current or 'the last snapshot'}: {where} is current{note}")
    else:
        w.log(f"final snapshot {box['tag']} pushed; {where} names it{note}")
    return 0


def _unfinished(w: Snapshots, error: Optional[BaseException], where: str) -> int:
    """The final snapshot failed or ran past the grace: the exit code, and what the target tag names.
    Once it named the final snapshot the box is saved (0): what was left undone is a warning."""
    grace, line, moved = w.opts.grace, w.tags.line, w.handover.moved
    why = f"failed: {error}" if error is not None else f"did not finish within the {grace:g}s grace"
    if moved is not None:
        w.log(f"final snapshot {moved} pushed; {where} names it")
        w.log(f"warning: the final snapshot then {why}")
        return 0
    current_tag = w.tags.current
    target, last = line.tag, "its last snapshot" if current_tag == line.tag else current_tag
    current = f"{target} still names {last}" if current_tag else f"{target} was not moved"
    w.log(f"snap: error: the final snapshot {why} ({current})")
    return 1 if error is None else exit_code_of(error)
