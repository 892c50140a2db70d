"""Progress on stderr, in the form its reader can use: bars on a terminal (tqdm); without one (a
pod's log, systemd's journal, a pipe) a plain line now and then per transfer, as `docker pull`
prints without a TTY: a start line, then at most one line every SNAP_PROGRESS_EVERY seconds
(default 10) saying how much of how much and how fast, then an end line; no carriage return, no
escape code. SNAP_PROGRESS=bars|lines|off chooses instead (1 is bars); SNAP_QUIET silences both."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional


from snapshotter import settings
from snapshotter.errors import UsageError, printable

MODES = ("bars", "lines", "off")
DEFAULT_EVERY = 10.0  # seconds between two lines of one transfer


Sink = Callable[[str], None]  # where a transfer's lines go, one at a time


def to_stderr(line: str) -> None:
    """The sink of every command but `snap watch`, whose lines go through its log, with their time."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


Clock = Callable[[], float]  # what the lines are timed by: seconds, only ever increasing

_lock = threading.Lock()


def mode() -> str:
    """'bars', 'lines' or 'off', from the environment and whether stderr is a terminal."""
    if os.environ.get("SNAP_QUIET"):
        return "off"
    want = os.environ.get("SNAP_PROGRESS", "").strip().lower()
    if want in ("1", "bars"):
        return "bars"
    if want in ("0", "off"):
        return "off"
    if want == "lines":
        return want
    return "bars" if _stderr_is_terminal() else "lines"


def enabled() -> bool:
    return mode() != "off"


def check_settings() -> None:
    """Refuse a misspelt SNAP_PROGRESS or SNAP_PROGRESS_EVERY in one line, before any work starts."""
    want = os.environ.get("SNAP_PROGRESS", "").strip().lower()
    if want not in ("", "auto", "1", "0") + MODES:
        raise UsageError(f"SNAP_PROGRESS={os.environ['SNAP_PROGRESS']!r} is not one of auto, bars, lines, off")
    _every()


def bar(desc: str, total: Optional[int] = None, unit: str = "B", sink: Sink = to_stderr,
        clock: Clock = time.monotonic):
    """Progress of one transfer of bytes (sizes scaled to KiB/MiB/GiB) or of counted things
    (unit: 'files', 'layers'): a context manager with update(n). Plain lines go to `sink`, timed by
    `clock`; bars are drawn on stderr, the terminal."""
    desc = printable(desc)  # labels come from images: no control character reaches the terminal or the log
    how = mode()
    if how == "lines":
        try:
            every = _every()
        except UsageError:  # check_settings refused it at the start; a library caller gets the default
            every = DEFAULT_EVERY
        return LineProgress(desc, total, unit, every, sink, clock)
    if how == "off":
        return Silent()
    from tqdm import tqdm  # here: a run without a terminal (a pod, a pipe) draws no bar and skips its import

    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
        leave=False, file=sys.stderr, dynamic_ncols=True, lock_args=None,
    )


class Silent:
    """A transfer's progress that shows nothing (SNAP_QUIET, SNAP_PROGRESS=off), without tqdm's import."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self, ok: bool = True) -> None:
        pass

    def __enter__(self) -> "Silent":
        return self

    def __exit__(self, *_) -> None:
        pass


class LineProgress:
    """One transfer's progress as plain lines on stderr (see the module's doc)."""

    def __init__(self, desc: str, total: Optional[int], unit: str, every: float, sink: Sink = to_stderr,
                 clock: Clock = time.monotonic):
        self.desc, self.total, self.unit, self.every, self.sink = desc, total, unit, every, sink
        self.clock = clock
        self.n = 0
        self._started: Optional[float] = None
        self._last_t, self._last_n = 0.0, 0
        self._broken = False
        if total:
            self._start()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._started is None:
            self._start()
        now = self.clock()
        if now - self._last_t >= self.every:
            self._say(f"{self._amount()}{self._rate(self.n - self._last_n, now - self._last_t)}")
            self._last_t, self._last_n = now, self.n

    def close(self, ok: bool = True) -> None:
        if self._started is None:
            return  # nothing was said and nothing done: nothing to end
        if ok:
            took = self.clock() - self._started
            self._say(f"done, {self._size(self.n)} in {_duration(took)}{self._rate(self.n, took, ' (%s)')}")
        else:
            self._say(f"stopped at {self._amount()}")
        self._started = None

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(ok=exc_type is None)

    def _start(self) -> None:
        self._started = self._last_t = self.clock()
        self._say(f"started ({self._size(self.total)})" if self.total else "started")

    def _amount(self) -> str:
        if not self.total:
            return self._size(self.n)
        return f"{self._size(self.n, with_unit=False)} of {self._size(self.total)} ({100 * self.n // self.total}%)"

    def _size(self, n: Optional[int], with_unit: bool = True) -> str:
        if self.unit == "B":
            return human_size(n or 0)
        return f"{n or 0:,} {self.unit}" if with_unit else f"{n or 0:,}"

    def _rate(self, n: int, seconds: float, form: str = ", %s") -> str:
        if seconds <= 0:
            return ""
        per_s = n / seconds
        return form % (f"{human_size(per_s)}/s" if self.unit == "B" else f"{per_s:,.1f} {self.unit}/s")

    def _say(self, what: str) -> None:
        """One line; a log that can no longer be written (its reader gone) never fails the transfer."""
        if self._broken:
            return
        try:
            self.sink(f"{self.desc}: {what}")
        except (OSError, ValueError):
            self._broken = True


class Stopped(Exception):
    """Work in flight given up because the command is stopping (an error elsewhere, Ctrl-C, SIGTERM)."""


def stoppable(update, stopping: threading.Event):
    """`update`, raising Stopped once `stopping` is set: work that reports progress per chunk
    gives up at its next chunk instead of holding the exit until it ends."""

    def guarded(n: int) -> None:
        if stopping.is_set():
            raise Stopped()
        update(n)

    return guarded


def safe_update(b):
    """An update callback usable from worker threads."""

    def update(n: int) -> None:
        with _lock:
            b.update(n)

    return update


def human_size(n: float) -> str:
    """512 B, 1.5 KiB, 3.2 GiB."""
    units = ("B", "KiB", "MiB", "GiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def _duration(seconds: float) -> str:
    """0.4 s, 12 s, 3 min 5 s."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def _every() -> float:
    """SNAP_PROGRESS_EVERY in seconds (DEFAULT_EVERY when unset)."""
    return settings.seconds("SNAP_PROGRESS_EVERY", DEFAULT_EVERY,
                            "e.g. SNAP_PROGRESS_EVERY=30; 0 prints a line on every update")


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed, or replaced by an object that is no file
        return False
