"""Loopback servers below HTTP, in a thread of the test process: what a link or a broken server does
to a connection before any answer (RawServer)."""

from __future__ import annotations

import socket
import struct
import threading

# Bytes that are no HTTP status line, nor a TLS record (a TLS client reads "wrong version number").
GARBAGE = b"\x00\x01 no protocol at all\r\n\r\n"


class RawServer:
    """A TCP server on 127.0.0.1 that treats every connection as `kind` says:

    - "silent": takes it and never answers (it stays open until stop); `connected` is set at the first;
    - "reset": reads what the client sent, then resets the connection (RST);
    - "garbage": reads what the client sent, answers GARBAGE and closes;
    - "close": reads what the client sent (a request, or a TLS client hello) and closes without a word.
    """

    def __init__(self, kind: str):
        assert kind in ("silent", "reset", "garbage", "close"), kind
        self.kind = kind
        self.connected = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._sock.getsockname()[1]}"

    def start(self) -> "RawServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while True:
            conn, _ = self._sock.accept()
            if self._stopping.is_set():  # stop()'s own connection
                conn.close()
                return
            self._treat(conn)

    def _treat(self, conn: socket.socket) -> None:
        if self.kind == "silent":
            self._held.append(conn)
            self.connected.set()
            return
        try:
            conn.recv(1 << 16)
            if self.kind == "reset":  # a zero linger: close() sends RST, not FIN
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif self.kind == "garbage":
                conn.sendall(GARBAGE)
        except OSError:
            pass  # the client hung up first
        finally:
            conn.close()

    def stop(self) -> None:
        self._stopping.set()
        socket.create_connection(self._sock.getsockname()).close()  # wakes accept()
        self._thread.join()
        self._sock.close()
        for conn in self._held:
            conn.close()
