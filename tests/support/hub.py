"""A small Hugging Face hub on loopback, answering as the hub does for what huggingface_hub's
hf_hub_download and snap's origin fetch ask: HEAD/GET {repo}/resolve/{revision}/{path}, where
{repo} is ORG/NAME, datasets/ORG/NAME or spaces/ORG/NAME and {revision} a branch or a commit.

A small file is answered by the hub itself (ETag: its git blob hash, quoted). An LFS file is
answered with a 302 to the CDN, a second server on another loopback address (127.0.0.2), with
ETag and X-Linked-Etag (its sha256, quoted), X-Linked-Size and X-Repo-Commit; the CDN serves it
with ranges. A gated repository answers 401 without its token; an unknown repository or file, 404.
Both servers record each request's headers. Faults: `corrupt` (the CDN serves other bytes of the
same size), `refuse` (the CDN answers a status instead), `redirect_to` (the hub sends a blob's GET
elsewhere), `pause` (the CDN stops after N bytes of a blob until `release` is set, `reached` telling
the test it got there)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

from support.servers import NoDelayHandler, ThreadedServer, send_answer

LFS_THRESHOLD = 1024  # files at least this big are LFS files here (the hub's rule is by .gitattributes)
PREFIXES = {"datasets/": "dataset", "spaces/": "space"}


@dataclass
class Repo:
    """A repository: its commit, its branches, its files (path -> bytes), and the token a gated one wants."""

    commit: str
    files: dict[str, bytes]
    branches: dict[str, str] = field(default_factory=dict)
    token: str = ""


def git_blob_hash(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Seen:
    """One request a server answered: which server, its method, path and headers (lower-case names)."""

    server: str
    method: str
    path: str
    headers: dict[str, str]


class _Recording(ThreadedServer):
    def __init__(self, host: str, name: str, seen: list[Seen]):
        self.name, self.seen = name, seen
        self._httpd = ThreadingHTTPServer((host, 0), self._handler())
        self._httpd.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def _handler(self):
        server = self

        class Handler(NoDelayHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server._record(self)
                server.answer(self)

            do_GET = do_HEAD

        return Handler

    def _record(self, handler) -> None:
        self.seen.append(Seen(self.name, handler.command, handler.path,
                              {k.lower(): v for k, v in handler.headers.items()}))


class CdnServer(_Recording):
    """Serves blobs by sha256 at /blobs/SHA256, with ranges."""

    def __init__(self, seen: list[Seen], blobs: dict[str, bytes]):
        super().__init__("127.0.0.2", "cdn", seen)
        self.blobs = blobs
        self.corrupt: set[str] = set()
        self.refuse: dict[str, int] = {}  # sha256 -> the status answered instead (429: rate-limited)
        self.pause: dict[str, int] = {}  # sha256 -> bytes sent before waiting for `release`
        self.reached, self.release = threading.Event(), threading.Event()

    def answer(self, h) -> None:
        sha = urlsplit(h.path).path.rpartition("/")[2]
        data = self.blobs.get(sha)
        if data is None:
            return send_answer(h, 404, {}, [b"no such blob"])
        if sha in self.refuse:
            return send_answer(h, self.refuse[sha], {"Retry-After": "1"}, [b"slow down"])
        if sha in self.corrupt:
            data = bytes(b ^ 0xFF for b in data[:16]) + data[16:]
        start = int(h.headers.get("Range", "bytes=0-")[6:].partition("-")[0] or 0)
        status, headers = (206, {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}) if start else (200, {})
        headers.update({"Accept-Ranges": "bytes", "ETag": f'"{sha}"'})
        if sha in self.pause and h.command == "GET" and start < self.pause[sha]:
            return self._pausing(h, status, headers, data[start:self.pause[sha]], data[self.pause[sha]:])
        send_answer(h, status, headers, [data[start:]])

    def _pausing(self, h, status: int, headers: dict, first: bytes, rest: bytes) -> None:
        """The body in two pieces, the second sent only once the test releases it."""
        h.send_response_only(status)
        for k, v in {**headers, "Content-Length": str(len(first) + len(rest))}.items():
            h.send_header(k, v)
        h.end_headers()
        try:
            h.wfile.write(first)
            h.wfile.flush()
            self.reached.set()
            self.release.wait(120)
            h.wfile.write(rest)
        except OSError:
            pass  # the client was killed


class HubServer(_Recording):
    """The hub: resolve URLs of `repos` ((type, repo id) -> Repo), LFS files redirected to its CDN."""

    def __init__(self, repos: dict[tuple[str, str], Repo]):
        self.seen_all: list[Seen] = []
        super().__init__("127.0.0.1", "hub", self.seen_all)
        self.repos = repos
        blobs = {sha256_hex(d): d for r in repos.values() for d in r.files.values() if len(d) >= LFS_THRESHOLD}
        self.cdn = CdnServer(self.seen_all, blobs)
        self.redirect_to: dict[str, str] = {}  # sha256 -> where the hub sends its GET instead of the CDN

    def start(self) -> "HubServer":
        self.cdn.start()
        return super().start()

    def stop(self) -> None:
        self.cdn.release.set()
        self.cdn.stop()
        super().stop()

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def seen(self, server: str) -> list[Seen]:
        return [s for s in self.seen_all if s.server == server]

    def answer(self, h) -> None:
        found = self._resolve(unquote(urlsplit(h.path).path))
        if isinstance(found[0], int):
            return send_answer(h, found[0], {"X-Error-Code": found[1]}, [found[1].encode()])
        repo, path = found
        if repo.token and h.headers.get("Authorization") != f"Bearer {repo.token}":
            return send_answer(h, 401, {"X-Error-Code": "GatedRepo"}, [b"gated: a token is needed"])
        if path not in repo.files:
            return send_answer(h, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit}, [b"no entry"])
        data = repo.files[path]
        headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
        if len(data) < LFS_THRESHOLD:
            headers["ETag"] = f'"{git_blob_hash(data)}"'
            return send_answer(h, 200, headers, [data])
        sha = sha256_hex(data)
        headers.update({"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                        "Location": self.redirect_to.get(sha, f"{self.cdn.url}/blobs/{sha}?sig={quote(path)}")})
        send_answer(h, 302, headers, [])

    def _resolve(self, path: str):
        """(Repo, file path) a resolve path names, or (status, error code)."""
        kind = next((k for p, k in PREFIXES.items() if path.startswith("/" + p)), "model")
        parts = path.lstrip("/").removeprefix({"dataset": "datasets/", "space": "spaces/"}.get(kind, "")).split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return 404, "RepoNotFound"
        repo = self.repos.get((kind, f"{parts[0]}/{parts[1]}"))
        if repo is None:
            return 404, "RepoNotFound"
        if parts[3] not in (repo.commit, *repo.branches):
            return 404, "RevisionNotFound"
        return repo, "/".join(parts[4:])


_DOWNLOAD = """
import json, sys
from huggingface_hub import hf_hub_download
endpoint, cache = sys.argv[1:3]
for kind, repo, revision, name, token in json.loads(sys.argv[3]):
    hf_hub_download(repo, name, repo_type=kind, revision=revision, cache_dir=cache, endpoint=endpoint,
                    token=token or False)
"""


def hub_download(endpoint: str, hf_home: str, downloads: list[tuple], timeout: float = 300) -> None:
    """The real huggingface_hub client's hf_hub_download of each (repo type, repo id, revision, file,
    token) into HF_HOME/hub, its home `hf_home`, nothing sent anywhere but `endpoint`."""
    env = {**os.environ, "HF_HOME": hf_home, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "HF_TOKEN": ""}
    subprocess.run([sys.executable, "-c", _DOWNLOAD, endpoint, os.path.join(hf_home, "hub"), json.dumps(downloads)],
                   env=env, check=True, timeout=timeout)
