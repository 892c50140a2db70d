"""Packing layers in worker processes (workers.py), so that a commit uses every core.

Python runs one thread at a time: reading a venv's tens of thousands of small files, writing their
tar headers and hashing the tar all hold the interpreter's lock, so threads pack one layer at a
time whatever the core count. Each packer is a worker process of its own (started afresh, not
forked: the committing process runs threads) that builds the layers it is sent, one at a time,
into the out_dir (layer/generate.py's build_layer: the same bytes as in-process), and sends back
progress, the blob with its digests (and its skeleton piece), or the error. The caller decides
which layers go to packers, and how many packers there are.

Stopping: the packers are killed (Ctrl-C, SIGTERM, an error elsewhere); a layer they were building
leaves only its temp file, removed here. A packer that dies on its own (killed, out of memory) fails
its layer with one line."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from snapshotter.errors import SnapError
from snapshotter.workers import Worker, WorkerDied, WorkerPool

from .generate import BUILDING_PREFIX, AfterRead, LayerBlob, build_layer
from .plan import LayerPlan

PROGRESS_EVERY = 1 << 20  # bytes read between progress messages: a stop is noticed within one


@dataclass
class PackJob:
    plan: LayerPlan
    root: str
    out_dir: str
    zstd_level: int
    zstd_threads: int
    headers: Optional[Callable[[], Any]]  # makes the layer's HeaderSink, which has finish(diff_id) -> bytes
    after_read: AfterRead  # model.CommitHooks.after_read, pickled: a test's class, or None


class PackerDied(SnapError):
    """A packer process ended without answering (killed, out of memory)."""


class Packers:
    """`count` packer processes, started at once (they start in parallel; a packer dies with the
    thread that started it: make them from the thread that outlives the work). `pack` from any
    thread, one layer per call, on an idle packer. `stop()` kills them all (the calls in flight
    raise `stopped()`); leaving the block ends them."""

    def __init__(self, count: int, stopped: Callable[[], BaseException]):
        self._out_dirs: set[str] = set()  # where the packers build: their temp files are swept at the end
        self._pool = WorkerPool(count, stopped, lambda: Worker(_packer, (), PROGRESS_EVERY, fork=False,
                                                               name="a packer process"))

    def __enter__(self) -> "Packers":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._pool.__exit__(*exc)
        finally:
            self._sweep()

    def stop(self) -> None:
        self._pool.stop()
        self._sweep()

    def pack(self, job: PackJob, on_bytes: Callable[[int], None]) -> tuple[LayerBlob, Optional[bytes]]:
        """Build job.plan in a packer: (the blob, in job.out_dir; the headers' finish(diff_id)).
        on_bytes may raise (a stop): the packer is then killed, its temp file removed."""
        self._out_dirs.add(job.out_dir)
        try:
            return self._pool.run(job, on_bytes)
        except WorkerDied as e:
            self._sweep()
            raise PackerDied(f"the process packing layer {job.plan.label!r} died ({e.how})",
                             "nothing was pushed; commit again, with --jobs 1 to pack in one process") from None
        except BaseException:
            self._sweep()
            raise

    def _sweep(self) -> None:
        """Removes the temp files of the layers that dead packers were building."""
        for w in self._pool.all:
            if w.proc.poll() is None:
                continue
            for out_dir in list(self._out_dirs):
                for tmp in glob.glob(os.path.join(glob.escape(out_dir), f"{BUILDING_PREFIX}{w.pid}-*")):
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass


# ---- in the packer process ---------------------------------------------------------------------

def _packer() -> Callable[[PackJob, Callable[[int], None]], tuple[LayerBlob, Optional[bytes]]]:
    return _pack


def _pack(job: PackJob, on_bytes: Callable[[int], None]) -> tuple[LayerBlob, Optional[bytes]]:
    headers = job.headers() if job.headers is not None else None
    blob = build_layer(job.root, job.plan, job.out_dir, job.zstd_level, on_bytes, headers, job.zstd_threads,
                       job.after_read)
    return blob, (headers.finish(blob.diff_id) if headers is not None else None)
