"""A layer plan: what goes into one image layer (LayerPlan), its stat-cache key, and the names a
plan gives its layers and part files. How the box's changes are planned into layers: planning.py."""

from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Iterator, Optional, Protocol

from snapshotter.digests import chunks_digest
from snapshotter.index.entry import Entry

DEFAULT_MAX_LAYER_SIZE = int(9.5 * 1000**3)  # some registries reject layers over 10 GB
PART_SUFFIX = ".snap-part-"  # "<path>.snap-part-0001-of-0003"
MAX_PARTS = 100_000  # a file cut into more parts than this is refused (by commit and restore)
_PART_NAME = re.compile(re.escape(PART_SUFFIX) + r"([0-9]{4,6})-of-([0-9]{4,6})")
_PART_ANNOTATION = re.compile(r"([0-9]{1,6})/([0-9]{1,6})")
_ROWS_PER_PIECE = 4096  # rows of a stat-cache key hashed at once (a piece of about 0.5 MB)


class KeyMemo(Protocol):
    """What fingerprint() takes from a plan memo (memo.PlanMemo): keys and rows it has seen."""

    def key(self, plan: LayerPlan, zstd_level: int) -> str: ...

    def rows_of(self, entries: list[Entry]) -> Iterator[str]: ...


@dataclass
class LayerPlan:
    """What goes into one image layer."""

    name: str  # the profile layer (venv, models, ...)
    compression: str
    entries: list[Entry] = field(default_factory=list)
    whiteouts: list[str] = field(default_factory=list)  # deleted paths
    detail: str = ""  # "" | "bundle 2" | the file of a single-file layer | "part 1/3 of <file>"
    slices: dict[str, tuple[str, int]] = field(default_factory=dict)  # part entry -> (source file, offset)
    part_of: Optional[tuple[str, int, int]] = None  # (file, index, count) for a part layer
    part_links: list[str] = field(default_factory=list)  # last part: the file's other names (hardlinks)
    # fingerprint() by zstd level: asked twice per layer by a commit, and costly for a 20k-file venv
    _fingerprints: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def empty(self) -> bool:
        return not self.entries and not self.whiteouts

    @property
    def content_size(self) -> int:
        return sum(e.size for e in self.entries)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name

    def fingerprint(self, zstd_level: int, memo: Optional[KeyMemo] = None) -> str:
        """A digest of everything the layer's bytes depend on, from stat data only: the stat cache's
        key. ctime and inode are in it, so a file rewritten with its old mtime put back still counts
        as changed. Computed once per level: the plan is not changed after it is made.

        The digest is of the JSON text of {"compression", "zstd_level", "entries": [a row per
        entry], "whiteouts", "slices", "part_links"} (compact separators), written here a row at a
        time so that a `memo` can give the row of an entry it has seen (the same object), or the
        digest of a layer of the very same entries."""
        if zstd_level in self._fingerprints:
            return self._fingerprints[zstd_level]
        fp = self._fingerprints[zstd_level] = memo.key(self, zstd_level) if memo is not None else \
            chunks_digest(s.encode() for s in self.key_text(zstd_level, None))
        return fp

    def keep_fingerprint(self, zstd_level: int, fingerprint: str) -> None:
        """Take fingerprint(zstd_level) as known: a kept plan of the very same input had it (snapshot/kept.py)."""
        self._fingerprints[zstd_level] = fingerprint

    def key_text(self, zstd_level: int, memo: Optional[KeyMemo]):
        """fingerprint()'s JSON in pieces (ASCII: json escapes the rest), hashed as they come: the
        whole text of a 200k-file layer would be tens of MB at the commit's peak of memory."""
        dump = functools.partial(json.dumps, separators=(",", ":"))
        yield (f'{{"compression":{dump(self.compression)},'
               f'"zstd_level":{dump(zstd_level if self.compression == "zstd" else None)},"entries":[')
        rows = memo.rows_of(self.entries) if memo is not None else map(fingerprint_row, self.entries)
        sep = ""
        while batch := list(itertools.islice(rows, _ROWS_PER_PIECE)):
            yield sep + ",".join(batch)
            sep = ","
        yield (f'],"whiteouts":{dump(self.whiteouts)},"slices":{dump(sorted(self.slices.items()))},'
               f'"part_links":{dump(self.part_links)}}}')


_json_row = json.JSONEncoder(separators=(",", ":")).encode
_json_str = json.encoder.encode_basestring_ascii  # the string form json.dumps writes (ensure_ascii)


def fingerprint_row(e: Entry) -> str:
    """An entry's row of the stat cache's key: the JSON text of [path, kind, mode, uid, gid, size,
    mtime, linkname, rdev, inode, stamp, sorted xattrs]. Written by hand when every field has its
    usual type (a commit makes one row per path of the box; the generic encoder costs ~5 us each),
    by the encoder otherwise: the same text either way."""
    try:
        if not e.xattrs and type(e.mode) is type(e.uid) is type(e.gid) is type(e.size) is type(e.mtime) \
                is type(e.rdev) is int:
            inode = "null" if e.inode is None else _json_str(e.inode)
            return (f"[{_json_str(e.path)},{_json_str(e.kind)},{e.mode},{e.uid},{e.gid},{e.size},{e.mtime},"
                    f"{_json_str(e.linkname)},{e.rdev},{inode},{_json_str(e.stamp)},[]]")
    except TypeError:  # a field of another type: the encoder says how it is written
        pass
    return _json_row([e.path, e.kind, e.mode, e.uid, e.gid, e.size, e.mtime, e.linkname, e.rdev, e.inode, e.stamp,
                      sorted(e.xattrs.items()) if e.xattrs else []])


META_DETAIL = "directories and deletions"
BUNDLE_PREFIX = "bundle "  # the detail of the n-th bundle of a layer: "bundle n"


def holds_one_file(detail: str) -> bool:
    """Whether a layer's detail (its dev.snap.content annotation) names the one file it holds:
    not a bundle's number, not the weights' directories-and-deletions layer."""
    return detail != META_DETAIL and not (detail.startswith(BUNDLE_PREFIX) and detail[len(BUNDLE_PREFIX):].isdigit())


def part_name(path: str, i: int, n: int) -> str:
    """The name of part i of n of `path`: "<path>.snap-part-0001-of-0003" (the one place it is built)."""
    return f"{path}{PART_SUFFIX}{i:04d}-of-{n:04d}"


def parse_part_name(name: str) -> Optional[tuple[str, int, int]]:
    """(path, i, n) of a name part_name() built, with 1 <= i <= n <= MAX_PARTS; None for any other name."""
    m = _PART_NAME.search(name)
    if m is None or m.end() != len(name):
        return None
    path, i, n = name[:m.start()], int(m.group(1)), int(m.group(2))
    if not path or not 1 <= i <= n <= MAX_PARTS or part_name(path, i, n) != name:
        return None
    return path, i, n


def parse_part_annotation(value: object) -> Optional[tuple[int, int]]:
    """(i, n) of a part layer's "i/n" annotation, with 1 <= i <= n <= MAX_PARTS; None if malformed."""
    m = _PART_ANNOTATION.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        return None
    i, n = int(m.group(1)), int(m.group(2))
    return (i, n) if 1 <= i <= n <= MAX_PARTS else None
