"""The OCI distribution protocol (v2 API) for one repository: references, index -> platform
manifest resolution, manifests pushed as the exact bytes we hashed, verified streamed downloads,
streamed uploads in bounded memory, cross-repository mounts. HTTP, auth and retries are
transport.py's.

oras-py does here what transport.py says (its session and its answers to auth challenges), and no
protocol step: its manifest calls re-serialise JSON (the digest would not be the one we hashed),
its upload reads a whole blob into memory (or PATCHes 16 MiB chunks, a writer reopen each on the
registry) and its download does not check the digest. So manifests, blobs and uploads (upload.py)
are our own requests over transport.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import requests

from .errors import IntegrityError, NotFound, RegistryError, RegistryUnreachable, UsageError
from .image import Image, sha256_digest
from .mediatypes import INDEX_TYPES, MANIFEST_TYPES
from .reference import Reference
from .transport import Transport, TransportOptions, check, short_error
from .upload import PIECE_SIZE, upload

ProgressFn = Optional[Callable[[int], None]]

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

    # ---- manifests -------------------------------------------------------------------------

    def get_manifest(self, target: str) -> tuple[bytes, str, str]:
        """Return (bytes, media type, digest) of a manifest or index, verifying pinned digests."""
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        r = self.transport.request("GET", self.transport.url(f"manifests/{target}"), headers={"Accept": accept})
        if r.status_code == 404:
            raise NotFound(f"image {self.ref.name}:{target} not found in the registry" if ":" not in target
                           else f"image {self.ref.name}@{target} not found in the registry")
        check(r, f"fetch manifest {self.ref.name}:{target}")
        body = r.content
        digest = sha256_digest(body)
        algorithm, pinned, _ = target.partition(":")  # a digest (sha256, sha384, sha512), or a tag
        if pinned and f"{algorithm}:{hashlib.new(algorithm, body).hexdigest()}" != target:
            raise IntegrityError(f"manifest {target} from {self.ref.registry} does not match its digest")
        media = r.headers.get("Content-Type", "").split(";")[0].strip() or json.loads(body).get("mediaType", "")
        return body, media, digest

    def resolve(self, target: Optional[str] = None, want: Optional[tuple[str, str]] = None) -> Image:
        """Fetch the image for this ref (following an index to the host platform) and its config."""
        body, media, digest = self.get_manifest(target or self.ref.target)
        doc = _json(body, "manifest")
        if media in INDEX_TYPES or (not media and "manifests" in doc):
            os_, arch = want or host_platform()
            for m in doc.get("manifests", []):
                p = m.get("platform", {})
                if p.get("os") == os_ and p.get("architecture") == arch:
                    return self.resolve(m["digest"], want)
            raise NotFound(f"image {self.ref} has no {os_}/{arch} manifest in its index")
        if media not in MANIFEST_TYPES and doc.get("mediaType") not in MANIFEST_TYPES:
            raise UsageError(f"{self.ref} is not a container image (media type {media or 'unknown'})")
        cfg_desc = doc["config"]
        config = self.fetch_bytes(cfg_desc["digest"])
        return Image(self.ref.with_digest(digest), body, digest, config)

    def put_manifest(self, body: bytes, media_type: str, target: str) -> str:
        """PUT the exact bytes (never re-serialised, so the digest is what we computed)."""
        r = self.transport.request("PUT", self.transport.url(f"manifests/{target}"), data=body, headers={"Content-Type": media_type})
        check(r, f"push manifest to {self.ref.name}:{target}")
        return sha256_digest(body)

    def manifest_digest(self, tag: str) -> Optional[str]:
        """The digest a tag points at (HEAD, nothing downloaded); None if there is no such tag."""
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        r = self.transport.request("HEAD", self.transport.url(f"manifests/{tag}"), headers={"Accept": accept})
        if r.status_code == 404:
            return None
        check(r, f"look up {self.ref.name}:{tag}")
        return r.headers.get("Docker-Content-Digest") or self.get_manifest(tag)[2]

    def list_tags(self) -> list[str]:
        """Every tag of the repository, following the registry's pages (Link: rel="next")."""
        tags: list[str] = []
        url = self.transport.url("tags/list?n=1000")
        while url:
            r = self.transport.request("GET", url)
            if r.status_code == 404:
                return tags  # a repository with nothing pushed yet
            check(r, f"list the tags of {self.ref.name}")
            tags.extend(_json(r.content, "tag list").get("tags") or [])
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
        r = self.transport.request("HEAD", self.transport.url(f"blobs/{digest}"))
        return r.status_code == 200

    def fetch_bytes(self, digest: str) -> bytes:
        """A small blob (a config) into memory, verified."""
        r = self.transport.request("GET", self.transport.url(f"blobs/{digest}"))
        if r.status_code == 404:
            raise NotFound(f"blob {digest} missing from {self.ref.name}")
        check(r, f"fetch blob {digest}")
        if sha256_digest(r.content) != digest:
            raise IntegrityError(f"blob {digest} from {self.ref.name} does not match its digest")
        return r.content

    def open_blob(self, digest: str, offset: int = 0) -> requests.Response:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        r = self.transport.request("GET", self.transport.url(f"blobs/{digest}"), stream=True, headers=headers)
        if r.status_code == 404:
            raise NotFound(f"blob {digest} missing from {self.ref.name}")
        check(r, f"fetch blob {digest}")
        return r

    def iter_blob(self, digest: str, progress: ProgressFn = None) -> Iterator[bytes]:
        """Stream a blob. Raises IntegrityError at the end if the bytes do not hash to `digest`:
        callers that write must treat what they got as untrusted until the generator finishes."""
        # Not oras's download_blob: it never checks the digest of what it wrote.
        h = hashlib.sha256()
        with self.open_blob(digest) as r:
            try:
                for chunk in r.iter_content(chunk_size=1 << 20):
                    h.update(chunk)
                    if progress:
                        progress(len(chunk))
                    yield chunk
            except requests.exceptions.RequestException as e:
                raise RegistryUnreachable(f"download of {digest} from {self.ref.registry} broke off: {short_error(e)}")
        if "sha256:" + h.hexdigest() != digest:
            raise IntegrityError(f"blob {digest} from {self.ref.name} does not match its digest (tampered or corrupt)")

    def download_blob(self, digest: str, dest: str, progress: ProgressFn = None, durable: bool = False) -> None:
        """Download to `dest` atomically: written to dest.part, verified, then renamed. `durable`
        fsyncs it first (else a power loss can leave a renamed file with lost bytes: a cache
        that keeps blobs across runs must check them again, as restore does)."""
        part = dest + ".part"
        try:
            with open(part, "wb") as f:
                for chunk in self.iter_blob(digest, progress):
                    f.write(chunk)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(part, dest)
        finally:
            if os.path.exists(part):
                os.unlink(part)

    def mount_blob(self, digest: str, from_repository: str) -> bool:
        """Ask the registry to link a blob from another repository. False if it would not."""
        q = urllib.parse.urlencode({"mount": digest, "from": from_repository})
        r = self.transport.request("POST", self.transport.url(f"blobs/uploads/?{q}"), headers={"Content-Length": "0"})
        if r.status_code == 201:
            return True
        if r.status_code == 202 and r.headers.get("Location"):
            # The registry opened a normal upload instead; cancel it.
            self.transport.request("DELETE", self.transport.absolute(r.headers["Location"]))
        return False

    def upload_blob(self, path: str, digest: str, size: int, progress: ProgressFn = None) -> None:
        """Upload a file as a blob."""

        def copy(out) -> None:
            with open(path, "rb") as f:
                while chunk := f.read(PIECE_SIZE):
                    out.write(chunk)

        self.upload_from(copy, digest, size, progress)

    def upload_from(self, produce: Callable[[object], None], digest: str, size: int, progress: ProgressFn = None) -> None:
        """Upload a blob whose bytes `produce(out)` writes to `out`, streamed in bounded memory.
        `produce` must give the same bytes each time it is called: an upload that breaks resumes
        by running it again (upload.py)."""
        upload(self, produce, digest, size, progress)


def _json(body: bytes, what: str) -> dict:
    try:
        return json.loads(body)
    except ValueError:
        raise RegistryError(f"the registry returned a {what} that is not JSON")
