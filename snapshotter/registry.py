"""Talking to an OCI registry (distribution v2 API) through oras-py.

oras-py gives us the HTTP session, docker-config credentials and retries; this module adds what a
snapshot tool needs on top: index -> platform manifest resolution, streamed uploads in
bounded memory, verified streamed downloads, cross-repository mounts, and manifests pushed as the
exact bytes we hashed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import platform
import queue
import re
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import oras.auth
import oras.auth.utils
import oras.container
import oras.utils
import oras.provider
import requests

from .errors import AuthError, IntegrityError, NotFound, RegistryError, RegistryUnreachable, UsageError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)

PIECE_SIZE = 1024 * 1024  # upload body pieces: what is queued between the packer and the socket
QUEUED_PIECES = 8  # memory per upload: about this many pieces, whatever the blob size
PING_TIMEOUT = 10
TIMEOUT = (10, 300)  # connect, read: a registry that hangs is an error, not a wait forever
RETRY_DELAYS = (0.5, 1, 2, 4, 8)  # ~15 s for a registry to come back before we give up
UPLOAD_ATTEMPTS = 3
# oras's request function without its retry decorator (which sleeps up to minutes per request).
_do_request = oras.provider.Registry.do_request.__wrapped__

ProgressFn = Optional[Callable[[int], None]]

_REF_RE = re.compile(
    r"^(?P<repo>[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)

# Docker Hub is named docker.io (index.docker.io of old) but its API is served by registry-1.docker.io,
# and `docker login` stores its credentials under https://index.docker.io/v1/.
DOCKER_HUB_NAMES = ("docker.io", "index.docker.io", "registry-1.docker.io")
DOCKER_HUB_API = "registry-1.docker.io"
DOCKER_HUB_LOGIN = "https://index.docker.io/v1/"


def api_host(registry: str) -> str:
    """The host[:port] that serves the /v2/ API of a registry named in a reference."""
    return DOCKER_HUB_API if registry in DOCKER_HUB_NAMES else registry


@dataclass(frozen=True)
class Reference:
    """registry/repository[:tag][@digest]. The registry part is required: snap has no default registry."""

    registry: str
    repository: str
    tag: Optional[str] = None
    digest: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> "Reference":
        host, sep, rest = text.partition("/")
        if not sep or not ("." in host or ":" in host or host == "localhost"):
            raise UsageError(
                f"image reference {text!r} has no registry host",
                "write it as HOST[:PORT]/REPO[:TAG], e.g. 127.0.0.1:5000/box:v1",
            )
        m = _REF_RE.match(rest)
        if not m:
            raise UsageError(f"image reference {text!r} is not valid", "use HOST[:PORT]/REPO[:TAG][@sha256:DIGEST]")
        tag, digest = m.group("tag"), m.group("digest")
        if not tag and not digest:
            tag = "latest"
        return cls(host, m.group("repo"), tag, digest)

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    @property
    def api_host(self) -> str:
        return api_host(self.registry)

    @property
    def target(self) -> str:
        """What goes after /manifests/: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> "Reference":
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        s = self.name
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


@dataclass
class Credentials:
    username: Optional[str] = None
    password: Optional[str] = None


