"""Servers that misbehave as real ones do, in threads of the test process: a fault proxy in front of
a registry, a lying HTTP server, a cloud's metadata service, and the DMI files that name a cloud."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from typing import Callable, Optional

from support.servers import NoDelayHandler, ThreadedServer, send_answer


class FaultProxy(ThreadedServer):
    """A reverse proxy on 127.0.0.1 in front of a registry, in a thread of the test process, that
    counts what passes and makes the faults a real link or registry has: a connection cut in the
    middle of an upload, a slow download, a 429/503 answer with Retry-After, a registry that
    refuses PATCH. Point snap at `proxy.host` instead of `registry.host`.

    - `answer(method, path)`: return (status, headers) to answer a request without forwarding it
      (None forwards it); set it from the test.
    - `stall_uploads_after`: bytes of a PATCH body after which the proxy stops forwarding (sets
      `stalled`) until `release` is set.
    - `cut_upload_after`: bytes of the next upload body (PATCH or PUT) after which both
      connections are cut; the registry keeps what it got. One cut, then it resets to None.
    - `throttle`: bytes per second for blob download bodies, shared by all of them as on one
      link; `midway` is set once `midway_at` bytes of one have passed.
    - `uploads`: set to {} to keep each blob upload's body bytes, by upload path (PATCH and PUT);
    - `body_bytes[method]`: request body bytes forwarded (manifests under "PUT manifest");
      `blob_bytes_sent`: blob download body bytes passed to the client; `log`: (method, path, status).
    - A lying registry: `lie(method, path)` may return (status, headers, body pieces) to answer
      with a body of its own (a 300 MiB manifest, ...), streamed; `endless_blob`: the digest of a
      blob whose body goes on past its end with zeros, without a length, until the client hangs up.
    - `hold_blob`: the digest of a blob whose downloads wait (setting `holding`) until `unhold` is set;
      `hold_answer(method, path)`: True holds the registry's answer to a request it has carried out
      (setting `holding`) until `unhold` is set.
    - `wait_for(request)`: block until a logged (method, path, status) matches, instead of polling;
      a request the upstream refused (a registry that is down) is logged with status REFUSED and
      its connection closed unanswered.
    - `back`: an Event for a registry that restarts: once one request has been REFUSED, later
      ones that find it down wait for `back` (set by the test once it is up again), so a client
      that retries at once (SNAP_RETRY_SCALE=0) still meets it back, however long its restart.
    - `down`: while set, every request is refused so (an outage the test starts and ends at will,
      the registry behind it kept as it is)."""

    REFUSED = -2

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.down = threading.Event()
        self.answer = lambda method, path: None
        self.lie = lambda method, path: None
        self.hold_answer = lambda method, path: False
        self.endless_blob: Optional[str] = None
        self.hold_blob: Optional[str] = None
        self.back: Optional[threading.Event] = None
        self.holding, self.unhold = threading.Event(), threading.Event()
        self.cut_upload_after: Optional[int] = None
        self.stall_uploads_after: Optional[int] = None
        self.stalled, self.release = threading.Event(), threading.Event()
        self.cut = threading.Event()
        self.throttle: Optional[int] = None
        self.midway_at = 1 << 20
        self.midway = threading.Event()
        self.body_bytes: dict[str, int] = {}
        self.blob_bytes_sent = 0
        self.uploads: Optional[dict[str, bytearray]] = None  # a dict: each blob upload's body, by its path
        self.log: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._link_free_at = 0.0  # monotonic time the throttled link has sent what it was given
        self._logged = threading.Condition()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._httpd.server_address[1]}"

    def upload_bytes(self) -> int:
        return self.body_bytes.get("PATCH", 0) + self.body_bytes.get("PUT", 0)

    def wait_for(self, request: Callable[[str, str, int], bool], timeout: float = 120) -> bool:
        """Wait until a request matching `request(method, path, status)` has been logged; False on timeout."""
        with self._logged:
            return self._logged.wait_for(lambda: any(request(*entry) for entry in self.log), timeout)

    def _log(self, method: str, path: str, status: int) -> None:
        with self._logged:
            self.log.append((method, path, status))
            self._logged.notify_all()

    def _count(self, method: str, n: int) -> None:
        with self._lock:
            self.body_bytes[method] = self.body_bytes.get(method, 0) + n

    def _handler(self):
        proxy = self
        import http.client

        class Handler(NoDelayHandler):
            protocol_version = "HTTP/1.1"

            def _body(self):
                """The request body, decoded from chunked encoding if it is chunked."""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return
                        data = self.rfile.read(size)
                        self.rfile.readline()
                        yield data
                else:
                    left = int(self.headers.get("Content-Length") or 0)
                    while left:
                        data = self.rfile.read(min(left, 1 << 16))
                        if not data:
                            return
                        left -= len(data)
                        yield data

            def _forwarded(self, method: str, upstream):
                limit = proxy.cut_upload_after if method in ("PATCH", "PUT") else None
                if "/manifests/" in self.path:
                    method = f"{method} manifest"  # counted apart from blob bytes
                sent = 0
                for data in self._body():
                    if limit is not None and sent + len(data) > limit:
                        data = data[:limit - sent]
                        upstream.send(b"%x\r\n%s\r\n" % (len(data), data) if data else b"")
                        proxy._count(method, len(data))
                        proxy.cut_upload_after = None
                        raise _Cut()
                    sent += len(data)
                    proxy._count(method, len(data))
                    if proxy.uploads is not None and method in ("PATCH", "PUT"):
                        proxy.uploads.setdefault(self.path.split("?")[0], bytearray()).extend(data)
                    yield data
                    stall_at = proxy.stall_uploads_after
                    if stall_at is not None and method == "PATCH" and sent >= stall_at:
                        proxy.stalled.set()
                        proxy.release.wait(300)  # a link that stops moving, until the test lets it go

            def _any(self):
                method, path = self.command, self.path
                canned = proxy.answer(method, path)
                if canned is not None:
                    for _ in self._body():
                        pass
                    status, headers = canned
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    proxy._log(method, path, status)
                    return
                if proxy.hold_blob and method == "GET" and path.endswith(f"/blobs/{proxy.hold_blob}"):
                    proxy.holding.set()
                    proxy.unhold.wait(300)  # a weight still on its way, until the test lets it arrive
                lie = proxy.lie(method, path)
                if lie is not None:
                    self._lie(method, path, *lie)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=300)
                try:
                    if proxy.down.is_set():
                        raise ConnectionRefusedError()
                    upstream.connect()
                except ConnectionRefusedError:  # the registry is down: the client's request goes unanswered
                    if proxy.back is None or not proxy.wait_for(lambda *entry: entry[2] == proxy.REFUSED, 0):
                        proxy._log(method, path, proxy.REFUSED)
                        self.close_connection = True
                        return
                    proxy.back.wait(300)  # refused once already: this one waits for the registry's restart
                    upstream.connect()
                hop_by_hop = ("transfer-encoding", "content-length", "connection")
                headers: dict[str, str] = {}
                for k, v in self.headers.items():  # Docker sends Accept once per media type: one list, not the last
                    if k.lower() not in hop_by_hop:
                        headers[k] = f"{headers[k]}, {v}" if k in headers else v
                chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
                try:
                    if chunked or self.headers.get("Content-Length") not in (None, "0"):
                        upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                        for k, v in headers.items():
                            upstream.putheader(k, v)
                        upstream.putheader("Transfer-Encoding", "chunked")
                        upstream.endheaders()
                        for data in self._forwarded(method, upstream):
                            upstream.send(b"%x\r\n%s\r\n" % (len(data), data))
                        upstream.send(b"0\r\n\r\n")
                    else:
                        upstream.request(method, path, headers={**headers, "Content-Length": "0"})
                    r = upstream.getresponse()
                except _Cut:
                    upstream.sock.shutdown(socket.SHUT_RDWR)
                    upstream.close()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    proxy._log(method, path, -1)
                    proxy.cut.set()
                    return
                proxy._log(method, path, r.status)
                if proxy.hold_answer(method, path):
                    proxy.holding.set()
                    proxy.unhold.wait(300)  # the registry did it; the client has not heard yet
                if proxy.endless_blob and path.endswith(f"/blobs/{proxy.endless_blob}") and method == "GET":
                    self._lie(method, path, r.status, {"Content-Type": "application/octet-stream"},
                              itertools.chain([r.read()], itertools.repeat(bytes(1 << 16))), length=False)
                    upstream.close()
                    return
                self.send_response_only(r.status)
                length = r.getheader("Content-Length")
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                body = b"" if method == "HEAD" or length is not None else r.read()
                self.send_header("Content-Length", length if length is not None else str(len(body)))
                self.end_headers()
                if method == "HEAD":
                    upstream.close()
                    return
                if length is None:
                    self.wfile.write(body)
                    upstream.close()
                    return
                passed = 0
                slow = proxy.throttle and "/blobs/" in path and method == "GET"
                # The slow link: one for all downloads (two streams share its rate), paced against
                # the clock, in pieces of ~10 ms of it (cheap on a fast link).
                piece = max(16384, min(1 << 20, proxy.throttle // 100)) if slow else 1 << 20
                while data := r.read(piece):
                    try:
                        self.wfile.write(data)
                    except OSError:
                        break
                    passed += len(data)
                    if "/blobs/" in path and method == "GET":
                        with proxy._lock:
                            proxy.blob_bytes_sent += len(data)
                    if slow:
                        if passed >= proxy.midway_at:
                            proxy.midway.set()
                        with proxy._lock:
                            now = time.monotonic()
                            proxy._link_free_at = max(now, proxy._link_free_at) + len(data) / proxy.throttle
                            ahead = proxy._link_free_at - now
                        if ahead > 0:
                            time.sleep(ahead)
                upstream.close()

            def _lie(self, method, path, status, headers, pieces, length=True):
                """Answer with `pieces` as the body: with a Content-Length (their total), or without
                one, the end of the body being the end of the connection."""
                for _ in self._body():
                    pass
                proxy._log(method, path, status)
                pieces = list(pieces) if length else pieces
                send_answer(self, status, headers, pieces, length)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *args):
                pass

        return Handler


class HostileServer(ThreadedServer):
    """A lying HTTP server on 127.0.0.1 (over TLS with a self-signed certificate if `workdir` is
    given), in a thread of the test process: a registry's front, its token service, or the other
    host that a registry's answer points at. `answer(method, path)` returns (status, headers,
    body pieces), sent with their total as Content-Length (default: 404). Each request is noted
    in `seen` as (method, path, its Authorization header or None)."""

    def __init__(self, workdir: Optional[str] = None):
        self.answer: Callable[[str, str], tuple[int, dict, list[bytes]]] = lambda method, path: (404, {}, [])
        self.seen: list[tuple[str, str, Optional[str]]] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        if workdir:
            import ssl
            cert, key = os.path.join(workdir, "hostile-cert.pem"), os.path.join(workdir, "hostile-key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                            "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", cert], check=True, capture_output=True)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._httpd.server_address[1]}"

    def _handler(self):
        server = self

        class Handler(NoDelayHandler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                left = int(self.headers.get("Content-Length") or 0)
                while left > 0:
                    left -= len(self.rfile.read(min(left, 1 << 16)) or b"\0" * left)
                server.seen.append((self.command, self.path, self.headers.get("Authorization")))
                send_answer(self, *server.answer(self.command, self.path))

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *args):
                pass

        return Handler



class _Cut(Exception):
    """The proxy cuts this upload's connections here."""


