"""`snap verify`: compare a directory with the files of an image, path by path.

The expected tree is built from the image's layers (streamed from the registry, each blob checked
against its digest and diff_id, an encrypted one against its HMAC or its plain digest instead of its
own digest: decryption.py; nothing is written to disk), the way restore would apply them:
whiteouts, replaced trees, files joined from part layers. A snapshot layer the directory holds
whole (skip.hold_layer: its headers blob and the directory's bytes rebuild a tar that hashes to
its diff_id) is not streamed, unless `read_layers`: its members come from its headers, each file's
digest from the bytes that hash read; its blob is only asked for (HEAD). Every path of the tree
is then checked in the directory: type, content digest, mode, owner, symlink target, device number
(a file whose bytes were read already is not read again), extended attributes (exactly those restore
sets: xattrs.py; a directory's extra ones too, though a restore over it leaves them), and that the
names the image gives one file (hardlinks) are one inode, its other files not (hardlinks.py).

What is not compared: mtimes (a restore sets them, but a touched file has not changed), paths the
profile never captures (its `exclude` list: /proc, /tmp, /etc/hosts, ...), the secrets commit left
out (listed in the image's manifest, and reported as left out instead), `trusted.*` xattrs and
SELinux labels (the host's: commit never takes them), and, as restore does not write them by
default, device nodes, setuid/setgid bits and file capabilities (unless --allow-devices /
--allow-setuid). Files in the directory that the image does not have are reported only with
`strict` (a live root has much the image never held); paths the image deletes (whiteouts) are
reported when they are still there.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from snapshotter import progress
from snapshotter.box.mounts import bind_mounted_files, pseudo_mounts
from snapshotter.box.openat import file_head
from snapshotter.digests import chunks_digest, hasher_digest, sha256_digest
from snapshotter.errors import IntegrityError, UsageError, quoted_path
from snapshotter.index.entry import (BLOCK, CHAR, DIR, FIFO, FILE, SYMLINK, Entry, clean_path, entry_from_member,
                                     entry_from_stat, self_and_parents)
from snapshotter.index.indexer import ImageIndexer
from snapshotter.jobs import resolve_jobs
from snapshotter.layer.plan import parse_part_name
from snapshotter.oci.image import SNAP_PART_FILE, Layer, layer_label, left_out_secrets, select_layers
from snapshotter.profile import PathSet, Profile, load_profile
from snapshotter.oci.reference import Reference
from snapshotter.origin.references import References
from snapshotter.origin.snapshots import read_document
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions
from snapshotter.restore.contents import files_digests
from snapshotter.snapshot.decryption import open_image
from snapshotter.snapshot.skeleton import image_skeletons
from snapshotter.tar.compress import IterReader, check_layer
from snapshotter.tar.reader import EntryCount, data_chunks, iter_members
from snapshotter.tar.rules import check_name

from .hardlinks import HardlinkCheck
from .held import HeldLayers, Members
from .parts import part_files, part_links
from .skip import RootPaths, RootRules
from .xattrs import image_xattrs_differ

_PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID
HASH_BATCH = 1024  # files whose content is compared at once: what is kept per file stays bounded
NAME_MAX, PATH_MAX = 255, 4096  # Linux's limits (limits.h), in bytes


@dataclass
class VerifyOptions:
    only_snapshot: bool = False
    strict: bool = False  # also report files the image does not have
    allow_setuid: bool = False  # expect setuid/setgid bits (restore --allow-setuid)
    allow_devices: bool = False  # expect device nodes (restore --allow-devices)
    profile: Profile = field(default_factory=load_profile)
    jobs: int = field(default_factory=resolve_jobs)  # files hashed at once
    transport: TransportOptions = field(default_factory=TransportOptions)
    log: Callable[[str], None] = lambda msg: None
    decryption_keys: list = field(default_factory=list)  # private keys that open an encrypted image
    read_layers: bool = False  # download every layer, even one the directory holds whole (the registry's copy)


@dataclass
class Difference:
    path: str  # "/opt/app/x"
    kind: str  # missing | extra | type | content | mode | owner | symlink | device | xattrs | hardlink
    detail: str

    def __str__(self) -> str:
        # A name with a newline or a control character in it is quoted: it cannot forge a line.
        return f"{self.path if self.path.isprintable() else quoted_path(self.path)}: {self.detail}"


@dataclass
class ImageTree:
    """What the image's layers leave, as restore applies them."""

    index: dict[str, Entry]  # its paths
    deleted: set[str]  # paths its layers delete that no later layer brings back
    linked: dict[str, object]  # path -> a key its file's other names share (the hardlinks the layers make)


