"""`snap restore` (extract mode): pull an image's layers, verify them, and apply them onto a directory.

Every blob is downloaded to the local state dir and its digest checked before a single byte of the
image reaches the target; each layer's diff_id is checked as it is applied. A journal in the state dir
records the layers already applied, so a restore that was interrupted resumes where it stopped."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import progress
from .commit import seed_stat_cache
from .compress import HashingReader, compression_of, decompressing_reader
from .errors import IntegrityError, UsageError
from .extract import ExtractOptions, Extractor, storage_error
from .image import SNAP_PART, SNAP_PART_FILE, snap_label, snapshot_layer_count
from .plan import PART_SUFFIX
from .registry import Image, Reference, Remote, TransportOptions
from .state import sub

DOWNLOAD_WORKERS = 3


@dataclass
class RestoreOptions:
    only_snapshot: bool = False
    extract: ExtractOptions = field(default_factory=ExtractOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None
    seed_stat_cache: bool = True  # so the first commit after a restore reads no unchanged layer


@dataclass
class RestoreResult:
    ref: Reference
    manifest_digest: str
    applied: list[str]  # layer names (or digests for base layers) applied now
    resumed: int  # layers skipped because an earlier run had applied them
    files: int
    bytes: int
    skipped_devices: list[str]
    stripped_setuid: list[str]
    seeded_layers: int = 0  # snap layers the next commit of this root will know without reading them


def layer_label(desc: dict, i: int) -> str:
    """'venv', 'models (bundle 2)', ... as commit named it; 'base layer N' for the base's."""
    return snap_label(desc) or f"base layer {i + 1}"


def _journal_path(root: str) -> str:
    key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:32]
    return os.path.join(sub("restore-journal"), key + ".json")


def _read_journal(path: str, manifest_digest: str) -> list[str]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return []
    return doc.get("applied", []) if doc.get("manifest") == manifest_digest else []


def _write_journal(path: str, manifest_digest: str, applied: list[str]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"manifest": manifest_digest, "applied": applied}, f)
    os.replace(tmp, path)


def select_layers(image: Image, only_snapshot: bool) -> list[tuple[int, dict, str]]:
    """[(index, descriptor, diff_id)] of the layers to apply, in order."""
    layers = image.layers
    diff_ids = image.config.get("rootfs", {}).get("diff_ids", [])
    if len(diff_ids) != len(layers):
        raise IntegrityError(f"image {image.ref} is inconsistent: {len(layers)} layers but {len(diff_ids)} diff_ids")
    start = 0
    if only_snapshot:
        n = snapshot_layer_count(image)
        if n == 0:
            raise UsageError(f"{image.ref} was not made by snap commit", "drop --only-snapshot to restore all its layers")
        start = len(layers) - n
    return [(i, layers[i], diff_ids[i]) for i in range(start, len(layers))]


