"""Where a box came from, and so which tags a commit of it may move.

A moving tag (box:v2) names the snapshot a reclaimed box comes back to. A commit that moved it from a
box that never held that snapshot (a restore that failed or stopped half-way, a fresh box, a wrong
--root) would replace the good snapshot with a worse one. So a tag only moves forward: from a snapshot
this box came from (the last finished `snap restore` into this root, record.py) or made itself
since the last restore into it (this state dir's snapshots of the root under its restore mark now,
statcache.made_from: a restore, finished or not, writes over what the box made before), or from
nothing (a new tag)."""

from __future__ import annotations

from typing import Iterable, Optional

from snapshotter.errors import UsageError
from snapshotter.oci.reference import Reference
from snapshotter.registry.remote import Remote

from .record import restore_mark, restored_from
from .statcache import made_from


def made_here(root: str) -> list[str]:
    """The snapshots this state dir pushed of `root` since the last restore into it (its restore mark
    now), oldest first: the box still holds their work. A lost state dir knows none."""
    return made_from(root, restore_mark(root))


def known_origins(root: str, also: Iterable[str] = ()) -> set[str]:
    """Manifest digests of the snapshots `root` came from or made (`also`: others the caller knows,
    such as the image a container was started from)."""
    came = restored_from(root)
    return {*made_here(root), *([came] if came else []), *also}


def movable(remote: Remote, ref: Reference, root: str, force: bool = False,
            also: Iterable[str] = ()) -> tuple[Optional[str], bool]:
    """The digest `ref`'s tag names now (None: no such tag yet), and whether this box may move it."""
    current = remote.manifest_digest(ref.tag)
    return current, _may_move(current, root, force, also)


def _may_move(current: Optional[str], root: str, force: bool, also: Iterable[str]) -> bool:
    return current is None or force or current in known_origins(root, also)


def check_forward(remote: Remote, ref: Reference, root: str, force: bool = False,
                  also: Iterable[str] = ()) -> Optional[tuple[str, bytes]]:
    """The manifest `ref`'s tag names now (its digest and bytes; None: no such tag yet), if this box
    may move it; else a UsageError (exit 2) naming the ways on, before anything is written. The
    manifest itself, not only its digest: a commit that would push that very image pushes nothing."""
    tagged = remote.tagged(ref.tag)
    current = tagged[0] if tagged else None
    if _may_move(current, root, force, also):
        return tagged
    raise UsageError(
        f"{ref} names {current[:19]}, a snapshot that {root!r} neither came from (no finished `snap restore` of it "
        f"here) nor made: moving the tag would replace it with this box",
        f"restore it first (snap restore {ref} --root {root}), pass --diverge to push this box to a tag of its own "
        f"({ref.tag}-diverged-<UTC time>), --force to replace it, or push to another tag")
