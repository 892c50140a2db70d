"""Downloading a restore's layer blobs, several at once, for the apply loop (restore.py).

Each distinct blob downloads once, into the staging dir of the filesystem its layer's files land on
(layer/staging.py: inside the restore root, not the state dir), and is handed over only once its digest is
checked: no unverified byte reaches the target. The app's blobs download first, the weights' after
them at a lower CPU priority (AppFirst, priority.py). A blob that an interrupted run left is hashed again and
used; a blob goes once the last layer that needs it is applied."""

from __future__ import annotations

import os
import shutil
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import NamedTuple, Optional

from snapshotter import progress
from snapshotter.digests import file_digest
from snapshotter.errors import IntegrityError, StorageError, storage_error
from snapshotter.jobs import cpu_count
from snapshotter.layer.direct import direct_allowed
from snapshotter.layer.staging import SPLIT_SUFFIX, SplitLayer, StagingDirs, download_split
from snapshotter.oci.image import SNAP_CONTENT, Layer
from snapshotter.registry.remote import Remote
from snapshotter.restore.priority import WeightsPriority

# Streams at once: each costs a core while it hashes and writes, and the layers are applied in a
# process of their own beside them; more streams than cores only slowed the restore down.
DOWNLOAD_WORKERS = max(2, min(4, cpu_count()))


class Blob(NamedTuple):
    path: str  # in a staging dir
    split: bool  # an uncompressed layer kept split (layer/staging.py): its big files are renamed into place


class Downloads:
    """The blobs of `layers` (in the order they are applied), downloaded in that order by
    DOWNLOAD_WORKERS threads while the context is open, the app's (`app`, their digests) before any
    other, the weights' at `priority`. Leaving the context on an error stops the downloads in flight
    at their next chunk instead of waiting for them to end (a weight on a slow link takes minutes).
    Making one checks that the target's disk has room for them all, and starts no thread."""

    def __init__(self, remote: Remote, layers: list[Layer], app: set[str], staging: StagingDirs,
                 durable: bool, priority: WeightsPriority):
        self._remote, self._durable, self._staging = remote, durable, staging
        self._sizes = {layer.digest: layer.size for layer in layers}
        self._uses = Counter(layer.digest for layer in layers)
        # An uncompressed layer is its tar (its digest is its diff_id), whatever its media type says:
        # kept split, so that its big files are renamed into place instead of copied (layer/staging.py).
        # Only a layer applied once: applying takes its big files away.
        self._split = {layer.digest for layer in layers
                       if layer.diff_id == layer.digest and self._uses[layer.digest] == 1}
        # Their big files past the page cache (layer/direct.py): not a part, which is read back to be joined.
        self._direct = {layer.digest for layer in layers if layer.digest in self._split and layer.part_file is None}
        self._paths = self._staging_paths(layers, staging)
        self._check_disks()
        self._stopping = threading.Event()
        self._app_first = AppFirst(app, self._stopping, priority)
        self._futures: dict[str, Future] = {}

    def verified(self, digest: str) -> Blob:
        """The blob of `digest` once it is downloaded and its digest checked: waits for it, and
        raises what its download raised."""
        return Blob(self._futures[digest].result(), digest in self._split)

    def kept_split(self, digest: str) -> bool:
        """Its blob is kept split (layer/staging.py): applying it takes its files away, so it is applied once."""
        return digest in self._split

    def used(self, digest: str) -> None:
        """A layer of `digest` is applied: its blob is removed once no later layer needs it."""
        self._uses[digest] -= 1
        if not self._uses[digest]:
            _remove_blob(self._paths[digest])

    def __enter__(self) -> "Downloads":
        with ExitStack() as stack:
            bar = stack.enter_context(progress.bar("downloading", sum(self._sizes.values())))
            pool = stack.enter_context(ThreadPoolExecutor(DOWNLOAD_WORKERS))
            self._update = progress.stoppable(progress.safe_update(bar), self._stopping)
            # Submitted in layer order: the first layers arrive first, and each can be applied as
            # soon as it is verified, while the later ones still download.
            self._futures = {digest: pool.submit(self._fetch, digest) for digest in self._sizes}
            self._running = stack.pop_all()
        return self

    def __exit__(self, *exc) -> Optional[bool]:
        if exc[0] is not None:
            self.stop()
        return self._running.__exit__(*exc)

    def stop(self) -> None:
        """Stop downloading: streams give up at their next chunk, waiting ones wake, queued ones are
        cancelled. Called again on leaving after an error: a second call does nothing more."""
        self._stopping.set()
        self._app_first.stop()
        for f in self._futures.values():
            f.cancel()

    def _fetch(self, digest: str) -> str:
        self._app_first.wait_turn(digest)
        path, size = self._paths[digest], self._sizes[digest]
        self._staging.check(os.path.dirname(path))  # still the restore's own: never written through another's
        # Left by an interrupted run: verified before its rename, but not fsynced (unless
        # --fsync), so after a power loss its bytes may be lost. Hashed again before use.
        if os.path.exists(path) and _stored_digest(path) == digest:
            self._update(size)
        elif digest in self._split:
            _remove_blob(path)
            download_split(self._remote.iter_blob(digest, self._update, size), path, durable=self._durable,
                           direct=digest in self._direct and direct_allowed(os.path.dirname(path)))
        else:
            self._remote.download_blob(digest, path, self._update, durable=self._durable, size=size)
        self._app_first.fetched(digest)
        return path

    def _staging_paths(self, layers: list[Layer], staging: StagingDirs) -> dict[str, str]:
        """{digest: where its blob is kept}: each in the staging dir of the filesystem its files land on."""
        try:
            return {layer.digest: _blob_path(staging.for_path(_lands_at(layer)), layer.digest,
                                             layer.digest in self._split)
                    for layer in layers}
        except OSError as e:
            raise storage_error(e, f"the restore root {staging.root!r}",
                                " while making a staging dir for downloads") from e

    def _check_disks(self) -> None:
        """Refuse to start downloads the target's disks cannot hold (the layers' declared sizes)."""
        need: Counter[str] = Counter()
        for digest, size in self._sizes.items():
            if not os.path.exists(self._paths[digest]):
                need[os.path.dirname(self._paths[digest])] += size
        for blob_dir, size in need.items():
            _check_room(blob_dir, size)