@dataclass
class VerifyResult:
    ref: Reference
    manifest_digest: str
    checked: int  # image paths compared
    differences: list[Difference]
    left_out_secrets: list[str] = field(default_factory=list)  # what commit left out as secrets ("/root/.ssh")
    left_out_total: int = 0  # how many it left out (more than listed when the image's list was cut)
    layers_read: int = 0  # layers streamed from the registry
    layers_held: int = 0  # layers found whole in the root by their headers and its bytes (not downloaded)

    @property
    def ok(self) -> bool:
        return not self.differences


# ---- the expected tree ------------------------------------------------------------------------


def image_index(remote: Remote, layers: list[Layer], log: Callable[[str], None] = lambda msg: None, jobs: int = 1,
                holder: Optional[HeldLayers] = None) -> ImageTree:
    """The image's paths, those its layers delete, its hardlinks. Layers are read with restore's
    checks: an image restore refuses is refused here too. `jobs` layers are downloaded, decompressed
    and hashed at once (threads: zstd, zlib and hashlib let go of Python's lock); their members go
    into the index in layer order. A layer the `holder` finds whole in the directory is not read."""
    index: dict[str, Entry] = {}
    deleted: set[str] = set()
    linked: dict[str, object] = {}
    joins: dict[str, tuple[hashlib._Hash, int]] = {}  # part-layer file -> (running sha256, size so far)
    links = part_links(layers)
    for rel in (*part_files(layers), *links, *(n for names in links.values() for n in names)):
        _check_fits(rel)  # the part annotations restore refuses are refused here too
    entries = EntryCount()  # the image's members: the layers read ahead and the index are bounded by it
    stopping = threading.Event()  # set when this ends early: the layers being read give up at their next chunk

    def read(layer: tuple[int, dict, str]) -> Optional[Members]:
        """Layer's members with their content digests; None for a part layer, read in order below."""
        i, desc, diff_id = layer
        if SNAP_PART_FILE in desc.get("annotations", {}):
            return None
        held = holder.hold(remote, layer, entries) if holder else None
        return held if held is not None else _read_layer(remote, desc, diff_id, layer_label(desc, i), log,
                                                          entries, stopping)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        waiting = iter(layers)
        ahead: deque = deque()  # (layer, its future): `jobs` read at once, each dropped once indexed

        def read_ahead() -> None:
            while len(ahead) < max(1, jobs) and (layer := next(waiting, None)) is not None:
                ahead.append((layer, pool.submit(read, layer)))

        read_ahead()
        try:
            while ahead:
                (i, desc, diff_id), members = ahead.popleft()
                label = layer_label(desc, i)
                got = members.result()
                members = None
                read_ahead()
                if got is None:
                    def consume(stream, check) -> None:  # check: left to check_layer (an index shows nothing early)
                        deleted.update(_apply_part_layer(index, stream, joins, links, label, entries, linked))

                    read_blob(remote, desc, diff_id, label, log, consume)
                else:
                    indexer = ImageIndexer(index, linked)
                    got.reverse()
                    while got:  # each member dropped as it is indexed
                        m, digest = got.pop()
                        indexer.add(m, lambda digest=digest: digest)
                    deleted.update(indexer.end_layer())
                deleted -= index.keys()
        finally:
            stopping.set()
            for _, f in ahead:
                f.cancel()
    for rel in (*index, *deleted):
        _check_fits(rel)
    return ImageTree(index, deleted, linked)


def read_blob(remote: Remote, desc: dict, diff_id: str, label: str, log: Callable[[str], None],
               consume: Callable, stopping: Optional[threading.Event] = None) -> None:
    """Stream a layer's blob through check_layer (digest and diff_id checked) into `consume`;
    `stopping` set: it gives up at its next chunk (progress.Stopped)."""
    def note(msg: str) -> None:
        log(f"warning: {label}: {msg}")

    with progress.bar(f"reading {label}", desc["size"]) as bar:
        update = progress.safe_update(bar)
        update = progress.stoppable(update, stopping) if stopping is not None else update
        blob = IterReader(remote.iter_blob(desc["digest"], update, desc["size"]))
        check_layer(blob, desc["mediaType"], diff_id, label, consume, note)


def _read_layer(remote: Remote, desc: dict, diff_id: str, label: str, log: Callable[[str], None],
                entries: EntryCount, stopping: Optional[threading.Event] = None) -> Members:
    """A layer's members, each regular file's with the digest of its data (ImageIndexer.add wants
    it only for those)."""
    out: Members = []

    def consume(stream, check) -> None:
        for reader, m in iter_members(stream, f"layer {label}", entries):
            out.append((m, chunks_digest(data_chunks(reader)) if m.isreg() else None))

    read_blob(remote, desc, diff_id, label, log, consume, stopping)
    return out


