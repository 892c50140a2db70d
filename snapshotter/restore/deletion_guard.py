"""The deletion guard of a restore onto a live root (restore.py's holds_system), unless --force.

Before anything is written, what each layer deletes is read from its tar headers: whiteouts
(`.wh.NAME`) and opaque markers (`.wh..wh..opq`) at any depth, and non-directories that would
replace a directory the root holds (the extractor removes that tree). The headers come from the
snapshot's skeleton blob (snapshot/skeleton.py) where it has the layer's diff_id, without a
download; any other layer (a foreign one, a skeleton missing, malformed or too big) is streamed
from the registry, its digest and diff_id checked, its headers read and its contents dropped
(nothing is written: it downloads again to be applied). The manifest's `dev.snap.deletes` is never
read: an image can say anything there.

They are counted against the paths the root holds (box/deletions.py: count_live, and the rule for
when that is the system). Over it: exit 6, one line, the root untouched. Under it: each layer is
applied with the deletions that were counted, each with where it was counted to delete
(LayerJob.deletions), and the extractor refuses any other, or one that now lands elsewhere (a link
a layer put on the way): a layer whose bytes are not what its skeleton says cannot delete more than
was checked. Layers the root already holds (skip.py) are not applied, so delete nothing."""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from snapshotter.box.deletions import Deleting, LiveRoot, count_live, refuse_live
from snapshotter.box.profile import PathSet
from snapshotter.errors import IntegrityError
from snapshotter.oci.image import Image, layer_label
from snapshotter.registry.remote import Remote
from snapshotter.snapshot.skeleton import Skeleton
from snapshotter.tar.reader import iter_members
from snapshotter.tar.rules import OPAQUE, WHITEOUT_PREFIX, check_name, whiteout_target

from .skip import members_of
from .verify import read_blob

# {layer digest: {member path: where it was counted to delete}}: what each layer may delete.
Claims = dict[str, dict[str, Optional[str]]]


@dataclass
class LayerDeletions:
    """What a layer's headers delete, and what they write."""
    deleting: list[Deleting] = field(default_factory=list)  # its whiteouts and opaque markers
    nondirs: list[Deleting] = field(default_factory=list)  # its non-directories: they replace a directory there
    written: set[str] = field(default_factory=set)  # the paths it writes


def read_deletions(members: Iterable[tarfile.TarInfo]) -> LayerDeletions:
    """The deletions of a layer's members, in the extractor's terms (layer/extract.py)."""
    out = LayerDeletions()
    for m in members:
        rel = check_name(m.name)
        if not rel:
            continue
        parent, _, base = rel.rpartition("/")
        if base == OPAQUE:
            out.deleting.append(Deleting(rel, parent, ""))
        elif base.startswith(WHITEOUT_PREFIX):
            out.deleting.append(Deleting(rel, parent, whiteout_target(base)))
        else:
            out.written.add(rel)
            if not m.isdir():
                out.nondirs.append(Deleting(rel, parent, base))
    return out


def guard_live_root(remote: Remote, image: Image, todo: list[tuple[int, dict, str]], skeletons: dict[str, Skeleton],
                    root: str, sign: str, never_write: PathSet, log: Callable[[str], None]) -> Claims:
    """Refuse (IntegrityError) the layers `todo` when what they delete of the live `root` is its
    system; else what each may delete (Claims). Nothing is written to the root either way."""
    layers: dict[str, LayerDeletions] = {}
    for i, desc, diff_id in todo:
        if desc["digest"] not in layers:
            layers[desc["digest"]] = _layer_deletions(remote, desc, diff_id, layer_label(desc, i),
                                                      skeletons.get(diff_id), log)
    live = LiveRoot(root, never_write.match)
    replacing = {digest: _replacing(live, ld.nondirs) for digest, ld in layers.items()}
    written = set().union(*(ld.written for ld in layers.values()))
    deleting = [d for digest, ld in layers.items() for d in (*ld.deleting, *replacing[digest])]
    counted, where = count_live(live, deleting, written)
    refuse_live(root, str(image.ref), sign, counted)
    return {digest: {d.member: where[d.member] for d in (*ld.deleting, *replacing[digest])}
            for digest, ld in layers.items()}


def _layer_deletions(remote: Remote, desc: dict, diff_id: str, label: str, skeleton: Optional[Skeleton],
                     log: Callable[[str], None]) -> LayerDeletions:
    """From the skeleton when there is one that reads; else from the layer, streamed and checked."""
    if skeleton is not None:
        try:
            return read_deletions(members_of(skeleton, label))
        except IntegrityError as e:
            log(f"warning: {e}: reading the layer's own headers")
    got: list[LayerDeletions] = []

    def consume(stream, check) -> None:
        got.append(read_deletions(m for _, m in iter_members(stream, f"layer {label}")))

    read_blob(remote, desc, diff_id, label, log, consume)
    return got[0]


def _replacing(live: LiveRoot, nondirs: list[Deleting]) -> list[Deleting]:
    """The non-directories that land where the root holds a directory (each directory read once)."""
    names: dict[str, Optional[set[str]]] = {}  # parent as named -> the names of directories in it on the root
    out = []
    for d in nondirs:
        if d.parent not in names:
            there = live.resolve(d.parent)
            names[d.parent] = _dir_names(os.path.join(live.root, there)) if there is not None else None
        if names[d.parent] and d.name in names[d.parent]:
            out.append(d)
    return out


def _dir_names(path: str) -> set[str]:
    try:
        with os.scandir(path) as it:
            return {e.name for e in it if e.is_dir(follow_symlinks=False)}
    except OSError:
        return set()