@dataclass
class TransportOptions:
    """How to reach registries. Loopback hosts default to plain http (as Docker does for them)
    unless they answer TLS; other hosts always use https."""

    plain_http: Optional[bool] = None  # None: auto
    ca_bundle: Optional[str] = None
    tls_verify: bool = True
    credentials: Credentials = field(default_factory=Credentials)
    # The registry the explicit `credentials` are for; other registries get only the docker config's.
    # None: every registry (a command that talks to one registry only).
    credentials_registry: Optional[str] = None

    def credentials_only_for(self, registry: str) -> "TransportOptions":
        return dataclasses.replace(self, credentials_registry=registry)

    def explicit_credentials_for(self, registry: str) -> bool:
        return self.credentials.username is not None and (
            self.credentials_registry is None or api_host(self.credentials_registry) == api_host(registry))


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def host_platform() -> tuple[str, str]:
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(platform.machine(), platform.machine())
    return "linux", arch


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0].strip("[]") if host.count(":") <= 1 or host.startswith("[") else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass
class Image:
    """A resolved single-platform image: its manifest (exact bytes) and config."""

    ref: Reference
    manifest_bytes: bytes
    manifest_digest: str
    config_bytes: bytes

    @property
    def manifest(self) -> dict:
        return json.loads(self.manifest_bytes)

    @property
    def config(self) -> dict:
        return json.loads(self.config_bytes)

    @property
    def layers(self) -> list[dict]:
        return self.manifest["layers"]


