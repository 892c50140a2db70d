"""`snap commit`: diff the box against its base image, build the snapshot layers, push the image."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import progress
from .compress import IterReader, decompressing_reader
from .errors import UsageError
from .fsindex import DIR, Diff, Entry, Scan, apply_layer_to_index, diff, load_index, save_index, scan_box
from .image import SNAP_LAYER, descriptor, now_rfc3339, snapshot_config, snapshot_manifest
from .layer import LayerBlob, LayerPlan, build_layer
from .profile import Profile, load_profile
from .registry import OCI_CONFIG, Image, Reference, Remote, TransportOptions, sha256_digest
from .state import state_dir, sub

UPLOAD_WORKERS = 3


@dataclass
class CommitOptions:
    root: str = "/"
    profile: Profile = field(default_factory=load_profile)
    compression: Optional[str] = None  # "gzip" turns every zstd layer into gzip (for old engines)
    rehash: bool = False  # compare file contents, not just size and mtime
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None


@dataclass
class LayerReport:
    name: str
    digest: str
    size: int
    media_type: str
    entries: int
    status: str  # "uploaded" | "exists, skipped"


@dataclass
class CommitResult:
    ref: Reference
    manifest_digest: str
    base_layers: int
    layers: list[LayerReport]
    skipped_secrets: list[str]
    changed_while_read: list[str]
    deleted: int


def base_index(remote: Remote, image: Image, log: Callable[[str], None]) -> dict[str, Entry]:
    """The file index of the base image, from its layer tars (cached by manifest digest)."""
    cache = os.path.join(sub("base-index"), image.manifest_digest.split(":", 1)[1] + ".jsonl.gz")
    index = load_index(cache)
    if index is not None:
        return index
    index = {}
    total = sum(layer["size"] for layer in image.layers)
    log(f"indexing base image {image.ref} ({len(image.layers)} layers)")
    with progress.bar("reading base layers", total) as b:
        for layer in image.layers:
            raw = IterReader(remote.iter_blob(layer["digest"], progress.safe_update(b)))
            stream = decompressing_reader(raw, layer["mediaType"])
            apply_layer_to_index(index, stream)
            raw.drain()  # runs the digest check at the end of the blob
    save_index(index, cache)
    return index


def plan_layers(d: Diff, scan: Scan, base: dict[str, Entry], profile: Profile,
                compression: Optional[str] = None) -> list[LayerPlan]:
    """Assign every changed and deleted path to one profile layer."""
    plans = {r.name: LayerPlan(r.name, _compression(r.compression, compression)) for r in profile.layers}
    changed = {e.path: e for e in d.changed}
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
            group_layer[inode] = profile.classify(first.path, first.size, True, scan.venv_roots)
            for m in members:
                changed[m.path] = m
    for path in sorted(changed):
        e = changed[path]
        name = group_layer.get(e.inode) if e.inode else None
        name = name or profile.classify(path, e.size, e.kind != DIR, scan.venv_roots)
        plans[name].entries.append(e)
    # A directory that replaced a base non-directory goes with every layer below it, so each layer
    # applies on its own (engines cannot create children under a file).
    retyped = {p for p, e in changed.items() if e.kind == DIR and p in base and base[p].kind != DIR}
    if retyped:
        for plan in plans.values():
            have = {e.path for e in plan.entries}
            for p in sorted(retyped):
                if p not in have and any(e.path.startswith(p + "/") for e in plan.entries):
                    plan.entries.append(changed[p])
            plan.entries.sort(key=lambda e: e.path)
    for path in d.deleted:
        old = base[path]
        plans[profile.classify(path, old.size, old.kind != DIR, scan.venv_roots)].whiteouts.append(path)
    return [plans[r.name] for r in profile.layers]


def _compression(layer_default: str, override: Optional[str]) -> str:
    if override is None or layer_default == "none":
        return layer_default  # weights stay uncompressed whatever the engine
    return override


def commit(target: str, base: str, opts: Optional[CommitOptions] = None) -> CommitResult:
    opts = opts or CommitOptions()
    if opts.compression not in (None, "zstd", "gzip"):
        raise UsageError(f"--compression {opts.compression} is not known: use zstd or gzip")
    profile = opts.profile
    target_ref, base_ref = Reference.parse(target), Reference.parse(base)
    if not os.path.isdir(opts.root):
        raise UsageError(f"root {opts.root} does not exist or is not a directory")
    root = os.path.realpath(opts.root)

    base_remote = Remote(base_ref, opts.transport)
    base_img = base_remote.resolve()
    index = base_index(base_remote, base_img, opts.log)

    # Our own state dir must never end up in the snapshot.
    own = os.path.relpath(state_dir(), root)
    extra = (own,) if not own.startswith("..") else ()
    with progress.bar("scanning box", unit="files") as b:
        scan = scan_box(root, profile, extra, progress.safe_update(b))

    def skipped(path: str) -> bool:
        return profile.exclude.match(path) or (not profile.include_secrets and profile.secrets.match(path)) \
            or path in extra
    d = diff(index, scan, skipped, rehash=opts.rehash, root=root)
    plans = [p for p in plan_layers(d, scan, index, profile, opts.compression) if not p.empty]

    blobs: list[LayerBlob] = []
    out_dir = sub("layers")
    for plan in plans:
        with progress.bar(f"packing {plan.name}", plan.content_size) as b:
            blobs.append(build_layer(root, plan, out_dir, profile.zstd_level, progress.safe_update(b)))

    target_remote = base_remote if target_ref.name == base_ref.name else Remote(target_ref, opts.transport)
    _ensure_base_layers(target_remote, base_remote, base_img)
    statuses = _push_blobs(target_remote, blobs)

    created = now_rfc3339()
    config = snapshot_config(base_img.config, [(b.name, b.diff_id) for b in blobs], created)
    layer_descs = [descriptor(b.media_type, b.digest, b.size, {SNAP_LAYER: b.name}) for b in blobs]
    manifest = snapshot_manifest(base_img, str(base_ref), config, layer_descs, profile.name, created)
    config_digest = sha256_digest(config)
    if not target_remote.blob_exists(config_digest):
        path = os.path.join(out_dir, config_digest.split(":", 1)[1])
        _write_file(path, config)
        target_remote.upload_blob(path, config_digest, len(config))
    # The tag moves only now, after every blob is in.
    digest = target_remote.put_manifest(manifest, "application/vnd.oci.image.manifest.v1+json", target_ref.target)

    reports = [LayerReport(b.name, b.digest, b.size, b.media_type, len(p.entries) + len(p.whiteouts), statuses[b.digest])
               for b, p in zip(blobs, plans)]
    for b in blobs:  # the registry has them now; the local copies were only for the upload
        _unlink(b.path)
    return CommitResult(target_ref.with_digest(digest), digest, len(base_img.layers), reports,
                        scan.skipped_secrets, sorted(p for b in blobs for p in b.changed_while_read), len(d.deleted))


def _ensure_base_layers(target: Remote, source: Remote, base: Image) -> None:
    """Make the base's blobs available in the target repository: nothing to do in the same repo,
    a cross-repository mount on the same registry, else a copy through the local disk."""
    if target is source:
        return
    missing = [d for d in base.layers + [base.manifest["config"]] if not target.blob_exists(d["digest"])]
    if not missing:
        return
    same_registry = target.ref.registry == source.ref.registry
    tmp_dir = sub("blobs")
    with progress.bar("copying base layers", sum(d["size"] for d in missing)) as b:
        for d in missing:
            if same_registry and target.mount_blob(d["digest"], source.ref.repository):
                b.update(d["size"])
                continue
            path = os.path.join(tmp_dir, d["digest"].split(":", 1)[1])
            if not os.path.exists(path):
                source.download_blob(d["digest"], path)
            target.upload_blob(path, d["digest"], d["size"], progress.safe_update(b))


def _push_blobs(remote: Remote, blobs: list[LayerBlob]) -> dict[str, str]:
    statuses: dict[str, str] = {}
    todo = []
    for b in blobs:
        if b.digest in statuses or remote.blob_exists(b.digest):
            statuses[b.digest] = "exists, skipped"
        else:
            statuses[b.digest] = "uploaded"
            todo.append(b)
    if todo:
        with progress.bar("uploading", sum(b.size for b in todo)) as bar, ThreadPoolExecutor(UPLOAD_WORKERS) as pool:
            update = progress.safe_update(bar)
            for f in [pool.submit(remote.upload_blob, b.path, b.digest, b.size, update) for b in todo]:
                f.result()
    return statuses


def _write_file(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
