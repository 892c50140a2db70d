"""JSON from outside snap (a registry, an image's annotations and blobs, a provider, a helper) and
from its state files (which a damaged disk may garble): one parse whose every failure is a ValueError,
as malformed JSON's is, so a caller's one `except` covers JSON nested deeper than the parser goes
(RecursionError, which an image can cause at will)."""

from __future__ import annotations

import json


def loads(text):
    """json.loads, with too deep a nesting a ValueError."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested deeper than it may be") from None
