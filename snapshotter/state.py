"""Where snap keeps local state: built layers, copied base blobs, cached base indexes, journals
(a restore downloads into staging dirs in its own root, not here); the lock that gives one
snap process at a time the state dir; and the rules its files share: a box root's files are
named by the root's key, and every format names its version, so that a file of another version
is never misread."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import threading
from contextlib import contextmanager
from typing import IO, Callable, Iterator, Optional

from .errors import StorageError

LOCK_NAME = "lock"
_held = 0  # how deep this process is in exclusive() (a commit from a container commits inside)
_held_guard = threading.Lock()


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


def root_key(root: str, length: int = 32) -> str:
    """The name a box root's files in the state dir go by: the sha256 of its real path (the same
    root however it is spelt), in hex, cut to `length` digits."""
    return hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:length]


def versioned(doc: object, version: int) -> Optional[dict]:
    """`doc` (a parsed JSON document or header line) if it is an object of format `version`, else None."""
    return doc if isinstance(doc, dict) and doc.get("version") == version else None


def read_versioned(path: str, version: int) -> Optional[dict]:
    """The JSON document at `path` if it is of format `version`; None if it is missing, unreadable,
    damaged or of another version."""
    try:
        with open(path) as f:
            return versioned(json.load(f), version)
    except (OSError, ValueError):
        return None


def write_versioned(path: str, version: int, fields: dict) -> None:
    """Write {"version": version, **fields} as the JSON document at `path`, whole or not at all."""
    replace_file(path, lambda f: json.dump({"version": version, **fields}, f))


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


@contextmanager
def exclusive(log: Callable[[str], None] = lambda msg: None) -> Iterator[None]:
    """Hold the state dir's lock for the block: a second snap process on the same state dir waits
    for the first (saying so in one line) and never touches its files. Once it is held, anything
    a killed run left half-made (`.building-*` layers, `*.part` downloads, temp files) is swept:
    no other process can be writing it."""
    global _held
    with _held_guard:
        nested = _held > 0
        _held += 1
    try:
        if nested:
            yield
            return
        try:
            root = sub()
            fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StorageError(f"cannot use snap's state dir {state_dir()!r}: {e.strerror or e}",
                               "point SNAP_STATE_DIR at a writable directory") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                log(f"waiting for another snap process (pid {holder}) that is using the state dir {root!r}")
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # only for the message of a process that waits
            except OSError:
                pass  # a full disk: the lock holds all the same
            sweep_leftovers(root)
            yield
        finally:
            os.close(fd)  # releases the lock
    finally:
        with _held_guard:
            _held -= 1


def is_leftover(name: str) -> bool:
    """A name snap gives only to what it is still making: built layers, downloads, temp files."""
    return name.startswith(".building-") or name.endswith(".part") or ".tmp." in name


def sweep_leftovers(root: str) -> int:
    """Remove what killed runs left half-made in the state dir. Returns how many entries."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [n for n in dirnames if is_leftover(n)]:
            shutil.rmtree(os.path.join(dirpath, name), ignore_errors=True)
            dirnames.remove(name)
            removed += 1
        for name in filenames:
            if is_leftover(name):
                try:
                    os.unlink(os.path.join(dirpath, name))
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed
