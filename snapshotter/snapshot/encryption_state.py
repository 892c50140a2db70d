"""The state file of encrypted snapshots (docs/encryption.md), one per set of recipients
(ENCRYPTED_DIR/<recipients id>.json, 0600): the encrypted descriptor pushed for each plain blob
("layers"), the last seals made ("sealed"), and what the snapshots pushed from here sealed
("snapshots", by manifest digest; "tags": each tag's last one), which the next commit to a tag reads
its last snapshot's files from (kept_seal): it holds no private key to unseal them.

Several snap processes write it (a watcher, which keeps its Encryption for its life, and `snap
commit`), one at a time under the state dir's lock: each save merges what is on disk (merged)."""

from __future__ import annotations

import os
from typing import Optional

from snapshotter.digests import DIGEST
from snapshotter.oci.mediatypes import ENCRYPTED_SUFFIX
from snapshotter.state import read_versioned, sub

ENCRYPTED_DIR = "encrypted-layers"
VERSION = 1
# Seals kept: the last SNAPSHOTS_KEPT pushed from here (a tag's snapshot is the last one pushed to it,
# or one before), and each of the last TAGS_KEPT tags' last one, however many others went since.
SNAPSHOTS_KEPT = 4
TAGS_KEPT = 8


def is_seal(doc) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("layers"), dict)
            and all(isinstance(v, dict) and all(isinstance(x, str) for x in v.values())
                    for v in doc["layers"].values()))


def well_formed(desc) -> bool:
    return (isinstance(desc, dict) and isinstance(desc.get("digest"), str) and type(desc.get("size")) is int
            and isinstance(desc.get("mediaType"), str) and desc["mediaType"].endswith(ENCRYPTED_SUFFIX)
            and isinstance(desc.get("annotations"), dict))


def state_path(recipients: str) -> str:
    """The state file of a set of recipients (recipients_id), 0600: ENCRYPTED_DIR/<its 32 first hex>.json."""
    return os.path.join(sub(ENCRYPTED_DIR), recipients.split(":", 1)[1][:32] + ".json")


def read_state(recipients: str) -> dict:
    """The state file's fields, each kept only where well formed: {} for none, or another version."""
    doc = read_versioned(state_path(recipients), VERSION)
    if doc is None:
        return {}
    return {name: {k: v for k, v in doc[name].items() if check(k, v)}
            for name, check in (("layers", lambda k, v: well_formed(v)), ("snapshots", lambda k, v: is_seal(v)),
                                ("sealed", _strings), ("tags", _strings))
            if isinstance(doc.get(name), dict)}


def _strings(key, value) -> bool:
    return isinstance(value, str)


def merged(on_disk: dict, seen: dict, ours: dict, used: set[str], snapshots: dict, sealed: dict,
           pushed: Optional[tuple[str, Optional[str], dict]]) -> dict:
    """The state file's fields after a save, from what is on disk now (`on_disk`, read under the state
    dir's lock) and this process's view: the layers it used (`ours`, a subset: `used`) and the rows
    others wrote since it last read or wrote the file (not as in `seen`; a row it saw and did not use
    falls out, its layer gone from the box); the seals of both, and `pushed` (manifest digest, tag,
    seal) as the newest, pruned to each recent tag's last snapshot and the last few overall."""
    layers = {k: v for k, v in on_disk.get("layers", {}).items() if seen.get(k) != v and k not in used}
    layers.update({k: v for k, v in ours.items() if k in used})
    disk_snapshots, tags = on_disk.get("snapshots", {}), dict(on_disk.get("tags", {}))
    # one another process dropped comes back, as the oldest: the pruning below decides
    kept = {**{k: v for k, v in snapshots.items() if k not in disk_snapshots}, **disk_snapshots}
    if pushed is not None:
        digest, tag, seal = pushed
        kept.pop(digest, None)
        kept[digest] = seal
        if tag:
            tags.pop(tag, None)
            tags[tag] = digest
    tags = {t: d for t, d in list(tags.items())[-TAGS_KEPT:] if d in kept}
    wanted = set(list(kept)[-SNAPSHOTS_KEPT:]) | set(tags.values())
    seals = list({**on_disk.get("sealed", {}), **sealed}.items())[-SNAPSHOTS_KEPT:]
    return {"layers": layers, "sealed": dict(seals),
            "snapshots": {k: v for k, v in kept.items() if k in wanted}, "tags": tags}


def kept_seal(recipients: Optional[str], manifest_digest: str) -> Optional[dict]:
    """What a snapshot pushed from this state dir sealed ({"manifest": ..., "layers": {index: ...}}),
    if this state dir still keeps it (merged) for these recipients (`recipients`: its RECIPIENTS,
    as the registry says it: a digest, else nothing is read)."""
    if not isinstance(recipients, str) or not DIGEST.fullmatch(recipients):
        return None
    return read_state(recipients).get("snapshots", {}).get(manifest_digest)
