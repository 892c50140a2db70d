"""What the last commit of a root learnt, kept in the state dir for the next commit of that root
(`snap watch` keeps the same memos in memory instead):
  - its walk (box/memo.py's ScanMemo): a path whose lstat is as then keeps its entry, symlink
    target, xattrs and secret verdict, none of which is read again. The rule is the scan memo's
    own: the ctime moves with every change and cannot be set back, and a path changed within the
    memo's racy window is not kept;
  - its RECORDs (box/records.py's RecordMemo): one whose stamp is as then is not read again, and
    while none changed, the owners they gave are reused;
  - its plan (layer/planning.py) and the layers' stat-cache keys, reused while everything the plan
    is made from is as then: the walk (every entry kept in it), the diff's paths, the base's entries
    of those, the RECORDs, the profile and the options.

One file of each per root, for one context (the profile's scan rules, snap's version): another's is
not used. A file is marshal's form of its rows with the sha256 of those bytes ahead of them: it is
read only if whole (the state dir is ours alone), and written only when what it holds changed."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from operator import attrgetter
from typing import Optional

from snapshotter.box.records import RecordMemo, record_stamps
from snapshotter.box.diff import Diff
from snapshotter.box.memo import ScanMemo, scan_context
from snapshotter.box.scan import Scan
from snapshotter.index.entry import Entry
from snapshotter.layer.parents import parent_copy
from snapshotter.layer.plan import LayerPlan
from snapshotter.profile import Profile
from snapshotter.state import if_room, read_marshalled, root_key, sub, write_marshalled
from snapshotter.version import __version__

VERSION = 3  # 2: a plan's paths as one string; 3: the walk stored by field, not by row
_FIELDS = ("path", "kind", "mode", "uid", "gid", "size", "mtime", "linkname", "rdev", "digest", "inode", "stamp",
           "xattrs", "mtime_ns")  # an Entry's, in the order Entry() takes them


_TYPES = ({str}, {str}, {int}, {int}, {int}, {int}, {int}, {str}, {int}, {str, type(None)}, {str, type(None)}, {str},
          {dict, type(None)}, {int, type(None)})  # of _FIELDS, in order (exact: marshal makes no subclasses)
_XATTRS = _FIELDS.index("xattrs")


def _entries(columns) -> dict[str, Entry]:
    """The entries of the stored walk, only as save() writes them: a list per field, every value of
    its field's type (a bool is no int here). Checked a field at a time (an isinstance per value,
    as rows once were, cost more than the rest of the load: 0.07 s of 0.12 at 35k paths)."""
    if not (type(columns) is list and len(columns) == len(_FIELDS)
            and all(type(c) is list and len(c) == len(columns[0]) and set(map(type, c)) <= t
                    for c, t in zip(columns, _TYPES))
            and all(type(k) is str and type(v) is str for x in columns[_XATTRS] if x for k, v in x.items())):
        raise ValueError("stored walk: not a walk's entries")
    entries = dict(zip(columns[0], map(Entry, *columns)))
    if len(entries) != len(columns[0]):  # a path twice: one of its rows would be dropped unseen
        raise ValueError("stored walk: a path twice")
    return entries


def _key(*context) -> str:
    return hashlib.sha256(json.dumps([VERSION, __version__, *context]).encode("utf-8", "surrogateescape")).hexdigest()


def _read(path: str, key: str) -> tuple[object, Optional[str]]:
    """The data stored at `path` for `key`, and the digest of the file; (None, None) if there is none,
    it is damaged, or it is for another key."""
    stored, digest = read_marshalled(path)
    if type(stored) is tuple and len(stored) == 2 and stored[0] == key:
        return stored[1], digest
    return None, None


def _write(path: str, key: str, value) -> Optional[str]:
    """Store `value` for `key` at `path`; the digest of what was written, None where the state dir
    had no room (a memo only saves reading: the next commit reads again)."""
    written: list[str] = []
    return written[0] if if_room(lambda: written.append(write_marshalled(path, (key, value)))) else None


class StoredWalk:
    """A root's ScanMemo as the state dir keeps it, for one scan context."""

    def __init__(self, root: str, profile: Profile, extra_excludes: tuple[str, ...] = ()):
        self.context = scan_context(root, profile, extra_excludes)
        root, _, extra, metadata_only = self.context
        self.key = _key(root, sorted(extra), metadata_only, profile.exclude.patterns, profile.secrets.names,
                        profile.secrets.private_keys, profile.include_secrets, list(profile.include))
        self.path = os.path.join(sub("walk-memo"), root_key(root) + ".bin")
        self.loaded: dict[str, Entry | str] = {}
        self.digest: Optional[str] = None  # of the stored walk
        self._memo = ScanMemo()

    def memo(self) -> ScanMemo:
        """A ScanMemo holding what the stored walk kept (nothing if there is none for this context)."""
        self.loaded = {}
        stored, self.digest = _read(self.path, self.key)
        try:
            if stored is not None:
                columns, secrets = stored  # the entries by field; a secret's path -> its memo_stamp
                self.loaded = _entries(columns)
                if not (type(secrets) is dict and set(map(type, secrets)) <= {str} and set(map(type, secrets.values()))
                        <= {str} and secrets.keys().isdisjoint(self.loaded)):
                    raise ValueError("stored walk: not a walk's secrets")
                self.loaded.update(secrets)
        except (TypeError, ValueError):  # not what save() writes: the walk reads every path again
            self.loaded = {}
        self._memo = ScanMemo()
        self._memo.finish(self.context, self.loaded)
        return self._memo

    def save(self, scan: Scan) -> None:
        """Keep what the memo's last scan (`scan`) kept, unless it is what was loaded. The scan's
        kept_as names the stored walk if it holds every entry of the scan, with the entries it may
        not hold (`unkept`: files some process maps shared-writable) as they are now."""
        seen = self._memo.seen
        if seen != self.loaded:  # dict equality, in C: a kept entry is the loaded object itself (`is` first)
            entries = [v for v in seen.values() if not isinstance(v, str)]
            columns = [list(map(attrgetter(f), entries)) for f in _FIELDS]
            self.digest = _write(self.path, self.key, (columns, {p: v for p, v in seen.items() if isinstance(v, str)}))
        unkept = [[getattr(scan.entries[p], f) for f in _FIELDS] for p in sorted(scan.unkept)]
        # No walk stored (the state dir had no room for it): no plan may be kept on its word.
        scan.kept_as = None if scan.racy_dirs or self.digest is None else (
            _key(self.digest, unkept) if unkept else self.digest)


