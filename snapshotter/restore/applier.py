"""Applying layers in child processes of their own, for `snap restore`.

Python runs one thread at a time: in the process that downloads, unpacking the venv's many small
files would wait on the weights being hashed and written beside it (twice as long, measured). Each
extractor runs in a child (ExtractWorker), with the checks of layer/extract.py; the parent sends
it one verified layer at a time and gets back progress, the result or the error. Several of them
apply snap's own layers at once (restore.py says which, and when).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import tarfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from snapshotter.errors import SnapError
from snapshotter.index.indexer import ImageIndexer
from snapshotter.index.store import save_index
from snapshotter.layer.extract import ExtractOptions, Extractor, ExtractStats, NeedsSerial
from snapshotter.layer.staging import SplitLayer
from snapshotter.tar.compress import check_layer
from snapshotter.tar.rules import HeadersDigest


@dataclass
class LayerJob:
    path: str  # the verified blob (or its split form)
    media_type: str
    diff_id: str
    split: bool  # kept split at download (layer/staging.py); its digest is its diff_id
    label: str
    record: bool  # send back the digest of its tar headers
    # Its position among the base's layers, when the applier indexes the base as it goes (0 starts
    # the index: restore.py); None: not indexed.
    base_layer: Optional[int] = None
    save_index: Optional[str] = None  # where to save the base's index once this layer is applied (its last)
    index_diff_ids: tuple[str, ...] = ()  # with save_index: the diff_ids of the base's layers, saved with it
    in_place: bool = False  # nothing reads the root yet: new files written at their paths (Extractor.apply)
    parallel: bool = False  # other workers apply layers meanwhile (Extractor.parallel): NeedsSerial may come back
    also_written: tuple[str, ...] = ()  # files other workers wrote since this one's last job: hardlinks may name them
    # Onto a live root: the deletions this layer may make, each with where it was counted to delete
    # (restore/deletion_guard.py); None: any.
    deletions: Optional[dict[str, Optional[str]]] = None


@dataclass
class LayerResult:
    """What applying a layer gave back to the parent."""
    record: Optional[str]  # the digest of its tar headers, if the job asked for it
    files: list[str]  # what it wrote (Extractor.layer_files)
    shapes: list[int]  # what each of those is (Extractor.layer_shapes)
    gone: list[str]  # what its whiteouts hid (Extractor.layer_gone)
    dir_headers: dict[str, tarfile.TarInfo]  # with job.parallel: the directories it set (Extractor.settle_dirs)
    touched_dirs: dict[str, tuple[int, int]]  # with job.parallel: those it only wrote into, their times before


def apply_layer(extractor: Extractor, job: LayerJob, on_bytes: Callable[[int], None]) -> Optional[str]:
    """Apply one verified layer; the digest of its tar headers if job.record. on_bytes: stored bytes consumed."""
    extractor.forget_dirs()  # other workers changed the tree since this one's last layer
    extractor.count_as_written(job.also_written)
    extractor.parallel = job.parallel
    extractor.deletions = job.deletions
    extractor.record = HeadersDigest() if job.record else None
    if job.base_layer is None or job.base_layer == 0:
        extractor.indexer = ImageIndexer() if job.base_layer == 0 else None
    what = f"layer {job.label}"
    if job.split:  # its digest, checked at download, is its diff_id
        with SplitLayer(job.path, on_bytes) as layer:
            extractor.apply(layer, take=layer.take, layer=what, in_place=job.in_place)
    else:
        with open(job.path, "rb") as raw:
            check_layer(_CountingFile(raw, on_bytes), job.media_type, job.diff_id, job.label,
                        lambda stream, check: extractor.apply(stream, layer=what, check_end=check, in_place=job.in_place))
    if job.save_index and extractor.indexer is not None:
        try:
            save_index(extractor.indexer.index, job.save_index, job.index_diff_ids)
        except OSError:
            pass  # an optimisation only: the next commit reads the base's layers
        extractor.indexer = None
    return extractor.record.hexdigest() if extractor.record is not None else None


class ExtractWorker:
    """Applies the layers, one after the other, in a child process, forked (spawned if the caller
    runs other threads, which a fork does not copy: a program calling restore_image() from a
    thread-running __main__ needs the usual `if __name__ == "__main__":` guard) and killed with
    its parent. `written`: the files earlier runs of this restore wrote (its journal), which a
    layer's hardlink may name (layer/extract.py)."""

    PROGRESS_EVERY = 4 << 20  # bytes between progress messages

    def __init__(self, extractor: Extractor, written: Iterable[str] = ()):
        ctx = multiprocessing.get_context("fork" if threading.active_count() == 1 else "spawn")
        self.conn, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child_end, extractor.root, extractor.opts, os.getpid(), list(written)),
                                name="snap-extract", daemon=True)
        # Ctrl-C goes to the whole process group: the child is born with SIGINT blocked, then
        # ignores it; one pressed meanwhile reaches the parent once unblocked.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        child_end.close()
        self.stats = ExtractStats()

    def apply(self, job: LayerJob, on_bytes: Callable[[int], None]) -> LayerResult:
        """Apply `job` in the child; raises what applying it raised there (NeedsSerial included)."""
        try:
            self.conn.send(job)
            while True:
                kind, payload = self.conn.recv()
                if kind != "progress":
                    break
                on_bytes(payload)
        except (EOFError, OSError):  # OSError: a broken pipe
            self.proc.join(1)
            raise SnapError(f"the extraction process died (exit code {self.proc.exitcode}) while applying "
                            f"layer {job.label}", "run the restore again: it resumes") from None
        if kind == "error":
            raise payload
        if kind == "serial":
            raise NeedsSerial(job.label)
        self.stats, result = payload
        return result

    def __enter__(self) -> "ExtractWorker":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(5 if exc[0] is None else 0)
        if self.proc.is_alive():  # stopped mid-layer: its temp files are swept by the next run
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _worker_main(conn, root: str, opts: ExtractOptions, parent: int, written: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent(parent)
    try:
        extractor = Extractor(root, opts)
        extractor.count_as_written(written)
        _serve(conn, extractor)
    except BaseException:  # noqa: BLE001 - the parent is gone or the pipe broke: no one to tell
        os._exit(1)  # quietly: no child's traceback on the user's terminal


def _serve(conn, extractor: Extractor) -> None:
    pending = 0

    def on_bytes(n: int) -> None:
        nonlocal pending
        pending += n
        if pending >= ExtractWorker.PROGRESS_EVERY:
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
            record = apply_layer(extractor, job, on_bytes)
        except NeedsSerial:
            pending = 0
            conn.send(("serial", None))  # applied again alone, later: this worker goes on serving
            continue
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent, to be raised there
            try:
                pickle.loads(pickle.dumps(e))  # some exceptions pickle but do not unpickle
            except Exception:
                e = SnapError(f"{type(e).__name__}: {e}")
            conn.send(("error", e))
            return
        if pending:
            conn.send(("progress", pending))
            pending = 0
        conn.send(("done", (extractor.stats, LayerResult(record, extractor.layer_files, extractor.layer_shapes,
                                                         extractor.layer_gone, dict(extractor.layer_dir_headers),
                                                         extractor.layer_touched_dirs))))


def _die_with_parent(parent: int) -> None:
    """A killed restore must not leave a child writing into the root: PR_SET_PDEATHSIG (Linux),
    else a thread that watches for the parent to go."""
    try:
        armed = ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        armed = False
    if os.getppid() != parent:  # the parent died before that
        os._exit(1)
    if not armed:
        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()


class _CountingFile:
    """Passes reads through, reporting compressed bytes consumed (for the extract progress bar)."""

    def __init__(self, f, on_bytes: Callable[[int], None]):
        self.f, self.on_bytes = f, on_bytes

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.on_bytes(len(data))
        return data

    def readinto(self, b) -> int:
        n = self.f.readinto(b)
        self.on_bytes(n or 0)
        return n
