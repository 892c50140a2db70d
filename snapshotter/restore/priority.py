"""The CPU priority of the threads that download weights (the registry's weights layers, the origin's
blobs): far below the app's unpacking, then below the app.

On a box with few cores, hashing and writing weights at link speed takes most of a core, which the
app's unpacking needs (`--then` starts the app once its layers are applied). Until they are, a
thread downloading a weight runs at nice UNPACKING_NICE: it gets a core when the unpacking leaves one,
which on a box with many cores is most of them. Once they are applied it runs at nice WEIGHTS_NICE:
the app may want every core, and must not starve the weights it will load. (Not SCHED_IDLE, which
measured the same here: a thread that seldom runs can be stopped holding the GIL, and the restore's
own thread then waits for it.)

Going back from UNPACKING_NICE to WEIGHTS_NICE takes CAP_SYS_NICE (or a raised RLIMIT_NICE), which a
container seldom has: where a thread of ours cannot (tried once per process), the weights run at nice
WEIGHTS_NICE from the start. Linux sets a thread's nice value by its id; where that is refused, the
thread goes on as it is."""

from __future__ import annotations

import os
import threading
from typing import Optional

UNPACKING_NICE = 19  # the nice value of a thread downloading weights while the app's layers are applied
WEIGHTS_NICE = 10  # and once they are

_undoable: Optional[bool] = None  # whether a thread of this process can go back from UNPACKING_NICE


class WeightsPriority:
    """The priority of weights' download threads for one restore. `app_in`: the app's layers are applied
    already (or there are none). Shared by the threads of several pools."""

    def __init__(self, app_in: bool):
        self._lock = threading.Lock()
        self._app_in = app_in
        self._lowest: dict[int, int] = {}  # the threads at UNPACKING_NICE: their id -> the nice value to go back to

    def lower(self) -> None:
        """Lower the calling thread's priority: it downloads weights from now on. A process that runs
        nicer already keeps its own value where it is the higher."""
        tid = threading.get_native_id()
        with self._lock:
            after = self._lowest.get(tid) or max(_nice(tid), WEIGHTS_NICE)  # lowered before: what it had then
            if not self._app_in and undoable() and _set_nice(tid, max(after, UNPACKING_NICE)):
                self._lowest[tid] = after
                return
        _set_nice(tid, after)

    def app_in(self) -> None:
        """The app's layers are applied: the threads at UNPACKING_NICE go to WEIGHTS_NICE."""
        known = os.path.isdir("/proc/self/task")  # this process's threads, where /proc shows them
        with self._lock:  # held throughout: a thread lowering itself meanwhile finds the app in
            self._app_in = True
            for tid, after in self._lowest.items():
                if not known or os.path.exists(f"/proc/self/task/{tid}"):  # not a thread gone (its id another's)
                    _set_nice(tid, after)
            self._lowest.clear()


def undoable() -> bool:
    """Whether a thread of this process can go to UNPACKING_NICE and back to WEIGHTS_NICE (asked once,
    of a thread of its own)."""
    global _undoable
    if _undoable is None:
        result: list[bool] = []

        def probe() -> None:
            tid = threading.get_native_id()
            after = max(_nice(tid), WEIGHTS_NICE)
            result.append(_set_nice(tid, max(after, UNPACKING_NICE)) and _set_nice(tid, after))

        t = threading.Thread(target=probe, name="snap-priority-probe")
        t.start()
        t.join()
        _undoable = bool(result and result[0])
    return _undoable


def _nice(tid: int) -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return 0


def _set_nice(tid: int, nice: int) -> bool:
    """Set thread `tid` to nice `nice`; whether it took."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        return False
    return True
