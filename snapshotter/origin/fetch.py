"""Fetching referenced blobs from the origin (Hugging Face, or the HF_ENDPOINT a restore names), the
way huggingface_hub does and no looser: GET {endpoint}/{repo}/resolve/{commit}/{path}, redirects
followed to a CDN only to checked hosts (the registry's destination checks: http(s), no link-local or
metadata address, https unless the endpoint itself is http), at most MAX_REDIRECTS of them, HF_TOKEN
sent only to the endpoint's own scheme, host and port (never to the CDN), the answer bounded by the
reference's size.

Bytes land in `<blob>.snap-part` beside the blob, resumed with a Range where a part is left; the
sha256 is checked before an atomic rename puts the blob at its path, so a path holds the whole
verified file or nothing. A blob already at its path with the right hash is not fetched again.
Every path is opened beneath the root, following no symlink (box/openat.py)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import requests

from snapshotter.box.openat import open_root
from snapshotter.digests import file_digest
from snapshotter.errors import (IntegrityError, NotFound, OriginAuthError, RegistryError, RegistryUnreachable,
                                SnapError, UsageError, storage_error)
from snapshotter.origin.layout import open_folder
from snapshotter.origin.references import DEFAULT_ENDPOINT, Reference
from snapshotter.registry.answers import short_error
from snapshotter.registry.destinations import GuardedSession, check_destination, origin
from snapshotter.registry.transport import TIMEOUT

ENDPOINT_ENV = "HF_ENDPOINT"
TOKEN_ENV = "HF_TOKEN"
MAX_REDIRECTS = 5  # the hub itself answers with one, to its CDN
CHUNK = 1 << 20
PART_SUFFIX = ".snap-part"
REDIRECTS = (301, 302, 303, 307, 308)
_FOLDER_TIMES = threading.Lock()  # _folder_times_kept's: one name made or removed at a time
OnBytes = Optional[Callable[[int], None]]  # told each received chunk's size: progress


@dataclass(frozen=True)
class Origin:
    """Where references are fetched from and the token for it: the restoring side's settings, never
    the snapshot's (a snapshot that named its own endpoint could collect the token)."""

    endpoint: str = DEFAULT_ENDPOINT
    token: Optional[str] = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Origin":
        """HF_ENDPOINT (default https://huggingface.co) and HF_TOKEN, as huggingface_hub reads them."""
        endpoint = env.get(ENDPOINT_ENV, "").strip().rstrip("/") or DEFAULT_ENDPOINT
        scheme, host, _ = origin(endpoint)
        if scheme not in ("http", "https") or not host:
            raise UsageError(f"{ENDPOINT_ENV}={endpoint[:200]!r} is not an http(s) URL",
                             "set it to the hub's address, e.g. https://huggingface.co")
        try:
            check_destination(endpoint, UsageError)
        except UsageError as e:
            raise UsageError(f"{ENDPOINT_ENV}={endpoint[:200]!r}: {e.args[0]}",
                             "set it to the hub's address, e.g. https://huggingface.co") from None
        return cls(endpoint, env.get(TOKEN_ENV, "").strip() or None)

    def url(self, ref: Reference) -> str:
        """{endpoint}/{repo}/resolve/{commit}/{path}: the hub's address of one file at one commit."""
        return (f"{self.endpoint}/{ref.url_path}/resolve/{urllib.parse.quote(ref.revision, safe='')}/"
                f"{urllib.parse.quote(ref.path, safe='/')}")

    def may_follow(self, url: str) -> str:
        """Why a hop to `url` is refused ("" if it is not): https only, unless the endpoint is http."""
        scheme = origin(url)[0]
        if scheme == "https" or (scheme == "http" and origin(self.endpoint)[0] == "http"):
            return ""
        return "only https is followed from an https endpoint"

    def gets_token(self, url: str) -> bool:
        return self.token is not None and origin(url) == origin(self.endpoint)


