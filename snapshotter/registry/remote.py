"""The OCI distribution protocol (v2 API) for one repository: references, index -> platform
manifest resolution, manifests pushed as the exact bytes we hashed, verified streamed downloads,
streamed uploads in bounded memory (upload.py), cross-repository mounts. HTTP, auth and retries
are the transport's (transport.py): no request here sets an Authorization header.

oras-py takes no protocol step here: its manifest calls re-serialise JSON (the digest would not
be the one we hashed), its upload reads a whole blob into memory (or PATCHes 16 MiB chunks, a
writer reopen each on the registry) and its download does not check the digest.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import threading
import time
import urllib.parse
from typing import Callable, Iterator, Optional

import requests

from snapshotter import jsontext
from snapshotter import settings
from snapshotter.digests import DIGEST, hasher_digest, sha256_digest
from snapshotter.errors import (IntegrityError, NotFound, RegistryError, RegistryUnreachable, SnapError, UsageError,
                                printable)
from snapshotter.oci.image import Image, NewImage
from snapshotter.oci.mediatypes import INDEX_TYPES, MANIFEST_TYPES, OCI_MANIFEST
from snapshotter.oci.reference import Reference
from snapshotter.state import remove_if_there

from .answers import check, json_object, short_error
from .transport import Transport, TransportOptions
from .upload import PIECE_SIZE, Digest, upload

ProgressFn = Optional[Callable[[int], None]]

MAX_DOCUMENT_SIZE = 4 << 20  # manifests, indexes, configs: distribution's own cap on a manifest
MAX_INDEX_DEPTH = 8  # an index that names an index ...: deeper chains are refused
MAX_TAG_PAGES = 500  # of a tag list, 1000 tags each
# Every download has an overall deadline: a grace ($SNAP_DOWNLOAD_GRACE seconds) plus its declared
# size at the minimum throughput ($SNAP_MIN_THROUGHPUT, bytes per second, K/M/G suffixes allowed).
# Per-read timeouts alone let a registry that drips a byte every few seconds keep a restore waiting forever.
MIN_THROUGHPUT_ENV = "SNAP_MIN_THROUGHPUT"
DEFAULT_MIN_THROUGHPUT = 64 << 10
DOWNLOAD_GRACE_ENV = "SNAP_DOWNLOAD_GRACE"
DEFAULT_DOWNLOAD_GRACE = 10.0
MIN_DEADLINE = 1.0  # seconds: a small blob's size at the minimum throughput is a few ms, less than a round trip
BODY_PIECE = 1 << 20
BLOB_UNKNOWN = "MANIFEST_BLOB_UNKNOWN"  # the distribution spec's code for a manifest naming blobs the registry lacks
_RATE = re.compile(r"([0-9]+)\s*([kmg]?)(?:i?b)?(?:/s)?", re.I)


class BlobsUnknown(RegistryError):
    """The registry refused a manifest for blobs it lacks (MANIFEST_BLOB_UNKNOWN): one a manifest of
    the repository lists, lost since (held_by), or one never sent."""


def host_platform() -> tuple[str, str]:
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(platform.machine(), platform.machine())
    return "linux", arch


class Remote:
    """One repository on one registry: its manifests and blobs, over a `Transport`."""

    def __init__(self, ref: Reference, options: Optional[TransportOptions] = None):
        self.ref = ref
        self.transport = Transport(ref.registry, ref.repository, options)
        # Set by the caller on an error or Ctrl-C: uploads in flight give up, even one whose socket hangs.
        self.stopping = threading.Event()
        self.pushed: dict[str, int] = {}  # bytes this client put into the registry, by what they were
        self._pushed_lock = threading.Lock()  # uploads run in threads
        # Blobs a manifest of this repository lists (held_by): the registry keeps those, so a commit
        # asks no HEAD for them (62 round trips on a commit that reuses 62 layers).
        self.listed: set[str] = set()

    # ---- manifests -------------------------------------------------------------------------

    def get_manifest(self, target: str) -> tuple[bytes, str, str]:
        """Return (bytes, media type, digest) of a manifest or index, verifying pinned digests."""
        if ":" in target and target.partition(":")[0] not in ("sha256", "sha384", "sha512"):
            raise IntegrityError(f"manifest digest {printable(target)!r} uses an algorithm OCI does not define")
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        with self.transport.request("GET", self.transport.url(f"manifests/{target}"), headers={"Accept": accept},
                                    stream=True) as r:
            if r.status_code == 404:
                raise NotFound(f"image {self.ref.name}:{target} not found in the registry" if ":" not in target
                               else f"image {self.ref.name}@{target} not found in the registry")
            check(r, f"fetch manifest {self.ref.name}:{target}")
            body = b"".join(self._body(r, f"manifest {target}", MAX_DOCUMENT_SIZE, RegistryError))
        digest = sha256_digest(body)
        algorithm, pinned, _ = target.partition(":")  # a digest (sha256, sha384, sha512), or a tag
        if pinned and hasher_digest(hashlib.new(algorithm, body)) != target:
            raise IntegrityError(f"manifest {target} from {self.ref.registry} does not match its digest")
        media = r.headers.get("Content-Type", "").split(";")[0].strip() or _json(body, "manifest").get("mediaType", "")
        return body, media, digest

    def resolve(self, target: Optional[str] = None, want: Optional[tuple[str, str]] = None, depth: int = 0) -> Image:
        """Fetch the image for this ref (following an index to the host platform) and its config.
        What the image's documents say is checked before it is used (IntegrityError)."""
        body, media, digest = self.get_manifest(target or self.ref.target)
        doc = _json(body, "manifest")
        if media in INDEX_TYPES or (not media and "manifests" in doc):
            if depth >= MAX_INDEX_DEPTH:
                raise IntegrityError(f"image {self.ref} is an index of indexes more than {MAX_INDEX_DEPTH} deep: "
                                     "refusing a hostile image")
            os_, arch = want or host_platform()
            manifests = doc.get("manifests", [])
            if not isinstance(manifests, list) or not all(isinstance(m, dict) for m in manifests):
                raise IntegrityError(f"image {self.ref} has a malformed index")
            for m in manifests:
                p = m.get("platform") or {}
                if isinstance(p, dict) and p.get("os") == os_ and p.get("architecture") == arch:
                    if not _valid_descriptor(m):
                        raise IntegrityError(f"image {self.ref} has a malformed descriptor in its index")
                    return self.resolve(m["digest"], want, depth + 1)
            raise NotFound(f"image {self.ref} has no {os_}/{arch} manifest in its index")
        if media not in MANIFEST_TYPES and doc.get("mediaType") not in MANIFEST_TYPES:
            raise UsageError(f"{self.ref} is not a container image (media type {media or 'unknown'})")
        cfg_desc = doc.get("config")
        if not _valid_descriptor(cfg_desc) or not isinstance(doc.get("layers"), list) \
                or not isinstance(doc.get("annotations", {}), dict):
            raise IntegrityError(f"image {self.ref} has a malformed manifest (config, layers or annotations)")
        config = self.fetch_bytes(cfg_desc["digest"], cfg_desc["size"])
        cfg = _json(config, "config", IntegrityError)
        rootfs = cfg.get("rootfs", {})
        if not isinstance(rootfs, dict) or not isinstance(rootfs.get("diff_ids", []), list) \
                or not all(isinstance(d, str) and DIGEST.fullmatch(d) for d in rootfs.get("diff_ids", [])):
            raise IntegrityError(f"image {self.ref} has a malformed config (rootfs.diff_ids)")
        return Image(self.ref.with_digest(digest), body, digest, config)

    def put_manifest(self, body: bytes, media_type: str, target: str) -> str:
        """PUT the exact bytes (never re-serialised, so the digest is what we computed). BlobsUnknown:
        the registry lacks a blob the manifest lists."""
        r = self.transport.request("PUT", self.transport.url(f"manifests/{target}"), data=body,
                                   headers={"Content-Type": media_type})
        check(r, f"push manifest to {self.ref.name}:{target}", {BLOB_UNKNOWN: BlobsUnknown})
        self._count("manifests", len(body))
        return sha256_digest(body)

    def write_config(self, image: NewImage) -> tuple[bytes, str]:
        """Push a built image's config unless the registry has it: (its bytes, its digest)."""
        config = image.config_bytes()
        config_digest = sha256_digest(config)
        if not self.blob_exists(config_digest):
            self.upload_from(lambda out: out.write(config), config_digest, len(config), what="config")
        return config, config_digest

    def write_image(self, image: NewImage, target: str,
                    before_tag: Optional[Callable[[str], None]] = None) -> tuple[str, bytes, str]:
        """Push a built image whose layers are already in: its config (write_config), then its
        manifest under `target`; the tag moves only now, after every blob is in. `before_tag` is
        told the manifest's digest before the tag moves. Returns (the manifest's digest, its bytes,
        the config's digest)."""
        config, config_digest = self.write_config(image)
        manifest = image.manifest_bytes(config)
        if before_tag is not None:
            before_tag(sha256_digest(manifest))
        return self.put_manifest(manifest, OCI_MANIFEST, target), manifest, config_digest

    def _count(self, what: str, n: int) -> None:
        with self._pushed_lock:
            self.pushed[what] = self.pushed.get(what, 0) + n

    def tagged(self, tag: str) -> Optional[tuple[str, bytes]]:
        """The manifest a tag names now: (its digest, its exact bytes); None if there is no such tag."""
        try:
            body, _, digest = self.get_manifest(tag)
        except NotFound:
            return None
        return digest, body

    def held_by(self, body: bytes) -> None:
        """Note the blobs an image manifest of this repository lists (its config and layers) as held:
        a registry refuses a manifest whose blobs it lacks, and its garbage collection keeps them.
        A registry that lost one since (damaged storage, a blob deleted by hand) refuses the next
        manifest that lists it (BlobsUnknown): the caller then forgets these (forget_held) and asks."""
        try:
            doc = jsontext.loads(body)
            self.listed.update(d["digest"] for d in [doc["config"], *doc["layers"]]
                               if isinstance(d, dict) and isinstance(d.get("digest"), str))
        except (ValueError, KeyError, TypeError):
            pass  # not an image manifest (an index, an artifact of another shape): nothing is known

    def forget_held(self) -> None:
        """Trust no manifest's list of blobs any more (held_by): each blob is looked up (HEAD)."""
        self.listed.clear()

    def manifest_digest(self, tag: str) -> Optional[str]:
        """The digest a tag points at (HEAD, nothing downloaded); None if there is no such tag."""
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        r = self.transport.request("HEAD", self.transport.url(f"manifests/{tag}"), headers={"Accept": accept})
        if r.status_code == 404:
            return None
        check(r, f"look up {self.ref.name}:{tag}")
        return r.headers.get("Docker-Content-Digest") or self.get_manifest(tag)[2]

    def list_tags(self) -> list[str]:
        """Every tag of the repository, following the registry's pages (Link: rel="next"): at
        most MAX_TAG_PAGES of them, none asked for twice (a registry whose pages loop)."""
        tags: list[str] = []
        url = self.transport.url("tags/list?n=1000")
        seen: set[str] = set()
        while url:
            if url in seen or len(seen) >= MAX_TAG_PAGES:
                why = "names a page again" if url in seen else f"has more than {MAX_TAG_PAGES} pages"
                raise RegistryError(f"the tag list of {self.ref.name} on registry {self.ref.registry!r} {why}: "
                                    "giving up")
            seen.add(url)
            r = self.transport.request("GET", url)
            if r.status_code == 404:
                return tags  # a repository with nothing pushed yet
            check(r, f"list the tags of {self.ref.name}")
            page = _json(r.content, "tag list").get("tags") or []
            if not isinstance(page, list) or not all(isinstance(t, str) for t in page):
                raise RegistryError(f"registry {self.ref.registry!r} returned a tag list whose tags are not strings")
            tags.extend(page)
            nxt = r.links.get("next", {}).get("url")
            url = self.transport.absolute(nxt) if nxt else ""
        return tags

    def delete_manifest(self, digest: str) -> bool:
        """Delete a manifest (and every tag on it). False when the registry does not allow it."""
        r = self.transport.request("DELETE", self.transport.url(f"manifests/{digest}"))
        if r.status_code in (404, 202, 200):
            return True
        if r.status_code in (400, 403, 405) or "UNSUPPORTED" in r.text:
            return False
        check(r, f"delete manifest {digest} from {self.ref.name}")
        return True

    # ---- blobs -------------------------------------------------------------------------------

    def blob_exists(self, digest: str) -> bool:
        if digest in self.listed:
            return True
        r = self.transport.request("HEAD", self.transport.url(f"blobs/{digest}"))
        return r.status_code == 200

    def fetch_bytes(self, digest: str, size: Optional[int] = None) -> bytes:
        """A small blob (a config: at most MAX_DOCUMENT_SIZE, and `size` if given) into memory, verified."""
        if size is not None and size > MAX_DOCUMENT_SIZE:
            raise IntegrityError(f"blob {digest} of {self.ref.name} is {size} bytes, more than the {MAX_DOCUMENT_SIZE} "
                                 "an image config may have: refusing a hostile image")
        with self.open_blob(digest) as r:
            data = b"".join(self._body(r, f"blob {digest}", MAX_DOCUMENT_SIZE if size is None else size))
        if sha256_digest(data) != digest:
            raise IntegrityError(f"blob {digest} from {self.ref.name} does not match its digest")
        return data

    def open_blob(self, digest: str, offset: int = 0) -> requests.Response:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        r = self.transport.request("GET", self.transport.url(f"blobs/{digest}"), stream=True, headers=headers)
        if r.status_code == 404:
            raise NotFound(f"blob {digest} missing from {self.ref.name}")
        check(r, f"fetch blob {digest}")
        return r

    def iter_blob(self, digest: str, progress: ProgressFn = None, size: Optional[int] = None) -> Iterator[bytes]:
        """Stream a blob. Raises IntegrityError at the end if the bytes do not hash to `digest`:
        callers that write must treat what they got as untrusted until the generator finishes.
        `size` (the descriptor's): a blob that grows past it is refused as soon as it does, and
        the download has a deadline derived from it (see min_throughput)."""
        # Not oras's download_blob: it never checks the digest of what it wrote.
        h = hashlib.sha256()
        for chunk in self.iter_blob_unhashed(digest, progress, size):
            h.update(chunk)
            yield chunk
        if hasher_digest(h) != digest:
            raise IntegrityError(f"blob {digest} from {self.ref.name} does not match its digest (tampered or corrupt)")

    def iter_blob_unhashed(self, digest: str, progress: ProgressFn = None,
                           size: Optional[int] = None) -> Iterator[bytes]:
        """iter_blob without the digest check, for a caller whose own check covers every byte as
        surely (an encrypted layer's HMAC, under a key the same manifest names): one sha256 pass less."""
        with self.open_blob(digest) as r:
            for chunk in self._body(r, f"blob {digest}", size):
                if progress:
                    progress(len(chunk))
                yield chunk

    def _body(self, r: requests.Response, what: str, limit: Optional[int],
              too_long: type[SnapError] = IntegrityError) -> Iterator[bytes]:
        """A response body in pieces of up to BODY_PIECE bytes. Refused (`too_long`) once it passes
        `limit` bytes, and (RegistryUnreachable) once it takes longer than the grace plus `limit`
        bytes at the minimum throughput. Each read takes what has arrived, so that a registry that
        drips bytes meets the deadline instead of filling a piece first."""
        registry = self.ref.registry
        rate = min_throughput()
        allowed = max(MIN_DEADLINE, download_grace() + (limit or 0) / rate)
        deadline = time.monotonic() + allowed if limit is not None else None
        got = 0
        parts: list[bytes] = []
        pending = 0
        while True:
            try:
                data = r.raw.read1(BODY_PIECE, decode_content=True)
            except Exception as e:  # noqa: BLE001 - urllib3's read errors are not requests' nor OSError
                if isinstance(e, SnapError):
                    raise
                raise RegistryUnreachable(f"download of {what} from {registry} broke off: {short_error(e)}") from None
            got += len(data)
            if limit is not None and got > limit:
                raise too_long(f"{what} from {registry} is longer than the {limit} bytes it may have: refusing it")
            if deadline is not None and got < (limit or 0) and time.monotonic() > deadline:  # (all in: it made it)
                raise RegistryUnreachable(f"download of {what} from {registry} is slower than {rate} bytes/s "
                                          f"({got} of {limit} bytes in {allowed:.0f} s): giving up",
                                          f"on a slow link, set {MIN_THROUGHPUT_ENV} lower (bytes per second) "
                                          f"or {DOWNLOAD_GRACE_ENV} higher (seconds)")
            if data:
                parts.append(data)
                pending += len(data)
            if pending >= BODY_PIECE or (not data and pending):
                yield b"".join(parts) if len(parts) > 1 else parts[0]
                parts, pending = [], 0
            if not data:
                return

    def download_blob(self, digest: str, dest: str, progress: ProgressFn = None, durable: bool = False,
                      size: Optional[int] = None) -> None:
        """Download to `dest` atomically: written to dest.part, verified, then renamed. `durable`
        fsyncs it first (else a power loss can leave a renamed file with lost bytes: a cache
        that keeps blobs across runs must check them again, as restore does). `size`: see iter_blob."""
        part = dest + ".part"
        remove_if_there(part)  # an interrupted run's, or planted: never written through
        try:
            # O_EXCL | O_NOFOLLOW: a name swapped in since is refused, not followed.
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                for chunk in self.iter_blob(digest, progress, size):
                    f.write(chunk)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(part, dest)
        finally:
            remove_if_there(part)

    def mount_blob(self, digest: str, from_repository: str) -> bool:
        """Ask the registry to link a blob from another repository. False if it would not."""
        q = urllib.parse.urlencode({"mount": digest, "from": from_repository})
        r = self.transport.request("POST", self.transport.url(f"blobs/uploads/?{q}"), headers={"Content-Length": "0"})
        if r.status_code == 201:
            return True
        if r.status_code == 202 and r.headers.get("Location"):
            # The registry opened a normal upload instead; cancel it.
            self.transport.request("DELETE", self.transport.location(r, "a mount"))
        return False

    def upload_blob(self, path: str, digest: str, size: int, progress: ProgressFn = None, what: str = "blobs") -> None:
        """Upload a file as a blob (counted in `pushed[what]`)."""
        self.upload_from(lambda out: copy_file(path, out), digest, size, progress, what)

    def upload_from(self, produce: Callable[[object], None], digest: Digest, size: int, progress: ProgressFn = None,
                    what: str = "blobs") -> str:
        """Upload a blob whose bytes `produce(out)` writes to `out`, streamed in bounded memory
        (counted in `pushed[what]`); its digest. `produce` must give the same bytes each time it is
        called: an upload that breaks resumes by running it again (upload.py). `digest` may be a
        function that knows it once the bytes are written (upload.py: such an upload starts again)."""
        done = upload(self.transport, produce, digest, size, exists=lambda: self.blob_exists(digest),
                      stopping=self.stopping, progress=progress)
        self._count(what, size)
        return done


