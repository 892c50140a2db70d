"""What the last plan of a box made, kept for the next plan of the same box (`snap watch`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from snapshotter.box.records import RecordMemo
from snapshotter.digests import chunks_digest
from snapshotter.index.entry import DIR, Entry
from snapshotter.profile import LayerRule, Profile, VenvRoots

from .bundling import Bundling, split_plan
from .parents import parent_copy
from .plan import LayerPlan, fingerprint_row
from .units import Owners


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
            hit = (list(plan.entries), chunks_digest(s.encode() for s in plan.key_text(zstd_level, self)))
        self.keys[ident] = hit
        return hit[1]

    def parent_copy(self, e: Entry, mtime: int) -> Entry:
        """add_parent_dirs' copy of directory `e` with `mtime`: the one made last time for them."""
        hit = self.parents.get((id(e), mtime)) or self._old_parents.get((id(e), mtime))
        if hit is None or hit[0] is not e:
            hit = (e, parent_copy(e, mtime))
        self.parents[(id(e), mtime)] = hit
        return hit[1]

    def rows_of(self, entries: list[Entry]):
        for e in entries:
            hit = self.rows.get(id(e)) or self._old_rows.get(id(e))
            if hit is None or hit[0] is not e:
                hit = (e, fingerprint_row(e))
            self.rows[id(e)] = hit
            yield hit[1]


def _copy(plan: LayerPlan) -> LayerPlan:
    """A plan whose lists a caller may change (add_parent_dirs does) without changing this one."""
    return replace(plan, entries=list(plan.entries), whiteouts=list(plan.whiteouts), slices=dict(plan.slices),
                   part_links=list(plan.part_links))
