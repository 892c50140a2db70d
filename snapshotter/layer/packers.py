"""Packing layers in worker processes, so that a commit uses every core.

Python runs one thread at a time: reading a venv's tens of thousands of small files, writing their
tar headers and hashing the tar all hold the interpreter's lock, so threads pack one layer at a
time whatever the core count. Each packer here is a child process of its own (started with
`python -c`, not forked: the committing process runs threads) that builds the layers it is sent,
one at a time, into the out_dir (layer/generate.py's build_layer: the same bytes as in-process),
and sends back progress, the blob with its digests (and its skeleton piece), or the error. The
caller decides which layers go to packers, and how many packers there are.

Stopping: the packers are killed (Ctrl-C, SIGTERM, an error elsewhere); a layer they were building
leaves only its temp file, removed here. A packer that dies on its own (killed, out of memory) fails
its layer with one line. A packer dies with its parent (PR_SET_PDEATHSIG) and ignores the
terminal's Ctrl-C (it runs in a session of its own): the parent decides."""

from __future__ import annotations

import ctypes
import glob
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from snapshotter.errors import SnapError

from . import generate
from .generate import BUILDING_PREFIX, LayerBlob, build_layer
from .plan import LayerPlan

PROGRESS_EVERY = 1 << 20  # bytes read between progress messages: a stop is noticed within one
# The packer loads snap from where this process found it, whatever lies on its path or in the
# working directory (`python -c` puts that first: another `snapshotter` there was imported instead);
# its other imports come from the same environment.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
from snapshotter.layer.packers import main
main()
"""


@dataclass
class PackJob:
    plan: LayerPlan
    root: str
    out_dir: str
    zstd_level: int
    zstd_threads: int
    headers: Optional[Callable[[], Any]]  # makes the layer's HeaderSink, which has finish(diff_id) -> bytes
    after_read: Optional[Callable[[str, int], None]]  # generate.after_read, for tests


class PackerDied(SnapError):
    """A packer process ended without answering (killed, out of memory)."""


class Packers:
    """`count` packer processes, started at once (they start in parallel; a packer dies with the
    thread that started it: make them from the thread that outlives the work). `pack` from any
    thread, one layer per call, on an idle packer. `stop()` kills them all (the calls in flight
    raise `stopped()`); leaving the block ends them."""

    def __init__(self, count: int, stopped: Callable[[], BaseException]):
        self.stopped = stopped  # the exception a call raises when the packers were stopped
        self._lock = threading.Lock()
        self._stopping = False
        self._all: list[_Packer] = []
        try:
            for _ in range(count):
                self._all.append(_Packer())
        except BaseException:
            self.stop()
            raise
        self._idle = list(self._all)
        self._slots = threading.Semaphore(count)

    def __enter__(self) -> "Packers":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            self.stop()
        for p in self._all:
            p.close()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        for p in self._all:
            p.kill()

    def pack(self, job: PackJob, on_bytes: Callable[[int], None]) -> tuple[LayerBlob, Optional[bytes]]:
        """Build job.plan in a packer: (the blob, in job.out_dir; the headers' finish(diff_id)).
        on_bytes may raise (a stop): the packer is then killed, its temp file removed."""
        with self._slots:
            with self._lock:
                if self._stopping:
                    raise self.stopped()
                packer = self._idle.pop()
            try:
                result = packer.run(job, on_bytes)
            except PackerDied:
                if self._stopping:
                    raise self.stopped() from None
                raise
            except BaseException:
                packer.kill()  # mid-layer: of no use any more
                raise
            with self._lock:
                self._idle.append(packer)
            return result


class _Packer:
    """One packer process, and the parent's end of its socket."""

    def __init__(self):
        parent_end, child_end = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _START, _PACKAGE_PARENT, str(child_end.fileno()), str(os.getpid())],
                pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
        except OSError as e:
            parent_end.close()
            raise SnapError(f"cannot start a packer process ({sys.executable}): {e.strerror or e}",
                            "commit with --jobs 1 to pack in one process") from None
        finally:
            child_end.close()
        self.conn = Connection(parent_end.detach())
        self.out_dirs: set[str] = set()
        self._lock = threading.Lock()  # kill() from a stopping thread and from the packer's user

    def run(self, job: PackJob, on_bytes: Callable[[int], None]) -> tuple[LayerBlob, Optional[bytes]]:
        self.out_dirs.add(job.out_dir)
        try:
            self.conn.send(job)
            while True:
                kind, payload = self.conn.recv()
                if kind != "progress":
                    break
                on_bytes(payload)
        except (EOFError, OSError):  # OSError: a broken pipe, or our end closed by kill()
            code = self.proc.wait()
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            raise PackerDied(f"the process packing layer {job.plan.label!r} died ({how})",
                             "nothing was pushed; commit again, with --jobs 1 to pack in one process") from None
        if kind == "error":
            raise payload
        return payload

    def kill(self) -> None:
        with self._lock:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.conn.close()
            for out_dir in self.out_dirs:  # the layer it was building
                for tmp in glob.glob(os.path.join(glob.escape(out_dir), f"{BUILDING_PREFIX}{self.proc.pid}-*")):
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass

    def close(self) -> None:
        """Ends an idle packer: every pack call has returned (else stop() killed it)."""
        try:
            with self._lock:
                self.conn.send(None)
            self.proc.wait()
        except (OSError, ValueError):  # ValueError: already closed (killed)
            pass
        self.kill()


# ---- the packer process ------------------------------------------------------------------------

def main() -> None:
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with(parent)
    conn = Connection(fd)
    try:
        _serve(conn)
    except BaseException:  # noqa: BLE001 - the parent is gone or the pipe broke: no one to tell
        os._exit(1)  # quietly: no child's traceback on the user's terminal


def _serve(conn: Connection) -> None:
    pending = 0

    def on_bytes(n: int) -> None:
        nonlocal pending
        pending += n
        if pending >= PROGRESS_EVERY:
            conn.send(("progress", pending))
            pending = 0

    while True:
        job = conn.recv()
        if job is None:
            return
        generate.after_read = job.after_read
        try:
            headers = job.headers() if job.headers is not None else None
            blob = build_layer(job.root, job.plan, job.out_dir, job.zstd_level, on_bytes, headers, job.zstd_threads)
            piece = headers.finish(blob.diff_id) if headers is not None else None
        except Exception as e:  # noqa: BLE001 - raised again in the parent
            try:
                pickle.loads(pickle.dumps(e))  # some exceptions pickle but do not unpickle
            except Exception:  # noqa: BLE001
                e = SnapError(f"packing layer {job.plan.label!r} failed: {type(e).__name__}: {e}")
            conn.send(("error", e))
            continue
        if pending:
            conn.send(("progress", pending))
            pending = 0
        conn.send(("done", (blob, piece)))


def _die_with(parent: int) -> None:
    """Killed with the parent (PR_SET_PDEATHSIG, bound to the thread that started this process): a
    commit killed outright leaves no packer running."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # then a dead parent shows as a broken pipe, at the end of the layer
    if os.getppid() != parent:
        os._exit(1)
