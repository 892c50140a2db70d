"""`snap watch`'s options: the user's (--every, --keep, --grace) and the tuning that tests make tiny
through the environment."""

from __future__ import annotations

import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapshotter import settings
from snapshotter.commit.commit import check_options
from snapshotter.commit.model import CommitOptions
from snapshotter.errors import UsageError
from snapshotter.layer.generate import AfterRead

from .notices import NoticeWatcher


MAX_GRACE = 3600.0  # seconds: a provider's notice is seconds to minutes; more is a mistake, not a grace


def _env_seconds(name: str, default: float) -> float:
    return settings.seconds(name, default, "unset it, or set it to a number of seconds")


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{name}={text!r} is not a whole number above 0", "unset it, or set it to one")
    return int(text)


def parse_duration(text: str) -> float:
    """'90', '90s', '5m', '1h', '1.5m' -> seconds."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|ms)?\s*", str(text))
    if not m:
        raise UsageError(f"duration {text!r} is not valid", "write it as 90s, 5m or 1h")
    return float(m.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass
class WatchOptions:
    commit: CommitOptions = field(default_factory=CommitOptions)
    every: float = 300.0  # at most one snapshot per this many seconds (a burst of writes excepted)
    keep: Optional[int] = None  # immutable snapshot tags kept (oldest deleted); None: all
    grace: float = 4.0  # the final commit's time limit after a signal or notice
    notices: Optional[NoticeWatcher] = None
    # Tuning (environment variables so that tests can make them tiny):
    # a burst is over after this
    quiet: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_QUIET", 10.0))
    # a big file is complete after this
    stable: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_STABLE", 5.0))
    # seconds between scans, at least
    min_scan: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_MIN_SCAN", 2.0))
    # of one core, for checks
    scan_budget: float = field(default_factory=lambda: _env_seconds("SNAP_WATCH_BUDGET", 0.005))
    notice_poll: float = field(default_factory=lambda: _env_seconds("SNAP_NOTICE_POLL", 5.0))
    events: bool = field(default_factory=lambda: os.environ.get("SNAP_WATCH_EVENTS", "1") != "0")  # inotify
    # tests: as the kernel's limit
    max_watches: Optional[int] = field(default_factory=lambda: _env_int("SNAP_WATCH_MAX_WATCHES"))
    log: Callable[[str], None] = lambda msg: None
    clock: Callable[[], float] = time.time  # wall clock (compared with file times); injectable for tests
    # CPU, not wall: on a busy machine a check waits, and waiting costs nothing
    cpu_clock: Callable[[], float] = time.thread_time
    after_read: AfterRead = None  # each snapshot's CommitHooks.after_read (tests: a writer racing the reads)

    def check(self) -> None:
        """Refuse values the watcher cannot work with (before anything is read)."""
        if self.keep is not None and self.keep < 1:
            raise UsageError("--keep must be at least 1")
        if self.every < 0:
            raise UsageError("--every must be >= 0")
        if not (math.isfinite(self.grace) and 0 < self.grace <= MAX_GRACE):
            raise UsageError(f"--grace {self.grace!r} is not a number of seconds above 0 and at most {MAX_GRACE:g}",
                             "the final snapshot's time after a signal or notice: RunPod gives 5 s, so 4")
        check_options(self.commit)  # the root, --compression, --max-layer-size, --jobs: before a detach


def trace(log: Callable[[str], None], msg: str) -> None:
    """Progress markers for tests that kill the watcher at chosen moments (SNAP_WATCH_TRACE=1)."""
    if os.environ.get("SNAP_WATCH_TRACE"):
        log(f"trace: {msg}")
