"""Cutting one profile layer into image layers (split_plan), and sizing the cuts to the box (sizing).

  - a file of at least the rule's `file_layer_min` gets a layer of its own (big weights);
  - a file larger than the registry's layer cap is cut into part layers that restore joins back;
  - the rest is bundled: in a code layer by natural unit (layer/units.py: a distribution with its
    dist-info, one custom node) and then path, cut only between units where the unit's hash says
    so (content-defined), in a weights layer by path, cut between files; so an insertion only
    changes the bundle it falls in;
  - directories and deletions go into a small last layer (always for weights, else when there are
    several bundles): the shared directories' new mtimes change only it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Optional

from snapshotter.errors import UsageError
from snapshotter.index.entry import DIR, FILE, Entry
from snapshotter.profile import LayerRule, Profile

from .plan import BUNDLE_PREFIX, MAX_PARTS, META_DETAIL, LayerPlan, part_name
from .units import Owners, units_of

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