def _check_fits(rel: str) -> None:
    """Refuse a path no directory can hold as named (one too long): what it would be compared with
    is nothing a restore could have written. A name with a newline, a control character or bytes
    that are not UTF-8 is a name as any other (commit takes it, restore writes it), reported quoted."""
    raw = rel.encode("utf-8", "surrogateescape")
    if len(raw) >= PATH_MAX or any(len(part) > NAME_MAX for part in raw.split(b"/")):
        raise IntegrityError(f"the image has a path too long for a file system ({len(raw)} bytes, "
                             f"{quoted_path(rel[:64])}...): refusing a hostile image")


def _apply_part_layer(index: dict[str, Entry], stream, joins: dict, links: dict[str, list[str]],
                      label: str, entries: EntryCount, linked: dict[str, object]) -> set[str]:
    """A layer holding one part of a file cut at the layer size cap: hash it into the joined file,
    which is what restore leaves at the path once the last part is in (and at its other names,
    hardlinks to it: `linked`). Its other members are indexed with the indexer's checks (hardlinks,
    whiteouts, symlinks), as in any layer. Returns the paths it removed."""
    indexer = ImageIndexer(index, linked)
    for reader, m in iter_members(stream, f"layer {label}", entries):
        rel = check_name(m.name)
        part = parse_part_name(rel) if m.isreg() else None
        if part is None:
            indexer.add(m, lambda: chunks_digest(data_chunks(reader)))
            continue
        path, i, n = part
        h, size = joins.pop(path) if i > 1 and path in joins else (hashlib.sha256(), 0)
        for chunk in data_chunks(reader):
            h.update(chunk)
        size += m.size
        if i < n:
            joins[path] = (h, size)
            continue
        e = entry_from_member(m, path)
        e.size, e.digest = size, hasher_digest(h)
        index[path] = e
        key = linked[path] = object()  # a new file: no link of what was there before
        for name in links.get(path, ()):
            index[name] = replace(e, path=name)
            linked[name] = key
    return indexer.end_layer()


# ---- comparing ------------------------------------------------------------------------------


def _kind_name(kind: str) -> str:
    other = f"a {kind} device" if kind in (CHAR, BLOCK) else f"a {kind}"
    return {FILE: "a file", DIR: "a directory", SYMLINK: "a symlink"}.get(kind, other)


def compare(root: str, tree: ImageTree, opts: VerifyOptions, left_out: frozenset[str] = frozenset(),
            read: Optional[dict[str, str]] = None, paths: Optional[RootPaths] = None) -> tuple[int, list[Difference]]:
    """Compare the directory with the image's paths. `left_out` holds the paths commit left out as
    secrets: neither they nor what lies under them are compared. `read`: the digests of files whose
    bytes this verify has read already (held layers'): those are not read again."""
    index = tree.index
    c = _Comparison(paths or RootPaths(os.path.realpath(root)), opts, left_out, read or {}, tree.linked)
    # What the contents' check reads, as far as the image tells: its files the profile does not leave out.
    content_bytes = sum(e.size for rel, e in index.items()
                        if e.kind == FILE and e.digest and rel not in c.read and not c.excluded(rel))
    with progress.bar("comparing paths", len(index), unit="paths") as bar, \
            progress.bar("checking contents", content_bytes) as hashed:
        update = progress.safe_update(hashed)
        for rel in sorted(index):
            bar.update(1)
            c.check(rel, index[rel])
            if len(c.contents) >= HASH_BATCH:
                c.diffs.extend(_content_differences(c.contents, opts.jobs, update))
                c.contents.clear()
        c.diffs.extend(_content_differences(c.contents, opts.jobs, update))
    c.check_links()
    c.check_deleted(tree.deleted)
    if opts.strict:
        c.diffs.extend(_extras(c.root, index, c.covered, opts, c.excluded))
    c.diffs.sort(key=lambda d: d.path)
    return c.checked, c.diffs


