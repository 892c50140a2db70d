"""Streamed blob uploads that survive a broken link: the blob goes up in PATCHes of up to
CHUNK_SIZE from a producer that writes it (bounded memory, whatever its size); a PATCH that breaks
or is throttled resumes from the offset the registry reports holding, since the producer gives
the same bytes each time it runs; a registry that refuses PATCH gets one streamed PUT."""

from __future__ import annotations

import queue
import re
import threading
import urllib.parse
from typing import Callable, Iterator, Optional, Union

import requests

from snapshotter.errors import IntegrityError, RegistryError, SnapError
from snapshotter.progress import Stopped

from .answers import check
from .retry import RETRY_DELAYS, retry_delay, worth_retrying
from .transport import TIMEOUT, Transport

PIECE_SIZE = 1024 * 1024  # upload body pieces: what is queued between the producer and the socket
QUEUED_PIECES = 8  # memory per upload: about this many pieces, whatever the blob size
CHUNK_SIZE = 256 * 1024 * 1024  # bytes per PATCH: what a break can cost on a registry that cannot resume mid-PATCH
# Answers of a registry that takes no chunked uploads (Google Artifact Registry): one PUT instead.
PATCH_REFUSED = (405, 501)

Produce = Callable[[object], None]
Digest = Union[str, Callable[[], str]]  # a blob's digest, or a function that knows it once the bytes are written


class DigestFirst(RegistryError):
    """A blob whose digest is known only at its end could not go up in one pass (a registry that takes
    no chunked uploads, or a failed attempt, which cannot resume): count it first, then upload it."""


class _Bar:
    """A blob's bytes on the progress bar."""

    def __init__(self, progress: Optional[Callable[[int], None]]):
        self.progress, self.shown = progress, 0

    def count(self, n: int) -> None:
        self.shown += n
        if self.progress:
            self.progress(n)

    def back_to(self, offset: int) -> None:
        self.count(offset - self.shown)


def upload(transport: Transport, produce: Produce, digest: Digest, size: int, *, exists: Callable[[], bool],
           stopping: threading.Event, progress: Optional[Callable[[int], None]] = None) -> str:
    """Upload the blob whose `size` bytes `produce(out)` writes to `out`, into the transport's
    repository; its digest. After a failed attempt the registry is asked whether it holds the blob
    after all (`exists`), else where the upload stands (GET on its URL: the Range it holds); the next
    attempt runs `produce` again and sends only what follows. A registry that lost the upload
    (distribution 2.8 drops one whose PATCH broke mid-way) gets it again from zero. The registry
    accepts the blob only at the final PUT, and only if the bytes hash to `digest`. `stopping`
    set: the upload gives up (Stopped), even one whose socket hangs.

    `digest` may be a function that knows it only once the bytes are written (a blob encrypted as it
    streams, in one pass): _upload_once."""
    # Not oras's upload_blob: it reads the whole blob into memory (20 GB of RAM for a 20 GB model).
    bar = _Bar(progress)
    if callable(digest):
        return _upload_once(transport, produce, digest, size, stopping, bar)
    monolithic = transport.chunks_refused  # learned once: no PATCH refused again for each blob
    location, offset = None, 0
    for delay in RETRY_DELAYS:  # one attempt per step of the backoff
        if location is None:
            location, offset = _start(transport, digest), 0
        out = _StreamedUpload(transport, stopping, location, digest, size, offset, bar.count, monolithic)
        try:
            location = _written(out, produce)
            if not monolithic:
                _commit(transport, location, digest)
            return digest
        except RegistryError as e:
            last: RegistryError = e
        if out.patch_refused and not monolithic:
            transport.chunks_refused = True
            monolithic, location, offset = True, out.location, 0  # same upload, one PUT
            bar.back_to(0)
            continue
        if exists():  # it went in after all (waits for a registry that restarts)
            bar.back_to(size)
            return digest
        transport.backoff(out.retry_after if out.retry_after is not None else delay)
        status = None if monolithic else _status(transport, out.location)
        location, offset = status if status else (None, 0)
        bar.back_to(offset)  # the bar goes back to what the registry holds
    raise last


ONCE = "an encrypted layer"  # how _upload_once's blob is named in messages: its digest is not known yet


