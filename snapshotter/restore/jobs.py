"""How many layers a restore applies, and files a verify hashes, at once: `--jobs N`, else
SNAP_JOBS, else one per core this process may run on."""

from __future__ import annotations

import os
from typing import Optional

from snapshotter.errors import UsageError

JOBS_ENV = "SNAP_JOBS"


def default_jobs(given: Optional[int] = None) -> int:
    """`given` (an option), else $SNAP_JOBS, else the cores this process may run on."""
    if given is None:
        raw = os.environ.get(JOBS_ENV, "").strip()
        if not raw:
            return len(os.sched_getaffinity(0))
        try:
            given = int(raw)
        except ValueError:
            raise UsageError(f"{JOBS_ENV}={raw!r} is not a number", f"set {JOBS_ENV} to how many jobs run at once, e.g. 4") from None
    if given < 1:
        raise UsageError(f"--jobs {given}: at least 1 job runs", "pass --jobs 1 or more")
    return given