class _Comparison:
    """What compare() found so far, and the paths it no longer looks into."""

    def __init__(self, paths: RootPaths, opts: VerifyOptions, left_out: frozenset[str], read: dict[str, str],
                 linked: dict[str, object]):
        self.paths, self.root, self.opts, self.left_out, self.read = paths, paths.root, opts, left_out, read
        self.links = HardlinkCheck(linked)
        self.diffs: list[Difference] = []
        self.covered: set[str] = set()  # paths whose subtree is not looked into (reported, or not a directory)
        self.checked = 0
        self.contents: list[tuple[str, str, str, int]] = []  # (shown, path, digest, size): hashed in batches

    def excluded(self, rel: str) -> bool:
        return self.opts.profile.exclude.match(rel) or any(p in self.left_out for p in self_and_parents(rel))

    def under_covered(self, rel: str) -> bool:
        parent = rel.rpartition("/")[0]
        while parent:
            if parent in self.covered:
                return True
            parent = parent.rpartition("/")[0]
        return False

    def check(self, rel: str, e: Entry) -> None:
        """Compare one path of the image (its content's check is queued in `contents`)."""
        if self.excluded(rel) or self.under_covered(rel):
            return
        if e.kind in (CHAR, BLOCK, FIFO) and not self.opts.allow_devices:
            return  # restore skips device nodes unless asked
        if e.kind != DIR:
            self.covered.add(rel)  # nothing below a non-directory is reachable
        self.checked += 1
        shown = "/" + rel
        full = os.path.join(self.root, rel)
        try:
            if not self.paths.real_dir(rel.rpartition("/")[0]):
                raise FileNotFoundError(full)
            st = os.lstat(full)
            have = entry_from_stat(rel, st, os.readlink(full) if stat.S_ISLNK(st.st_mode) else "")
        except FileNotFoundError:
            self.diffs.append(Difference(shown, "missing", f"missing (expected {_kind_name(e.kind)})"))
            self.covered.add(rel)
            return
        kind = have.kind if have else "socket"
        if kind != e.kind:
            self.diffs.append(Difference(shown, "type", f"is {_kind_name(kind)}, expected {_kind_name(e.kind)}"))
            self.covered.add(rel)
            return
        if e.kind == FILE:
            self.links.note(rel, st)
        self.diffs.extend(_compare_entry(shown, full, have, e, self.opts.allow_setuid, self.contents,
                                         self.read.get(rel)))

    def check_links(self) -> None:
        """The image's hardlinks that are not one inode in the directory, and its files apart that are."""
        self.diffs.extend(Difference("/" + rel, "hardlink", detail) for rel, detail in self.links.differences())

    def check_deleted(self, deleted: set[str]) -> None:
        """The paths the image deletes that are there."""
        for rel in sorted(deleted):
            if self.excluded(rel) or self.under_covered(rel) or rel.rpartition("/")[0] in deleted:
                continue
            if self.paths.real_dir(rel.rpartition("/")[0]) and os.path.lexists(os.path.join(self.root, rel)):
                self.diffs.append(Difference("/" + rel, "extra", "present, but the image deletes it"))
                self.covered.add(rel)


def _compare_entry(shown: str, full: str, have: Entry, want: Entry, allow_setuid: bool,
                   contents: list[tuple[str, str, str, int]], read: Optional[str] = None) -> list[Difference]:
    """The differences of one path but its content's, whose check is added to `contents` unless its
    digest was `read` already."""
    out: list[Difference] = []
    if want.kind != SYMLINK and have.mode != want.mode:
        stripped = want.kind != DIR and not allow_setuid and have.mode == want.mode & ~_PRIVILEGE_BITS
        if not stripped:  # restore strips setuid/setgid unless --allow-setuid
            out.append(Difference(shown, "mode", f"mode {have.mode:04o}, expected {want.mode:04o}"))
    if (have.uid, have.gid) != (want.uid, want.gid):
        out.append(Difference(shown, "owner", f"owner {have.uid}:{have.gid}, expected {want.uid}:{want.gid}"))
    if want.kind == SYMLINK and have.linkname != want.linkname:
        out.append(Difference(shown, "symlink", f"symlink to {have.linkname!r}, expected {want.linkname!r}"))
    differ = image_xattrs_differ(full, want.xattrs, allow_setuid)
    if differ:
        out.append(Difference(shown, "xattrs", differ))
    if want.kind in (CHAR, BLOCK) and have.rdev != want.rdev:
        out.append(Difference(shown, "device", f"device {os.major(have.rdev)}:{os.minor(have.rdev)}, "
                                               f"expected {os.major(want.rdev)}:{os.minor(want.rdev)}"))
    if want.kind == FILE:
        if have.size != want.size:
            out.append(Difference(shown, "content", f"content differs: {have.size} bytes, expected {want.size}"))
        elif want.digest and read is not None:
            out.extend(_content_difference(shown, read, want.digest))
        elif want.digest:
            contents.append((shown, full, want.digest, want.size))
    return out


