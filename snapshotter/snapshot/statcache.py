"""The stat cache: layer fingerprints (from stat data only) -> the layer blob they produced.

A second commit whose big layers did not change reads no model bytes: each planned layer's
fingerprint (path, size, mtime, inode, ctime, mode, owner of every entry) is looked up here, and a
hit whose blob the registry still has is reused as it is. The cache is per (box root, base image):
a cache from another root or base is never consulted.

Every file here carries a format version; one of another version, or whose entries are not laid out
as this version writes them, is ignored (and rewritten), never misread."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from snapshotter import jsontext
from snapshotter.state import open_own, read_versioned, replace_file, root_key, sub

from .reserve import write_note

VERSION = 1
BLOB_FIELDS = {"digest": str, "diff_id": str, "size": int, "media_type": str}  # what a hit gives commit


def blob_entry(value) -> Optional[dict]:
    """`value` if it is a blob as this version records it ({digest, diff_id, size, media_type}), else None."""
    if isinstance(value, dict) and all(type(value.get(k)) is t for k, t in BLOB_FIELDS.items()):
        return {k: value[k] for k in BLOB_FIELDS}
    return None


class StatCache:
    def __init__(self, root: str, base_digest: str):
        self.key = {"version": VERSION, "root": os.path.realpath(root), "base": base_digest}
        name = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:32]
        self.path = os.path.join(sub("stat-cache"), name + ".json")
        self.old: dict[str, dict] = {}
        self.new: dict[str, dict] = {}
        try:
            with open_own(self.path) as f:
                doc = jsontext.loads(f.read())
            if isinstance(doc, dict) and doc.get("key") == self.key and isinstance(doc.get("layers"), dict):
                self.old = doc["layers"]
        except (OSError, ValueError):
            pass  # no cache, or a damaged one: everything is built

    def lookup(self, fingerprint: str) -> Optional[dict]:
        return blob_entry(self.old.get(fingerprint))

    def record(self, fingerprint: str, blob: dict) -> None:
        self.new[fingerprint] = blob

    def save(self, keep_old: bool = False) -> None:
        """Keep what this commit used: layers that are gone from the box fall out of the cache.
        `keep_old` adds to the cache instead (layers sent ahead of a commit, by `snap watch`)."""
        layers = {**self.old, **self.new} if keep_old else self.new
        replace_file(self.path, lambda f: json.dump({"key": self.key, "layers": layers}, f))


# ---- what a commit leaves for `snap status` and for the next commit of the root ----------------


# 3: each made digest with the root's restore mark it was pushed under (record.restore_mark)
LAST_COMMIT_VERSION = 3
MADE_KEPT = 32  # digests of the snapshots made from a root that are remembered (lineage.py)


def _last_commit_path(root: str) -> str:
    return os.path.join(sub("last-commit"), root_key(root) + ".json")


def _last_commit(root: str) -> dict:
    path = _last_commit_path(root)
    doc = read_versioned(path, LAST_COMMIT_VERSION)
    if doc is None and (old := read_versioned(path, 2)) is not None:
        doc = _from_version_2(old)
    return doc or {}


NO_RESTORE = (None, None, None)  # the restore mark (record.restore_mark) of a root no restore wrote into


def _from_version_2(old: dict) -> dict:
    """An older snap's file (format 2, no restore marks): its base and target as they are; its made
    digests as made under NO_RESTORE. So they count for such a root alone: for one restored, whether
    they were made before or after the restore is not known, and they are not counted (a commit then
    diverges once rather than move a tag over work a restore replaced)."""
    made = old.get("made")
    return {**old, "made": [[d, list(NO_RESTORE)] for d in made if isinstance(d, str)] if isinstance(made, list)
            else []}


def note_last_commit(root: str, base: str, target: str, digest: str, mark: tuple, pending: bool = False) -> None:
    """Remembered per root: the base, so that `snap status` needs no --base after a commit or a
    watch; the tag its snapshots are for (the moving one: `snap status` lists its diverged tags);
    the manifest digests of the last snapshots made from it, each with the root's restore mark
    (record.restore_mark) it was pushed under, so that a later commit may move a tag that names one
    made since the last restore into the root (lineage.py). `pending`: noted before the tag may name
    it (a commit stopped between the registry's move and its note keeps the box its tag), one at a
    time and apart from the made ones, which commits that never moved the tag so cannot push out."""
    doc = _last_commit(root)
    made = _made_rows(doc)
    if not pending:
        made = [m for m in made if m[0] != digest][-(MADE_KEPT - 1):] + [[digest, list(mark)]]
    write_note(_last_commit_path(root), LAST_COMMIT_VERSION, {
        "base": base, "target": target, "made": made, **({"pending": [digest, list(mark)]} if pending else {})})


def last_base(root: str) -> Optional[str]:
    base = _last_commit(root).get("base")
    return base if isinstance(base, str) else None


def last_target(root: str) -> Optional[str]:
    """The tag the last commit or watch of `root` was for."""
    target = _last_commit(root).get("target")
    return target if isinstance(target, str) else None


def _made_rows(doc: dict) -> list[list]:
    """[digest, restore mark] of each snapshot noted as made in a last-commit file, oldest first."""
    made = doc.get("made")
    return [m for m in made if _row(m)] if isinstance(made, list) else []


def _row(m) -> bool:
    return isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and isinstance(m[1], list)


def _made(root: str) -> list[list]:
    """[digest, restore mark] of each snapshot made from `root`, oldest first, the pending one last."""
    doc = _last_commit(root)
    pending = doc.get("pending")
    return _made_rows(doc) + ([pending] if _row(pending) else [])


def made_from(root: str, mark: Optional[tuple] = None) -> list[str]:
    """The manifest digests of the last snapshots this state dir pushed of `root`, oldest first.
    With `mark` (the root's restore mark now), only those pushed under it: made since the last
    restore into the root began or ended, so the box still holds their work. A restore writes
    over it, finished or not: a snapshot made before then is no longer this box's line of work."""
    return [d for d, m in _made(root) if mark is None or tuple(m) == tuple(mark)]
