"""The CPU priority of the threads that download weights: below the app's unpacking, then below the app.

On a box with few cores, hashing and writing weights at link speed takes most of a core, which the
app's unpacking needs (`--then` starts the app once its layers are applied). Until they are, a
thread downloading a weight runs at SCHED_IDLE: on a core nothing else wants, which on a box with
many cores is most of them. Once they are applied it runs at nice WEIGHTS_NICE instead: the app may
want every core, and must not starve the weights it will load.

Leaving SCHED_IDLE takes CAP_SYS_NICE (or a raised RLIMIT_NICE), which a container seldom has: where a
thread of ours cannot leave it (tried once per process), the weights run at nice WEIGHTS_NICE from
the start. Linux sets a thread's priority by its id; where that is refused, the thread goes on as it is."""

from __future__ import annotations

import os
import threading
from typing import Optional

WEIGHTS_NICE = 10  # the nice value of a thread downloading weights once the app's layers are applied

_undoable: Optional[bool] = None  # whether a thread of this process can leave SCHED_IDLE


class WeightsPriority:
    """The priority of weights' download threads for one restore. `app_in`: the app's layers are applied
    already (or there are none)."""

    def __init__(self, app_in: bool):
        self._lock = threading.Lock()
        self._app_in = app_in
        self._idle: set[int] = set()  # the ids of the threads at SCHED_IDLE

    def lower(self) -> None:
        """Lower the calling thread's priority: it downloads weights from now on."""
        tid = threading.get_native_id()
        with self._lock:
            if not self._app_in and idle_undoable() and _set_idle(tid, True):
                self._idle.add(tid)
                return
        _set_nice(tid)

    def app_in(self) -> None:
        """The app's layers are applied: the threads at SCHED_IDLE go to nice WEIGHTS_NICE."""
        with self._lock:
            self._app_in = True
            tids, self._idle = self._idle, set()
        for tid in tids:
            if _set_idle(tid, False):
                _set_nice(tid)

    def forget(self) -> None:
        """The threads are gone (their ids may name others): nothing is changed from now on."""
        with self._lock:
            self._app_in = True
            self._idle.clear()


def idle_undoable() -> bool:
    """Whether a thread of this process can go to SCHED_IDLE and back (asked once, of a thread of its own)."""
    global _undoable
    if _undoable is None:
        result: list[bool] = []

        def probe() -> None:
            tid = threading.get_native_id()
            result.append(_set_idle(tid, True) and _set_idle(tid, False))

        t = threading.Thread(target=probe, name="snap-priority-probe")
        t.start()
        t.join()
        _undoable = bool(result and result[0])
    return _undoable


def _set_idle(tid: int, idle: bool) -> bool:
    """Put thread `tid` at SCHED_IDLE, or back at the normal policy; whether it took."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
    except (OSError, AttributeError):
        return False
    return True


def _set_nice(tid: int) -> None:
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < WEIGHTS_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, WEIGHTS_NICE)
    except OSError:
        pass
