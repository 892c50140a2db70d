"""`snap restore` (extract mode): pull an image's layers, verify them, and apply them onto a directory.

Blobs download to the local state dir, several at once, and each layer is applied as soon as its
digest is checked and the layers before it are applied: no unverified byte reaches the target, and
the extraction of the first layers overlaps the download of the rest. Layers are applied in order,
by one extractor in a child process (applier.py), so that unpacking does not wait on the
download threads for Python's lock. Each layer's diff_id is checked as it is applied. A journal
in the state dir records how many layers of this run's list are applied (always a prefix), so a
restore that was interrupted resumes where it stopped; a run with another image or another layer
selection (--only-snapshot or not) starts over instead.

A restore writes over what is there, so two things guard a live machine: a full image (base layers
and all) is refused onto a root that already holds an operating system, unless this restore
started there (its journal) or the caller forces it; and the profile's excludes (/etc/hostname,
/etc/resolv.conf, /proc, /tmp, ...) are never written, whatever the image holds."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import tarfile
import threading
import time
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import baseindex, progress
from .applier import ExtractWorker, LayerJob
from .blobsources import BlobSources
from .compress import label_mismatch, read_head, sniff_compression
from .errors import IntegrityError, StorageError, UsageError
from .extract import TMP_PREFIX, ExtractOptions, Extractor, check_name, storage_error
from .image import (BASE_DIGEST, SNAP_MAX_LAYER, SNAP_PART, SNAP_PART_FILE, SNAP_PART_LINKS, SNAP_PROFILE, Image,
                    snap_label, snapshot_layer_count)
from .plan import DEFAULT_MAX_LAYER_SIZE, parse_part_annotation, part_name
from .profile import Profile, available_profiles, load_profile
from .reference import Reference
from .registry import Remote
from .staging import SPLIT_SUFFIX, SplitLayer, download_split
from .state import exclusive, replace_file, state_dir, sub
from .statcache import CLOCK_TICK_S, write_restore_record
from .transport import TransportOptions

# Streams at once: each costs a core while it hashes and writes, and the layers are applied in a
# process of their own beside them; more streams than cores only slowed the restore down.
DOWNLOAD_WORKERS = max(2, min(4, len(os.sched_getaffinity(0))))
JOURNAL_VERSION = 2
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")  # also what makes a blob's file name in the state dir safe


@dataclass
class RestoreOptions:
    only_snapshot: bool = False
    extract: ExtractOptions = field(default_factory=ExtractOptions)
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None
    seed_stat_cache: bool = True  # record the snap layers, so that the next commit reads no unchanged one
    force: bool = False  # apply a full image even onto a root that holds an operating system
    profile: Optional[str] = None  # whose `exclude` is never written; None: the image's own, if snap ships it


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
    seeded_layers: int = 0  # snap layers the next commit of this root will know without reading them (statcache.py)


def layer_label(desc: dict, i: int) -> str:
    """'venv', 'models (bundle 2)', ... as commit named it; 'base layer N' for the base's."""
    return printable(snap_label(desc)) or f"base layer {i + 1}"