class Remote:
    """One repository on one registry. Kept per repository because token auth scopes are per repo."""

    def __init__(self, ref: Reference, options: Optional[TransportOptions] = None):
        self.ref = ref
        self.options = options or TransportOptions()
        self.host = ref.api_host  # where requests go; ref.registry stays the name in messages
        self.container = oras.container.Container(ref.repository, registry=self.host)
        self.scheme = self._probe()
        verify = self.options.ca_bundle or self.options.tls_verify
        backend = self._auth_kind
        self.oras = oras.provider.Registry(
            self.host, insecure=self.scheme == "http", tls_verify=verify, auth_backend=backend
        )
        self.oras.session.mount("http://", _TimeoutAdapter())
        self.oras.session.mount("https://", _TimeoutAdapter())
        creds = self.options.credentials
        if self.options.explicit_credentials_for(ref.registry):
            self.oras.auth.set_basic_auth(creds.username, creds.password or "")
        else:
            load_docker_credentials(self.oras.auth, ref.registry)
        self.has_credentials = bool(getattr(self.oras.auth, "_basic_auth", None))
        self._token_lock = threading.Lock()  # layers upload in threads that share one token
        self._scopes: dict[str, set[str]] = {}  # "repository:box" -> actions, of every token asked for
        if backend == "basic" and self.has_credentials:
            # Send Basic credentials up front: saves a 401 round trip per request.
            self.oras.headers["Authorization"] = f"Basic {self.oras.auth._basic_auth}"
        elif not self.has_credentials:
            self.oras.auth._basic_auth = None  # oras expects the attribute; unset it means anonymous

    # ---- connection and auth -------------------------------------------------------------

    def _probe(self) -> str:
        """Ping /v2/ to pick http or https and learn the auth scheme; fail fast when down."""
        host = self.host
        verify = self.options.ca_bundle or self.options.tls_verify
        schemes = ["https"]
        if self.options.plain_http:
            schemes = ["http"]
        elif self.options.plain_http is None and _is_loopback(host):
            schemes = ["https", "http"]
        first_error: Optional[Exception] = None
        for scheme in schemes:
            try:
                r = requests.get(f"{scheme}://{host}/v2/", timeout=PING_TIMEOUT, verify=verify)
            except requests.exceptions.SSLError as e:
                first_error = first_error or e
                continue
            except requests.exceptions.RequestException as e:
                first_error = first_error or e
                continue
            if r.status_code == 400 and scheme == "http" and first_error is not None:
                break  # an https server answering plain http: the TLS error is the real cause
            challenge = r.headers.get("Www-Authenticate", "")
            self._auth_kind = "basic" if challenge.lower().startswith("basic") else "token"
            return scheme
        if isinstance(first_error, requests.exceptions.SSLError):
            raise RegistryUnreachable(
                f"TLS to registry {host} failed: {_short(first_error)}",
                "pass --ca-cert FILE for a private CA, or --plain-http for a registry without TLS",
            )
        raise RegistryUnreachable(
            f"registry {host} is not reachable: {_short(first_error)}",
            "check the host and port, and that the registry is running",
        )

    def _request(self, method: str, url: str, resend: bool = True, **kw) -> requests.Response:
        """One registry request through oras (auth, token refresh), retried by us with a short
        backoff: a registry that restarts is waited for, one that is down fails in seconds.
        (oras's own retry decorator waits minutes per request, so we call past it.)
        `resend=False` for a streamed body, which cannot be sent twice: a broken connection or an
        expired token is then a RegistryError, for the caller to start its upload over."""
        headers = dict(self.oras.headers)
        headers.update(kw.pop("headers", {}) or {})
        registry = self.ref.registry
        refreshed = False
        for delay in (*RETRY_DELAYS, None) if resend else (None,):
            try:
                r = _do_request(self.oras, url, method, headers=dict(headers), **kw)
                if r.status_code == 401 and not refreshed and self._needs_new_token(r):
                    refreshed = True  # once: a token the server scopes down again is a refusal
                    if not resend:
                        raise RegistryError(f"registry {registry} asked for a new token during an upload")
                    r = _do_request(self.oras, url, method, headers=dict(headers), **kw)
            except requests.exceptions.SSLError as e:
                raise RegistryUnreachable(f"TLS to registry {registry} failed: {_short(e)}")
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
                if not resend:
                    raise RegistryError(f"upload to registry {registry} broke: {_short(e)}")
                if delay is None:
                    raise RegistryUnreachable(f"registry {registry} stopped answering: {_short(e)}",
                                              "run the command again when it is back: what was pushed stays pushed")
                time.sleep(delay)
                continue
            except requests.exceptions.RequestException as e:
                raise RegistryUnreachable(f"registry {registry} failed: {_short(e)}")
            except (oras.auth.AuthenticationException, ValueError):
                # oras could not answer the registry's auth challenge (no token for us)
                if self.has_credentials:
                    raise AuthError(f"registry {registry} refused the credentials for {self.ref.repository}",
                                    "check the username/password or the token's permissions")
                raise AuthError(f"registry {registry} asks for credentials we do not have",
                                "log in with `docker login`, or pass --username and --password-stdin")
            if r.status_code in (502, 503, 504) and delay is not None:
                time.sleep(delay)
                continue
            break
        if r.status_code in (401, 403):
            if not self.has_credentials:
                raise AuthError(f"registry {registry} asks for credentials we do not have",
                                "log in with `docker login`, or pass --username and --password-stdin")
            raise AuthError(
                f"registry {registry} refused the credentials for {method} on {self.ref.repository} (HTTP {r.status_code})",
                "check the username/password or the token's permissions",
            )
        return r

    def _needs_new_token(self, r: requests.Response) -> bool:
        """A 401 with a Bearer challenge after oras sent its token: the token lacks the scope this
        request needs (a pull token on a push: error="insufficient_scope") or it expired. oras
        keeps one token and would send it again. Get a new one for the challenge's scope (e.g.
        repository:box:pull,push) joined with the scopes of the tokens before it, so that it
        replaces the old one for every later request, pulls included. True if there is a new
        token to try (ours, or one another thread got meanwhile)."""
        auth = self.oras.auth
        challenge = r.headers.get("Www-Authenticate", "")
        if not isinstance(auth, oras.auth.TokenAuth) or not challenge.lower().startswith("bearer"):
            return False
        sent = r.request.headers.get("Authorization") if r.request is not None else None
        r.close()
        with self._token_lock:
            if auth.token and sent != f"Bearer {auth.token}":
                return True  # another thread replaced the token after this request was sent
            h = oras.auth.utils.parse_auth_header(challenge)
            for one in (h.scope or "").split():
                resource, _, actions = one.rpartition(":")
                self._scopes.setdefault(resource, set()).update(a for a in actions.split(",") if a)
            if self._scopes:
                h.scope = " ".join(f"{res}:{','.join(sorted(acts))}" for res, acts in sorted(self._scopes.items()))
            # What oras's authenticate_request(refresh=True) does, without a moment with no token:
            # other threads keep sending the old one until the new one is set.
            token = auth.request_token(h)
            if not token:
                return False
            auth.token = token
            return True

    def _url(self, path: str) -> str:
        return f"{self.scheme}://{self.host}/v2/{self.ref.repository}/{path}"

    def _abs(self, location: str) -> str:
        return urllib.parse.urljoin(f"{self.scheme}://{self.host}/", location)

    # ---- manifests -------------------------------------------------------------------------

    def get_manifest(self, target: str) -> tuple[bytes, str, str]:
        """Return (bytes, media type, digest) of a manifest or index, verifying pinned digests."""
        accept = ", ".join(MANIFEST_TYPES + INDEX_TYPES)
        r = self._request("GET", self._url(f"manifests/{target}"), headers={"Accept": accept})
        if r.status_code == 404:
            raise NotFound(f"image {self.ref.name}:{target} not found in the registry" if not target.startswith("sha256:")
                           else f"image {self.ref.name}@{target} not found in the registry")
        _check(r, f"fetch manifest {self.ref.name}:{target}")
        body = r.content
        digest = sha256_digest(body)
        if target.startswith("sha256:") and digest != target:
            raise IntegrityError(f"manifest {target} from {self.ref.registry} does not match its digest (got {digest})")
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
        r = self._request("PUT", self._url(f"manifests/{target}"), data=body, headers={"Content-Type": media_type})
        _check(r, f"push manifest to {self.ref.name}:{target}")
        return sha256_digest(body)

    # ---- blobs -------------------------------------------------------------------------------

    def blob_exists(self, digest: str) -> bool:
        r = self._request("HEAD", self._url(f"blobs/{digest}"))
        return r.status_code == 200

    def fetch_bytes(self, digest: str) -> bytes:
        """A small blob (a config) into memory, verified."""
        r = self._request("GET", self._url(f"blobs/{digest}"))
        if r.status_code == 404:
            raise NotFound(f"blob {digest} missing from {self.ref.name}")
        _check(r, f"fetch blob {digest}")
        if sha256_digest(r.content) != digest:
            raise IntegrityError(f"blob {digest} from {self.ref.name} does not match its digest")
        return r.content

    def open_blob(self, digest: str, offset: int = 0) -> requests.Response:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        r = self._request("GET", self._url(f"blobs/{digest}"), stream=True, headers=headers)
        if r.status_code == 404:
            raise NotFound(f"blob {digest} missing from {self.ref.name}")
        _check(r, f"fetch blob {digest}")
        return r

    def iter_blob(self, digest: str, progress: ProgressFn = None) -> Iterator[bytes]:
        """Stream a blob. Raises IntegrityError at the end if the bytes do not hash to `digest`:
        callers that write must treat what they got as untrusted until the generator finishes."""
        h = hashlib.sha256()
        with self.open_blob(digest) as r:
            try:
                for chunk in r.iter_content(chunk_size=1 << 20):
                    h.update(chunk)
                    if progress:
                        progress(len(chunk))
                    yield chunk
            except requests.exceptions.RequestException as e:
                raise RegistryUnreachable(f"download of {digest} from {self.ref.registry} broke off: {_short(e)}")
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
        r = self._request("POST", self._url(f"blobs/uploads/?{q}"), headers={"Content-Length": "0"})
        if r.status_code == 201:
            return True
        if r.status_code == 202 and r.headers.get("Location"):
            # The registry opened a normal upload instead; cancel it.
            self._request("DELETE", self._abs(r.headers["Location"]))
        return False

    def upload_blob(self, path: str, digest: str, size: int, progress: ProgressFn = None) -> None:
        """Upload a file as a blob."""

        def copy(out) -> None:
            with open(path, "rb") as f:
                while chunk := f.read(PIECE_SIZE):
                    out.write(chunk)

        self.upload_from(copy, digest, size, progress)

    def upload_from(self, produce: Callable[[object], None], digest: str, size: int, progress: ProgressFn = None) -> None:
        """Upload a blob whose bytes `produce(out)` writes to `out`, streamed as the body of one
        PATCH in bounded memory. `produce` must give the same bytes each time it is called: an
        upload that breaks (registry restarted, connection lost) is started over, and the registry
        only accepts the blob at the final PUT if the bytes match the digest."""
        last: Optional[Exception] = None
        for _ in range(UPLOAD_ATTEMPTS):
            sent = [0]

            def count(n: int) -> None:
                sent[0] += n
                if progress:
                    progress(n)

            try:
                self._upload_once(produce, digest, size, count)
                return
            except RegistryError as e:  # the upload broke while the registry stayed up
                last = e
                if progress:
                    progress(-sent[0])  # the bar restarts with the upload
                if self.blob_exists(digest):  # (waits for a registry that restarts)
                    return
        raise last  # type: ignore[misc]

    def _upload_once(self, produce: Callable[[object], None], digest: str, size: int,
                     progress: Callable[[int], None]) -> None:
        r = self._request("POST", self._url("blobs/uploads/"), headers={"Content-Length": "0"})
        _check(r, f"start upload of {digest}")
        out = _StreamedUpload(self, self._abs(r.headers["Location"]), digest, progress)
        try:
            produce(out)
        except BaseException:
            out.abort()
            raise
        location = out.finish()
        if out.offset != size:
            raise IntegrityError(f"blob {digest} changed while it was uploaded ({out.offset} bytes, expected {size})",
                                 "a file of the box changed during the commit; commit again")
        sep = "&" if "?" in location else "?"
        r = self._request("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}",
                          headers={"Content-Length": "0", "Content-Type": "application/octet-stream"})
        if r.status_code == 400 and "DIGEST_INVALID" in r.text:
            raise IntegrityError(f"blob {digest} changed while it was uploaded (the registry saw other bytes)",
                                 "a file of the box changed during the commit; commit again")
        _check(r, f"finish upload of {digest}")


