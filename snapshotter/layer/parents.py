"""The parent directories each layer carries, and which layer decides their mtime."""

from __future__ import annotations

from typing import Callable, Optional

from snapshotter.index.entry import DIR, Entry

from .plan import META_DETAIL, LayerPlan


def last_carries_changed_dirs(layers: list[LayerPlan], weights: set[str], changed: dict[str, Entry]) -> None:
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


def parent_copy(e: Entry, mtime: int) -> Entry:
    """A parent directory as a layer carries it. No stamp: a directory's ctime moves with every file
    added to it, and the stat cache keys on what the layer's bytes depend on (its mode, owner,
    xattrs and this mtime)."""
    # Every field named (dataclasses.replace() cost 3 us a copy; a kept plan of 35k paths makes ~4k)
    return Entry(path=e.path, kind=e.kind, mode=e.mode, uid=e.uid, gid=e.gid, size=e.size, mtime=mtime,
                 linkname=e.linkname, rdev=e.rdev, digest=None, inode=None, stamp="", xattrs=e.xattrs,
                 mtime_ns=e.mtime_ns)


def add_parent_dirs(layers: list[LayerPlan], box: dict[str, Entry], changed: dict[str, Entry],
                    base: dict[str, Entry], copy: Callable[[Entry, int], Entry] = parent_copy) -> None:
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
            plan.entries.append(copy(e, mtime))
            added = True
        if added:
            plan.entries.sort(key=lambda x: x.path)


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
