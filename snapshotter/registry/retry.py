"""When a registry request is worth asking again, and how long to wait first: our short backoff
(a registry that restarts is waited for ~15 s, one that is down fails in seconds), or the
registry's own Retry-After (capped) when it throttles. The request loop (transport.py) and an
upload's attempts (upload.py) both follow it."""

from __future__ import annotations

import email.utils
import time

import requests

from snapshotter import settings

RETRY_DELAYS = (0.5, 1, 2, 4, 8)  # ~15 s for a registry to come back before we give up
RETRY_STATUSES = (429, 500, 502, 503, 504)  # busy, throttling or restarting: worth asking again
MAX_RETRY_AFTER = 60  # seconds: a longer Retry-After is waited this long, then asked again
RETRY_SCALE_ENV = "SNAP_RETRY_SCALE"  # scales every wait (tests make them short)


def worth_retrying(r: requests.Response) -> bool:
    return r.status_code in RETRY_STATUSES


def retry_delay(r: requests.Response, default: float) -> float:
    """How long to wait before asking again: the registry's Retry-After (seconds or an HTTP date,
    at most MAX_RETRY_AFTER), else `default`, our own backoff step."""
    value = r.headers.get("Retry-After", "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return default
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def scaled(seconds: float) -> float:
    """A wait as $SNAP_RETRY_SCALE scales it."""
    return seconds * max(0.0, settings.number(RETRY_SCALE_ENV, 1.0))