def load_docker_credentials(auth: oras.auth.AuthBackend, registry: str) -> bool:
    """Credentials for `registry` from $DOCKER_CONFIG/config.json (else ~/.docker/config.json) into
    `auth`: inline auths, credHelpers and credsStore, the helpers run by oras. (oras itself ignores
    $DOCKER_CONFIG.) Docker Hub's are found under any of its names. True if some were found."""
    path = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            cfg = json.load(f)
        auths = {_auth_key(k): v for k, v in (cfg.get("auths") or {}).items()}
        auth._auth_config = {
            "auths": auths, "credsStore": cfg.get("credsStore"), "credHelpers": cfg.get("credHelpers") or {},
        }
        if registry in DOCKER_HUB_NAMES:
            for key in DOCKER_HUB_NAMES:  # inline auths, whichever of its names docker used
                if (auths.get(key) or {}).get("auth"):
                    auth._basic_auth = auths[key]["auth"]
                    return True
            return auth._load_auth(DOCKER_HUB_LOGIN)  # the helpers, asked with the key docker gives them
        for host in oras.utils.iter_localhosts(registry):
            if auth._load_auth(host):
                return True
        return False
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise AuthError(f"cannot read registry credentials from {path}: {_short(e)}")


class _StreamedUpload:
    """A write-only stream sent as the body of one PATCH with chunked transfer encoding (a
    "streamed upload", as docker push sends it): one request per blob, where 16 MiB PATCH chunks
    cost the registry a writer reopen and a hash-state save each. A thread runs the request and
    takes pieces from a short queue, so memory stays bounded whatever the blob size."""

    _END = object()

    def __init__(self, remote: "Remote", location: str, digest: str, progress: Callable[[int], None]):
        self.remote, self.location, self.digest, self.progress = remote, location, digest, progress
        self.parts: list[bytes] = []  # bytes written, joined into one piece once PIECE_SIZE is here
        self.pending = 0
        self.offset = 0  # bytes handed to the request
        self.queue: queue.Queue = queue.Queue(QUEUED_PIECES)
        self.aborted = False
        self.response: Optional[requests.Response] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._send, name=f"upload {digest[:19]}", daemon=True)
        self.thread.start()

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        self.pending += len(data)
        if self.pending >= PIECE_SIZE:
            self._queue(b"".join(self.parts))
        return len(data)

    def finish(self) -> str:
        """End the body, wait for the registry's answer; the upload's next location."""
        if self.parts:
            self._queue(b"".join(self.parts))
        self._put(self._END)
        self.thread.join()
        if self.error is not None:
            raise self.error
        r = self.response
        _check(r, f"upload of {self.digest}")
        # The registry says how much it holds; a body it did not take whole (e.g. sent again empty
        # after an auth challenge) must not reach the PUT.
        got = r.headers.get("Range", "")
        if self.offset and got and got != f"0-{self.offset - 1}":
            raise RegistryError(f"upload of {self.digest} incomplete: the registry holds {got}, we sent {self.offset} bytes")
        return self.remote._abs(r.headers["Location"])

    def abort(self) -> None:
        """The producer failed: end the request without a valid body."""
        self.aborted = True
        try:
            while True:
                self.queue.get_nowait()  # make room: the request thread may be waiting for a piece
        except queue.Empty:
            pass
        self.queue.put(self._END)
        self.thread.join(TIMEOUT[0])

    def _queue(self, piece: bytes) -> None:
        self.parts, self.pending = [], 0
        self._put(piece)
        self.offset += len(piece)

    def _put(self, item) -> None:
        while True:
            if not self.thread.is_alive():  # the request ended early: the registry refused or broke
                self.thread.join()
                raise self.error or RegistryError(f"upload of {self.digest} ended before its body was sent")
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _body(self) -> Iterator[bytes]:
        while True:
            piece = self.queue.get()
            if self.aborted:
                raise _Aborted()
            if piece is self._END:
                return
            yield piece
            self.progress(len(piece))

    def _send(self) -> None:
        try:
            self.response = self.remote._request("PATCH", self.location, data=self._body(), resend=False,
                                                 headers={"Content-Type": "application/octet-stream"})
        except BaseException as e:  # handed to the writer
            self.error = e


