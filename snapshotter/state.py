"""Where snap keeps local state: built layers, downloaded blobs, cached base indexes."""

from __future__ import annotations

import os


def state_dir() -> str:
    """$SNAP_STATE_DIR, else $XDG_CACHE_HOME/snap, else ~/.cache/snap."""
    d = os.environ.get("SNAP_STATE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "snap")
    return os.path.realpath(d)  # real: commit compares it with the box root to leave it out


def sub(*parts: str) -> str:
    """A directory in the state dir, made private (it holds layer blobs of the box)."""
    root = state_dir()
    if not os.path.isdir(root):
        os.makedirs(root, mode=0o700, exist_ok=True)
    path = os.path.join(root, *parts)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path
