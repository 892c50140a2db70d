"""Progress bars (tqdm, on stderr). Off when SNAP_QUIET is set or stderr is not a terminal,
unless SNAP_PROGRESS=1 forces them on."""

from __future__ import annotations

import os
import sys
import threading

from tqdm import tqdm

_lock = threading.Lock()


def enabled() -> bool:
    if os.environ.get("SNAP_QUIET"):
        return False
    if os.environ.get("SNAP_PROGRESS") == "1":
        return True
    return sys.stderr.isatty()


def bar(desc: str, total: int | None = None, unit: str = "B") -> tqdm:
    """A bar for bytes (scaled to KB/MB/GB) or for counted things."""
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
        disable=not enabled(), leave=False, file=sys.stderr, dynamic_ncols=True, lock_args=None,
    )


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


def safe_update(b: tqdm):
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
