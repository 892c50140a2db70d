"""What a commit is made of: its options, its plan (the box diffed against its base and split into
layers, nothing pushed yet) and its result; and the one way a commit plans its layers, used again
whenever files are left out."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from snapshotter.box import deletions
from snapshotter.box.diff import Diff
from snapshotter.box.records import owners_of
from snapshotter.box.scan import Scan
from snapshotter.box.writers import WRITING_QUIET_S, Writers, being_written
from snapshotter.index.entry import FILE, Entry
from snapshotter.layer.generate import AfterRead
from snapshotter.layer.memo import PlanMemo
from snapshotter.layer.plan import DEFAULT_MAX_LAYER_SIZE, LayerPlan
from snapshotter.layer.planning import plan_layers
from snapshotter.oci.image import Image, Layer
from snapshotter.origin.hubcache import Recognition
from snapshotter.profile import Profile, load_profile
from snapshotter.progress import human_size
from snapshotter.oci.reference import Reference
from snapshotter.registry.blobsources import BlobSources
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.snapshot.files import last_snapshot_files
from snapshotter.snapshot.kept import StoredPlan, StoredRecords
from snapshotter.snapshot.record import RestoreRecord, restored_at_ns
from snapshotter.snapshot.statcache import StatCache

if TYPE_CHECKING:  # made by the CLI for --encrypt-to: a clear commit does not import it
    from snapshotter.snapshot.encryption import Encryption

SCRATCH = "scratch"  # --base scratch: no base image


@dataclass
class CommitOptions:
    root: str = "/"
    profile: Profile = field(default_factory=load_profile)
    compression: Optional[str] = None  # "gzip" turns every zstd layer into gzip (for old engines)
    rehash: bool = False  # compare file contents with the base; ignore the stat cache and the tag's list of blobs
    max_layer_size: int = DEFAULT_MAX_LAYER_SIZE  # bigger files are cut into part layers
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None
    # Push even what snap refuses: a snapshot that deletes the base's system (box/deletions.py), a tag
    # this box neither came from nor made (snapshot/lineage.py).
    force: bool = False
    # Manifest digests the box is known to come from besides snapshot/lineage.py's (a container's image).
    origins: tuple[str, ...] = ()
    # Where the tag names a snapshot this box neither came from nor made: push to a tag of the box's own,
    # TAG-diverged-<UTC time> (snapshot/diverged.py), instead of refusing.
    diverge: bool = False
    moving: Optional[str] = None  # the moving tag a push to another tag is for (a watcher's TAG-<time>, a diverged tag)
    # Layers packed at once, in worker processes when there is enough to compress (commit/push.py);
    # None: SNAP_JOBS, else one per core. 1: everything in this process.
    jobs: Optional[int] = None
    encryption: Optional[Encryption] = None  # --encrypt-to: snap's layers encrypted (snapshot/encryption.py)
    # Hub-cache blobs the origin serves kept as references, not layers (origin/snapshots.py); with
    # upload_origin they are recognised (their count noted) but go into the layers: self-contained.
    weights_from_origin: bool = False
    upload_origin: bool = False


class CommitHooks:
    """What a commit asks its caller at named points. `snap commit`'s answers are these defaults;
    `snap watch` gives its own (watch/hooks.py), a container's commit says where its changes come
    from (container.py). The points, in the order a commit reaches them:

    - pushing_to(remote, root, digest): commit_box names the snapshot its target tag names (None:
      none), before anything is planned;
    - changes(base_img, index): the box's (Scan, Diff) against its base index; None: walk the root;
    - hold(scan, root): the files not to read now (being written), path -> why, once the box is scanned;
    - previous_files(): the last snapshot's own layers of each file (snapshot/files.py), asked only
      when a file is held (at planning, or when one tears while pushed): it keeps that version;
    - old_entry(path): the last snapshot's entry of a changed path, whose layer the stat cache may
      still have (snap watch): a held file in a bundle keeps that version; None: no such entry.

    Four attributes travel with a plan (CommitPlan.hooks): writers, the files some process holds
    open for writing or maps shared-writable (box/writers.py), looked up by each commit once, before
    its walk (plan_commit sets it; hold and changes use it); plan_memo, the last plan's splits and rows
    (layer/plan.py's PlanMemo) kept between the plans of one watcher; stopping, an event another
    thread sets: the push gives up at its next chunk (the watcher's final snapshot wants the lock);
    and after_read(path, attempt), called after each read of a box file's content, before it is
    checked for changes (None: nothing; tests rewrite the file there, as a writer racing the commit
    would). after_read goes to the packer processes with each layer: it must pickle there (a
    module-level class, not a lambda) when the commit packs with jobs > 1."""

    def __init__(self, after_read: AfterRead = None) -> None:
        self.writers: Optional[Writers] = None
        self.plan_memo: Optional[PlanMemo] = None
        self.stopping: Optional[threading.Event] = None
        self.after_read = after_read
        self._target: Optional[tuple[Remote, str, Optional[str]]] = None
        self._previous: Optional[dict[str, list[Layer]]] = None

    def pushing_to(self, remote: Remote, root: str, digest: Optional[str]) -> None:
        self._target, self._previous = (remote, root, digest), None

    def changes(self, base_img: Optional[Image], index: dict[str, Entry]) -> Optional[tuple[Scan, Diff]]:
        return None

    def hold(self, scan: Scan, root: str) -> dict[str, str]:
        """The files some process is writing (box/writers.py) that changed in the last WRITING_QUIET_S seconds."""
        return being_written(scan, root, WRITING_QUIET_S, writers=self.writers, restored_at=restored_at_ns(root))

    def previous_files(self) -> dict[str, list[Layer]]:
        """The target tag's snapshot's (read once, when first asked); none without a target."""
        if self._previous is None:
            self._previous = last_snapshot_files(*self._target) if self._target else {}
        return self._previous

    def old_entry(self, path: str) -> Optional[Entry]:
        return None


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
    # bind-mounted from the host (GPU driver files), and links to them
    host_files: list[str] = field(default_factory=list)
    held: dict[str, str] = field(default_factory=dict)  # files not read because they were being written, with why
    carried: list[str] = field(default_factory=list)  # of those, kept at the last snapshot's version
    snap_layers: list[Layer] = field(default_factory=list)  # the image's own layers
    unreadable: list[str] = field(default_factory=list)  # paths of the box snap may not read: left out
    grown: dict[str, int] = field(default_factory=dict)  # files that grew while sent: sent as first seen (size)
    uploaded_bytes: int = 0  # every byte this commit put into the registry: layers, headers, config, manifests
    uploaded: dict[str, int] = field(default_factory=dict)  # the same by what they were ("layers", "headers", ...)
    current: bool = False  # the tag named this very snapshot already: no config or manifest pushed, the tag not moved
    references: int = 0  # hub files kept as references to the origin, not uploaded (--weights-from-origin)
    reference_bytes: int = 0  # their bytes (each blob once)
    origin_uploaded: int = 0  # hub files the origin serves, held in the layers all the same (--upload-origin)

    def sent(self) -> str:
        """What the commit put into the registry, in one phrase: "sent 1.2 MiB (layers 1.1 MiB, ...)"."""
        order = ("layers", "base layers", "headers", "base index", "config", "manifests")
        parts = sorted(self.uploaded.items(),
                       key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0]))
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
    hooks: CommitHooks = field(default_factory=CommitHooks)  # what the commit asks its caller
    log: Callable[[str], None] = lambda msg: None  # CommitOptions.log: its progress lines go there too
    encryption: Optional[Encryption] = None  # CommitOptions.encryption
    origin: Optional[Recognition] = None  # the box's hub caches, with --weights-from-origin (origin/snapshots.py)
    # The scan's files some process maps shared-writable (CommitHooks.writers' `mapped`):
    # a write through a mapping moves the times only at its first write to a clean page, so their stat
    # data does not tell their bytes. Their layers are read each commit (known), and never cached.
    writing: frozenset[str] = frozenset()

    @property
    def base_name(self) -> str:
        return str(self.base_ref) if self.base_ref else SCRATCH

    @property
    def base_layers(self) -> int:
        return len(self.base_img.layers) if self.base_img else 0

    def known(self, plan: LayerPlan) -> Optional[dict]:
        """None with --rehash, or for a layer that reads a file some process maps shared-writable
        (`writing`; a held file kept at its old entry is not read: its old layer stands)."""
        if self.rehash or self.reads_writing(plan):
            return None
        hit = self.cache.lookup(plan.fingerprint(self.zstd_level))
        return hit or (self.restored.blob_for(plan) if self.restored else None)

    def reads_writing(self, plan: LayerPlan) -> bool:
        """Whether building `plan` reads a file some process maps shared-writable (`writing`)."""
        return bool(self.writing) and not self.writing.isdisjoint(files_read(plan) - self.unreadable)


def files_read(plan: LayerPlan) -> set[str]:
    """The box files whose bytes building the layer reads (a part layer reads its slice's file)."""
    return {plan.slices.get(e.path, (e.path, 0))[0] for e in plan.entries if e.kind == FILE}


def plan_commit_layers(d: Diff, scan: Scan, index: dict[str, Entry], opts: CommitOptions,
                       base_layers: int, memo: Optional[PlanMemo] = None) -> list[LayerPlan]:
    """The layers of a diff with the commit's options (planned once, and again whenever files are
    left out: hold_back, push_commit); `memo`: CommitHooks.plan_memo, a watcher's, in memory."""
    if memo is not None:
        owners = owners_of(opts.root, scan.entries, memo.records)
        return plan_layers(d, scan, index, opts.profile, opts.compression, opts.max_layer_size, memo,
                           base_layers, owners)
    # The last commit's plan and RECORDs, kept in the state dir.
    kept = StoredPlan(opts.root, scan, d, index, opts.profile, (opts.compression, opts.max_layer_size, base_layers))
    plans = kept.plans(opts.profile.zstd_level)
    if plans is None:
        records = StoredRecords(opts.root)
        owners = owners_of(opts.root, scan.entries, records.memo())
        records.save()
        plans = plan_layers(d, scan, index, opts.profile, opts.compression, opts.max_layer_size, None, base_layers,
                            owners)
        kept.save(plans, opts.profile.zstd_level)
    return plans