def printable(text: str) -> str:
    """`text` (from the image: annotations, paths) fit for a one-line message: control characters escaped."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# ---- the journal ------------------------------------------------------------------------------


class _Journal:
    """{manifest digest, the digests of this run's layer list, how many of them are applied, files
    joined from part layers}, in the state dir, keyed by the restore root. Resuming needs the same
    manifest and the same list: an interrupted `--only-snapshot` run says nothing about a full one."""

    def __init__(self, root: str, manifest_digest: str, layers: list[str], fsync: bool):
        key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:32]
        self.path = os.path.join(_state_sub("restore-journal"), key + ".json")
        self.root, self.manifest, self.layers, self.fsync = root, manifest_digest, layers, fsync
        self.applied = 0
        self.joined: list[str] = []

    def _read(self) -> tuple[bool, object, bool]:
        """(whether there is a journal, what it holds (None if unreadable), whether it is this
        restore's: same image, same layers)."""
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return False, None, False
        except (OSError, ValueError):
            return True, None, False
        applied = doc.get("applied") if isinstance(doc, dict) else None
        return True, doc, (isinstance(doc, dict) and doc.get("version") == JOURNAL_VERSION and doc.get("manifest") == self.manifest
                     and doc.get("layers") == self.layers and type(applied) is int and 0 <= applied <= len(self.layers))

    def started_here(self) -> bool:
        """This restore (same image, same layers) ran into this root before and did not finish."""
        return self._read()[2]

    def load(self, log: Callable[[str], None]) -> None:
        exists, doc, ours = self._read()
        if not exists:
            return
        if not ours:
            why = ("was interrupted with another image or layer selection" if isinstance(doc, dict)
                   else f"left an unreadable journal ({self.path})")
            log(f"an earlier restore into {self.root} {why}: starting over, applying all {len(self.layers)} layer(s)")
            self.write()  # at once: the tree is about to change under what the old journal says
            return
        self.applied = doc["applied"]
        self.joined = [j for j in doc.get("joined", []) if isinstance(j, str)]

    def write(self) -> None:
        """Replace the journal atomically. With --fsync everything written so far is made durable
        first (os.sync: the tree may span filesystems), then the journal and its directory."""
        doc = {"version": JOURNAL_VERSION, "manifest": self.manifest, "layers": self.layers,
               "applied": self.applied, "joined": self.joined}
        d = os.path.dirname(self.path)
        try:
            if self.fsync:
                os.sync()  # file data, and the directories of every rename, before the journal says so
            replace_file(self.path, lambda f: json.dump(doc, f), durable=self.fsync)
        except OSError as e:
            raise storage_error(e, f"snap's state dir {d}", " while writing the restore journal",
                                "free space or point SNAP_STATE_DIR at a bigger disk, and run the restore again: "
                                "it resumes") from e

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, f"snap's state dir {os.path.dirname(self.path)}",
                                " while removing the restore journal") from e


def _state_sub(name: str) -> str:
    try:
        return sub(name)
    except OSError as e:
        raise storage_error(e, f"snap's state dir {state_dir()}", hint="point SNAP_STATE_DIR at a writable directory") from e


# ---- which layers, which parts ------------------------------------------------------------------


def select_layers(image: Image, only_snapshot: bool) -> list[tuple[int, dict, str]]:
    """[(index, descriptor, diff_id)] of the layers to apply, in order."""
    layers = image.layers
    diff_ids = image.config.get("rootfs", {}).get("diff_ids", [])
    if len(diff_ids) != len(layers):
        raise IntegrityError(f"image {image.ref} is inconsistent: {len(layers)} layers but {len(diff_ids)} diff_ids")
    for i, d in enumerate(layers):
        if not (isinstance(d, dict) and isinstance(d.get("digest"), str) and _DIGEST.fullmatch(d["digest"])
                and type(d.get("size")) is int and d["size"] >= 0 and isinstance(d.get("mediaType"), str)):
            raise IntegrityError(f"image {image.ref} has a malformed descriptor for layer {i + 1}: refusing it")
    start = 0
    if only_snapshot:
        n = snapshot_layer_count(image)
        if n == 0:
            raise UsageError(f"{image.ref} was not made by snap commit", "drop --only-snapshot to restore all its layers")
        start = len(layers) - n
    return [(i, layers[i], diff_ids[i]) for i in range(start, len(layers))]


def part_files(layers: list[tuple[int, dict, str]]) -> dict[str, int]:
    """{file: number of parts} for the files commit cut into part layers, from the layers'
    annotations. Refused unless every file has each of its parts 1..n exactly once, all saying n."""
    seen: dict[str, tuple[int, set[int]]] = {}
    for i, desc, _ in layers:
        ann = desc.get("annotations") or {}
        if not isinstance(ann, dict) or (SNAP_PART_FILE not in ann and SNAP_PART not in ann):
            continue
        label = layer_label(desc, i)
        part = parse_part_annotation(ann.get(SNAP_PART))
        rel = ann.get(SNAP_PART_FILE)
        if part is None or not isinstance(rel, str):
            raise IntegrityError(f"layer {label} has a malformed part annotation "
                                 f"({SNAP_PART}={ann.get(SNAP_PART)!r}, {SNAP_PART_FILE}={rel!r}): refusing a hostile image")
        rel = check_name(rel)
        if not rel:
            raise IntegrityError(f"layer {label} is a part of the root directory: refusing a hostile image")
        k, n = part
        count, have = seen.setdefault(rel, (n, set()))
        if n != count:
            raise IntegrityError(f"the part layers of /{printable(rel)} disagree on its number of parts ({count} and {n}): "
                                 "refusing a hostile image")
        if k in have:
            raise IntegrityError(f"part {k}/{n} of /{printable(rel)} is in the image twice: refusing a hostile image")
        have.add(k)
    for rel, (n, have) in seen.items():
        if len(have) != n:
            raise IntegrityError(f"/{printable(rel)} is cut into {n} parts, but the layers restored hold only {len(have)} of them: "
                                 "refusing an incomplete image")
    return {rel: n for rel, (n, _) in seen.items()}


