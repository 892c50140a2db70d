"""Where snap keeps local state: built layers, downloaded blobs, cached base indexes."""

from __future__ import annotations

import os


def state_dir() -> str:
    """$SNAP_STATE_DIR, else $XDG_CACHE_HOME/snap, else ~/.cache/snap."""
    d = os.environ.get("SNAP_STATE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "snap")
    return os.path.abspath(d)


def sub(*parts: str) -> str:
    path = os.path.join(state_dir(), *parts)
    os.makedirs(path, exist_ok=True)
    return path