class StoredRecords:
    """A root's RecordMemo as the state dir keeps it."""

    def __init__(self, root: str):
        self.key = _key(os.path.realpath(root))
        self.path = os.path.join(sub("record-memo"), root_key(root) + ".bin")
        self.loaded = None
        self._memo = RecordMemo()

    def memo(self) -> RecordMemo:
        self.loaded, _ = _read(self.path, self.key)
        try:
            self._memo = RecordMemo.from_state(self.loaded) if self.loaded is not None else RecordMemo()
        except (TypeError, ValueError, IndexError):
            self._memo = RecordMemo()
        return self._memo

    def save(self) -> None:
        """Keep what the memo holds now, unless it is what was loaded."""
        state = self._memo.state()
        if state != self.loaded:
            _write(self.path, self.key, state)


class StoredPlan:
    """A root's last plan as the state dir keeps it: its layers, each entry by path (a parent
    directory's copy with its mtime), and their stat-cache keys."""

    def __init__(self, root: str, scan: Scan, d: Diff, index: dict[str, Entry], profile: Profile,
                 options: tuple):
        self.path = os.path.join(sub("plan-memo"), root_key(root) + ".bin")
        changed = [e.path for e in d.changed]
        # The diff's entries are the scan's own but where it made others (a digest computed): only
        # those are merged in, not a copy of the whole walk made on each commit.
        other = {e.path: e for e in d.changed if scan.entries.get(e.path) is not e}
        self.by_path = {**scan.entries, **other} if other else scan.entries
        records = record_stamps(scan.entries)  # what the units of bundles depend on (box/records.py)
        self.key = None if scan.kept_as is None or records is None else _key(
            scan.kept_as, sorted(scan.host_files), scan.unreadable, sorted(scan.pseudo_mounts), scan.skipped_secrets,
            _profile_rules(profile), list(options), records, _paths_digest(changed), d.deleted,
            # the base's entries of the diff's paths, which the plan reads
            [(p, index[p].kind, index[p].mtime, index[p].size) for p in itertools.chain(changed, d.deleted)
             if p in index])

    def plans(self, zstd_level: int) -> Optional[list[LayerPlan]]:
        """The kept plan, if it was made from the same input; None if there is none."""
        if self.key is None:
            return None
        stored, _ = _read(self.path, self.key)
        try:
            return None if stored is None else [self._plan(row, zstd_level) for row in stored]
        except (TypeError, ValueError, KeyError):
            return None

    def save(self, plans: list[LayerPlan], zstd_level: int) -> None:
        """Keep `plans` (with their keys at `zstd_level`, computed here) for the next commit's input."""
        if self.key is None:
            return
        rows = []
        for p in plans:
            parents = []  # (place, mtime) of each parent directory's copy
            for i, e in enumerate(p.entries):
                src = self.by_path.get(e.path)
                if src is None or (e is not src and e != parent_copy(src, e.mtime)):
                    return  # an entry made another way (a part of a big file): not kept
                if e is not src:
                    parents.append((i, e.mtime))
            # The paths as one string (a path holds no NUL): one object to load, not one per entry.
            rows.append((p.name, p.compression, p.detail, p.whiteouts, sorted(p.slices.items()), p.part_of,
                         p.part_links, len(p.entries), "\0".join(e.path for e in p.entries), parents,
                         zstd_level, p.fingerprint(zstd_level)))
        _write(self.path, self.key, rows)

    def _plan(self, row: tuple, zstd_level: int) -> LayerPlan:
        name, compression, detail, whiteouts, slices, part_of, part_links, count, paths, parents, level, key = row
        own = list(map(self.by_path.__getitem__, paths.split("\0"))) if count else []  # none: "" would be one, the root
        for i, mtime in parents:
            own[i] = parent_copy(own[i], mtime)
        plan = LayerPlan(name, compression, own, list(whiteouts), detail, {k: tuple(v) for k, v in slices},
                         tuple(part_of) if part_of else None, list(part_links))
        if level == zstd_level:
            plan.keep_fingerprint(level, key)
        return plan


def _profile_rules(profile: Profile) -> list:
    """Everything of a profile that decides a plan, as plain data."""
    return [profile.name, profile.zstd_level, profile.exclude.patterns, profile.secrets.names,
            profile.secrets.private_keys, profile.include_secrets, list(profile.include),
            [(r.name, r.paths.patterns, r.venv, r.min_size, list(r.extensions), r.compression, r.file_layer_min,
              r.bundle_max) for r in profile.layers]]


def _paths_digest(paths: list[str]) -> str:
    """sha256 of each path with a NUL after it (one string joined: an update per path cost twice as much)."""
    joined = "\0".join(paths) + "\0" if paths else ""
    return hashlib.sha256(joined.encode("utf-8", "surrogateescape")).hexdigest()