@dataclass
class FetchReport:
    """What a fetch of many references did: blobs fetched, blobs already there, and failures (path, error)."""

    fetched: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    failed: list[tuple[str, SnapError]] = field(default_factory=list)

    def raise_first(self) -> None:
        """The first failure, as its own error kind, the others counted in its hint."""
        if self.failed:
            path, error = self.failed[0]
            more = f"{len(self.failed) - 1} more failed; " if len(self.failed) > 1 else ""
            raise type(error)(str(error.args[0]), f"{more}everything else is in place; rerun to fetch what is missing")


def fetch_all(root: str, refs: list[Reference], source: Origin, workers: int = 4,
              on_bytes: OnBytes = None, on_thread: Callable[[], None] = lambda: None) -> FetchReport:
    """Every blob the references name, `workers` at a time, each once; every one is tried whatever
    the others do, so that a failure loses nothing else. `on_thread` is called in the fetching
    thread before each blob (the restore lowers its priority there)."""
    blobs = list({r.blob_path: r for r in refs}.values())
    report = FetchReport()

    def fetch_one(ref: Reference):
        on_thread()
        return _fetch_one(root, ref, source, on_bytes)

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="origin-fetch") as pool:
        results = pool.map(fetch_one, blobs)
        for ref, result in zip(blobs, results):
            if isinstance(result, SnapError):
                report.failed.append((ref.blob_path, result))
            else:
                (report.fetched if result else report.present).append(ref.blob_path)
    return report


def _fetch_one(root: str, ref: Reference, source: Origin, on_bytes: OnBytes):
    try:
        return fetch(root, ref, source, on_bytes=on_bytes)
    except SnapError as e:
        return e


def fetch(root: str, ref: Reference, source: Origin, session: Optional[requests.Session] = None,
          on_bytes: OnBytes = None) -> bool:
    """Put the blob `ref` names at its path below `root`: True if fetched, False if it was there.
    Errors name the file and the origin in one line: RegistryUnreachable (3), OriginAuthError (4),
    NotFound (5), IntegrityError (6), RegistryError (10), StorageError (7)."""
    root_fd = open_root(root)
    try:
        blobs_fd = open_folder(root_fd, ref.blob_path.rpartition("/")[0])
        try:
            if _has_blob(blobs_fd, ref):
                return False
            with session or GuardedSession() as s:
                _download(s, blobs_fd, ref, source, on_bytes)
            return True
        finally:
            os.close(blobs_fd)
    finally:
        os.close(root_fd)


def _what(ref: Reference, source: Origin) -> str:
    return f"{ref.path!r} of {ref.url_path!r} from {source.endpoint!r}"


def _has_blob(blobs_fd: int, ref: Reference) -> bool:
    """Whether the verified blob is already at its path (a rerun fetches only what is missing)."""
    try:
        fd = os.open(ref.sha256, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=blobs_fd)
    except OSError:
        return False
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != ref.size:  # fdopen refuses a folder: not one to open as a file
        os.close(fd)
        return False
    with os.fdopen(fd, "rb") as f:
        return file_digest(f) == "sha256:" + ref.sha256


def _download(session: requests.Session, blobs_fd: int, ref: Reference, source: Origin, on_bytes: OnBytes) -> None:
    """Fetch into the part file (resumed where one is left), verify, then rename it to the blob."""
    part = ref.sha256 + PART_SUFFIX
    with _locked_part(blobs_fd, ref) as f:
        if f is None:
            return  # another fetch put the blob in place while we waited for its part
        try:
            hasher = _resume(f, ref)
            if f.tell() < ref.size:
                hasher = _receive(session, f, hasher, ref, source, on_bytes)
        except BaseException:
            if not os.fstat(f.fileno()).st_size:
                _drop_part(blobs_fd, part)  # nothing arrived (401, 404): no empty part for a commit to capture
            raise
        if hasher.hexdigest() != ref.sha256:
            _drop_part(blobs_fd, part)  # a rerun starts afresh; the folder's times stay the box's
            raise IntegrityError(f"{_what(ref, source)}: its content does not hash to the sha256 it is referenced by",
                                 "the origin serves other bytes than the box had: nothing was put in place")
        try:
            _settle(f, ref)
            with _folder_times_kept(blobs_fd):
                os.replace(part, ref.sha256, src_dir_fd=blobs_fd, dst_dir_fd=blobs_fd)  # still locked: none appends
        except OSError as e:  # a folder at the blob's path, an owner the file system refuses
            _drop_part(blobs_fd, part)
            raise storage_error(e, repr(ref.blob_path)) from None
    os.fsync(blobs_fd)