def restore(ref: str, root: str, opts: Optional[RestoreOptions] = None) -> RestoreResult:
    opts = opts or RestoreOptions()
    reference = Reference.parse(ref)
    if os.path.exists(root) and not os.path.isdir(root):
        raise UsageError(f"restore target {root} exists and is not a directory")
    remote = Remote(reference, opts.transport)
    image = remote.resolve()
    todo = select_layers(image, opts.only_snapshot)

    journal = _journal_path(root)
    done = _read_journal(journal, image.manifest_digest)
    pending = [(i, d, diff_id) for i, d, diff_id in todo if d["digest"] not in done]
    resumed = len(todo) - len(pending)
    if resumed:
        opts.log(f"resuming: {resumed} layer(s) already applied by an earlier run")

    blob_dir = sub("blobs")
    applied: list[str] = []
    headers: dict[str, list[tuple]] = {}
    total = sum(d["size"] for _, d, _ in pending)
    with progress.bar("downloading", total) as dl, ThreadPoolExecutor(DOWNLOAD_WORKERS) as pool:
        update = progress.safe_update(dl)

        def fetch(desc: dict) -> str:
            path = os.path.join(blob_dir, desc["digest"].split(":", 1)[1])
            if os.path.exists(path):  # verified by an earlier run before it was renamed into place
                update(desc["size"])
            else:
                remote.download_blob(desc["digest"], path, update)
            return path

        futures = [pool.submit(fetch, d) for _, d, _ in pending]
        try:
            # Every blob is downloaded and its digest checked before the first byte reaches the root:
            # a tampered layer anywhere in the image stops the restore with nothing written.
            paths = [f.result() for f in futures]
            extractor = Extractor(root, opts.extract)
            for (i, desc, diff_id), path in zip(pending, paths):
                label = layer_label(desc, i)
                # snap's own layers: keep their tar headers, to teach the stat cache afterwards.
                extractor.record = [] if snap_label(desc) else None
                with progress.bar(f"extracting {label}", desc["size"]) as xb, open(path, "rb") as raw:
                    counted = _CountingFile(raw, progress.safe_update(xb))
                    stream = HashingReader(decompressing_reader(counted, desc["mediaType"]))
                    # An uncompressed blob is its tar: its digest, checked at download, is the diff_id.
                    same = compression_of(desc["mediaType"]) == "none" and diff_id == desc["digest"]
                    extractor.apply(counted if same else stream)
                    if not same:
                        stream.drain()
                if not same and stream.digest != diff_id:
                    raise IntegrityError(f"layer {label} does not match its diff_id in the image config")
                if extractor.record is not None:
                    headers[desc["digest"]] = extractor.record
                done.append(desc["digest"])
                _write_journal(journal, image.manifest_digest, done)
                applied.append(label)
                os.unlink(path)
        except BaseException as e:
            for f in futures:
                f.cancel()
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise storage_error(e, f"snap's state dir {blob_dir}", " while downloading layers",
                                    "free space or point SNAP_STATE_DIR at a bigger disk, and run the restore again: it resumes") from e
            raise
    if not pending:
        extractor = Extractor(root, opts.extract)
    try:
        _join_parts(extractor, todo, opts.extract.fsync)
    except OSError as e:
        raise storage_error(e, root, " while joining part layers") from e
    if os.path.exists(journal):
        os.unlink(journal)
    seeded = seed_stat_cache(root, image, headers, opts.transport, opts.log) if headers and opts.seed_stat_cache else 0
    s = extractor.stats
    return RestoreResult(image.ref, image.manifest_digest, applied, resumed, s.files, s.bytes,
                         s.skipped_devices, s.stripped_setuid, seeded)


def _join_parts(extractor: Extractor, layers: list[tuple[int, dict, str]], fsync: bool) -> None:
    """Join files that commit cut into part layers (over the registry's layer size cap) back into
    their original path. Each part was verified with its layer; parts already joined are gone."""
    files: dict[str, int] = {}
    for _, desc, _ in layers:
        ann = desc.get("annotations", {})
        if SNAP_PART_FILE in ann:
            files[ann[SNAP_PART_FILE]] = int(ann[SNAP_PART].split("/")[1])
    for rel, count in files.items():
        pdir, path = extractor._locate(rel)
        parts = [f"{path}{PART_SUFFIX}{i:04d}-of-{count:04d}" for i in range(1, count + 1)]
        if not all(os.path.lexists(p) for p in parts):
            continue  # joined by an earlier run
        dir_st = os.lstat(pdir)
        st = os.lstat(parts[0])
        tmp = os.path.join(pdir, f".snap-tmp-join-{os.getpid()}")
        try:
            with open(tmp, "wb") as out:
                for p in parts:
                    with open(p, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 20)
                if fsync:
                    out.flush()
                    os.fsync(out.fileno())
            if extractor.opts.same_owner:
                os.chown(tmp, st.st_uid, st.st_gid)
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.rename(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        for p in parts:
            os.unlink(p)
        os.utime(pdir, ns=(dir_st.st_atime_ns, dir_st.st_mtime_ns))


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
