"""What the test's own HTTP servers share: a thread to serve in, a handler without Nagle's delay,
and an answer sent in pieces."""

from __future__ import annotations

import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional


class NoDelayHandler(BaseHTTPRequestHandler):
    """A test server's request handler. TCP_NODELAY: its headers and body go out as separate
    writes, and Nagle would hold the body back until the client's delayed ACK (40 ms a request)."""

    disable_nagle_algorithm = True


class ThreadedServer:
    """An HTTP server of the test process, run in a thread: `_httpd` is set by the subclass."""

    _httpd: ThreadingHTTPServer
    _thread: Optional[threading.Thread] = None

    def start(self):
        self._stopping = threading.Event()
        self._httpd.handle_error = self._handle_error
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def _handle_error(self, request, client_address) -> None:
        """A client that hung up mid-answer (snap stopping a transfer, the bench ending a restore) is
        no error of the server's: no traceback on stderr for it."""
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return
        ThreadingHTTPServer.handle_error(self._httpd, request, client_address)

    def _serve(self) -> None:
        # Not serve_forever: its shutdown() waits for a 0.5 s poll (per test, with a proxy).
        # Here stop() wakes the loop with a connection of its own.
        self._httpd.timeout = None
        while not self._stopping.is_set():
            self._httpd.handle_request()

    def stop(self) -> None:
        if self._thread:
            self._stopping.set()
            socket.create_connection(self._httpd.server_address[:2]).close()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()



def send_answer(handler: BaseHTTPRequestHandler, status: int, headers: dict, pieces, length: bool = True) -> None:
    """Answer with `pieces` as the body: with a Content-Length (their total: a list), or without
    one, the end of the body being the end of the connection."""
    handler.send_response_only(status)
    for k, v in headers.items():
        handler.send_header(k, v)
    if length:
        handler.send_header("Content-Length", str(sum(len(p) for p in pieces)))
    else:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    if handler.command == "HEAD":
        return
    for piece in pieces:
        try:
            handler.wfile.write(piece)
        except OSError:
            return  # the client hung up