class _Aborted(Exception):
    """Raised inside a streamed request body to end the request when its producer failed."""


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """oras passes no timeout to requests; this gives every request one."""

    def send(self, request, **kw):
        if kw.get("timeout") is None:
            kw["timeout"] = TIMEOUT
        return super().send(request, **kw)


def _auth_key(key: str) -> str:
    """Docker config auths may be keyed "https://host/v1/": reduce to "host"."""
    return key.split("://", 1)[-1].split("/", 1)[0]


def _check(r: requests.Response, what: str) -> None:
    if r.status_code < 300:
        return
    detail = ""
    try:
        errors = r.json().get("errors", [])
        detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
    except ValueError:
        detail = r.text[:200].strip()
    raise RegistryError(f"{what} failed: HTTP {r.status_code} {detail}".strip())


def _json(body: bytes, what: str) -> dict:
    try:
        return json.loads(body)
    except ValueError:
        raise RegistryError(f"the registry returned a {what} that is not JSON")


def _short(e: Optional[BaseException]) -> str:
    """The last, most specific line of a requests/urllib3 error chain."""
    if e is None:
        return "no answer"
    text = str(e)
    for key in ("Connection refused", "Name or service not known", "timed out", "certificate verify failed",
                "No route to host", "Temporary failure in name resolution"):
        if key in text:
            return key
    return text.splitlines()[0][:200]

