"""The clocks a box's file times are compared with, and the rule for telling a file changed since a moment.

A file's ctime is set by the kernel on every change (a write, a chmod, a rename) and cannot be set
back by a program: a file whose ctime is older than a moment has not changed since then, provided
that the clock never ran backwards in between, and that the ctime is read with its filesystem's
granularity in mind. What vouches for the clock is kept with the moment (Stamp): the boot it was
taken in, and the offset of the wall clock from the boot clock (CLOCK_BOOTTIME), which only a
step of the wall clock changes (NTP's slewing and a suspend move both alike)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from snapshotter import settings

BOOT_ID = "/proc/sys/kernel/random/boot_id"
# The kernel stamps ctimes from its coarse clock (Linux's CLOCK_REALTIME_COARSE, which time does
# not name), which lags the fine one by up to a tick.
_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)
_WHOLE_SECONDS_GRAIN_NS = 2 * 10**9  # FAT keeps 2 s; ext3, HFS+ and many NFS servers 1 s
# A smaller step back of the wall clock is not told from the time between reading two clocks (NTP
# steps only past 128 ms, chrony past 1 s, a leap second is 1 s).
STEP_SLACK_NS = 10 * 10**6


# Tests set the wall clock ahead (or back) by this many seconds, as a step of the clock would: the
# boot clock stays. Files keep the kernel's times, so only steps between runs make sense.
OFFSET_ENV = "SNAP_CLOCK_OFFSET"


def _offset_ns() -> int:
    return int(settings.number(OFFSET_ENV, 0.0) * 1e9)


def _boot_id() -> Optional[str]:
    try:
        with open(BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class Clock:
    """This machine's clocks: a seam (tests pass one of their own)."""

    wall_ns: Callable[[], int] = lambda: time.time_ns() + _offset_ns()
    coarse_ns: Callable[[], int] = lambda: time.clock_gettime_ns(_REALTIME_COARSE) + _offset_ns()
    boot_ns: Callable[[], int] = lambda: time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    boot_id: Callable[[], Optional[str]] = _boot_id


SYSTEM = Clock()


@dataclass(frozen=True)
class Stamp:
    """A moment on the wall clock (ns), with what tells later whether the clock was stepped back since."""

    wall_ns: int
    offset_ns: int  # wall clock less boot clock (read boot first: a delay between the reads adds to it)
    boot_id: Optional[str]

    def to_json(self) -> dict:
        return {"wall_ns": self.wall_ns, "offset_ns": self.offset_ns, "boot_id": self.boot_id}

    @classmethod
    def from_json(cls, doc: object) -> Optional["Stamp"]:
        if not isinstance(doc, dict):
            return None
        wall, offset, boot = doc.get("wall_ns"), doc.get("offset_ns"), doc.get("boot_id")
        if type(wall) is not int or type(offset) is not int or not isinstance(boot, str):
            return None
        return cls(wall, offset, boot)


def stamp(clock: Clock = SYSTEM) -> Stamp:
    """Now. A write that ends before this call has a ctime below `wall_ns` (the fine clock is read,
    then the coarse one waited for until it passes: at most a tick); one that starts after it, a
    ctime of at least `wall_ns`."""
    boot = clock.boot_ns()
    fine = clock.wall_ns()
    offset = fine - boot
    coarse = clock.coarse_ns()
    while coarse <= fine:
        time.sleep(0.001)
        coarse = clock.coarse_ns()
    return Stamp(coarse, offset, clock.boot_id())


def stepped_back_since(then: Stamp, clock: Clock = SYSTEM) -> Optional[str]:
    """Why the wall clock cannot be trusted to have run forward since `then`, or None: another boot
    (nothing says what the clock did meanwhile, or where the disk was), a moment that lies ahead, or
    a wall clock stepped back (its offset from the boot clock is smaller now: read wall first, so that
    a delay between the reads only makes a step look bigger, never hides one)."""
    now = clock.wall_ns()
    offset = now - clock.boot_ns()
    if then.boot_id is None or then.boot_id != clock.boot_id():
        return "it was written in another boot"
    if then.wall_ns > now:
        return "its time lies ahead of the clock (the clock was set back)"
    if offset < then.offset_ns - STEP_SLACK_NS:
        return f"the clock was set back by {(then.offset_ns - offset) / 1e9:.3f} s since"
    return None


def consistent(start: Stamp, end: Stamp) -> Optional[str]:
    """Why two stamps of one run (its start, its end) do not tell a clock that ran forward, or None."""
    if start.boot_id != end.boot_id:
        return "it began in another boot than it ended"
    if start.wall_ns > end.wall_ns or end.offset_ns < start.offset_ns - STEP_SLACK_NS:
        return "the clock was set back while it ran"
    return None


def grain_ns(ctime_ns: int) -> int:
    """How coarse a timestamp may be: a filesystem keeps times in whole units (seconds, 100 ns, ...),
    so a time with k trailing zero digits (in ns) may stand for any moment up to 10**k ns later;
    whole seconds, up to 2 s (FAT). A fine time ends in a zero by chance only (one in ten)."""
    if ctime_ns % 10**9 == 0:
        return _WHOLE_SECONDS_GRAIN_NS
    grain = 1
    while ctime_ns % (grain * 10) == 0:
        grain *= 10
    return grain


def changed_since(ctime_ns: int, moment_ns: int) -> bool:
    """Might a file with this ctime have changed at or after `moment_ns`? Unless its ctime, with the
    filesystem's granularity, lies wholly before the moment (a file whose ctime lies in the future
    changed after any moment before now)."""
    return ctime_ns + grain_ns(ctime_ns) > moment_ns
