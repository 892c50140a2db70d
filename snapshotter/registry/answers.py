"""What a registry's answers say: a failure as one printable line with the registry's own error
codes (check), every body read within bounds whatever a hostile registry sends (read_answer,
read_capped), and the short reason of a requests/urllib3 error (short_error)."""

from __future__ import annotations

import time
from typing import Optional

import requests

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
    """The last, most specific line of a requests/urllib3 error chain."""
    if e is None:
        return "no answer"
    text = str(e)
    for key in ("Connection refused", "Name or service not known", "timed out", "certificate verify failed",
                "No route to host", "Temporary failure in name resolution"):
        if key in text:
            return key
    return text.splitlines()[0][:200]

