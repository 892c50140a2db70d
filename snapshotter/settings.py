"""Settings snap reads from its environment (SNAP_*): one parser for each kind of value, so a bad
value gets the same one-line error whichever setting it is."""

from __future__ import annotations

import math
import os

from snapshotter.errors import UsageError


def seconds(name: str, default: float, hint: str, above_zero: bool = False) -> float:
    """$name as seconds (`default` when unset); a value that is no finite number >= 0 (> 0 with
    `above_zero`) is a usage error naming the setting."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 if above_zero else value >= 0)):
        raise UsageError(f"{name}={text!r} is not a number of seconds{' above 0' if above_zero else ''}", hint)
    return value


def number(name: str, default: float) -> float:
    """$name as a number, `default` when unset or unreadable: for the knobs tests turn (a retry
    scale, a clock step), where a bad value must not stop a user's command halfway."""
    try:
        value = float(os.environ.get(name, "").strip() or default)
    except ValueError:
        return default
    return value if math.isfinite(value) else default