def part_links(layers: list[tuple[int, dict, str]]) -> dict[str, list[str]]:
    """{file: its other names} for the files cut into part layers that had hardlinks (listed on
    the last part): restore links them to the joined file. Names are checked like tar names."""
    out: dict[str, list[str]] = {}
    for i, desc, _ in layers:
        ann = desc.get("annotations") or {}
        if not isinstance(ann, dict) or SNAP_PART_LINKS not in ann:
            continue
        rel = ann.get(SNAP_PART_FILE)
        try:
            names = json.loads(ann[SNAP_PART_LINKS]) if isinstance(ann[SNAP_PART_LINKS], str) else None
        except ValueError:
            names = None
        if not isinstance(rel, str) or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise IntegrityError(f"layer {layer_label(desc, i)} has a malformed {SNAP_PART_LINKS} annotation: "
                                 "refusing a hostile image")
        rel, names = check_name(rel), [check_name(n) for n in names]
        if "" in names or rel in names:
            raise IntegrityError(f"layer {layer_label(desc, i)} links the root or /{printable(rel)} to itself: "
                                 "refusing a hostile image")
        out[rel] = names
    return out


# ---- restore ----------------------------------------------------------------------------------------


def restore_image(ref: str, root: str, opts: Optional[RestoreOptions] = None) -> RestoreResult:
    """Restore `ref` into `root`, holding the state dir's lock (state.exclusive)."""
    opts = opts or RestoreOptions()
    with exclusive(opts.log):
        return _restore_image(ref, root, opts)


