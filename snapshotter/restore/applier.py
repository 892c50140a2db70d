"""Applying layers in child processes of their own, for `snap restore`.

Python runs one thread at a time: in the process that downloads, unpacking the venv's many small
files would wait on the weights being hashed and written beside it (twice as long, measured). Each
extractor runs in a worker process (ExtractWorker, on workers.py), with the checks of
layer/extract.py; the parent sends it one verified layer at a time and gets back progress, the
result or the error (NeedsSerial included: the worker serves on). Several of them
apply snap's own layers at once (restore.py says which, and when).
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from snapshotter.errors import SnapError
from snapshotter.index.indexer import ImageIndexer
from snapshotter.index.store import save_index
from snapshotter.layer.extract import Extractor
from snapshotter.layer.extract_model import ExtractOptions, ExtractStats
from snapshotter.layer.staging import SplitLayer
from snapshotter.tar.compress import check_layer
from snapshotter.tar.rules import HeadersDigest
from snapshotter.workers import Worker, WorkerDied


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
    links: dict[str, str]  # its hardlinks' targets (Extractor.layer_links)
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
    try:
        if job.split:  # its digest, checked at download, is its diff_id
            with SplitLayer(job.path, on_bytes) as layer:
                extractor.apply(layer, take=layer.take, layer=what, in_place=job.in_place)
        else:
            with open(job.path, "rb") as raw:
                check_layer(_CountingFile(raw, on_bytes), job.media_type, job.diff_id, job.label,
                            lambda stream, check: extractor.apply(stream, layer=what, check_end=check,
                                                                  in_place=job.in_place))
    finally:
        if extractor.in_place_log is not None:  # applied, or given up with its half-written file removed
            extractor.in_place_log.layer_ended()
    if job.save_index and extractor.indexer is not None:
        try:
            save_index(extractor.indexer.index, job.save_index, job.index_diff_ids)
        except OSError:
            pass  # an optimisation only: the next commit reads the base's layers
        extractor.indexer = None
    return extractor.record.hexdigest() if extractor.record is not None else None


class ExtractWorker:
    """Applies the layers, one after the other, in a worker process (workers.py: forked when the
    caller runs one thread, else started afresh) that dies with its parent. `written`: the files
    earlier runs of this restore wrote (its journal), which a layer's hardlink may name
    (layer/extract.py)."""

    PROGRESS_EVERY = 4 << 20  # bytes between progress messages

    def __init__(self, extractor: Extractor, written: Iterable[str] = ()):
        self.worker = Worker(_extractor, (extractor.root, extractor.opts, list(written)), self.PROGRESS_EVERY,
                             name="an extraction process")
        self.stats = ExtractStats()

    def apply(self, job: LayerJob, on_bytes: Callable[[int], None]) -> LayerResult:
        """Apply `job` in the child; raises what applying it raised there (NeedsSerial included)."""
        try:
            self.stats, result = self.worker.run(job, on_bytes)
        except WorkerDied as e:
            raise SnapError(f"the extraction process died ({e.how}) while applying layer {job.label}",
                            "run the restore again: it resumes") from None
        return result

    def __enter__(self) -> "ExtractWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.worker.__exit__(*exc)  # stopped mid-layer: its temp files are swept by the next run


# ---- in the extraction process -----------------------------------------------------------------

def _extractor(root: str, opts: ExtractOptions, written: list[str]) -> Callable:
    extractor = Extractor(root, opts)
    extractor.count_as_written(written)

    def handle(job: LayerJob, on_bytes: Callable[[int], None]) -> tuple[ExtractStats, LayerResult]:
        record = apply_layer(extractor, job, on_bytes)  # looked up now: a test's hook, forked with snap
        return extractor.stats, LayerResult(record, extractor.layer_files, extractor.layer_shapes,
                                            extractor.layer_gone, dict(extractor.layer_links),
                                            dict(extractor.layer_dir_headers),
                                            extractor.layer_touched_dirs)

    return handle


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


WORKER_MEMORY = 256 << 20  # an extraction process: Python, a zstd window (8 MiB at snap's levels), 1 MiB buffers


def workers_memory_allows() -> int:
    """How many extraction processes fit in half the memory available now (at least one)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 1 << 16  # not Linux's /proc: the cores bound it
    return max(1, (kib << 10) // 2 // WORKER_MEMORY)