def _drop_part(blobs_fd: int, part: str) -> None:
    """Remove the part file, the folder's times kept (_folder_times_kept)."""
    with _folder_times_kept(blobs_fd), contextlib.suppress(FileNotFoundError):
        os.unlink(part, dir_fd=blobs_fd)


@contextlib.contextmanager
def _folder_times_kept(folder_fd: int):
    """The folder's times as they were before a name is made or renamed in it: a restore's layers
    set the blobs folder's times as the box had them, and a blob landing after must not change them.
    One at a time: two fetches in one folder interleaved would put back the time the other's made."""
    with _FOLDER_TIMES:
        st = os.fstat(folder_fd)
        yield
        with contextlib.suppress(OSError):  # not ours to set (a restore as another user): only the time is off
            os.utime(folder_fd, ns=(st.st_atime_ns, st.st_mtime_ns))


@contextlib.contextmanager
def _locked_part(blobs_fd: int, ref: Reference):
    """The part file, opened unbuffered (what arrived is in it if we are killed) and locked (flock):
    two fetches of one blob (two restores of a root) take turns. None if, once ours, the name is no
    longer the file we locked and the blob is in place: the other fetch finished it."""
    part = ref.sha256 + PART_SUFFIX
    while True:
        try:
            with _folder_times_kept(blobs_fd):
                fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=blobs_fd)
        except OSError as e:
            raise storage_error(e, repr(ref.blob_path)) from None
        with os.fdopen(fd, "r+b", buffering=0) as f:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(part, dir_fd=blobs_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield f
                return
        if _has_blob(blobs_fd, ref):
            yield None
            return


def _resume(f, ref: Reference):
    """A sha256 of what the part file holds (its position at the end), or of nothing after truncating
    a part longer than the blob can be."""
    size = os.fstat(f.fileno()).st_size
    if size > ref.size:
        f.truncate(0)
    hasher = hashlib.sha256()
    while chunk := f.read(CHUNK):
        hasher.update(chunk)
    return hasher


def _receive(session: requests.Session, f, hasher, ref: Reference, source: Origin, on_bytes: OnBytes):
    """Append the rest of the blob to `f` (positioned at its end) from the origin, bounded by its
    size; the hasher of the whole part file."""
    start = f.tell()
    r = _open(session, source.url(ref), start, ref, source)
    with r:
        if start and r.status_code == 200:  # the server ignored the Range: start over
            f.seek(0)
            f.truncate(0)
            hasher, start = hashlib.sha256(), 0
        _check_length(r, start, ref, source)
        try:
            for chunk in r.iter_content(CHUNK):
                if f.tell() + len(chunk) > ref.size:
                    raise IntegrityError(f"{_what(ref, source)}: the origin sends more than the {ref.size} bytes "
                                         "it is referenced with")
                view = memoryview(chunk)
                while view:  # an unbuffered write may take part of it
                    view = view[f.write(view):]
                hasher.update(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
        except (requests.RequestException, OSError) as e:
            if isinstance(e, OSError) and not isinstance(e, requests.RequestException):
                raise storage_error(e, repr(ref.blob_path)) from None
            f.flush()
            raise RegistryUnreachable(f"{_what(ref, source)} broke off: {short_error(e)}",
                                      "rerun: it resumes where it stopped") from None
    f.flush()
    if f.tell() != ref.size:
        raise RegistryUnreachable(f"{_what(ref, source)} broke off at byte {f.tell()} of {ref.size}",
                                  "rerun: it resumes where it stopped")
    return hasher


def _open(session: requests.Session, url: str, start: int, ref: Reference, source: Origin) -> requests.Response:
    """The answer to GET `url` from byte `start`, redirects followed by hand: each hop checked before
    it is connected to, the token only to the endpoint's own origin (requests' own redirects would
    take the Range and the checks along less carefully)."""
    for _ in range(MAX_REDIRECTS + 1):
        why = source.may_follow(url)
        if why:
            raise RegistryError(f"{_what(ref, source)}: refusing to follow {url[:200]!r}: {why}")
        headers = {"Accept-Encoding": "identity"}  # the bytes themselves: the size and hash are of them
        if start:
            headers["Range"] = f"bytes={start}-"
        if source.gets_token(url):
            headers["Authorization"] = f"Bearer {source.token}"
        try:
            check_destination(url)
            r = session.get(url, headers=headers, stream=True, allow_redirects=False, timeout=TIMEOUT)
        except RegistryError as e:
            raise RegistryError(f"{_what(ref, source)}: {e.args[0]}", "only the origin and the hosts it "
                                "redirects to, if they pass the destination checks, are reached") from None
        except requests.RequestException as e:
            raise RegistryUnreachable(f"cannot reach the origin for {_what(ref, source)}: {short_error(e)}",
                                      f"check the network, or {ENDPOINT_ENV}") from None
        if r.status_code in REDIRECTS and r.headers.get("Location"):
            url = urllib.parse.urljoin(url, r.headers["Location"])
            r.close()
            continue
        _check_status(r, ref, source)
        return r
    raise RegistryError(f"{_what(ref, source)}: more than {MAX_REDIRECTS} redirects")


def _check_status(r: requests.Response, ref: Reference, source: Origin) -> None:
    """One-line errors for an answer that is not the file: 401/403 auth, 404 not found, 429 rate-limited
    (exit 10, rerun), 5xx unreachable (3), else the status."""
    if r.status_code in (200, 206):
        return
    r.close()
    what = _what(ref, source)
    if r.status_code in (401, 403):
        raise OriginAuthError(f"{what}: HTTP {r.status_code}: the origin refuses it",
                              f"a gated or private repository: set {TOKEN_ENV} to a token that may read it")
    if r.status_code == 404:
        raise NotFound(f"{what}: HTTP 404: the origin does not have it (deleted, or the repository renamed)")
    if r.status_code == 429:
        raise RegistryError(f"{what}: HTTP 429: the origin limits the rate of downloads",
                            "rerun in a while: it fetches only what is missing")
    if r.status_code >= 500:
        raise RegistryUnreachable(f"{what}: HTTP {r.status_code}: the origin is failing", "rerun later: it resumes")
    raise RegistryError(f"{what}: HTTP {r.status_code}")


def _check_length(r: requests.Response, start: int, ref: Reference, source: Origin) -> None:
    """A ranged answer must start where asked, and any answer must not be longer than the blob's rest."""
    if r.status_code == 206:
        first = r.headers.get("Content-Range", "").removeprefix("bytes ").partition("-")[0]
        if first != str(start):
            raise RegistryError(f"{_what(ref, source)}: asked from byte {start}, answered "
                                f"{r.headers.get('Content-Range', 'no range')[:100]!r}")
    length = r.headers.get("Content-Length", "")
    if length.isdigit() and int(length) != ref.size - start:
        raise IntegrityError(f"{_what(ref, source)}: the origin sends {length} bytes where {ref.size - start} "
                             "are missing of the size it is referenced with")


def _settle(f, ref: Reference) -> None:
    """The blob's bytes on disk, and its mode, owner (where we may) and mtime the box's."""
    f.flush()
    os.fsync(f.fileno())
    os.fchmod(f.fileno(), ref.mode)
    if os.geteuid() == 0:
        try:
            os.fchown(f.fileno(), ref.uid, ref.gid)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EINVAL):  # an id the file system cannot hold
                raise
        os.fchmod(f.fileno(), ref.mode)  # chown clears setuid bits: the box's mode again
    if ref.mtime_ns:
        os.utime(f.fileno(), ns=(ref.mtime_ns, ref.mtime_ns))