def _restore_image(ref: str, root: str, opts: RestoreOptions) -> RestoreResult:
    reference = Reference.parse(ref)
    if os.path.exists(root) and not os.path.isdir(root):
        raise UsageError(f"restore target {root} exists and is not a directory")
    remote = Remote(reference, opts.transport)
    image = remote.resolve()
    todo = select_layers(image, opts.only_snapshot)
    parts = part_files(todo)  # a malformed image is refused before anything is downloaded or written
    links = part_links(todo)
    fsync = opts.extract.fsync
    journal = _Journal(root, image.manifest_digest, [d["digest"] for _, d, _ in todo], fsync)
    base_layers = len(todo) - snapshot_layer_count(image) if not opts.only_snapshot else 0
    if base_layers > 0 and not opts.force and not journal.started_here():
        refuse_live_system(root, image, base_layers)
    never_write = tuple(restore_profile(image, opts.profile).exclude.patterns)
    try:
        extractor = Extractor(root, dataclasses.replace(opts.extract, never_write=never_write))
    except OSError as e:
        raise StorageError(f"cannot create the restore root {root}: {e.strerror or e}",
                           "restore into a directory on a writable filesystem") from e

    journal.load(opts.log)
    resumed = journal.applied
    pending = todo[resumed:]
    if resumed:
        opts.log(f"resuming: {resumed} layer(s) already applied by an earlier run")

    blob_dir = _state_sub("blobs")
    applied: list[str] = []
    headers: dict[str, str] = {}  # layer digest -> digest of its tar headers
    # An image may list one blob twice: each distinct blob is downloaded once, and removed after its last use.
    sizes = {d["digest"]: d["size"] for _, d, _ in pending}
    last_use = {d["digest"]: n for n, (_, d, _) in enumerate(pending)}
    # An uncompressed layer is its tar (its digest is its diff_id), whatever its media type says:
    # kept split, so that its big files are renamed into place instead of copied (staging.py).
    split = {d["digest"] for _, d, diff_id in pending if diff_id == d["digest"]}
    # Started before the download threads (a fork copies only the thread that forks), and stopped
    # first: after an error or a Ctrl-C it must not go on writing while running downloads finish.
    worker = ExtractWorker(extractor)
    # Set on an error or Ctrl-C: downloads in flight give up at their next chunk instead of
    # holding the exit until they end (a weight on a slow link takes minutes).
    stopping = threading.Event()
    with progress.bar("downloading", sum(sizes.values())) as dl, ThreadPoolExecutor(DOWNLOAD_WORKERS) as pool, worker:
        update = progress.stoppable(progress.safe_update(dl), stopping)

        def fetch(digest: str) -> str:
            path = os.path.join(blob_dir, digest.split(":", 1)[1] + (SPLIT_SUFFIX if digest in split else ""))
            # Left by an interrupted run: verified before its rename, but not fsynced (unless
            # --fsync), so after a power loss its bytes may be lost. Hashed again before use.
            if os.path.exists(path) and _stored_digest(path) == digest:
                update(sizes[digest])
            elif digest in split:
                _remove_blob(path)
                download_split(remote.iter_blob(digest, update), path, durable=fsync)
            else:
                remote.download_blob(digest, path, update, durable=fsync)
            return path

        # Submitted in layer order: the first layers arrive first, and each is applied as soon as it
        # is verified and the ones before it are applied, while the later ones still download.
        futures = {digest: pool.submit(fetch, digest) for digest in sizes}
        try:
            for n, (i, desc, diff_id) in enumerate(pending):
                label = layer_label(desc, i)
                path = futures[desc["digest"]].result()  # its digest checked: nothing unverified is applied
                _note_mislabelled(desc, path, desc["digest"] in split, label, opts.log)
                job = LayerJob(path, desc["mediaType"], diff_id, desc["digest"] in split, label,
                               record=bool(snap_label(desc)))  # snap's own: its headers teach the stat cache
                with progress.bar(f"extracting {label}", desc["size"]) as xb:
                    record = worker.apply(job, progress.safe_update(xb))
                if record is not None:
                    headers[desc["digest"]] = record
                journal.applied = resumed + n + 1
                journal.write()
                applied.append(label)
                if last_use[desc["digest"]] == n:
                    _remove_blob(path)
        except BaseException as e:
            stopping.set()
            for f in futures.values():
                f.cancel()
            if journal.applied > resumed:
                opts.log(f"stopped with {journal.applied} of {len(todo)} layer(s) applied: "
                         "the next restore into this root resumes after them")
            if isinstance(e, OSError) and e.errno is not None:
                raise storage_error(e, f"snap's state dir {blob_dir}", " while downloading layers",
                                    "free space or point SNAP_STATE_DIR at a bigger disk, and run the restore again: "
                                    "it resumes") from e
            raise
    if parts:
        _join_parts(extractor, parts, links, fsync, journal)
    if fsync:
        os.sync()  # all of it durable before the journal goes (the last renames' directories too)
    journal.remove()
    _note_sources(reference, image)
    _keep_base_index(remote, image, opts.log)
    seeded = _record_for_next_commit(root, image, headers) if headers and opts.seed_stat_cache else 0
    s = worker.stats
    s.files += extractor.stats.files  # the joins
    s.bytes += extractor.stats.bytes
    return RestoreResult(image.ref, image.manifest_digest, applied, resumed, s.files, s.bytes,
                         s.skipped_devices, s.stripped_setuid, seeded)


