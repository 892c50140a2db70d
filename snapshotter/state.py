"""Where snap keeps local state: built layers, downloaded blobs, cached base indexes."""

from __future__ import annotations

import os
import threading
from typing import IO, Callable


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


def replace_file(path: str, write: Callable[[IO], None], opener: Callable[..., IO] = open, mode: str = "w",
                 durable: bool = False) -> None:
    """Write a file whole or not at all: `write` fills a temp file beside it, which then replaces
    `path`; on any failure the temp file is removed. `durable` also fsyncs the file and directory."""
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"  # threads of one process may write the same file
    try:
        with opener(tmp, mode) as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
