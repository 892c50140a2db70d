"""A Docker engine that fails as a real one does mid-run, on 127.0.0.1 in a thread of the test
process: the few Engine API calls `snap run` makes (ping, version, pull, create, inspect, attach,
start, wait, stop), each answered as dockerd does, or cut as a dockerd restart cuts it."""

from __future__ import annotations

import json
import socket
import struct
import threading
from http.server import ThreadingHTTPServer

from support.run import TIMEOUT
from support.servers import NoDelayHandler, ThreadedServer

CONTAINER_ID = "c0ffee" * 10 + "c0ff"
CONTAINER_NAME = "faulty"
VERSION = {"ApiVersion": "1.41", "MinAPIVersion": "1.12", "Version": "24.0.7", "Os": "linux", "Arch": "amd64"}


def frame(stream: int, data: bytes) -> bytes:
    """One frame of the engine's multiplexed attach stream (1 stdout, 2 stderr)."""
    return struct.pack(">BxxxL", stream, len(data)) + data


class FaultyEngine(ThreadedServer):
    """Point DOCKER_HOST at `address`. `fault` picks what fails:
    - "pull-cut": the pull's progress stream is cut after its first event;
    - "attach-cut", "wait-cut": the connection is closed before any answer;
    - "create-500", "create-403", "start-500": the create, or the start, is answered with that status;
    - "hold": the attach stream says "ready" on stdout, then holds until the container is stopped.
    Otherwise the container says "hello" and exits 3. `seen`: (method, route) of every request."""

    def __init__(self, fault: str | None = None):
        self.fault = fault
        self.seen: list[tuple[str, str]] = []
        self.started, self.stopped = threading.Event(), threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self._httpd.server_address[1]}"

    def _handler(self):
        server = self

        class Handler(NoDelayHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                left = int(self.headers.get("Content-Length") or 0)
                if left:
                    self.rfile.read(left)
                route = self.path.split("?")[0]
                route = route.split("/", 2)[2] if route.startswith("/v1.") else route.lstrip("/")
                server.seen.append((self.command, route))
                server.answer(self, self.command, route)

            do_GET = do_HEAD = do_POST = do_DELETE = _any

        return Handler

    def answer(self, h, method: str, route: str) -> None:
        fault = self.fault
        if (fault, route) in (("attach-cut", f"containers/{CONTAINER_ID}/attach"),
                              ("wait-cut", f"containers/{CONTAINER_ID}/wait")):
            return self._cut(h)
        if route == "images/create":
            return self._pull(h)
        if route == "containers/create" and fault in ("create-500", "create-403"):
            return self._json(h, int(fault[-3:]), {"message": f"the engine says {fault}"})
        if route == f"containers/{CONTAINER_ID}/start" and fault == "start-500":
            return self._json(h, 500, {"message": f"the engine says {fault}"})
        if route == "containers/create":
            return self._json(h, 201, {"Id": CONTAINER_ID, "Warnings": []})
        if route == f"containers/{CONTAINER_ID}/attach":
            return self._attach(h)
        if route == f"containers/{CONTAINER_ID}/wait":
            return self._json(h, 200, {"StatusCode": 3})
        if route == f"containers/{CONTAINER_ID}/start":
            self.started.set()
        if route == f"containers/{CONTAINER_ID}/stop":
            self.stopped.set()
        if route in (f"containers/{CONTAINER_ID}/start", f"containers/{CONTAINER_ID}/stop") or method == "DELETE":
            return self._json(h, 204, None)
        documents = {"_ping": "OK", "version": VERSION, "info": {"Name": socket.gethostname()},
                     f"containers/{CONTAINER_ID}/json": {"Id": CONTAINER_ID, "Name": "/" + CONTAINER_NAME,
                                                         "Config": {"Tty": False}, "State": {}}}
        if route in documents:
            return self._json(h, 200, documents[route])
        return self._json(h, 404, {"message": f"page not found: {route}"})

    @staticmethod
    def _json(h, status: int, doc) -> None:
        body = b"" if doc is None else json.dumps(doc).encode()
        h.send_response_only(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _cut(h) -> None:
        """As a dockerd that restarts: the connection closed, nothing answered."""
        h.close_connection = True
        h.connection.shutdown(socket.SHUT_RDWR)

    def _pull(self, h) -> None:
        h.send_response_only(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        event = json.dumps({"status": "Pulling from faulty", "id": "v1"}).encode() + b"\r\n"
        h.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        if self.fault == "pull-cut":
            return self._cut(h)
        h.wfile.write(b"0\r\n\r\n")

    def _attach(self, h) -> None:
        """101, then the raw multiplexed stream until the connection closes (the container's end)."""
        h.send_response_only(101)
        h.send_header("Content-Type", "application/vnd.docker.raw-stream")
        h.send_header("Connection", "Upgrade")
        h.send_header("Upgrade", "tcp")
        h.end_headers()
        h.close_connection = True
        # Output only once the container runs, as dockerd: bytes sent with the 101 would be read into
        # the client's buffer of the answer's headers, and lost to the raw socket it then reads.
        self.started.wait(TIMEOUT)
        if self.fault == "hold":
            h.wfile.write(frame(1, b"ready\n"))
            h.wfile.flush()
            self.stopped.wait(TIMEOUT)  # until `snap run` stops the container (or a hang's bound)
        else:
            h.wfile.write(frame(1, b"hello\n"))
        h.wfile.flush()
        h.connection.shutdown(socket.SHUT_RDWR)
