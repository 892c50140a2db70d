"""Planning the snapshot layers: which changed path goes into which layer.

Every changed or deleted path goes to one profile layer (venv, custom_nodes, models, rest, ...).
A profile layer can then become several image layers, each kept stable so that adding, upgrading
or removing one package, node or model re-uploads nothing else:
  - a file of at least the rule's `file_layer_min` gets a layer of its own (big weights);
  - a file larger than the registry's layer cap is cut into part layers that restore joins back;
  - the rest is bundled: in a code layer by natural unit (layer/units.py: a distribution with its
    dist-info, one custom node) and then path, cut only between units where the unit's hash says
    so (content-defined), in a weights layer by path, cut between files; so an insertion only
    changes the bundle it falls in;
  - directories and deletions go into a small last layer (always for weights, else when there are
    several bundles): the shared directories' new mtimes change only it.
sizing() sizes the bundles to the box so that a snapshot keeps to LAYER_BUDGET layers.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from snapshotter.box.diff import Diff
from snapshotter.box.records import RecordMemo
from snapshotter.box.scan import Scan
from snapshotter.digests import chunks_digest
from snapshotter.errors import UsageError
from snapshotter.index.entry import DIR, FILE, Entry
from snapshotter.profile import LayerRule, Profile, VenvRoots

from .units import Owners, units_of

DEFAULT_MAX_LAYER_SIZE = int(9.5 * 1000**3)  # some registries reject layers over 10 GB
PART_SUFFIX = ".snap-part-"  # "<path>.snap-part-0001-of-0003"
MAX_PARTS = 100_000  # a file cut into more parts than this is refused (by commit and restore)
_PART_NAME = re.compile(re.escape(PART_SUFFIX) + r"([0-9]{4,6})-of-([0-9]{4,6})")
_PART_ANNOTATION = re.compile(r"([0-9]{1,6})/([0-9]{1,6})")
_ROWS_PER_PIECE = 4096  # rows of a stat-cache key hashed at once (a piece of about 0.5 MB)
_BUNDLE_FILL = 4  # a weights layer's bundles hold bundle_max / 4 on average
LAYER_BUDGET = 100  # image layers, the base's included: engines refuse about 125 (MAX_ENGINE_LAYERS)
CODE_SHARE = 0.6  # of the budget left by the base, the code layers' bundles (the weights take the rest)
MIN_BUNDLE = 16 * 1024**2  # the code layers' smallest bundle target: a tiny layer costs round trips
WHOLE_BELOW = 4  # a code layer of less than this many MIN_BUNDLEs stays one layer
MAX_SIZING_ROUNDS = 16  # targets doubled at most this often to fit the budget


@dataclass(frozen=True)
class Bundling:
    """How one profile layer is cut into bundles (sizing() decides it for a commit)."""

    target: float  # content a bundle holds on average: a unit ends one with a chance of its size over this
    cap: int  # the most content a bundle holds (but for one entry bigger than it)
    file_layer_min: Optional[int] = None  # a file this big gets a layer of its own (weights)
    units: bool = False  # cuts fall between natural units (layer/units.py), not between any two files


def rule_bundling(rule: LayerRule, max_layer_size: int) -> Bundling:
    """A layer's bundling as its rule alone says: a weights layer's bundles of at most bundle_max,
    any other layer whole (but at the layer cap)."""
    if rule.bundle_max is not None:
        cap = min(rule.bundle_max, max_layer_size)
        return Bundling(cap / _BUNDLE_FILL, cap, rule.file_layer_min)
    return Bundling(float("inf"), max_layer_size, rule.file_layer_min)


def _step_up(n: float) -> int:
    """The power of two at or above n: a target moves only when the layer doubles, so a package
    added or removed keeps every other bundle's cuts."""
    return 1 << max(0, math.ceil(math.log2(n))) if n > 1 else 1


