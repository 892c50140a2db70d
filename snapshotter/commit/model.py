"""What a commit is made of: its options, its plan (the box diffed against its base and split into
layers, nothing pushed yet) and its result; and the one way a commit plans its layers, used again
whenever files are left out."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapshotter.box import deletions
from snapshotter.box.diff import Diff
from snapshotter.box.profile import Profile, load_profile
from snapshotter.box.records import owners_of
from snapshotter.box.scan import Scan
from snapshotter.index.entry import Entry
from snapshotter.layer.plan import DEFAULT_MAX_LAYER_SIZE, LayerPlan, PlanMemo, plan_layers
from snapshotter.oci.image import Image, Layer
from snapshotter.progress import human_size
from snapshotter.oci.reference import Reference
from snapshotter.registry.blobsources import BlobSources
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.record import RestoreRecord
from snapshotter.snapshot.statcache import StatCache

SCRATCH = "scratch"  # --base scratch: no base image


@dataclass
class CommitOptions:
    root: str = "/"
    profile: Profile = field(default_factory=load_profile)
    compression: Optional[str] = None  # "gzip" turns every zstd layer into gzip (for old engines)
    rehash: bool = False  # compare file contents with the base, and ignore the stat cache
    max_layer_size: int = DEFAULT_MAX_LAYER_SIZE  # bigger files are cut into part layers
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None
    # Where the changes come from instead of a walk of `root`, e.g. a container's diff (container.py):
    # called with (base image, base index), returns (Scan, Diff); file bytes are still read from `root`.
    changes: Optional[Callable] = None
    plan_memo: Optional[PlanMemo] = None  # the last plan's splits and rows, kept by `snap watch` (plan.PlanMemo)
    force: bool = False  # push even what snap refuses: a snapshot that deletes the base's system (box/deletions.py), a tag this box neither came from nor made (snapshot/lineage.py)
    origins: tuple[str, ...] = ()  # manifest digests the box is known to come from besides snapshot/lineage.py's (a container's image)
    # Where the tag names a snapshot this box neither came from nor made: push to a tag of the box's own,
    # TAG-diverged-<UTC time> (snapshot/diverged.py), instead of refusing.
    diverge: bool = False
    moving: Optional[str] = None  # the moving tag a push to another tag is for (a watcher's TAG-<time>, a diverged tag)
    # Files not to read now, with why (being written): given the scan, the paths to hold back. None: the
    # files some process is writing (box/writers.py) that changed in the last WRITING_QUIET_S seconds.
    hold: Optional[Callable[[Scan], dict[str, str]]] = None
    # Where a held file's last snapshot version is: the last snapshot's own layers of each file
    # (file_layers), asked only when a file is held. None: the target tag's snapshot (snap commit).
    previous: Optional[Callable[[], dict[str, list[Layer]]]] = None
    # The last snapshot's entries of changed paths (snap watch): a held file in a bundle is carried at
    # that version when the stat cache still has its layer.
    old_entries: dict[str, Entry] = field(default_factory=dict)
    stopping: Optional[threading.Event] = None  # set by another thread: the push gives up at its next chunk
    # Layers packed at once, in worker processes when there is enough to compress (commit/push.py);
    # None: SNAP_JOBS, else one per core. 1: everything in this process.
    jobs: Optional[int] = None


@dataclass
class LayerReport:
    name: str
    digest: str
    size: int
    media_type: str
    entries: int
    status: str  # "uploaded" | "exists, skipped" | "mounted from REPO", "... (unchanged, not read)"


@dataclass
class CommitResult:
    ref: Reference
    manifest_digest: str
    base_layers: int
    layers: list[LayerReport]
    skipped_secrets: list[str]
    changed_while_read: list[str]
    deleted: int
    host_files: list[str] = field(default_factory=list)  # bind-mounted from the host (GPU driver files), and links to them
    held: dict[str, str] = field(default_factory=dict)  # files not read because they were being written, with why
    carried: list[str] = field(default_factory=list)  # of those, kept at the last snapshot's version
    snap_layers: list[Layer] = field(default_factory=list)  # the image's own layers
    unreadable: list[str] = field(default_factory=list)  # paths of the box snap may not read: left out
    grown: dict[str, int] = field(default_factory=dict)  # files that grew while sent: sent as first seen (size)
    uploaded_bytes: int = 0  # every byte this commit put into the registry: layers, headers, config, manifests
    uploaded: dict[str, int] = field(default_factory=dict)  # the same by what they were ("layers", "headers", ...)

    def sent(self) -> str:
        """What the commit put into the registry, in one phrase: "sent 1.2 MiB (layers 1.1 MiB, ...)"."""
        order = ("layers", "base layers", "headers", "base index", "config", "manifests")
        parts = sorted(self.uploaded.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0]))
        return f"sent {human_size(self.uploaded_bytes)} (" + ", ".join(f"{what} {human_size(n)}" for what, n in parts
                                                                       if n) + ")"


@dataclass
class CommitPlan:
    """What a commit would send: the box diffed against its base and split into layers, nothing
    pushed yet. `known(plan)` is the blob a layer already has (stat cache or last restore)."""

    root: str
    base_ref: Optional[Reference]  # these three are None for --base scratch
    base_remote: Optional[Remote]
    base_img: Optional[Image]
    index: dict[str, Entry]
    scan: Scan
    diff: Diff
    plans: list[LayerPlan]
    cache: StatCache
    restored: Optional[RestoreRecord]
    scan_started_ns: int
    zstd_level: int
    rehash: bool
    sources: BlobSources = field(default_factory=BlobSources)  # where blobs of this registry were seen
    # Files that must not be read (snap watch: a big file being rewritten, carried at its last
    # snapshot's version). A layer holding one is only reused whole (stat cache and registry), never
    # built; push_commit leaves out such a file whose layer cannot be, and lists it in `left_unread`.
    unreadable: set[str] = field(default_factory=set)
    left_unread: list[str] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)  # files not read (being written), with why
    carried: dict[str, list[Layer]] = field(default_factory=dict)  # held files kept as the last snapshot's layers
    deletes: Optional[deletions.Deletions] = None  # what the snapshot deletes of its base (None: no base)
    jobs: int = 1  # layers packed at once (CommitOptions.jobs, resolved)

    @property
    def base_name(self) -> str:
        return str(self.base_ref) if self.base_ref else SCRATCH

    @property
    def base_layers(self) -> int:
        return len(self.base_img.layers) if self.base_img else 0

    def known(self, plan: LayerPlan) -> Optional[dict]:
        if self.rehash:
            return None
        hit = self.cache.lookup(plan.fingerprint(self.zstd_level))
        return hit or (self.restored.blob_for(plan) if self.restored else None)


def plan_commit_layers(d: Diff, scan: Scan, index: dict[str, Entry], opts: CommitOptions,
                       base_layers: int) -> list[LayerPlan]:
    """The layers of a diff with the commit's options (planned once, and again whenever files are
    left out: hold_back, push_commit)."""
    records = opts.plan_memo.records if opts.plan_memo is not None else None
    owners = owners_of(opts.root, scan.entries, records)
    return plan_layers(d, scan, index, opts.profile, opts.compression, opts.max_layer_size, opts.plan_memo, base_layers,
                       owners)
