"""The image index's on-disk form: gzip'd JSON lines, one Entry a line, behind a header that names
the format and the layers indexed."""

from __future__ import annotations

import gzip
import json
import operator
from dataclasses import fields
from typing import Optional, Sequence

from snapshotter import jsontext
from snapshotter.state import open_own, replace_file, versioned

from .entry import Entry, gc_paused

# The base-index cache holds each Entry positionally (compact, quick to load). Its first
# line names the format version and Entry's fields: a cache of another version or field layout is
# rebuilt, never read into the wrong fields, and so is one of other layers (its diff_ids).
INDEX_VERSION = 4
_ROW = operator.attrgetter(*(f.name for f in fields(Entry)))  # an Entry's fields in order (astuple copied each deeply)
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def _index_header(diff_ids: Sequence[str]) -> dict:
    return {"version": INDEX_VERSION, "fields": [f.name for f in fields(Entry)], "diff_ids": list(diff_ids)}


def save_index(index: dict[str, Entry], path: str, diff_ids: Sequence[str]) -> None:
    """Save the index of the layers `diff_ids` (their uncompressed digests, in order)."""
    def write(f) -> None:
        f.write(json.dumps(_index_header(diff_ids)) + "\n")
        for e in index.values():
            f.write(_ENCODE(_ROW(e)))
            f.write("\n")

    replace_file(path, write, lambda p, m: gzip.open(p, m, compresslevel=1), "wt")


def load_index(path: str, diff_ids: Optional[Sequence[str]] = None) -> Optional[dict[str, Entry]]:
    """The index saved at `path`; None if it is missing, damaged, of another version or layout, or,
    given `diff_ids`, of other layers than those: an image that names a base it does not hold (a
    hostile one, restored here) must not stand for that base in the next commit's diff."""
    try:
        with open_own(path, "rb") as raw, gzip.open(raw, "rt") as f, gc_paused():
            header = versioned(jsontext.loads(f.readline() or "null"), INDEX_VERSION)
            if header is None or not isinstance(header.get("diff_ids"), list) or \
                    header != _index_header(header["diff_ids"] if diff_ids is None else diff_ids):
                return None
            width = len(header["fields"])
            index = {}
            for line in f:
                row = jsontext.loads(line)
                if not isinstance(row, list) or len(row) != width:
                    return None
                e = Entry(*row)
                index[e.path] = e
            return index
    except (OSError, ValueError, TypeError, EOFError):
        return None  # a missing or damaged cache is rebuilt
