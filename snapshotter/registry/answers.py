"""What a registry's answers say: a failure as one printable line with the registry's own error
codes (check), every body read within bounds whatever a hostile registry sends (read_answer,
read_capped), and the short reason of a requests/urllib3 error (short_error)."""

from __future__ import annotations

import http.client
import re
import ssl
import time
from typing import Optional

import requests
import urllib3
from urllib3.exceptions import ProtocolError

from snapshotter import jsontext
from snapshotter.errors import RegistryError, RegistryUnreachable, SnapError, printable

ERROR_BODY_LIMIT = 16 * 1024  # bytes of an error answer read for its message; the rest is dropped
ERROR_READ_S = 5  # seconds spent reading them from a registry that drips
ANSWER_LIMIT = 4 << 20  # bytes of any other answer read whole (a tags page, an upload's answer)
ANSWER_READ_S = 60  # seconds it may take to arrive


def json_object(body: bytes) -> Optional[dict]:
    """`body` as a JSON object; None if it is not one (not JSON, a list, a number)."""
    try:
        doc = jsontext.loads(body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def check(r: requests.Response, what: str, by_code: Optional[dict[str, type[RegistryError]]] = None) -> None:
    """A RegistryError with the registry's own error codes, for an answer that is not a success:
    of the class `by_code` names for one of those codes, if any (one a caller recovers from).
    Whatever the body's size or shape (a hostile registry's), the message is one printable line."""
    if r.status_code < 300:
        return
    body = _error_body(r)
    doc = json_object(body)
    errors = doc.get("errors") if doc is not None else None
    errors = [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []
    if errors:
        detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
    else:
        detail = body[:200].decode(errors="replace")
    codes = [e["code"] for e in errors if isinstance(e.get("code"), str)]
    kind = next((by_code[c] for c in codes if c in (by_code or {})), RegistryError)
    raise kind(f"{what} failed: HTTP {r.status_code} {printable(detail.strip())[:500]}".strip())


def read_answer(r: requests.Response, what: str) -> None:
    """Read a streamed answer's body within bounds, for r.content and r.text to give: an error's
    first ERROR_BODY_LIMIT bytes (the rest dropped), any other's whole if it is at most
    ANSWER_LIMIT bytes (else a RegistryError: requests alone would read gigabytes into memory)."""
    body = _error_body(r) if r.status_code >= 300 else read_capped(r, ANSWER_LIMIT, what)
    r._content, r._content_consumed = body, True  # requests' own cache of a body it has read


def read_capped(r: requests.Response, limit: int, what: str, too_long: type[SnapError] = RegistryError,
                seconds: float = ANSWER_READ_S) -> bytes:
    """A streamed answer's body, refused (`too_long`) past `limit` bytes and (RegistryUnreachable)
    once it has taken longer than `seconds` to arrive. `what`: the answer, in the messages."""
    pieces: list[bytes] = []
    got, deadline = 0, time.monotonic() + seconds
    try:
        while data := r.raw.read1(limit + 1 - got, decode_content=True):  # what has arrived, at most one byte too many
            pieces.append(data)
            got += len(data)
            if got > limit:
                r.close()
                raise too_long(f"{what} is longer than the {limit} bytes it may have: refusing it")
            if time.monotonic() > deadline:
                r.close()
                raise RegistryUnreachable(f"{what} took more than {seconds:.0f} s to arrive: giving up")
    except SnapError:
        raise
    except Exception as e:  # noqa: BLE001 - urllib3's read errors are not requests' nor OSError
        raise RegistryUnreachable(f"{what} broke off: {short_error(e)}") from None
    return b"".join(pieces)


def _error_body(r: requests.Response) -> bytes:
    """At most ERROR_BODY_LIMIT bytes of an answer's body: the ones arrived within ERROR_READ_S of
    a streamed answer (then the connection is closed, the rest unread), or of one already read."""
    pieces: list[bytes] = []
    got, deadline = 0, time.monotonic() + ERROR_READ_S
    try:
        while got < ERROR_BODY_LIMIT and time.monotonic() < deadline:
            # what has arrived, without waiting for more
            data = r.raw.read1(ERROR_BODY_LIMIT - got, decode_content=True)
            if not data:
                break
            pieces.append(data)
            got += len(data)
    except Exception:  # noqa: BLE001 - a broken or already read stream: urllib3's errors are not OSError
        pass
    if pieces:
        r.close()
        return b"".join(pieces)
    try:
        return (r.content or b"")[:ERROR_BODY_LIMIT]  # read before (not streamed), or empty
    except Exception:  # noqa: BLE001 - a stream that broke: no message, the status says enough
        return b""


def short_error(e: Optional[BaseException]) -> str:
    """Why a request failed, in plain words: the innermost cause of a requests/urllib3 error chain
    (an OSError's strerror, ...), never the repr of a connection pool cut short."""
    if e is None:
        return "no answer"
    chain = _causes(e)
    # Through a proxy (HTTPS_PROXY), what failed may be the proxy, not the registry: said first.
    via = "the proxy: " if any(isinstance(c, urllib3.exceptions.ProxyError) for c in chain) else ""
    for cause in reversed(chain):  # the innermost that says something
        words = _plain_words(cause, chain)
        if words:
            return via + words
    text = printable((str(chain[-1]).splitlines() or [""])[0])
    return text if 0 < len(text) <= 200 else type(chain[-1]).__name__  # a whole line or a name, never cut


def _causes(e: BaseException) -> list[BaseException]:
    """`e` and the exceptions behind it, outermost first. requests puts its cause in args, urllib3
    in `reason` or args, Python in __cause__ (raise from) and __context__ (raised while handling)."""
    chain: list[BaseException] = []
    while e is not None and len(chain) < 16 and all(e is not c for c in chain):
        chain.append(e)
        inner = (e.__cause__, getattr(e, "reason", None), *e.args, e.__context__)
        e = next((x for x in inner if isinstance(x, BaseException) and all(x is not c for c in chain)), None)
    return chain


_SSL_CODES = re.compile(r"^\[[^\]]*\]\s*|\s*\(_ssl\.c:\d+\)$")  # OpenSSL's "[SSL: CODE] " and " (_ssl.c:1006)"


def _plain_words(e: BaseException, chain: list[BaseException]) -> str:
    """What `e` means to a user, or "" where it is only a wrapper of another."""
    if isinstance(e, SnapError):
        return str(e)
    if isinstance(e, ssl.SSLEOFError):
        # urllib3 calls a connection that broke within an answer "Connection broken"
        within = any(isinstance(c, ProtocolError) and str(c).startswith("Connection broken") for c in chain)
        return f"the TLS connection was closed mid-{'answer' if within else 'handshake'}"
    if isinstance(e, ssl.SSLError):
        return printable(_SSL_CODES.sub("", str(e.strerror or e))) or "TLS failed"
    if isinstance(e, http.client.RemoteDisconnected):  # a ConnectionResetError without strerror
        return "the server closed the connection without answering"
    if isinstance(e, OSError) and e.strerror:  # "Connection refused", "Network is unreachable", DNS's gaierror
        return e.strerror
    if isinstance(e, (TimeoutError, urllib3.exceptions.TimeoutError)):
        return "timed out"
    if isinstance(e, http.client.IncompleteRead):
        return "the answer was cut short"
    if isinstance(e, http.client.LineTooLong):
        return "the server's answer has a line too long for HTTP"
    if isinstance(e, http.client.HTTPException):  # BadStatusLine, UnknownProtocol, ...
        return "the server's answer is not HTTP"
    return ""
