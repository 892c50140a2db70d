"""`snap watch` where there is no init system (a container): one watcher per box root (a lock
file, held with flock for the watcher's life, so a watcher killed with -9 leaves no stale lock),
detached with a double fork, its pid file and log in the state dir, and `snap watch --stop`."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import struct
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from snapshotter.errors import NotFound, SnapError, StorageError, UsageError, WaitTimeout, exit_code_of
from snapshotter.snapshot.reserve import write_note
from snapshotter.state import open_own, read_versioned, root_key, sub

from .watcher import WatchOptions, exit_now, watch

VERSION = 1  # of the pid and exit files
READY = "\0ready\n"  # what the detached watcher sends its starter once it watches


@dataclass
class WatchFiles:
    lock: str
    pid: str
    log: str
    exit: str


def watch_files(root: str) -> WatchFiles:
    """The files of the watcher of `root`, in the state dir."""
    key = root_key(root, 16)
    d = sub("watch")
    return WatchFiles(*(os.path.join(d, f"{key}.{ext}") for ext in ("lock", "pid", "log", "exit")))


def _read_json(path: str) -> dict:
    return read_versioned(path, VERSION) or {}


def take_lock(files: WatchFiles, root: str) -> int:
    """Hold the root's watch lock (kept across fork); refuse if another watcher holds it."""
    fd = os.open(files.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        pid = _read_json(files.pid).get("pid", "?")
        raise UsageError(f"another snap watch (pid {pid}) is already watching {root!r}",
                         "stop it with: snap watch --stop --root ROOT")
    return fd


def lock_held(files: WatchFiles) -> bool:
    try:
        fd = os.open(files.lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock, if it got one


# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (and padding).
_FLOCK = "hhqqi4x"


def note_pid(files: WatchFiles, lock: int, target: str, grace: float) -> None:
    """Write the watcher's pid file, after taking a POSIX lock on the watch lock's `lock` fd: the
    flock is the starter's (kept across the fork); the POSIX lock names this very process, which is
    how `--stop` knows the pid it signals is the watcher's (lock_holder)."""
    fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no other process can: this one holds the flock
    write_note(files.pid, VERSION, {"pid": os.getpid(), "target": target, "grace": grace})


def lock_holder(files: WatchFiles) -> Optional[int]:
    """The pid of the process that holds the POSIX lock on the watch lock (note_pid), or None."""
    try:
        fd = os.open(files.lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        query = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
        kind, _, _, _, pid = struct.unpack(_FLOCK, fcntl.fcntl(fd, fcntl.F_GETLK, query))
    finally:
        os.close(fd)  # this process holds no lock on it: closing drops none
    return pid if kind != fcntl.F_UNLCK and pid > 0 else None


def note_exit(files: WatchFiles, code: int, error: str = "") -> None:
    """The watcher's exit code and its error line, if any: what `--stop` tells after the watcher ended.
    A disk with no room for it (the state dir's reserve spent) does not change the watcher's own code:
    `--stop` then says it left none."""
    try:
        write_note(files.exit, VERSION, {"pid": os.getpid(), "code": code, "error": error})
    except OSError:
        pass


def detach(files: WatchFiles, keep: tuple[int, ...] = ()) -> Callable[[], None]:
    """Double fork. The starting process waits for the watcher's readiness (printing what the
    watcher says until then) and exits; this returns only in the detached watcher, with the
    function that signals readiness. The watcher keeps no descriptor it inherited but `keep` (the
    watch lock): its stdin is /dev/null, its stdout and stderr its log file, so a caller that
    reads the starter's output (`out=$(snap watch ... --daemon)`) gets its end of file once the
    starter exits. Until ready, its stderr lines also go to the starter, which prints them (a
    usage error is shown where it was typed)."""
    r, w = os.pipe()
    if os.fork() > 0:  # the starter
        os.close(w)
        _relay_until_ready(r, files)
    os.close(r)
    # The starter's SIGTERM handler (cli's: stop as Ctrl-C does) is not the watcher's: until watch()
    # takes SIGTERM over for its final snapshot, it ends the watcher as before.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)  # the middle process: the watcher is now no session leader, reparented to init
    log = os.open(files.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)  # what is written to fd 2 directly (a helper program's stderr): the log
    _close_all_but({0, 1, 2, log, w, *keep})
    tee = _Tee(w, log)
    sys.stderr = tee
    return tee.ready


def _close_all_but(keep: set[int]) -> None:
    """Close every open descriptor of this process but `keep`: whatever the starter's caller left
    open (a pipe it reads to its end, a socket) must not stay open for the watcher's life."""
    for name in os.listdir("/proc/self/fd"):  # listed first: the listing's own descriptor is closed by then
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor


class _Tee:
    """stderr of the detached watcher: its log, and until ready a copy to the starter through the
    readiness pipe (which the starter prints). A copy whose reader is gone is dropped."""

    encoding = "utf-8"

    def __init__(self, pipe: int, log: int):
        self.log, self.copy = log, pipe

    def write(self, text: str) -> int:
        data = text.encode(errors="replace")
        os.write(self.log, data)
        if self.copy >= 0:
            try:
                os.write(self.copy, data)
            except OSError:
                os.close(self.copy)
                self.copy = -1
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def ready(self) -> None:
        pipe, self.copy = self.copy, -1
        if pipe >= 0:
            try:
                os.write(pipe, READY.encode())
            except OSError:
                pass
            os.close(pipe)


def _relay_until_ready(r: int, files: WatchFiles) -> None:
    buf = b""
    try:
        with os.fdopen(r, "rb", buffering=0) as pipe:
            while chunk := pipe.read(4096):
                buf += chunk
                if READY.encode() in buf:
                    sys.stderr.write(buf.split(READY.encode())[0].decode(errors="replace"))
                    sys.stderr.write(f"detached: pid file {files.pid}, log {files.log}\n")
                    sys.stderr.flush()
                    os._exit(0)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (cli's Terminated) of the starter: not of the watcher
        sys.stderr.write(f"snap: the starter was stopped; the watcher goes on (pid file {files.pid}, log {files.log}): "
                         "`snap watch --stop --root ROOT` stops it\n")
        sys.stderr.flush()
        os._exit(exit_code_of(e))
    sys.stderr.write(buf.decode(errors="replace"))
    sys.stderr.flush()
    os._exit(_read_json(files.exit).get("code") or 1)


def serve(target: str, base: str, opts: WatchOptions, detached: bool = False) -> None:
    """Be the one watcher of its root until its final snapshot, then exit the process with its code
    (threads still sending are not waited for). Detached (`--daemon`): in the background, its log
    in the state dir. The pid file and the exit file are what `--stop` reads."""
    opts.check()  # a usage error where it was typed, before the lock, the pid file and the detach
    root = opts.commit.root
    files = watch_files(root)
    lock = take_lock(files, root)
    ready = detach(files, keep=(lock,)) if detached else (lambda: None)
    note_pid(files, lock, target, opts.grace)
    notices = f"{opts.notices.provider} notices at {opts.notices.base_url}" if opts.notices else "no provider notices"

    def on_ready() -> None:
        opts.log(f"watching {root!r} for {target} (pid {os.getpid()}, every {opts.every:g}s, grace {opts.grace:g}s, "
                 f"{notices})")
        ready()

    try:
        code = watch(target, base, opts, on_ready)
    except SnapError as e:
        note_exit(files, exit_code_of(e), f"snap: error: {e}")
        raise
    note_exit(files, code)
    exit_now(code)


def stop(root: str, timeout: Optional[float] = None, log: Callable[[str], None] = lambda m: None) -> int:
    """Send the watcher of `root` the notice (SIGTERM) and wait for its final snapshot. Its exit code;
    WaitTimeout (11) if it has not ended after its grace and 30 s more (`timeout`)."""
    files = watch_files(root)
    info = _read_json(files.pid)
    if not isinstance(info.get("pid"), int):
        raise NotFound(f"no snap watch has run for {root!r}")
    pid = info["pid"]
    if not lock_held(files):
        return _ended_before(files, pid, root, log)
    if lock_holder(files) != pid:  # a stale or forged pid file: never signal what may be another process
        raise StorageError(f"the pid file {files.pid!r} names pid {pid}, which does not hold the watch lock of "
                           f"{root!r}: nothing signalled", "if a watcher is starting, run --stop again")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return _ended_before(files, pid, root, log)
    log(f"sent SIGTERM to snap watch (pid {pid}); waiting for its final snapshot")
    grace = info.get("grace") if isinstance(info.get("grace"), (int, float)) else 4
    deadline = time.monotonic() + (timeout if timeout is not None else grace + 30)
    while lock_held(files):  # the lock goes when the watcher's process is gone
        if time.monotonic() > deadline:
            raise WaitTimeout(f"snap watch (pid {pid}) did not stop in time", f"see its log {files.log}")
        time.sleep(0.05)
    done = _read_json(files.exit)
    code = done.get("code", 1) if done.get("pid") == pid else 1
    if code:
        why = done.get("error") or _last_line(files.log)
        log(f"snap watch (pid {pid}) of {root!r} stopped with code {code}: {why}")
    else:
        log(f"snap watch (pid {pid}) of {root!r} stopped after its final snapshot (exit code 0)")
    return code


def _ended_before(files: WatchFiles, pid: int, root: str, log: Callable[[str], None]) -> int:
    """The last watcher of `root` ended on its own (an auth error, a crash): its code, not "none
    running", so that a start script's stop reports why the box had no protection."""
    done = _read_json(files.exit)
    if done.get("pid") == pid and isinstance(done.get("code"), int):
        code, why = done["code"], done.get("error") or _last_line(files.log)
        log(f"snap watch (pid {pid}) of {root!r} had already ended with code {code}: {why}")
        return code
    log(f"snap watch (pid {pid}) of {root!r} had already ended leaving no exit code (killed?), so 1; "
        f"the last line of its log: {_last_line(files.log)}")
    return 1


def _last_line(path: str) -> str:
    try:
        with open_own(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(empty log)"
    except OSError:
        return f"(no log at {path})"