def _upload_once(transport: Transport, produce: Produce, digest_of: Callable[[], str], size: int,
                 stopping: threading.Event, bar: _Bar) -> str:
    """One attempt, in PATCHes, of a blob whose digest `digest_of()` gives once `produce` has written
    it, before the PUT (IntegrityError there: no PUT). It cannot resume (the bytes written again would
    be others: a new key), so any failure of the registry or the link is DigestFirst, as is a registry
    that takes no chunked uploads (a monolithic PUT names the digest before its body); the upload is
    cancelled and the bar goes back to zero."""
    if transport.chunks_refused:
        raise DigestFirst(f"registry {transport.registry} refuses chunked uploads")
    out = _StreamedUpload(transport, stopping, _start(transport, ONCE), ONCE, size, 0, bar.count, False)
    # Not cancelled where the registry is out of reach or the command stops (no request then): the
    # registry frees an upload it holds in its own time, and its key is gone with this attempt.
    try:
        location = _written(out, produce)
        done = digest_of()  # IntegrityError: the plain bytes were not the ones measured (never committed)
    except RegistryError as e:
        raise _once_failed(transport, out, bar, e) from None
    except IntegrityError:
        _cancel(transport, out.location)
        raise
    try:
        _commit(transport, location, done)
    except (RegistryError, IntegrityError) as e:  # DIGEST_INVALID: the link changed bytes hashed as they were sent
        raise _once_failed(transport, out, bar, e) from None
    return done


def _once_failed(transport: Transport, out: _StreamedUpload, bar: _Bar, e: Exception) -> DigestFirst:
    """A one-pass upload that failed: cancelled, its bar back to zero, DigestFirst for the caller."""
    if out.patch_refused:
        transport.chunks_refused = True
    _cancel(transport, out.location)
    bar.back_to(0)
    return DigestFirst(str(e))


def _written(out: _StreamedUpload, produce: Produce) -> str:
    """`produce` run into the upload's body, and the body ended: where the upload stands. A producer
    that fails ends the request without a valid body."""
    try:
        produce(out)
    except BaseException:
        out.abort()
        raise
    return out.finish()


def _cancel(transport: Transport, location: str) -> None:
    """Cancel an upload the registry holds (its bytes freed now, not days later): best effort."""
    try:
        transport.request("DELETE", location)
    except SnapError:
        pass


def _start(transport: Transport, digest: str) -> str:
    r = transport.request("POST", transport.url("blobs/uploads/"), headers={"Content-Length": "0"})
    check(r, f"start upload of {digest}")
    return transport.location(r, f"the start of upload of {digest}")


def _status(transport: Transport, location: str) -> Optional[tuple[str, int]]:
    """(location, offset) of an upload the registry still holds, from its Range; None if it is gone."""
    r = transport.request("GET", location)
    if r.status_code not in (200, 204):
        return None
    m = re.fullmatch(r"(?:bytes=)?0-(\d+)", r.headers.get("Range", "").strip())
    # distribution answers "0-0" for an empty upload too: resuming one byte early costs nothing.
    offset = int(m.group(1)) + 1 if m and m.group(1) != "0" else 0
    return transport.absolute(r.headers.get("Location") or location), offset


def _commit(transport: Transport, location: str, digest: str) -> None:
    r = transport.request("PUT", _with_digest(location, digest),
                          headers={"Content-Length": "0", "Content-Type": "application/octet-stream"})
    _check_put(r, digest)


def _with_digest(location: str, digest: str) -> str:
    sep = "&" if "?" in location else "?"
    return f"{location}{sep}digest={urllib.parse.quote(digest)}"


def _check_put(r: requests.Response, digest: str) -> None:
    if r.status_code == 400 and "DIGEST_INVALID" in r.text:
        raise IntegrityError(f"blob {digest} changed while it was uploaded (the registry saw other bytes)",
                             "a file of the box changed during the commit; commit again")
    check(r, f"finish upload of {digest}")


def _changed(digest: str, got: int, size: int) -> IntegrityError:
    return IntegrityError(f"blob {digest} changed while it was uploaded ({got} bytes, expected {size})",
                          "a file of the box changed during the commit; commit again")


