"""The watcher's tags: each snapshot goes under an immutable tag `<tag>-<UTC time>` first, then the
moving tag is put on the same manifest bytes, so it only ever names a complete snapshot. A box that
may not move the tag (snapshot/lineage.py) pushes its snapshots to a tag of its own instead
(snapshot/diverged.py's Line). --keep prunes the oldest immutable and diverged tags."""

from __future__ import annotations

import re
import threading
from datetime import datetime, timezone
from typing import Callable, Optional

from snapshotter.box.deletions import SYSTEM_TOPS, refuse_commit
from snapshotter.commit.model import CommitPlan
from snapshotter.oci.image import BASE_DIGEST, Layer, snapshot_layer_count
from snapshotter.oci.reference import Reference
from snapshotter.origin.snapshots import SNAP_ORIGIN_UPLOADED, SNAP_REFERENCES
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.diverged import Line, own_names, prune
from snapshotter.snapshot.files import last_snapshot_files

from .options import trace


class TagMover:
    """Where the snapshots go and what the target tag names. One connection to the moving tag's
    repository (Line.remote) serves every look at it."""

    def __init__(self, moving: Reference, transport: TransportOptions, root: str, force: bool,
                 origins: tuple[str, ...], log: Callable[[str], None], clock: Callable[[], float]):
        self.moving, self.root, self.force, self.log, self.clock = moving, root, force, log, clock
        self.lock = threading.Lock()  # one tag move at a time; the newest snapshot wins
        self.seq = 0
        self.moved_seq = 0
        self.last_tag = ""
        self.current: Optional[str] = None  # the immutable tag the moving tag names
        self.prune_refused = False
        # Where the snapshots go (the moving tag, or a diverged tag of this box's own), and the layers of one
        # file each of the snapshot that tag names, which keep a file being written at that version
        # (hold.hold_back).
        self.line = Line(moving, transport, root, force, origins, log, clock)
        self.previous_files: dict[str, list[Layer]] = {}
        self.stale = False  # the target changed, but its snapshot's files could not be read yet

    def check(self) -> bool:
        """Where the snapshots go (Line: the moving tag while this box came from or made what it
        names, else a diverged tag of its own); when that changed (True), the layers of one file each
        of the snapshot the target tag names are what a file being written is kept at. Until they
        are read (the registry failed), none are: the next check reads them, and is True then."""
        if not (self.line.check() or self.stale):
            return False
        self.stale, self.previous_files = True, {}  # never the old target's versions on the new one
        self.previous_files = last_snapshot_files(self.line.remote(), self.root, self.line.digest)
        self.stale = False
        return True

    def holds_weights(self) -> bool:
        """Whether the snapshot the target tag names holds the hub weights itself (--upload-origin's
        annotation, or no references): a watcher started again never moves the tag back to references."""
        if self.line.digest is None:
            return False
        annotations = self.line.remote().resolve(self.line.digest).annotations
        return SNAP_ORIGIN_UPLOADED in annotations or SNAP_REFERENCES not in annotations

    def judge_deletions(self, cp: CommitPlan) -> bool:
        """A snapshot that deletes a system directory of the base (box/deletions.py: `rm -rf
        /usr/share/doc`) is still saved, but to the box's diverged tag, never the moving tag (unless
        --force); once the box no longer deletes it, the moving tag is the target again where this box
        may move it (True: check() is due). One without the base's /bin, /etc or /usr is a wrong
        --root, not a box: refused (exit 2), as commit does."""
        d = cp.deletes
        if d is not None and d.deletes_system and not self.force:
            if any(t in SYSTEM_TOPS for t in d.top):
                refuse_commit(self.root, d)
            self.line.refuse(f"the box deletes {d.describe()}")
            return False
        return self.line.allow()

    def begin(self) -> int:
        """A snapshot's sequence number: of two in flight (the loop's and the final one), the newer moves the tag."""
        with self.lock:
            self.seq += 1
            return self.seq

    def target(self) -> str:
        """The tag the next snapshot is pushed under: the diverged tag, else a new immutable one."""
        with self.lock:
            return self.line.diverged or self._new_name()

    def _new_name(self) -> str:
        stamp = datetime.fromtimestamp(self.clock(), timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        name = f"{self.moving.tag}-{stamp}"
        n = 1
        while name <= self.last_tag and self.last_tag.startswith(f"{self.moving.tag}-{stamp}"):
            n += 1
            name = f"{self.moving.tag}-{stamp}-{n}"
        self.last_tag = name
        return name

    def move(self, seq: int, tag: str, digest: str) -> bool:
        """The snapshot `digest` is pushed under `tag`: the target tag names it, unless a newer one did
        already (False)."""
        with self.lock:
            if seq <= self.moved_seq:
                return False
            if tag == self.line.diverged:
                self.line.digest = digest
            else:
                self.line.move(digest)
            self.moved_seq, self.current = seq, tag
            trace(self.log, f"moved {self.line.tag} to {tag}")
            return True

    def said(self, tag: str, moved: bool) -> str:
        """What the line about a pushed snapshot adds: where it went."""
        if self.line.diverged:
            return f"; {self.line.note()}" + (f"; {self.line.diverged} names it" if tag != self.line.diverged else "")
        return f"; {self.moving.tag} moved to it" if moved else ""

    def is_current(self, cp: CommitPlan) -> bool:
        """Whether the moving tag already names this box: every layer known unchanged, the same
        layers and base in its manifest."""
        known = [cp.known(p) for p in cp.plans]
        if any(k is None for k in known):
            return False
        remote = self.line.remote()
        digest = remote.manifest_digest(self.line.tag)
        if digest is None:
            return False
        img = remote.resolve(digest)
        count = snapshot_layer_count(img)
        ours = [d["digest"] for d in img.layers[len(img.layers) - count:]] if count else []
        base_digest = cp.base_img.manifest_digest if cp.base_img else None
        carried = [layer.digest for layers in cp.carried.values() for layer in layers]
        return (img.manifest.get("annotations", {}).get(BASE_DIGEST) == base_digest
                and sorted(ours) == sorted([k["digest"] for k in known] + carried))

    def snapshot_tags(self, tags: list[str]) -> list[str]:
        """This watch's immutable tags among `tags`, oldest first."""
        pat = re.compile(re.escape(self.moving.tag) + r"-(\d{8}T\d{6}Z)(?:-(\d+))?$")
        found = [(m.group(1), int(m.group(2) or 1), t) for t in tags if (m := pat.match(t))]
        return [t for _, _, t in sorted(found)]

    def prune(self, keep: int) -> None:
        """Delete the oldest immutable snapshots beyond `keep`, and the oldest of the diverged tags this
        box made beyond it (snapshot/diverged.py), never one that the moving tag, a kept tag or this
        box's target names."""
        if self.prune_refused:
            return
        remote = self.line.remote()
        tags = remote.list_tags()
        series = [self.snapshot_tags(tags), own_names(remote, self.moving.tag, self.root, tags)]
        if not prune(remote, series, keep, [self.moving.tag, self.line.tag], self.log):
            self.prune_refused = True
            self.log(f"--keep: registry {self.moving.registry} does not allow deleting manifests "
                     "(storage.delete.enabled in its config); older snapshots stay")