def _keep_base_index(remote: Remote, image: Image, log: Callable[[str], None]) -> None:
    """Cache the index of the snapshot's base that came with it (baseindex.py, a small blob), so
    that the first commit on this machine neither downloads nor reads the base's layers again."""
    ann = image.manifest.get("annotations") or {}
    base, digest = ann.get(BASE_DIGEST), ann.get(baseindex.SNAP_BASE_INDEX)
    if not (isinstance(base, str) and _DIGEST.fullmatch(base) and isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        return
    if not os.path.exists(baseindex.cache_path(base)):
        baseindex.fetch(remote, base, log, digest)


def _note_sources(reference: Reference, image: Image) -> None:
    """Remember that this repository holds the image's blobs: a later commit to another repository
    of the registry mounts them from here instead of uploading them (blobsources.py)."""
    index = (image.manifest.get("annotations") or {}).get(baseindex.SNAP_BASE_INDEX)
    travelled = [index, baseindex.EMPTY_CONFIG_DIGEST] if isinstance(index, str) else []
    sources = BlobSources()
    sources.note(reference.api_host, reference.repository,
                 [d["digest"] for d in image.layers] + [image.manifest["config"]["digest"]] + travelled)
    try:
        sources.save()
    except OSError:
        pass  # an optimisation only: the next commit uploads instead of mounting



def holds_system(root: str) -> Optional[str]:
    """What shows that `root` holds an operating system (an os-release, a populated usr/), or None."""
    for rel in ("etc/os-release", "usr/lib/os-release"):
        if os.path.lexists(os.path.join(root, rel)):
            return rel
    try:
        if os.listdir(os.path.join(root, "usr")):
            return "a populated usr/"
    except OSError:
        pass
    return None


def refuse_live_system(root: str, image: Image, base_layers: int) -> None:
    """A full image applied onto a running system replaces its libc, /etc/passwd and /bin and applies
    the base's whiteouts: refused, before anything is written."""
    sign = holds_system(root)
    if sign:
        raise UsageError(
            f"{root!r} already holds an operating system ({sign}): restoring all of {image.ref}, "
            f"{base_layers} base layer(s) included, would overwrite its system files",
            "pass --only-snapshot if it runs the snapshot's base image, or restore into an empty directory "
            "(or start the image with `snap run` on a Docker host), or pass --force to overwrite it")


def restore_profile(image: Image, name: Optional[str] = None) -> Profile:
    """The profile whose excludes a restore never writes: `name`, else the one the snapshot was
    committed with when snap ships it, else the default."""
    if name is None:
        committed = (image.manifest.get("annotations") or {}).get(SNAP_PROFILE)
        name = committed if committed in available_profiles() else "default"
    return load_profile(name)


def _record_for_next_commit(root: str, image: Image, applied_headers: dict[str, str]) -> int:
    """Note the snap layers just extracted (their tar headers, by digest) for the next commit of
    this root (statcache.write_restore_record). Returns how many."""
    ann = image.manifest.get("annotations") or {}
    try:
        max_layer = int(ann.get(SNAP_MAX_LAYER, DEFAULT_MAX_LAYER_SIZE))
    except ValueError:
        return 0
    diff_ids = dict(zip((desc["digest"] for desc in image.layers), image.config["rootfs"]["diff_ids"]))
    layers = {}
    for desc in image.layers:
        label, headers = snap_label(desc), applied_headers.get(desc["digest"])
        if label and headers is not None:
            layers[label] = {"digest": desc["digest"], "diff_id": diff_ids[desc["digest"]], "size": desc["size"],
                             "media_type": desc["mediaType"], "headers": headers}
    restored_at = time.time_ns()
    try:
        write_restore_record(root, {"base": ann.get(BASE_DIGEST), "profile": ann.get(SNAP_PROFILE),
                                    "max_layer": max_layer, "restored_at_ns": restored_at, "layers": layers})
    except OSError:
        return 0  # an optimisation only: the next commit reads the layers instead
    time.sleep(CLOCK_TICK_S)  # later writes get ctimes past restored_at (statcache.CLOCK_TICK_S)
    return len(layers)


# ---- joining part layers ---------------------------------------------------------------------------


def _join_parts(extractor: Extractor, files: dict[str, int], links: dict[str, list[str]], fsync: bool,
                journal: _Journal) -> None:
    """Join files that commit cut into part layers (over the registry's layer size cap) back into
    their original path. Each part was verified with its layer. Parts are opened without following
    symlinks, relative to their directory, and must be regular files: a hostile image cannot make
    a "part" of a host file. A file whose parts are all gone was joined by an earlier run; one with
    only some of them is refused. The file's other names (`links`) are then hardlinked to it, as
    a layer's hardlink is made (scoped to the root, never replacing a directory)."""
    try:
        for rel, count in files.items():
            try:
                _join_file(extractor, rel, count, fsync, journal)
                for name in links.get(rel, ()):
                    link = tarfile.TarInfo(name)
                    link.type, link.linkname = tarfile.LNKTYPE, rel
                    extractor._apply_member(None, link)  # a hardlink entry: no data to read
            except OSError as e:
                raise storage_error(e, extractor.root, f" while joining the parts of /{printable(rel)}") from e
    finally:
        extractor.put_back_dir_times()


def _join_file(extractor: Extractor, rel: str, count: int, fsync: bool, journal: _Journal) -> None:
    try:
        pdir, _ = extractor._locate(rel, create=False)
    except FileNotFoundError:
        return  # no directory, so no parts: nothing to join
    base = rel.rpartition("/")[2]
    names = [part_name(base, k, count) for k in range(1, count + 1)]
    dfd = os.open(pdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        present = [_lexists_at(name, dfd) for name in names]
        if rel in journal.joined:  # joined and recorded; a killed run may have left some parts
            for name, there in zip(names, present):
                if there:
                    extractor._note_parent(pdir)
                    os.unlink(name, dir_fd=dfd)
            return
        if not any(present):
            return  # joined by an earlier run
        if not all(present):
            first = present.index(False) + 1
            raise IntegrityError(f"/{printable(rel)} is cut into {count} part layers, but {present.count(False)} of its parts "
                                 f"(part {first} first) are missing from the restored tree: refusing to join an incomplete file",
                                 "restore again into an empty directory")
        extractor._note_parent(pdir)
        tmp = f"{TMP_PREFIX}join-{os.getpid()}"
        out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            with os.fdopen(out_fd, "wb") as out:
                first_st = None
                for k, name in enumerate(names, 1):
                    fd, st = _open_part(name, dfd, rel, k, count)
                    first_st = first_st or st
                    with os.fdopen(fd, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 20)
                out.flush()
                if fsync:
                    os.fsync(out.fileno())
                if extractor.opts.same_owner:
                    os.fchown(out.fileno(), first_st.st_uid, first_st.st_gid)
                os.fchmod(out.fileno(), stat.S_IMODE(first_st.st_mode))  # after chown: chown clears setuid bits
                os.utime(out.fileno(), ns=(first_st.st_atime_ns, first_st.st_mtime_ns))
            os.rename(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
        journal.joined.append(rel)
        journal.write()  # before the parts go: a run killed while removing them knows the file is whole
        for name in names:
            os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


def _lexists_at(name: str, dfd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False


def _open_part(name: str, dfd: int, rel: str, k: int, count: int) -> tuple[int, os.stat_result]:
    """A read-only fd on part k of /rel: a regular file in directory `dfd`, never through a symlink."""
    st = os.lstat(name, dir_fd=dfd)
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise IntegrityError(f"part {k}/{count} of /{printable(rel)} is {kind}: refusing a hostile image")
    try:
        # O_NONBLOCK: had the path been swapped for a FIFO since the lstat, open would not hang on it.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise IntegrityError(f"part {k}/{count} of /{printable(rel)} is a symlink: refusing a hostile image")
        raise
    fst = os.fstat(fd)
    if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise IntegrityError(f"part {k}/{count} of /{printable(rel)} changed while being joined: refusing it")
    return fd, fst


def _note_mislabelled(desc: dict, path: str, split: bool, label: str, log: Callable[[str], None]) -> None:
    """Say it in one line when a layer's bytes are not what its media type says (the extractor
    reads them by their bytes all the same)."""
    if split:
        kind = "none"
    else:
        with open(path, "rb") as f:
            kind = sniff_compression(read_head(f))
    if kind is not None and (msg := label_mismatch(desc["mediaType"], kind)):
        log(f"warning: {label}: {msg}")


def _stored_digest(path: str) -> Optional[str]:
    """The digest of a blob kept in the state dir (a file, or a split layer's directory)."""
    try:
        if path.endswith(SPLIT_SUFFIX):
            with SplitLayer(path) as layer:
                return layer.digest()
        with open(path, "rb") as f:
            return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
    except (OSError, ValueError, IntegrityError):
        return None  # incomplete (a kill while its files were moved into place): fetched again


def _remove_blob(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
