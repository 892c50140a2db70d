"""Settings snap reads from its environment (SNAP_*): one parser for each kind of value, so a bad
value gets the same one-line error whichever setting it is."""

from __future__ import annotations

import math
import os

from snapshotter.errors import UsageError

# The most any setting may be, either way (seconds, or a scale that multiplies a wait of at most a
# minute): about 11.6 days. Past it a value is a bad one, as an unreadable one is: a timeout of 1e10 s
# overflows threading's and time.sleep's bound (threading.TIMEOUT_MAX, ~292 years) instead of waiting.
SETTING_MAX = 1e6


def _within_bounds(value: float) -> bool:
    return math.isfinite(value) and abs(value) <= SETTING_MAX


def seconds(name: str, default: float, hint: str, above_zero: bool = False) -> float:
    """$name as seconds (`default` when unset); a value that is no number from 0 (above 0 with
    `above_zero`) to SETTING_MAX is a usage error naming the setting."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (_within_bounds(value) and (value > 0 if above_zero else value >= 0)):
        raise UsageError(f"{name}={text!r} is not a number of seconds from {'above ' if above_zero else ''}0 "
                         f"to {SETTING_MAX:.0f}", hint)
    return value


def number(name: str, default: float) -> float:
    """$name as a number, `default` when unset, unreadable or past ±SETTING_MAX: for the knobs tests
    turn (a retry scale, a clock step), where a bad value must not stop a user's command halfway."""
    try:
        value = float(os.environ.get(name, "").strip() or default)
    except ValueError:
        return default
    return value if _within_bounds(value) else default
