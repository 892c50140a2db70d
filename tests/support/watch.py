"""The watcher: in this process on a clock the test moves, or `snap watch` as a process on fast pacing."""

from __future__ import annotations

import os
import subprocess
import threading
import time

from snapshotter import CommitOptions
from snapshotter.profile import load_profile
from snapshotter.watch.watcher import Watcher, WatchOptions

from support.run import SNAP, TIMEOUT

# Tiny pacing for watcher processes: scan at once, a burst is over after 0.2 s, files stable after 0.2 s.
FAST = {"SNAP_WATCH_MIN_SCAN": "0", "SNAP_WATCH_BUDGET": "1", "SNAP_WATCH_QUIET": "0.2", "SNAP_WATCH_STABLE": "0.2",
        "SNAP_NOTICE_POLL": "0.05"}


class FakeClock:
    """Wall-clock seconds that move only when the test says so."""

    def __init__(self):
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def watcher(registry, base_ref, box, repo, lines, clock=None, profile=None, **kw) -> Watcher:
    opts = WatchOptions(commit=CommitOptions(root=box, profile=profile or load_profile()), log=lines.append,
                        clock=clock or FakeClock(), **kw)
    return Watcher(f"{registry.host}/{repo}:v2", base_ref, opts)


class WatchProcess:
    """`snap watch` as a process; wait_for() reads what it prints on stderr, as it prints it."""

    def __init__(self, *args, env=None):
        e = {**os.environ, **FAST, **(env or {})}
        self.proc = subprocess.Popen([*SNAP, "watch", *args], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, env=e)
        self.seen: list[str] = []
        self._timer = threading.Timer(TIMEOUT, self.proc.kill)  # a hung test still ends
        self._timer.start()

    def wait_for(self, text: str) -> str:
        for line in self.proc.stderr:
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"snap watch ended without saying {text!r}:\n{''.join(self.seen)}")

    def finish(self) -> int:
        self.seen.extend(self.proc.stderr)
        code = self.proc.wait()
        self._timer.cancel()
        return code