class AppFirst:
    """The order of downloads: the blobs of the app's layers first, the weights' only once all of
    those are in. On a link the streams share, a weight started early takes its part of the link
    from the app's blobs, and so delays the app's start by as much. Weights start as soon as the
    app's blobs are downloaded, not applied: the link never idles while the app unpacks."""

    def __init__(self, app_digests: set[str], stopping: threading.Event, priority: WeightsPriority):
        self._app, self._left, self._stopping = frozenset(app_digests), set(app_digests), stopping
        self._lock, self._open, self._priority = threading.Lock(), threading.Event(), priority
        if not self._left:
            self._open.set()

    def wait_turn(self, digest: str) -> None:
        """Return when the download of `digest` may start; raise Stopped if the restore stops first."""
        if digest not in self._app:
            self._open.wait()
            self._priority.lower()
        if self._stopping.is_set():
            raise progress.Stopped()

    def fetched(self, digest: str) -> None:
        with self._lock:
            self._left.discard(digest)
            if not self._left:
                self._open.set()

    def stop(self) -> None:
        """Wake the waiting downloads (they find `stopping` set and give up)."""
        self._open.set()


def _lands_at(layer: Layer) -> Optional[str]:
    """Where a layer's files land, as its annotations say (snap's single-file and part layers), if they say."""
    hint = layer.part_file or layer.annotations.get(SNAP_CONTENT)
    return hint if isinstance(hint, str) else None


def _blob_path(blob_dir: str, digest: str, split: bool) -> str:
    """A digest checked by select_layers (oci/image.py) makes a safe file name."""
    return os.path.join(blob_dir, digest.split(":", 1)[1] + (SPLIT_SUFFIX if split else ""))


def _check_room(blob_dir: str, size: int) -> None:
    """Refuse to download `size` bytes into `blob_dir` if its disk has not that much free."""
    try:
        st = os.statvfs(blob_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if size > free:
        raise StorageError(f"disk full on the restore target {blob_dir!r}: the image's layers need {size} bytes, "
                           f"{free} are free",
                           "free space on the target's disk, or restore onto a bigger one")


def _stored_digest(path: str) -> Optional[str]:
    """The digest of a blob kept in the staging dir (a file, or a split layer's directory)."""
    try:
        if path.endswith(SPLIT_SUFFIX):
            with SplitLayer(path) as layer:
                return layer.digest()
        return file_digest(path)
    except (OSError, ValueError, IntegrityError):
        return None  # incomplete (a kill while its files were moved into place): fetched again


def _remove_blob(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