def layer_budget(profile: Profile, base_layers: int) -> int:
    """The layers a snapshot may have besides its base's (two per profile layer at least)."""
    return max(LAYER_BUDGET - base_layers, 2 * len(profile.layers))


def sizing(plans: dict[str, LayerPlan], profile: Profile, max_layer_size: int, base_layers: int,
           doublings: int = 0) -> dict[str, Bundling]:
    """Each profile layer's bundling, sized to the box so that the image, base layers included,
    keeps to LAYER_BUDGET layers. From the content sizes alone (the same tree gets the same cuts):
      - the code layers (all but the weights) share one target, the power of two at or above their
        content over CODE_SHARE of the budget (less their directory layers), and MIN_BUNDLE at least;
        cuts fall between natural units; a code layer under WHOLE_BELOW MIN_BUNDLEs stays whole;
      - a weights layer keeps a layer per file of file_layer_min or more while those fit in 3/4 of
        its share; else the threshold doubles until they do, and the files under it are bundled
        with a target raised (in powers of two from bundle_max / 4) to fit the rest of the share.
    `doublings` doubles every target that many times more (plan_layers, when a box's cuts came out
    over the budget)."""
    budget = layer_budget(profile, base_layers)
    code = [r for r in profile.layers if not r.weights]
    weights = [r for r in profile.layers if r.weights]
    code_share = int(budget * CODE_SHARE) if weights else budget
    out: dict[str, Bundling] = {}
    code_size = sum(plans[r.name].content_size for r in code)
    target = max(MIN_BUNDLE, _step_up(code_size / max(1, code_share - len(code)))) << doublings
    for r in code:
        if plans[r.name].content_size < WHOLE_BELOW * MIN_BUNDLE:
            out[r.name] = rule_bundling(r, max_layer_size)  # a few MB sent again cost less than more layers
        else:
            out[r.name] = Bundling(min(target, max_layer_size), min(4 * target, max_layer_size), None, units=True)
    share = max(2, (budget - code_share) // max(1, len(weights)) - 1)  # less its directories' layer
    for r in weights:
        files = sorted((e.size for e in plans[r.name].entries if e.kind == FILE), reverse=True)
        own = rule_bundling(r, max_layer_size)
        threshold = own.file_layer_min
        while threshold is not None and threshold < max_layer_size and \
                sum(1 for s in files if s >= threshold) > share * 3 // 4:
            threshold *= 2
        singles = sum(1 for s in files if threshold is not None and s >= threshold)
        folded = sum(s for s in files if threshold is None or s < threshold)
        wtarget = max(own.target, _step_up(folded / max(1, share - singles))) * (1 << doublings)
        if wtarget == own.target:
            out[r.name] = replace(own, file_layer_min=threshold)
        else:
            out[r.name] = Bundling(min(wtarget, max_layer_size), min(int(4 * wtarget), max_layer_size), threshold)
    return out


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

    def fingerprint(self, zstd_level: int, memo: Optional["PlanMemo"] = None) -> str:
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
            chunks_digest(s.encode() for s in self._key_text(zstd_level, None))
        return fp

    def _key_text(self, zstd_level: int, memo: Optional["PlanMemo"]):
        """fingerprint()'s JSON in pieces (ASCII: json escapes the rest), hashed as they come: the
        whole text of a 200k-file layer would be tens of MB at the commit's peak of memory."""
        dump = functools.partial(json.dumps, separators=(",", ":"))
        yield (f'{{"compression":{dump(self.compression)},'
               f'"zstd_level":{dump(zstd_level if self.compression == "zstd" else None)},"entries":[')
        rows = memo.rows_of(self.entries) if memo is not None else map(_fingerprint_row, self.entries)
        sep = ""
        while batch := list(itertools.islice(rows, _ROWS_PER_PIECE)):
            yield sep + ",".join(batch)
            sep = ","
        yield (f'],"whiteouts":{dump(self.whiteouts)},"slices":{dump(sorted(self.slices.items()))},'
               f'"part_links":{dump(self.part_links)}}}')


_json_row = json.JSONEncoder(separators=(",", ":")).encode
_json_str = json.encoder.encode_basestring_ascii  # the string form json.dumps writes (ensure_ascii)


def _fingerprint_row(e: Entry) -> str:
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


class PlanMemo:
    """What the last plan of the same box made, for the next one (`snap watch` keeps one, with one
    profile): each profile layer's split into image layers, reused when that layer holds the very
    same entries (objects: the scan memo keeps an unchanged path's entry) and deletions as then;
    each entry's profile layer, while the profile and the box's venv roots are as then; each
    entry's row of the stat cache's key, and each image layer's key; and the copies of the parent
    directories a layer carries (add_parent_dirs), so that an unchanged layer holds the same
    objects. Entries are mutable but nothing changes the fields a plan
    or a row reads once the scan made them. The memo holds the entries it names, so no new object
    can take one of their ids. Each plan starts afresh and keeps only what it used."""

    def __init__(self):
        self.records = RecordMemo()  # the box's RECORDs as read for the last plan
        self.splits: dict[str, tuple[tuple, list[LayerPlan], list[Entry]]] = {}
        self._old_splits: dict[str, tuple[tuple, list[LayerPlan], list[Entry]]] = {}
        self.rows: dict[int, tuple[Entry, str]] = {}
        self._old_rows: dict[int, tuple[Entry, str]] = {}
        self.layers: dict[int, tuple[Entry, str]] = {}
        self._old_layers: dict[int, tuple[Entry, str]] = {}
        self._classified_by: Optional[tuple[Profile, frozenset[str]]] = None
        self.keys: dict[tuple, tuple[list[Entry], str]] = {}
        self._old_keys: dict[tuple, tuple[list[Entry], str]] = {}
        self.parents: dict[tuple[int, int], tuple[Entry, Entry]] = {}
        self._old_parents: dict[tuple[int, int], tuple[Entry, Entry]] = {}

    def start(self) -> None:
        self._old_splits, self.splits = self.splits, {}
        self._old_rows, self.rows = self.rows, {}
        self._old_layers, self.layers = self.layers, {}
        self._old_keys, self.keys = self.keys, {}
        self._old_parents, self.parents = self.parents, {}

    def classifier(self, profile: Profile, venv_roots: VenvRoots) -> Callable[[Entry], str]:
        """The profile layer of an entry (Profile.classify), or what it was at the last plan for the
        same entry, profile and venv roots (a venv root that appears moves the paths under it)."""
        context = (profile, frozenset(venv_roots.roots))
        same = self._classified_by is not None and self._classified_by[0] is profile \
            and self._classified_by[1] == context[1]
        old, new = (self._old_layers if same else {}), self.layers
        self._classified_by = context

        def layer_of(e: Entry) -> str:
            hit = old.get(id(e))
            if hit is None or hit[0] is not e:
                hit = (e, profile.classify(e.path, e.size, e.kind != DIR, venv_roots))
            new[id(e)] = hit
            return hit[1]

        return layer_of

    def split(self, plan: LayerPlan, rule: LayerRule, max_layer_size: int, bundling: Bundling,
              owners: Optional[Owners] = None) -> list[LayerPlan]:
        """split_plan(plan, ...), or copies of what it gave last time for the same input (`owners`
        compared as the object: owners_of gives the same one while no RECORD changed)."""
        key = (rule, max_layer_size, bundling, plan.compression, tuple(map(id, plan.entries)), tuple(plan.whiteouts),
               owners)
        last = self._old_splits.get(rule.name)
        made = last[1] if last is not None and last[0] == key else \
            split_plan(plan, rule, max_layer_size, bundling, owners)
        # The key's ids stay unique while the entries live: the memo holds them (the third item).
        self.splits[rule.name] = (key, [_copy(p) for p in made], plan.entries)
        return [_copy(p) for p in made]

    def key(self, plan: LayerPlan, zstd_level: int) -> str:
        """plan.fingerprint(zstd_level): what it was for a layer of the same entries (objects),
        whiteouts, slices and part links, else made from the rows this memo keeps."""
        ident = (plan.compression, zstd_level, tuple(map(id, plan.entries)), tuple(plan.whiteouts),
                 tuple(sorted(plan.slices.items())), tuple(plan.part_links))
        hit = self.keys.get(ident) or self._old_keys.get(ident)
        if hit is None:  # (the entries are held with the key: their ids stay theirs)
            hit = (list(plan.entries), chunks_digest(s.encode() for s in plan._key_text(zstd_level, self)))
        self.keys[ident] = hit
        return hit[1]

    def parent_copy(self, e: Entry, mtime: int) -> Entry:
        """add_parent_dirs' copy of directory `e` with `mtime`: the one made last time for them."""
        hit = self.parents.get((id(e), mtime)) or self._old_parents.get((id(e), mtime))
        if hit is None or hit[0] is not e:
            hit = (e, _parent_copy(e, mtime))
        self.parents[(id(e), mtime)] = hit
        return hit[1]

    def rows_of(self, entries: list[Entry]):
        for e in entries:
            hit = self.rows.get(id(e)) or self._old_rows.get(id(e))
            if hit is None or hit[0] is not e:
                hit = (e, _fingerprint_row(e))
            self.rows[id(e)] = hit
            yield hit[1]


def _copy(plan: LayerPlan) -> LayerPlan:
    """A plan whose lists a caller may change (add_parent_dirs does) without changing this one."""
    return replace(plan, entries=list(plan.entries), whiteouts=list(plan.whiteouts), slices=dict(plan.slices),
                   part_links=list(plan.part_links))


def plan_layers(d: Diff, scan: Scan, base: dict[str, Entry], profile: Profile,
                compression: Optional[str] = None,
                max_layer_size: int = DEFAULT_MAX_LAYER_SIZE, memo: Optional[PlanMemo] = None,
                base_layers: int = 0, owners: Optional[Owners] = None) -> list[LayerPlan]:
    """Assign every changed and deleted path to a profile layer, then split each into bundles sized
    (sizing()) so that the image, its `base_layers` included, keeps to LAYER_BUDGET layers.
    Returns the non-empty plans in profile order, except that the weights layers come last: a
    restore can start the app once the layers before them are applied (`snap restore --then`).
    Each path is in one layer only, so no whiteout of an earlier layer concerns a later one.
    A `memo` (PlanMemo) reuses the last plan's split of a profile layer whose paths did not change.
    `owners` (box/records.py) says which distribution owns a path, for the units of bundles."""
    if memo is not None:
        memo.start()
    split = memo.split if memo is not None else split_plan
    plans = {r.name: LayerPlan(r.name, _compression(r.compression, compression)) for r in profile.layers}
    changed = {e.path: e for e in d.changed}
    layer_of = memo.classifier(profile, scan.venv_roots) if memo is not None else \
        (lambda e: profile.classify(e.path, e.size, e.kind != DIR, scan.venv_roots))
    # Hardlinked files travel together, in the layer of their first path, so the links survive.
    groups: dict[str, list[Entry]] = {}
    for e in scan.entries.values():
        if e.inode:
            groups.setdefault(e.inode, []).append(e)
    group_layer: dict[str, str] = {}
    for inode, members in groups.items():
        if any(m.path in changed for m in members):
            members.sort(key=lambda m: m.path)
            first = members[0]
            group_layer[inode] = layer_of(first)  # (a directory has no other names)
            for m in members:
                changed[m.path] = m
    for path in sorted(changed):
        e = changed[path]
        name = group_layer.get(e.inode) if e.inode else None
        plans[name or layer_of(e)].entries.append(e)
    for path in d.deleted:
        old = base[path]
        plans[profile.classify(path, old.size, old.kind != DIR, scan.venv_roots)].whiteouts.append(path)
    # Cuts fall by chance: a box whose bundles came out over the budget gets every target doubled
    # (the same tree the same way), while that still helps.
    out: list[LayerPlan] = []
    for doublings in range(MAX_SIZING_ROUNDS):
        bundlings = sizing(plans, profile, max_layer_size, base_layers, doublings)
        made: list[LayerPlan] = []
        for rule in sorted(profile.layers, key=lambda r: r.weights):  # stable: profile order otherwise
            made.extend(split(plans[rule.name], rule, max_layer_size, bundlings[rule.name], owners))
        made = [p for p in made if not p.empty]
        if out and len(made) >= len(out):
            break
        out = made
        if len(out) <= layer_budget(profile, base_layers):
            break
    _last_carries_changed_dirs(out, {r.name for r in profile.layers if r.weights}, changed)
    add_parent_dirs(out, scan.entries, changed, base, memo)
    return out


META_DETAIL = "directories and deletions"
BUNDLE_PREFIX = "bundle "  # the detail of the n-th bundle of a layer: "bundle n"


def holds_one_file(detail: str) -> bool:
    """Whether a layer's detail (its dev.snap.content annotation) names the one file it holds:
    not a bundle's number, not the weights' directories-and-deletions layer."""
    return detail != META_DETAIL and not (detail.startswith(BUNDLE_PREFIX) and detail[len(BUNDLE_PREFIX):].isdigit())


def _last_carries_changed_dirs(layers: list[LayerPlan], weights: set[str], changed: dict[str, Entry]) -> None:
    """With the weights last, the topmost layer carrying a directory would often be a weight's own
    layer, which then takes the directory's new mtime (add_parent_dirs): a file added beside a model
    would change the model's layer. The weights' small last layer (directories and deletions) carries
    every changed parent directory of the weights layers instead, and so decides their mtime."""
    parents: set[str] = set()
    for plan in layers:
        if plan.name in weights and plan.detail != META_DETAIL:
            for path in [e.path for e in plan.entries] + plan.whiteouts:
                parent = path.rpartition("/")[0]
                while parent and parent not in parents:
                    parents.add(parent)
                    parent = parent.rpartition("/")[0]
    dirs = [changed[d] for d in sorted(parents) if d in changed and changed[d].kind == DIR]
    if not dirs:
        return
    last = layers[-1]
    if last.detail != META_DETAIL or last.name not in weights:
        last = LayerPlan(last.name, last.compression, detail=META_DETAIL)
        layers.append(last)
    own = {e.path for e in last.entries}
    last.entries.extend(e for e in dirs if e.path not in own)
    last.entries.sort(key=lambda x: x.path)


def add_parent_dirs(layers: list[LayerPlan], box: dict[str, Entry], changed: dict[str, Entry],
                    base: dict[str, Entry], memo: Optional[PlanMemo] = None) -> None:
    """Give every layer each parent directory of its paths, as `docker commit` and buildkit do:
    Docker and podman create a parent a layer lacks as 0755 root:root, over the one below it.

    The copies carry the box's mode, owner and xattrs. The mtime: the box's in the topmost layer
    that carries the directory (that one decides what an engine shows, and what restore leaves),
    and in every layer for a directory the box has as in the base. In the lower layers a changed
    directory carries its mtime in the base instead (for a new one, the newest mtime of that
    layer's own paths under it): adding a model changes its directory's mtime, and that must not
    change the layer of every other model in it, not even the first time the directory changes."""
    below: list[set[str]] = []
    topmost: dict[str, int] = {}
    for i, plan in enumerate(layers):
        dirs: set[str] = set()
        for path in [e.path for e in plan.entries] + plan.whiteouts:
            parent = path.rpartition("/")[0]
            while parent and parent not in dirs:
                dirs.add(parent)
                parent = parent.rpartition("/")[0]
        below.append(dirs)
        for d in dirs.union(e.path for e in plan.entries if e.kind == DIR):
            topmost[d] = i
    for i, plan in enumerate(layers):
        own = {e.path for e in plan.entries}
        planned = len(plan.entries)  # the layer's own paths: the parents are added after them
        newest: Optional[dict[str, int]] = None
        added = False
        for d in sorted(below[i] - own):
            e = box.get(d)
            if e is None or e.kind != DIR:
                continue  # not seen in the box (cannot happen for a walk): engines make it as they do
            mtime = e.mtime
            if d in changed and topmost[d] != i:
                was = base.get(d)
                if was is not None and was.kind == DIR:
                    mtime = was.mtime
                else:
                    newest = newest if newest is not None else _newest_below(plan.entries[:planned])
                    mtime = newest.get(d, 0)
            plan.entries.append(memo.parent_copy(e, mtime) if memo is not None else _parent_copy(e, mtime))
            added = True
        if added:
            plan.entries.sort(key=lambda x: x.path)


def _parent_copy(e: Entry, mtime: int) -> Entry:
    """A parent directory as a layer carries it. No stamp: a directory's ctime moves with every file
    added to it, and the stat cache keys on what the layer's bytes depend on (its mode, owner,
    xattrs and this mtime)."""
    return replace(e, mtime=mtime, stamp="", inode=None, digest=None)


def _newest_below(entries: list[Entry]) -> dict[str, int]:
    """Each directory above `entries`' paths -> the newest mtime of those paths under it (one pass
    up each path: a layer holds thousands of paths under hundreds of new directories)."""
    newest: dict[str, int] = {}
    for e in entries:
        parent = e.path.rpartition("/")[0]
        while parent:
            if parent in newest and newest[parent] >= e.mtime:
                break  # its parents have as new a path already
            newest[parent] = e.mtime
            parent = parent.rpartition("/")[0]
    return newest


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


def _compression(layer_default: str, override: Optional[str]) -> str:
    if override is None or layer_default == "none":
        return layer_default  # weights stay uncompressed whatever the engine
    return override


def split_plan(plan: LayerPlan, rule: LayerRule, max_layer_size: int,
               bundling: Optional[Bundling] = None, owners: Optional[Owners] = None) -> list[LayerPlan]:
    """Cut one profile layer into image layers: single-file layers, part layers, bundles, and the
    small last layer of directories and deletions (a weights layer always; another when it has
    several bundles). `bundling` says how (sizing() gives it); None: as the rule alone says."""
    if max_layer_size <= 0:
        raise ValueError("max_layer_size must be positive")
    bundling = bundling or rule_bundling(rule, max_layer_size)
    weights = rule.weights
    singles: list[LayerPlan] = []
    rest: list[Entry] = []
    dirs: list[Entry] = []
    # Directories and deletions go into a small layer of their own, last: adding a package or a
    # model changes a shared directory's mtime (site-packages/, loras/), and only that layer follows.
    meta = LayerPlan(plan.name, plan.compression, detail=META_DETAIL)
    # The names of one inode travel with its first name (in path order), into the same layer: its
    # content is written once and the others are hardlinks to it. Not into a later layer: Docker
    # and podman refuse a hardlink to a lower layer's file.
    names: dict[str, list[Entry]] = {}
    for e in plan.entries:
        if e.inode:
            names.setdefault(e.inode, []).append(e)
    others = {group[0].path: group[1:] for group in (sorted(g, key=lambda x: x.path) for g in names.values())}
    for e in plan.entries:
        if e.inode and e.path not in others:
            continue  # another name of an inode: it goes with the first
        big_alone = bundling.file_layer_min is not None and e.size >= bundling.file_layer_min
        if e.kind == FILE and (e.size > max_layer_size or big_alone):
            singles.extend(_file_layers(plan, e, max_layer_size, others.get(e.path, [])))
        elif e.kind == DIR:
            dirs.append(e)
        else:
            rest.append(e)
    bundles = _bundles(plan, rest, bundling, others, owners)
    if weights or len(bundles) > 1:
        meta.entries, meta.whiteouts = dirs, list(plan.whiteouts)
        return bundles + singles + [meta]
    # One bundle: it holds the directories and deletions too.
    whole = bundles[0] if bundles else LayerPlan(plan.name, plan.compression)
    whole.entries = sorted(whole.entries + dirs, key=lambda x: x.path)
    whole.whiteouts = list(plan.whiteouts)
    return [whole] + singles


def _file_layers(plan: LayerPlan, e: Entry, max_layer_size: int, other_names: list[Entry]) -> list[LayerPlan]:
    """The layer of a big file (with its other names, as hardlinks), or its part layers. The other
    names of a file cut into parts are listed on its last part: restore links them to the joined file."""
    if e.size <= max_layer_size:
        return [LayerPlan(plan.name, plan.compression, [e, *other_names], detail=e.path)]
    count = -(-e.size // max_layer_size)
    if count > MAX_PARTS:
        raise UsageError(f"/{e.path} would be cut into {count} part layers (restore accepts at most {MAX_PARTS})",
                         "raise --max-layer-size")
    parts = []
    for i in range(count):
        offset = i * max_layer_size
        part_path = part_name(e.path, i + 1, count)
        part = replace(e, path=part_path, size=min(max_layer_size, e.size - offset), inode=None)
        parts.append(LayerPlan(plan.name, plan.compression, [part], detail=f"part {i + 1}/{count} of {e.path}",
                               slices={part_path: (e.path, offset)}, part_of=(e.path, i + 1, count)))
    parts[-1].part_links = [o.path for o in other_names]
    return parts


def _chance(key: str, size: int, target: float) -> bool:
    """Whether a unit (or a file of a big unit) ends its bundle: with a chance of its size over the
    target, by its key's hash. Nothing else decides it, so a unit added or removed moves only the
    cut next to it, and the same tree is cut the same way on any machine."""
    p = size / target
    raw = key.encode("utf-8", "surrogateescape")  # a name's own bytes: names need not be UTF-8
    return p >= 1 or (p > 0 and int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") / 2**64 < p)


def _bundles(plan: LayerPlan, entries: list[Entry], bundling: Bundling,
             other_names: dict[str, list[Entry]], owners: Optional[Owners] = None) -> list[LayerPlan]:
    """Entries, in order of their unit (units_of) and then of path, cut into bundles of bundling.target
    content on average and bundling.cap at most (but for one entry bigger than it). A cut falls
    only after a whole unit, by the unit's key; a unit of at least the target has bundles of its
    own, cut after its files by their paths. The other names of an inode go into the bundle of its
    first name (they add no content)."""
    paths = [e.path for e in entries]
    keys = units_of(paths, owners) if bundling.units else paths
    # Paths are unique: the entries themselves are never compared.
    items = sorted(zip(keys, paths, entries))
    target, cap = bundling.target, bundling.cap
    bundles: list[LayerPlan] = []
    cur: list[Entry] = []
    size = 0

    def close():
        nonlocal cur, size
        if cur:
            bundles.append(LayerPlan(plan.name, plan.compression, cur))
            cur, size = [], 0

    i, n = 0, len(items)
    while i < n:
        key = items[i][0]
        j = i + 1
        while j < n and items[j][0] == key:
            j += 1
        usize = sum(t[2].size for t in items[i:j])
        big = bundling.units and usize >= target
        if big or size + usize > cap:
            close()
        for _, path, e in items[i:j]:
            if big and size + e.size > cap:
                close()
            cur.append(e)
            if e.inode:
                cur.extend(other_names.get(path, ()))
            size += e.size
            if big and _chance(path, e.size, target):
                close()
        if big or _chance(key, usize, target):
            close()
        i = j
    close()
    for b in bundles:
        b.entries.sort(key=lambda x: x.path)
    if len(bundles) > 1:
        for i, b in enumerate(bundles):
            b.detail = f"{BUNDLE_PREFIX}{i + 1}"
    return bundles