def _content_differences(contents: list[tuple[str, str, str, int]], jobs: int,
                         on_bytes: Callable[[int], None]) -> list[Difference]:
    """The content differences of `contents` (shown path, path, expected digest, size), read `jobs` at once."""
    found = files_digests([(full, size) for _, full, _, size in contents], jobs, on_bytes)
    return [d for (shown, _, want, _), digest in zip(contents, found)
            for d in _content_difference(shown, digest, want)]


def _content_difference(shown: str, digest: str, want: str) -> list[Difference]:
    """A file's content difference, if its `digest` (or why it could not be read) is not `want`."""
    if digest == want:
        return []
    return [Difference(shown, "content", f"content differs: {_short(digest)}, expected {want[:19]}")]


def _short(digest: str) -> str:
    """A digest as the report shows it (its first 12 hex digits), or why there is none."""
    return digest[:19] if digest.startswith("sha256:") else digest


def _extras(root: str, index: dict[str, Entry], covered: set[str], opts: VerifyOptions,
            excluded: Callable[[str], bool]) -> list[Difference]:
    """Paths in the directory that the image does not have (only the top-most of an extra tree)."""
    out: list[Difference] = []
    skip = pseudo_mounts(root) | bind_mounted_files(root)  # the host's files (GPU drivers) were left out
    profile = opts.profile
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as it:
                names = sorted(de.name for de in it)
        except OSError:
            continue
        for name in names:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if rel in skip or rel in covered or excluded(rel):
                continue
            full = os.path.join(root, rel)
            try:
                mode = os.lstat(full).st_mode
            except OSError:
                continue
            if profile.is_secret(rel, stat.S_ISDIR(mode), stat.S_ISREG(mode), functools.partial(file_head, full)):
                continue  # commit never captures credentials: their absence from the image is expected
            e = index.get(rel)
            if e is None:
                out.append(Difference("/" + rel, "extra", "extra (not in the image)"))
            elif e.kind == DIR:
                stack.append(rel)
    return out


def _add_references(index: dict[str, Entry], doc: Optional[References]) -> None:
    """The weights a snapshot keeps as references (docs/weights-from-origin.md) are the image's files
    too: each blob checked as a layer's file (content, size, mode, owner), and the snapshot symlinks
    and refs files they imply where the layers hold none (restore's complete_layout makes those)."""
    if doc is None:
        return
    for r in doc.references:
        index[r.blob_path] = Entry(r.blob_path, FILE, r.mode, r.uid, r.gid, r.size, r.mtime_ns // 10**9,
                                   digest="sha256:" + r.sha256, mtime_ns=r.mtime_ns)
        index.setdefault(r.link_path, Entry(r.link_path, SYMLINK, 0o777, os.getuid(), os.getgid(),
                                            linkname=r.link_target))
    for ref in doc.refs:  # made by the restoring user, as the hub writes it
        index.setdefault(ref.file_path, Entry(ref.file_path, FILE, 0o644, os.getuid(), os.getgid(), len(ref.revision),
                                              digest=sha256_digest(ref.revision.encode())))


def verify(ref: str, root: str, opts: Optional[VerifyOptions] = None) -> VerifyResult:
    opts = opts or VerifyOptions()
    if not os.path.isdir(root):
        raise UsageError(f"root {root!r} does not exist or is not a directory")
    if opts.strict and opts.only_snapshot:
        raise UsageError("--strict compares the whole image with the directory", "drop --only-snapshot")
    reference = Reference.parse(ref)
    remote = Remote(reference, opts.transport)
    image, remote = open_image(remote.resolve(), remote, opts.decryption_keys)
    layers = select_layers(image, opts.only_snapshot)
    skeletons = {} if opts.read_layers else image_skeletons(remote, image, opts.log, kept=False)
    rules = RootRules(os.path.realpath(root), PathSet(opts.profile.exclude.patterns), same_owner=False,
                      keep_privileges=opts.allow_setuid, max_layer_size=None, part_links=part_links(layers))
    holder = HeldLayers(skeletons, rules) if skeletons else None
    if holder:
        holder.find(layers, opts.jobs)
    tree = image_index(remote, layers, opts.log, opts.jobs, holder)
    if holder:
        holder.done()
    _add_references(tree.index, read_document(remote, image.annotations))
    listed, total = left_out_secrets(image.manifest)
    secrets = sorted(clean_path(p) for p in listed)
    read = holder.read if holder else {}
    checked, diffs = compare(root, tree, opts, frozenset(secrets), read, holder.root if holder else None)
    held = holder.held if holder else 0
    return VerifyResult(image.ref, image.manifest_digest, checked, diffs, ["/" + p for p in secrets], total,
                        len(layers) - held, held)