class _StreamedUpload:
    """A write-only stream that a thread sends as request bodies: PATCHes of up to CHUNK_SIZE with
    their Content-Range (or one PUT of the whole blob), each with its Content-Length, streamed
    from a short queue so memory stays bounded. The first `skip` bytes written are what the
    registry already holds: dropped, not sent. Bytes past `size` (a file that changed since it was
    measured) are dropped too, and finish() refuses the upload: the producer goes to its end and can
    say which file changed."""

    _END = object()

    def __init__(self, transport: Transport, stopping: threading.Event, location: str, digest: str, size: int,
                 skip: int, progress: Callable[[int], None], monolithic: bool):
        self.transport, self.stopping = transport, stopping
        self.digest, self.size, self.skip = digest, size, skip
        self.progress, self.monolithic = progress, monolithic
        self.location = location  # where the upload continues: updated after each PATCH
        self.confirmed = skip  # bytes the registry holds at self.location
        self.written = 0  # bytes the producer wrote
        self.parts: list[bytes] = []  # written, joined into one piece once PIECE_SIZE is here
        self.pending = 0
        self.leftover = b""  # the rest of a piece cut at a chunk's end
        self.queue: queue.Queue = queue.Queue(QUEUED_PIECES)
        self.aborted = False
        self.patch_refused = False
        self.retry_after: Optional[float] = None
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._send, name=f"upload {digest[:19]}", daemon=True)
        self.thread.start()

    def write(self, data) -> int:
        n = len(data)
        self.written += n
        start = self.written - n
        dropped = max(0, min(n, self.skip - start))
        kept = min(n, max(0, self.size - start))  # none past `size`
        if dropped < kept:
            self.parts.append(bytes(data[dropped:kept]))
            self.pending += kept - dropped
            if self.pending >= PIECE_SIZE:
                self._queue()
        return n

    def finish(self) -> str:
        """End the body, wait for the registry's answers; the upload's location."""
        if self.written != self.size:
            self.abort()
            raise _changed(self.digest, self.written, self.size)
        if self.parts:
            self._queue()
        self._put(self._END)
        while self.thread.is_alive():  # the registry's answer; a stop does not wait for it
            self._check_stopping()
            self.thread.join(0.2)
        if self.error is not None:
            raise self.error
        return self.location

    def _check_stopping(self) -> None:
        if self.stopping.is_set():
            self.aborted = True  # the request thread (a daemon) ends at its next piece, or with the process
            raise Stopped()

    def abort(self) -> None:
        """The producer failed: end the request without a valid body."""
        self.aborted = True
        try:
            while True:
                self.queue.get_nowait()  # make room: the request thread may be waiting for a piece
        except queue.Empty:
            pass
        self.queue.put(self._END)
        if not self.stopping.is_set():  # a stop does not wait for a request stuck on a stalled link
            self.thread.join(TIMEOUT[0])

    def _queue(self) -> None:
        piece = b"".join(self.parts)
        self.parts, self.pending = [], 0
        self._put(piece)

    def _put(self, item) -> None:
        while True:
            self._check_stopping()
            if not self.thread.is_alive():  # the requests ended early: the registry refused or broke
                self.thread.join()
                if item is self._END and self.error is None:
                    return
                raise self.error or RegistryError(f"upload of {self.digest} ended before its body was sent")
            try:
                self.queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _pieces(self, n: int) -> Iterator[bytes]:
        """The next `n` bytes of the blob, as the producer hands them over."""
        while n > 0:
            piece, self.leftover = self.leftover, b""
            if not piece:
                piece = self.queue.get()
                if self.aborted:
                    raise _Aborted()
                if piece is self._END:
                    raise _Aborted()  # fewer bytes than `size`: finish() says so
            if len(piece) > n:
                piece, self.leftover = piece[:n], piece[n:]
            n -= len(piece)
            yield piece
            self.progress(len(piece))

    def _send(self) -> None:
        t = self.transport
        try:
            if self.monolithic:
                r = t.request("PUT", _with_digest(self.location, self.digest), resend=False,
                              data=_Body(self._pieces(self.size), self.size),
                              headers={"Content-Type": "application/octet-stream"})
                self._note_retry(r)
                _check_put(r, self.digest)
                return
            while self.confirmed < self.size:
                n = min(CHUNK_SIZE, self.size - self.confirmed)
                r = t.request("PATCH", self.location, resend=False, data=_Body(self._pieces(n), n),
                              headers={"Content-Type": "application/octet-stream",
                                       "Content-Range": f"{self.confirmed}-{self.confirmed + n - 1}"})
                if r.status_code in PATCH_REFUSED and self.confirmed == 0:
                    self.patch_refused = True
                    raise RegistryError(f"registry {t.registry} refuses chunked uploads (HTTP {r.status_code})")
                self._note_retry(r)
                check(r, f"upload of {self.digest}")
                # The registry says how much it holds; a body it did not take whole must not reach the PUT.
                got = r.headers.get("Range", "")
                if got and got != f"0-{self.confirmed + n - 1}":
                    raise RegistryError(f"upload of {self.digest} incomplete: the registry holds {got}, "
                                        f"we sent {self.confirmed + n} bytes")
                self.location = t.location(r, f"a PATCH of upload of {self.digest}")
                self.confirmed += n
        except BaseException as e:  # handed to the writer
            self.error = e

    def _note_retry(self, r: requests.Response) -> None:
        if worth_retrying(r):
            self.retry_after = retry_delay(r, RETRY_DELAYS[0])


class _Body:
    """A request body of known length, streamed: requests sends it with Content-Length."""

    def __init__(self, pieces: Iterator[bytes], length: int):
        self.pieces, self.length = pieces, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[bytes]:
        return self.pieces


class _Aborted(Exception):
    """Raised inside a streamed request body to end the request when its producer failed."""
