"""Which layers of a restore apply at once, on which extraction process, and in what order the
journal hears of them (restore.py hands the layers over, applier.py applies them).

snap's own layers write disjoint paths but for their parent directories: several of them are
applied at once, one per ExtractWorker, as soon as each blob is verified. Any other layer (a base
image's, which overlap and delete each other's files), and a blob kept split (applying it takes
its files away: it cannot be applied twice), is applied alone, once every layer before it is, by
the first worker (which indexes the base as it goes). A layer applied beside others that would
remove a directory, or link to a file of a layer applied meanwhile, stops before it changes
anything (layer/extract.py: NeedsSerial); it, and every layer above it already started, are
applied again, alone and in order.

The journal hears of layers in order: layer k is recorded once layers 1..k are done, so that a
run killed at any point resumes after a prefix that is wholly applied. A layer applied beside
others that wrote a path a lower one of them wrote (no snap image has one; an OCI image may) is
applied again, alone, before it is recorded: the upper layer's file wins whoever finished last. Before a layer applied
beside others is recorded, its directories get the owner, mode and times the topmost layer done
since the last lone layer gives them (Extractor.settle_dirs): the last word is the topmost
layer's, as applied one after the other."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Optional, Protocol

from snapshotter import progress
from snapshotter.layer.extract import Extractor
from snapshotter.layer.extract_model import NeedsSerial
from snapshotter.oci.image import Layer
from snapshotter.tar.reader import EntryCount

from .applier import ExtractWorker, LayerJob, LayerResult
from .download import Blob
from .journal import Journal


class LayerBlobs(Protocol):
    """What the apply loop takes from the downloads (download.Downloads): each layer's blob, verified."""

    def verified(self, digest: str) -> Blob:
        """The blob of `digest` once its digest is checked (waits for it)."""

    def used(self, digest: str) -> None:
        """A layer of `digest` is applied: its blob may go once no later layer needs it."""


class SkipsUntrusted(Exception):
    """A layer was applied whose tar headers are not those its skeleton claimed, and a layer above
    it was skipped on that skeleton's word (skip.py's order pass): the restore checks the layers
    above it again. Carries what this run recorded: the labels applied and their headers."""

    def __init__(self, label: str, applied: list[str], headers: dict[str, str]):
        super().__init__(f"layer {label} is not what its skeleton said")
        self.applied, self.headers = applied, headers


@dataclasses.dataclass
class _Done:
    result: LayerResult
    beside: bool  # applied beside others (its directories to settle)
    label: str