def copy_file(path: str, out) -> None:
    """A file's bytes written to `out` (an upload's stream), a piece at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(PIECE_SIZE):
            out.write(chunk)


def _json(body: bytes, what: str, error: type[SnapError] = RegistryError) -> dict:
    doc = json_object(body)
    if doc is None:
        raise error(f"the registry returned a {what} that is not a JSON object")
    return doc


def _valid_descriptor(d) -> bool:
    return (isinstance(d, dict) and isinstance(d.get("digest"), str) and bool(DIGEST.fullmatch(d["digest"]))
            and type(d.get("size")) is int and d["size"] >= 0)


def min_throughput() -> int:
    """The slowest download accepted, in bytes per second: $SNAP_MIN_THROUGHPUT (e.g. 200k, 1M)."""
    text = os.environ.get(MIN_THROUGHPUT_ENV, "").strip()
    if not text:
        return DEFAULT_MIN_THROUGHPUT
    m = _RATE.fullmatch(text)
    if not m or int(m.group(1)) == 0:
        raise UsageError(f"{MIN_THROUGHPUT_ENV}={text!r} is not a rate", "write bytes per second, e.g. 100k or 2M")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def download_grace() -> float:
    """Seconds a download may take beyond its size at min_throughput: $SNAP_DOWNLOAD_GRACE (default 10)."""
    return settings.seconds(DOWNLOAD_GRACE_ENV, DEFAULT_DOWNLOAD_GRACE, "write seconds, e.g. 30")
