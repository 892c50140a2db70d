"""Files being written are held back from a commit's reads: each keeps the last snapshot's version,
or is left out, and the layers are planned again without it."""

from __future__ import annotations

from snapshotter.index.entry import Entry

from .model import CommitOptions, CommitPlan, plan_commit_layers


def hold_back(cp: CommitPlan, held: dict[str, str], opts: CommitOptions) -> None:
    """Keep files that are being written (`held`: path -> why) out of the layers to read, and plan
    again: each keeps the last snapshot's version where that is its own layer (carried as is, never
    read), or where its old entry's layer is in the stat cache (CommitHooks.old_entry: snap watch);
    else it is left out, and the snapshot has the base's version, if any. Never read: it would tear.
    Other names of a held file's inode are held with it (they travel in one layer)."""
    held = {p: why for p, why in held.items() if p not in cp.held}
    if not held:
        return  # the usual case: no set of the diff's paths made
    inodes = {cp.scan.entries[p].inode for p in held if p in cp.scan.entries and cp.scan.entries[p].inode}
    if inodes:
        why = next(iter(held.values()))
        held.update({e.path: why for e in cp.scan.entries.values() if e.inode in inodes and e.path not in held})
    changed = {e.path for e in cp.diff.changed}
    held = {p: why for p, why in held.items() if p in changed}
    if not held:
        return
    previous = cp.hooks.previous_files()
    keep: list[Entry] = []
    for e in cp.diff.changed:
        if e.path not in held:
            keep.append(e)
        elif e.path in previous and not e.inode:  # a file with other names: its old layer may name others
            cp.carried[e.path] = previous[e.path]
        elif (old := cp.hooks.old_entry(e.path)) is not None:
            keep.append(old)
            cp.unreadable.add(e.path)
    cp.held.update(held)
    cp.diff.changed = keep
    cp.plans = plan_commit_layers(cp.diff, cp.scan, cp.index, opts, cp.base_layers, cp.hooks.plan_memo)
    for plan in cp.plans:
        plan.fingerprint(opts.profile.zstd_level, cp.hooks.plan_memo)
