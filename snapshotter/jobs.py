"""How much runs at once: the layers a commit packs or a restore applies, the files a verify hashes.
`--jobs N`, else SNAP_JOBS, else one per core this process may run on."""

from __future__ import annotations

import os
from typing import Optional

from snapshotter.errors import UsageError

JOBS_ENV = "SNAP_JOBS"


def cpu_count() -> int:
    """The cores this process may run on (a container's cpuset, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_jobs(given: Optional[int] = None) -> int:
    """`given` (an option), else $SNAP_JOBS, else the cores this process may run on."""
    source = f"--jobs {given}"
    if given is None:
        raw = os.environ.get(JOBS_ENV, "").strip()
        if not raw:
            return cpu_count()
        source = f"{JOBS_ENV}={raw!r}"
        try:
            given = int(raw)
        except ValueError:
            raise UsageError(f"{source} is not a number",
                             f"set {JOBS_ENV} to how many jobs run at once, e.g. 4") from None
    if given < 1:
        raise UsageError(f"{source}: at least 1 job runs", "pass 1 or more; 1 runs everything in this process")
    return given
