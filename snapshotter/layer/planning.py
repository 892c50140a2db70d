"""Planning the snapshot layers: which changed path goes into which layer.

Every changed or deleted path goes to one profile layer (venv, custom_nodes, models, rest, ...).
A profile layer can then become several image layers (bundling.py), each kept stable so that
adding, upgrading or removing one package, node or model re-uploads nothing else; bundling.sizing()
sizes the bundles to the box so that a snapshot keeps to LAYER_BUDGET layers. Each layer then gets
the parent directories of its paths (parents.py).
"""

from __future__ import annotations

from typing import Optional

from snapshotter.box.diff import Diff
from snapshotter.box.scan import Scan
from snapshotter.index.entry import DIR, Entry
from snapshotter.profile import Profile

from .bundling import MAX_SIZING_ROUNDS, layer_budget, sizing, split_plan
from .memo import PlanMemo
from .parents import add_parent_dirs, last_carries_changed_dirs, parent_copy
from .plan import DEFAULT_MAX_LAYER_SIZE, LayerPlan
from .units import Owners


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
    last_carries_changed_dirs(out, {r.name for r in profile.layers if r.weights}, changed)
    add_parent_dirs(out, scan.entries, changed, base, memo.parent_copy if memo is not None else parent_copy)
    return out


def _compression(layer_default: str, override: Optional[str]) -> str:
    if override is None or layer_default == "none":
        return layer_default  # weights stay uncompressed whatever the engine
    return override
