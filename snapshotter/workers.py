"""Child worker processes: the one protocol under commit's packers (layer/packers.py) and restore's
extractors (restore/applier.py).

Python runs one thread at a time, so work that must use every core (packing layers, applying them)
runs in child processes. A Worker is one child serving jobs one at a time: `setup(*args)`, a
module-level function, runs once in the child and returns the handler, `handler(job, on_bytes)`,
called for each job sent; the child sends back progress (bytes, batched), the handler's result, or
the error it raised (raised again in the parent), and serves on.

Starting: forked when the caller runs one thread (the child then also carries whatever the parent
changed in its modules), else started afresh with `python -c` (a fork copies only the forking
thread, and multiprocessing's spawn would run the caller's __main__ again), loading snap from where
this process found it, not from the working directory.

Stopping: the parent decides. A child runs in a session of its own (the terminal's Ctrl-C and a
signal to the caller's group do not reach it; the parent's own handlers stop the work and kill()
its workers), and dies with its parent: PR_SET_PDEATHSIG, else a thread that watches for the parent
to go; a parent gone before that was armed is noticed too. Leaving a Worker's block ends it (killed
if the block ended in an error). A child that dies on its own (killed, out of memory) fails its
job with WorkerDied."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from snapshotter.errors import SnapError

Handler = Callable[[Any, Callable[[int], None]], Any]
PARENT_POLL_S = 0.5  # where PR_SET_PDEATHSIG is missing: how often a child looks for its parent
# The child loads snap from where this process found it, whatever lies on its path or in the
# working directory (`python -c` puts that first: another `snapshotter` there was imported instead).
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_START = """
import importlib.util, os, sys
top = sys.argv.pop(1)
sys.path = [p for p in sys.path if p]  # not the working directory
init = os.path.join(top, "snapshotter", "__init__.py")
if os.path.isfile(init):
    spec = importlib.util.spec_from_file_location("snapshotter", init)
    sys.modules["snapshotter"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
else:  # snap in a zip: found through the path
    sys.path.append(top)
from snapshotter.workers import spawned_main
spawned_main()
"""


class WorkerDied(SnapError):
    """A worker ended without answering (killed, out of memory); `how` says how it ended."""

    def __init__(self, how: str):
        super().__init__(f"a worker process died ({how})")
        self.how = how


class Worker:
    """One child process serving jobs: run(job, on_bytes) from one thread at a time."""

    def __init__(self, setup: Callable[..., Handler], args: tuple = (), progress_every: int = 1 << 20,
                 fork: bool = True, name: str = "a worker process"):
        parent_end, child_end = socket.socketpair()
        self.forked = fork and threading.active_count() == 1
        try:
            self.proc = (_Forked(child_end) if self.forked else _spawn(child_end, name))
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.conn = Connection(parent_end.detach())
        self._lock = threading.Lock()  # kill() from a stopping thread and from the worker's user
        try:
            self.conn.send((setup, args, progress_every))
        except OSError:
            pass  # died at once: the first run() says so

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, job: Any, on_bytes: Callable[[int], None]) -> Any:
        """The handler's result for `job`; raises what the handler raised, or WorkerDied.
        on_bytes may raise (a stop): the caller then kills the worker, mid-job."""
        done, payload = self.call(job, on_bytes)
        if not done:
            raise payload
        return payload

    def call(self, job: Any, on_bytes: Callable[[int], None]) -> tuple[bool, Any]:
        """run(), with the handler's error returned, (False, it), not raised: the worker is idle
        again either way. Raises WorkerDied, or what on_bytes raised."""
        try:
            self.conn.send(job)
            while True:
                kind, payload = self.conn.recv()
                if kind != "progress":
                    break
                on_bytes(payload)
        except (EOFError, OSError):  # OSError: a broken pipe, or our end closed by kill()
            code = self.proc.wait()
            raise WorkerDied(f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}") from None
        return kind != "error", payload

    def kill(self) -> None:
        with self._lock:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.conn.close()

    def close(self, wait_s: Optional[float] = None) -> None:
        """Ends an idle worker (told to stop; killed if it has not within wait_s seconds)."""
        try:
            with self._lock:
                self.conn.send(None)
            self.proc.wait(wait_s)
        except (OSError, ValueError, subprocess.TimeoutExpired):  # ValueError: already closed (killed)
            pass
        self.kill()

    def __enter__(self) -> "Worker":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self.kill()  # stopped mid-job: what it was writing is the caller's to sweep
        self.close(5)


class WorkerPool:
    """`count` workers, started at once (a worker dies with the thread that started it: make them
    from the thread that outlives the work). run() from any thread, on an idle worker. stop() kills
    them all (the calls in flight raise `stopped()`); leaving the block ends them."""

    def __init__(self, count: int, stopped: Callable[[], BaseException], make: Callable[[], Worker]):
        self.stopped = stopped  # the exception a call raises when the workers were stopped
        self._lock = threading.Lock()
        self._stopping = False
        self.all: list[Worker] = []
        try:
            for _ in range(count):
                self.all.append(make())
        except BaseException:
            self.stop()
            raise
        self._idle = list(self.all)
        self._slots = threading.Semaphore(count)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self.stop()
        for w in self.all:
            w.close()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        for w in self.all:
            w.kill()

    def run(self, job: Any, on_bytes: Callable[[int], None]) -> Any:
        with self._slots:
            with self._lock:
                if self._stopping:
                    raise self.stopped()
                worker = self._idle.pop()
            try:
                done, payload = worker.call(job, on_bytes)
            except WorkerDied:
                if self._stopping:
                    raise self.stopped() from None
                raise
            except BaseException:
                worker.kill()  # mid-job: of no use any more
                raise
            with self._lock:
                self._idle.append(worker)  # it did the job, or said why it could not: it serves on
            if not done:
                raise payload
            return payload


# ---- starting a child -------------------------------------------------------------------------

def _spawn(child_end: socket.socket, name: str) -> subprocess.Popen:
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _START, _PACKAGE_PARENT, str(child_end.fileno()), str(os.getpid())],
            pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True)
    except OSError as e:
        raise SnapError(f"cannot start {name} ({sys.executable}): {e.strerror or e}",
                        "run with --jobs 1 to do the work in one process") from None


_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


class _Forked:
    """A forked child, with the part of Popen's interface a Worker uses. Two threads may wait for
    it at once (a job's thread sees it die while another stops it): one reaps it, the other is
    told by `_reaped`."""

    def __init__(self, child_end: socket.socket):
        parent = os.getpid()
        # Held over the fork: a stop signal's handler raising inside fork's own hooks (logging's lock
        # release) is printed and lost, and the command went on; it is raised just after instead.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            self.pid = os.fork()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # the child's too: it gets none of the pending
        if self.pid == 0:  # the child: never returns
            try:
                os.setsid()
                _child_main(Connection(child_end.detach()), parent)
            finally:
                os._exit(1)
        self.returncode: Optional[int] = None
        self._reaped = threading.Event()

    def _reap(self, flags: int) -> bool:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped by another thread: it sets returncode
            self._reaped.wait()
            return True
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)
            self._reaped.set()
        return bool(pid)

    def poll(self) -> Optional[int]:
        if not self._reaped.is_set():
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if timeout is None:
            if not self._reaped.is_set():
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if not self._reaped.is_set():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- the child ---------------------------------------------------------------------------------

def spawned_main() -> None:
    """The entry of a child started with `python -c` (_START)."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _child_main(Connection(fd), parent)
    os._exit(0)


def _child_main(conn: Connection, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    _die_with(parent)
    _keep_freed_memory()
    try:
        setup, args, progress_every = conn.recv()
        _serve(conn, setup(*args), progress_every)
    except BaseException:  # noqa: BLE001 - the parent is gone or the pipe broke: no one to tell
        os._exit(1)  # quietly: no child's traceback on the user's terminal
    os._exit(0)


def _serve(conn: Connection, handler: Handler, progress_every: int) -> None:
    pending = 0

    def on_bytes(n: int) -> None:
        nonlocal pending
        pending += n
        if pending >= progress_every:
            conn.send(("progress", pending))
            pending = 0

    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            result = handler(job, on_bytes)
        except Exception as e:  # noqa: BLE001 - raised again in the parent
            pending = 0
            conn.send(("error", _picklable(e)))
            continue
        if pending:
            conn.send(("progress", pending))
            pending = 0
        conn.send(("done", result))


def _picklable(e: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(e))  # some exceptions pickle but do not unpickle
        return e
    except Exception:  # noqa: BLE001
        return SnapError(f"{type(e).__name__}: {e}")


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BUFFERS, _HEAP_KEPT = 4 << 20, 32 << 20


def _keep_freed_memory() -> None:
    """A worker streams its data in buffers of about 1 MiB (read, decompressed, hashed, written):
    with glibc's defaults each was a fresh mapping, or heap trimmed back after it, whose pages the
    kernel faulted in and zeroed again: ~4 faults a page of data, a third of an extractor's CPU on a
    layer of small files (34k faults and 0.07 of 0.21 CPU s for a 35 MB layer of 2k files). Buffers
    up to 4 MiB come from the heap, and up to 32 MiB freed at its top is kept for the next. Nothing
    where the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _HEAP_BUFFERS)
    mallopt(_M_TRIM_THRESHOLD, _HEAP_KEPT)


def _die_with(parent: int) -> None:
    """A child must not outlive its parent (a killed restore must not leave one writing into the
    root): PR_SET_PDEATHSIG (Linux), else a thread that watches for the parent to go."""
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent:  # the parent died before that
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()
