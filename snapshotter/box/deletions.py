"""What a snapshot deletes of its base: counted at commit, where one that deletes the system is
refused (a wrong --root: an empty directory diffs as the whole base deleted), and recorded in the
manifest, where a restore onto a live system reads it before downloading anything.

The system is the base's top-level directories that hold paths (bin, etc, usr; an empty /srv or
/mnt does not count: deleting it loses nothing), or more than half of the base's paths. The
record is an accident guard, not a trust boundary: the extractor refuses to delete a top-level
directory of a live root whatever the manifest says (layer/extract.py)."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Optional

from snapshotter.errors import UsageError
from snapshotter.index.entry import DIR, Entry

SNAP_DELETES = "dev.snap.deletes"  # manifest annotation: {"paths": n, "of": base paths, "top": [top-level dirs]}
TOP_SHOWN = 5  # top-level directories named in a message


@dataclass
class Deletions:
    paths: int  # base paths the snapshot deletes (a deleted tree counts each path in it)
    of: int  # paths in the base
    top: list[str]  # top-level directories of the base, holding paths, that it deletes

    @property
    def deletes_system(self) -> bool:
        return bool(self.top) or 2 * self.paths > self.of

    def describe(self) -> str:
        shown = ", ".join("/" + t for t in self.top[:TOP_SHOWN]) + (", ..." if len(self.top) > TOP_SHOWN else "")
        tops = f"{len(self.top)} of the base's top-level directories ({shown}) and " if self.top else ""
        return f"{tops}{self.paths} of its {self.of} paths"

    def annotation(self) -> dict[str, str]:
        return {SNAP_DELETES: json.dumps({"paths": self.paths, "of": self.of, "top": self.top}, separators=(",", ":"))}


def count(index: dict[str, Entry], deleted: list[str]) -> Deletions:
    """What deleting `deleted` (the top-most paths of each deleted tree: box/diff.py's Diff) does to the
    base `index`. The paths below a path are one run of the sorted paths (those between 'p/' and
    'p0', '0' following '/'): no pass over a 200k-path base per deleted path."""
    if not deleted:
        return Deletions(0, len(index), [])
    paths = sorted(index)

    def below(rel: str) -> int:
        return bisect.bisect_left(paths, rel + "0") - bisect.bisect_left(paths, rel + "/")

    gone = [rel for rel in deleted if rel in index]
    top = [rel for rel in gone if "/" not in rel and index[rel].kind == DIR and below(rel)]
    return Deletions(sum(1 + below(rel) for rel in gone), len(index), sorted(top))


def refuse_commit(root: str, d: Deletions) -> None:
    """Refuse to push a snapshot that deletes the system (unless forced: the caller's choice)."""
    if d.deletes_system:
        raise UsageError(f"the box at --root {root!r} deletes {d.describe()}: refusing to push a snapshot that "
                         "deletes the base's system", "check --root: it must be the box's root, where the base "
                         "image's files are; or pass --force to push it anyway")


def recorded(annotations: Optional[dict]) -> Optional[Deletions]:
    """The deletions a snapshot's manifest records; None for an image without (older, foreign) or
    with a malformed record: the extractor's own check stands."""
    try:
        doc = json.loads((annotations or {})[SNAP_DELETES])
        d = Deletions(doc["paths"], doc["of"], doc["top"])
    except (KeyError, TypeError, ValueError):
        return None
    if type(d.paths) is not int or type(d.of) is not int or not isinstance(d.top, list) \
            or not all(isinstance(t, str) for t in d.top):
        return None
    return d


def refuse_restore(root: str, ref: str, sign: str, d: Optional[Deletions]) -> None:
    """Refuse, before anything is downloaded, to apply onto a live system (`sign`: what shows one)
    a snapshot that records deleting the system."""
    if d is not None and d.deletes_system:
        raise UsageError(f"{ref} deletes {d.describe()}, and {root!r} holds a live system ({sign}): refusing to "
                         "apply its deletions", "was it committed from a wrong --root? pass --force to apply it anyway")