class Scheduler:
    """Applies `layers` (the pending ones, in image order) with `workers`, recording each in
    `journal` (as the `offset`+k-th layer of its list) once it and every layer before it are done.
    Those of `alone` (their places in `layers`) are applied only with every layer before them
    applied and no other running; those of `skipped` ({place: the digest of its tar headers}: the
    root holds it, skip.py) are not applied at all; those of `headers_said` ({place: the digest of the tar
    headers its skeleton claimed}) must turn out to have those headers before a layer above them
    counts as skipped.
    `layer_job(n, blob)` says what applying layer n takes; `after_layer(count, layer)` is told each
    time the journal is; `settle` is the parent's extractor (settle_dirs)."""

    def __init__(self, layers: list[Layer], alone: set[int], skipped: dict[int, str], offset: int, blobs: LayerBlobs,
                 layer_job: Callable[[int, Blob], LayerJob], workers: list[ExtractWorker], journal: Journal,
                 after_layer: Callable[[int, Optional[Layer]], None], settle: Extractor,
                 note: Callable[[Layer, Blob, str], None], headers_said: Optional[dict[int, str]] = None):
        self.layers, self.alone, self.skipped = layers, alone, skipped
        self.headers_said = headers_said or {}
        self.offset, self.blobs, self.layer_job = offset, blobs, layer_job
        self.workers, self.journal, self.after_layer = workers, journal, after_layer
        self.settle, self.note = settle, note
        self._cond = threading.Condition()
        self._done: dict[int, _Done] = {}
        self._running: dict[int, bool] = {}  # layer -> applied beside others
        self._forced: set[int] = set()  # to apply alone: above a layer that had to (NeedsSerial)
        self._errors: list[tuple[int, BaseException]] = []
        self._written: list[str] = []  # files of the layers done, in the order they were done
        self._stop = False
        self._recorded = 0  # layers the journal lists (their directories settled)
        # What the journal keeps per file, over all the layers (each extraction process bounds only its own).
        self._entries = EntryCount()

    # ---- the parent's thread: the journal, in order ----------------------------------------------

    def run(self) -> tuple[list[str], dict[str, str]]:
        """Apply them all. Returns (labels of the layers applied, {layer digest: digest of its tar headers})."""
        feeders = [threading.Thread(target=self._feed, args=(i, w), name=f"snap-apply-{i}", daemon=True)
                   for i, w in enumerate(self.workers)]
        for t in feeders:
            t.start()
        try:
            return self._record_in_order()
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()

    def _record_in_order(self) -> tuple[list[str], dict[str, str]]:
        applied: list[str] = []
        headers: dict[str, str] = {}
        group_start = 0  # the first layer after the last one applied alone
        group_files: set[str] = set()  # what the layers of the group recorded so far wrote
        misclaimed: Optional[str] = None  # the first layer applied that its skeleton misdescribed
        for n, layer in enumerate(self.layers):
            at, digest = self.offset + n, layer.digest
            if n in self.skipped and misclaimed is not None:
                raise SkipsUntrusted(misclaimed, applied, headers)
            if n in self.skipped:  # the root holds it: as if applied now
                headers[digest] = self.skipped[n]
                self.journal.record_applied(at + 1)
                self.after_layer(at + 1, layer)
                self._note_recorded(n + 1)
                continue
            with self._cond:
                while True:
                    while n not in self._done:
                        if self._errors:
                            raise min(self._errors, key=lambda e: e[0])[1]
                        self._cond.wait()
                    done = self._done[n]
                    if not done.beside or group_files.isdisjoint(done.result.files):
                        break
                    # A lower layer of the group wrote one of its paths, perhaps after it did: the
                    # upper one's must win, as applied one after the other.
                    self._force_from(n)
                group = {m: d for m, d in self._done.items() if m >= group_start and d.beside}
            if done.beside:
                self._settle(n, group)
                group_files.update(done.result.files)
            else:
                group_start = n + 1
                group_files.clear()
            if done.result.record is not None:
                headers[digest] = done.result.record
            if n in self.headers_said and done.result.record != self.headers_said[n] and misclaimed is None:
                misclaimed = done.label
            self._entries.add(len(done.result.files) + len(done.result.gone), f"layer {done.label}")
            self.journal.record_applied(at + 1, done.result.files, done.result.shapes, done.result.gone,
                                        done.result.links)
            applied.append(done.label)
            self.after_layer(at + 1, layer)
            self.blobs.used(digest)
            self._note_recorded(n + 1)
        return applied, headers

    def _note_recorded(self, count: int) -> None:
        with self._cond:
            self._recorded = count
            self._cond.notify_all()

    def _settle(self, n: int, group: dict[int, _Done]) -> None:
        """Layer n's directories as the topmost layer done of its group says (module doc)."""
        mine = self._done[n].result
        top = sorted(group, reverse=True)
        headers, touched = {}, {}
        for rel in (*mine.dir_headers, *mine.touched_dirs):
            header = next((group[m].result.dir_headers[rel] for m in top if rel in group[m].result.dir_headers), None)
            if header is not None:
                headers[rel] = header
            else:  # only written into: the earliest times any saw are those from before the group
                touched[rel] = min((group[m].result.touched_dirs[rel] for m in top
                                    if rel in group[m].result.touched_dirs), key=lambda t: t[1])
        self.settle.settle_dirs(headers, touched)

    # ---- one thread per worker: taking layers as they may start ----------------------------------

    def _startable(self, i: int) -> Optional[tuple[int, bool]]:
        """(layer, beside others) worker i may start now, or None. Under the condition."""
        n = next((m for m in range(len(self.layers))
                  if m not in self.skipped and m not in self._done and m not in self._running), None)
        if n is None:
            return None
        if self._alone(n):
            # Only once the layers below are recorded: their directories settled, not to be noted
            # mid-settle as this layer's times to put back.
            return (n, False) if i == 0 and not self._running and self._recorded >= n else None
        if any(not beside for beside in self._running.values()):
            return None
        return n, True

    def _alone(self, n: int) -> bool:
        return n in self.alone or n in self._forced or len(self.workers) == 1

    def _force_from(self, n: int) -> None:
        """Layer n, and every layer above it already started, to apply again alone and in order.
        Under the condition; n is not running."""
        started = max((*self._running, *self._done, n))
        for m in range(n, started + 1):
            self._forced.add(m)
            if m in self._done and self._done[m].beside:
                del self._done[m]  # applied again, alone, after n
        self._cond.notify_all()

    def _feed(self, i: int, worker: ExtractWorker) -> None:
        told = 0  # how much of _written this worker was told of
        while True:
            with self._cond:
                while True:
                    if self._stop or self._errors:  # not once all are done: _record_in_order may force one again
                        return
                    taken = self._startable(i)
                    if taken is not None:
                        break
                    self._cond.wait()
                n, beside = taken
                self._running[n] = beside
                also, told = tuple(self._written[told:]), len(self._written)
            try:
                result, label = self._apply(n, beside, also, worker)
            except NeedsSerial:
                with self._cond:
                    del self._running[n]
                    self._force_from(n)
                continue
            except BaseException as e:  # noqa: BLE001 - raised by the parent's thread, in run()
                with self._cond:
                    del self._running[n]
                    self._errors.append((n, e))
                    self._cond.notify_all()
                return
            with self._cond:
                del self._running[n]
                if beside and n in self._forced:
                    pass  # a layer below it had to go alone: applied again, in order
                else:
                    self._done[n] = _Done(result, beside, label)
                    self._written.extend(result.files)
                self._cond.notify_all()

    def _apply(self, n: int, beside: bool, also: tuple[str, ...], worker: ExtractWorker) -> tuple[LayerResult, str]:
        layer = self.layers[n]
        blob = self.blobs.verified(layer.digest)  # nothing unverified is applied
        job = dataclasses.replace(self.layer_job(n, blob), parallel=beside, also_written=also)
        self.note(layer, blob, job.label)
        with progress.bar(f"extracting {job.label}", layer.size) as xb:
            return worker.apply(job, progress.safe_update(xb)), job.label