class MetadataServer(ThreadedServer):
    """A cloud's instance metadata service on 127.0.0.1, in a thread of the test process. It speaks
    only the documented paths and headers of one provider and refuses requests without them:
    aws   IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds), then
          GET /latest/meta-data/spot/instance-action (X-aws-ec2-metadata-token): 404 until a notice;
    gcp   GET /computeMetadata/v1/instance/preempted (Metadata-Flavor: Google): FALSE, then TRUE;
    azure GET /metadata/scheduledevents?api-version=2020-07-01 (Metadata: true): Events, Preempt.
    `preempt()` issues the notice; `requests` records (method, path) of every request, `refused`
    those it turned away."""

    def __init__(self, provider: str):
        self.provider = provider
        self.noticed = False
        self.requests: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []
        self.answered = threading.Event()  # set once a well-formed poll was answered
        self.token = uuid.uuid4().hex
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def preempt(self) -> None:
        self.noticed = True

    def _handler(self):
        server = self

        class Handler(NoDelayHandler):
            def _reply(self, code: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                if code >= 400 and code != 404:
                    server.refused.append((self.command, self.path))
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                server.requests.append(("PUT", self.path))
                if server.provider != "aws" or self.path != "/latest/api/token":
                    return self._reply(404)
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "").isdigit():
                    return self._reply(400)
                self._reply(200, server.token.encode())

            def do_GET(self):
                server.requests.append(("GET", self.path))
                p, h = self.path, self.headers
                if server.provider == "aws" and p == "/latest/meta-data/spot/instance-action":
                    if h.get("X-aws-ec2-metadata-token") != server.token:
                        return self._reply(401)
                    server.answered.set()
                    if not server.noticed:
                        return self._reply(404)
                    return self._reply(200,
                                       json.dumps({"action": "terminate", "time": "2026-12-03T12:00:00Z"}).encode(),
                                       "application/json")
                if server.provider == "gcp" and p == "/computeMetadata/v1/instance/preempted":
                    if h.get("Metadata-Flavor") != "Google":
                        return self._reply(403)
                    server.answered.set()
                    return self._reply(200, b"TRUE" if server.noticed else b"FALSE")
                if server.provider == "azure" and p == "/metadata/scheduledevents?api-version=2020-07-01":
                    if h.get("Metadata") != "true":
                        return self._reply(400)
                    server.answered.set()
                    events = [{"EventId": "A123", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                               "Resources": ["box"], "EventStatus": "Scheduled",
                               "NotBefore": "Thu, 03 Dec 2026 12:00:30 GMT"}]
                    doc = {"DocumentIncarnation": 2 if server.noticed else 1,
                           "Events": events if server.noticed else []}
                    return self._reply(200, json.dumps(doc).encode(), "application/json")
                self._reply(404)

            def log_message(self, *args):
                pass

        return Handler


def fake_dmi(path: str, **files: str) -> str:
    """A directory laid out like /sys/class/dmi/id with the given files (sys_vendor=..., ...)."""
    os.makedirs(path, exist_ok=True)
    for name, value in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(value + "\n")
    return path

