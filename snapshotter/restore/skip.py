"""Which layers a restore need not download: the root already holds exactly what they would write.

A pod restart keeps its volume (/workspace, with the weights) and loses the container disk and
snap's state dir with it. Before any download, each pending snap layer with a skeleton (snapshot/skeleton.py)
is checked against the root:

1. A stat pass over the layer's members, by the extractor's rules (layer/extract.py): every path there,
   reached through real directories, of the right type, size, mode (setuid bits as the extractor
   leaves them), owner (when the restore sets owners), xattrs (a file's or symlink's those alone, as
   the extractor makes it new: xattrs.py), symlink target and mtime; each hardlink the same inode as
   its target, each file with no other links than the layer's; each whiteout's path absent. A
   directory's mtime is left to the last layer that carries it (the one that decides it). A part
   of a file cut at the layer cap is read from the joined file. Any other member type, an opaque
   whiteout or a path the restore never writes fails the layer.
2. The layer's tar rebuilt from its headers and the bytes on disk, hashed: equal to its diff_id
   means applying it writes exactly what is there. A file that differs never passes: its bytes
   differ (the hash) or its stat data does (the stat pass). Where this state dir's restore record
   (snapshot/record.py) says the root got this very layer, its times can be trusted (this boot, no
   clock set back since) and no file of it changed since (ctime, with its filesystem's granularity;
   none on a network filesystem), the hash is not needed.
3. Order: a layer passes only if no earlier layer that is applied writes or deletes one of its
   paths or a parent of them (it would overwrite what was checked), save a directory written with
   the same mode, owner and xattrs whose mtime a later layer decides; the parts of a file pass
   together or not at all (the restore joins only what it applies). A layer without a skeleton is
   applied, and writes anything: no later layer passes. What an applied layer writes is taken from
   its skeleton before its blob is downloaded; once it is applied, its real headers must be the
   ones its skeleton claimed (SkipPlan.headers_said, schedule.py), or the layers above it are checked again.

A layer that passes is neither downloaded nor applied; the restore counts it as applied."""

from __future__ import annotations

import os
import stat
import tarfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapshotter import progress
from snapshotter.errors import IntegrityError
from snapshotter.jobs import cpu_count
from snapshotter.layer.plan import parse_part_annotation, parse_part_name
from snapshotter.oci.image import SNAP_PART, SNAP_PART_FILE
from snapshotter.profile import PathSet
from snapshotter.snapshot.record import Since
from snapshotter.snapshot.skeleton import Skeleton
from snapshotter.tar.reader import EntryCount
from .rebuild import Source, members_of, rebuilt_diff_id
from .skip_order import WHITEOUT, in_order
from .xattrs import xattrs_differ
from snapshotter.tar.rules import (OPAQUE, WHITEOUT_PREFIX, HeadersDigest, applied_xattrs, check_name, header_key,
                                   member_xattrs, whiteout_target)

HASH_WORKERS = max(1, min(16, cpu_count()))  # layers hashed at once (a GPU box has 16+ cores)
_PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID



@dataclass
class RootRules:
    """What the restore would leave at a path, beside the tar header: the extractor's options."""

    root: str
    never_write: PathSet
    same_owner: bool
    keep_privileges: bool  # --allow-setuid as root: setuid bits and file capabilities kept
    max_layer_size: Optional[int]  # the cap files were cut at (part layers)
    part_links: dict[str, list[str]]  # a file cut into parts -> its other names (parts.part_links)


@dataclass
class LayerCheck:
    """One layer's paths (from its headers) and what its stat pass found."""

    headers: str  # the digest of its tar headers (as the extractor records them: snapshot/record.py)
    paths: list[tuple[str, object, tuple]] = field(default_factory=list)  # (path, kind, what a directory must agree on)
    sources: list[Optional[Source]] = field(default_factory=list)  # per member: its content on disk, or None
    why: str = ""  # why the stat pass failed; "" if it passed

    @property
    def ok(self) -> bool:
        return not self.why


@dataclass
class SkipPlan:
    skipped: dict[int, str]  # index in the restore's list -> the digest of that layer's tar headers
    skipped_bytes: int = 0  # blob bytes not downloaded
    hashed_bytes: int = 0  # bytes of the root read to check them
    reasons: dict[int, str] = field(default_factory=dict)  # why a layer with a skeleton is applied
    # The layers to apply whose skeletons said what they write (the order pass took their word):
    # index -> the digest of the tar headers they claim. Their skeletons are checked against nothing
    # before they are applied, so the restore checks each claim once it is (schedule.py).
    headers_said: dict[int, str] = field(default_factory=dict)


class RootPaths:
    """lstat of root-relative paths, reached through real directories only (no symlink followed)."""

    def __init__(self, root: str):
        self.root = root
        self._dirs: dict[str, bool] = {"": True}

    def full(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def real_dir(self, rel: str) -> bool:
        """Is root/rel a directory reached without following any symlink? (Parents first, each
        looked at once; a loop, not a recursion: a hostile image's path may be thousands deep.)"""
        todo = []
        while rel not in self._dirs:
            todo.append(rel)
            rel = rel.rpartition("/")[0]
        ok = self._dirs[rel]
        for rel in reversed(todo):
            if ok:
                try:
                    ok = stat.S_ISDIR(os.lstat(self.full(rel)).st_mode)
                except OSError:
                    ok = False
            self._dirs[rel] = ok
        return ok

    def absent(self, rel: str) -> bool:
        """Is there nothing at `rel`, with no symlink on the way that the extractor would follow?"""
        parts = rel.split("/")
        for k in range(1, len(parts) + 1):
            prefix = "/".join(parts[:k])
            try:
                st = os.lstat(self.full(prefix))
            except FileNotFoundError:
                return True
            except OSError:
                return False
            if not stat.S_ISDIR(st.st_mode):
                return False  # `rel` itself, or a symlink or file where a directory leads to it
        return False

    def lstat(self, rel: str) -> Optional[os.stat_result]:
        if not self.real_dir(rel.rpartition("/")[0]):
            return None
        try:
            return os.lstat(self.full(rel))
        except OSError:
            return None


class _Fail(Exception):
    pass


def check_layer(members: list[tarfile.TarInfo], desc: dict, rules: RootRules, root: RootPaths,
                later_dirs: set[str]) -> LayerCheck:
    """The paths of one layer and its stat pass (see the module's doc)."""
    digest = HeadersDigest()
    for m in members:
        digest.add(header_key(m))
    lc = LayerCheck(digest.hexdigest(), _paths(members, desc, rules, later_dirs))
    try:
        lc.sources = _stat_pass(members, desc, rules, root, later_dirs)
    except _Fail as e:
        lc.why = str(e)
    except (IntegrityError, OSError) as e:
        lc.why = f"it cannot be checked ({e})"
    return lc


def _paths(members: list[tarfile.TarInfo], desc: dict, rules: RootRules, later_dirs: set[str]) -> list:
    """What applying the layer writes: (path, kind, for a directory the attributes it sets)."""
    part_file = _part_of(desc)[0]
    out: list[tuple[str, object, tuple]] = []
    for m in members:
        rel = check_name(m.name)
        parent, _, base = rel.rpartition("/")
        if not rel:
            continue
        if base.startswith(WHITEOUT_PREFIX):
            out.append((parent or "", WHITEOUT, ()) if base == OPAQUE else
                       (f"{parent}/{whiteout_target(base)}" if parent else whiteout_target(base), WHITEOUT, ()))
        elif m.isdir():
            mode, xattrs = _expected(m, rules)
            out.append((rel, stat.S_IFDIR, (mode, m.uid, m.gid, xattrs, int(m.mtime), rel in later_dirs)))
        else:
            out.append((rel, stat.S_IFREG, ()))
    if part_file is not None:
        out.append((part_file, stat.S_IFREG, ()))  # written by the join, once all parts are in
    return out


def _part_of(desc: dict) -> tuple[Optional[str], Optional[tuple[int, int]]]:
    """(the file, (i, n)) of a part layer, as its annotations say; (None, None) for another layer."""
    ann = desc.get("annotations") or {}
    part_file = ann.get(SNAP_PART_FILE) if isinstance(ann, dict) else None
    if not isinstance(part_file, str):
        return None, None
    return check_name(part_file), parse_part_annotation(ann.get(SNAP_PART))


def _expected(m: tarfile.TarInfo, rules: RootRules) -> tuple[int, tuple]:
    """The mode and xattrs applying `m` leaves (the extractor strips setuid bits and file
    capabilities unless --allow-setuid as root)."""
    mode = m.mode & 0o7777
    if not rules.keep_privileges and not m.isdir():
        mode &= ~_PRIVILEGE_BITS
    return mode, tuple(sorted(applied_xattrs(member_xattrs(m), rules.keep_privileges).items()))


def _stat_pass(members: list[tarfile.TarInfo], desc: dict, rules: RootRules, root: RootPaths,
               later_dirs: set[str]) -> list[Optional[Source]]:
    part_file, part = _part_of(desc)
    links_to: dict[str, int] = {}
    for m in members:
        if m.islnk():
            target = check_name(m.linkname)
            links_to[target] = links_to.get(target, 0) + 1
    sources: list[Optional[Source]] = []
    regular: set[str] = set()
    for m in members:
        sources.append(None)
        rel = check_name(m.name)
        if not rel:
            continue  # the root entry: the extractor leaves the root's attributes alone
        parent, _, base = rel.rpartition("/")
        if base.startswith(WHITEOUT_PREFIX):
            if base == OPAQUE:
                raise _Fail("it holds an opaque whiteout")
            target = f"{parent}/{whiteout_target(base)}" if parent else whiteout_target(base)
            if not rules.never_write.match(target) and not root.absent(target):
                raise _Fail(f"/{target} is there, and the layer deletes it")
            continue
        if rules.never_write.match(rel):
            raise _Fail(f"/{rel} is a path the restore never writes")
        shown = "/" + rel
        if m.isreg():
            if rel in regular:  # read twice for one hash: a hostile skeleton could list a file a million times
                raise _Fail(f"{shown} is listed twice")
            source = _regular(m, rel, part_file, part, rules, root, links_to)
            sources[-1] = source
            regular.add(rel)
            _attrs(m, source.st, rules, source.path, mtime=True)  # a part's: the joined file's
        elif m.isdir():
            st = root.lstat(rel)
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise _Fail(f"{shown} is not a directory")
            _attrs(m, st, rules, rel, mtime=rel not in later_dirs)
        elif m.issym():
            st = root.lstat(rel)
            if st is None or not stat.S_ISLNK(st.st_mode) or os.readlink(root.full(rel)) != m.linkname:
                raise _Fail(f"{shown} is not the symlink to {m.linkname!r}")
            _attrs(m, st, rules, rel, mtime=True)
        elif m.islnk():
            target = check_name(m.linkname)
            st, tst = root.lstat(rel), root.lstat(target)
            if target not in regular or st is None or tst is None or (st.st_dev, st.st_ino) != (tst.st_dev, tst.st_ino):
                raise _Fail(f"{shown} is not a hardlink to /{target}")
        else:
            raise _Fail(f"{shown} is a device node or FIFO")
    return sources


def _regular(m: tarfile.TarInfo, rel: str, part_file: Optional[str], part: Optional[tuple[int, int]],
             rules: RootRules, root: RootPaths, links_to: dict[str, int]) -> Source:
    """Where a regular member's content is: its path, or for a part of a file the joined file's slice."""
    cut = parse_part_name(rel)
    if cut is not None and part is not None and cut == (part_file, *part):
        path, i, n = cut
        if rules.max_layer_size is None or (i < n and m.size != rules.max_layer_size):
            raise _Fail(f"/{path} was cut at a size the image does not say")
        if root.lstat(rel) is not None:
            raise _Fail(f"/{rel} is there: its file was not joined")
        st = root.lstat(path)
        offset = (i - 1) * rules.max_layer_size
        fits = st is not None and stat.S_ISREG(st.st_mode) and (
            st.st_size == offset + m.size if i == n else st.st_size > offset + m.size)
        names = rules.part_links.get(path, [])
        if not fits or st.st_nlink != 1 + len(names):
            raise _Fail(f"/{path} is not the file its parts join into")
        for name in names:
            other = root.lstat(name)
            if other is None or (other.st_dev, other.st_ino) != (st.st_dev, st.st_ino):
                raise _Fail(f"/{name} is not a hardlink to /{path}")
        return Source(path, offset, m.size, st)
    st = root.lstat(rel)
    if st is None or not stat.S_ISREG(st.st_mode):
        raise _Fail(f"/{rel} is not a regular file")
    if st.st_size != m.size:
        raise _Fail(f"/{rel} has {st.st_size} bytes, the layer {m.size}")
    if st.st_nlink != 1 + links_to.get(rel, 0):
        raise _Fail(f"/{rel} has other hardlinks than the layer's")
    return Source(rel, 0, m.size, st)


def _attrs(m: tarfile.TarInfo, st: os.stat_result, rules: RootRules, rel: str, mtime: bool) -> None:
    """Fail unless the mode, owner, xattrs (and `mtime`) of `rel` are what applying `m` leaves."""
    mode, xattrs = _expected(m, rules)
    shown = "/" + rel
    if not m.issym() and stat.S_IMODE(st.st_mode) != mode:
        raise _Fail(f"{shown} has mode {stat.S_IMODE(st.st_mode):04o}, the layer {mode:04o}")
    if rules.same_owner and (st.st_uid, st.st_gid) != (m.uid, m.gid):
        raise _Fail(f"{shown} is owned by {st.st_uid}:{st.st_gid}, in the layer by {m.uid}:{m.gid}")
    if mtime and int(st.st_mtime) != int(m.mtime):
        raise _Fail(f"{shown} has another mtime than in the layer")
    # A directory the extractor finds there keeps the xattrs it has; any other path is made new.
    differ = xattrs_differ(os.path.join(rules.root, rel), dict(xattrs), exact=not m.isdir())
    if differ:
        raise _Fail(f"{shown}: {differ}")


def plan_skips(todo: list[tuple[int, dict, str]], start: int, skeletons: dict[str, Skeleton], rules: RootRules,
               unchanged_since: Callable[[dict, str], Optional[Since]]) -> SkipPlan:
    """Which of todo[start:] (the restore's layers not applied yet) the root already holds.
    `unchanged_since(desc, headers digest)`: the end of this root's last restore, if it applied
    this very layer and its times can be trusted (the restore record); None otherwise."""
    root = RootPaths(rules.root)
    pending = todo[start:]
    parsed: dict[int, tuple[Skeleton, list[tarfile.TarInfo]]] = {}
    reasons: dict[int, str] = {}
    entries = EntryCount()  # the members parsed are kept: bounded as the extractor bounds the image
    for n, (i, desc, diff_id) in enumerate(pending, start):
        skeleton = skeletons.get(diff_id)
        if skeleton is None:
            continue
        try:
            parsed[n] = (skeleton, members_of(skeleton, f"{desc['digest'][:19]}", entries))
        except IntegrityError as e:
            reasons[n] = f"its skeleton is not usable ({e})"
    # Which layer decides each directory's mtime: the last that carries it.
    last_carrier: dict[str, int] = {}
    for n, (_, members) in parsed.items():
        for m in members:
            if m.isdir():
                # As check_name gives a plain name; another form never matches, and the mtime is checked.
                last_carrier[m.name.strip("/")] = n
    checks: dict[int, LayerCheck] = {}
    with progress.bar("checking what the root holds", len(parsed), unit="layers") as bar:
        for n, (_, members) in parsed.items():
            later = {d for d, k in last_carrier.items() if k > n}
            bar.update(1)
            try:
                checks[n] = check_layer(members, pending[n - start][1], rules, root, later)
            except IntegrityError as e:  # a hostile name: what the layer writes is not known
                reasons[n] = f"its skeleton is not usable ({e})"
                continue
            if not checks[n].ok:
                reasons[n] = checks[n].why
    passed = {n for n, c in checks.items() if c.ok}
    passed = in_order(todo, start, checks, passed)
    # The hash, where the restore record does not vouch for the layer.
    to_hash = []
    for n in sorted(passed):
        since = unchanged_since(pending[n - start][1], checks[n].headers)
        if since is None or not all(since.unchanged(s.path, s.st.st_ctime_ns)
                                    for s in checks[n].sources if s is not None):
            to_hash.append(n)
    hashed = _hash_layers(to_hash, parsed, checks, pending, start, rules.root, reasons)
    passed -= hashed.failed
    passed = in_order(todo, start, checks, passed)
    for n in set(checks) - passed:
        reasons.setdefault(n, "an earlier layer that is applied writes one of its paths, "
                              "or a part of its file is applied")
    skipped = {n: checks[n].headers for n in sorted(passed)}
    said = {n: c.headers for n, c in checks.items() if n not in passed}
    return SkipPlan(skipped, sum(todo[n][1]["size"] for n in skipped), hashed.bytes, reasons, said)


def hold_layer(skeleton: Skeleton, desc: dict, diff_id: str, rules: RootRules, root: RootPaths, label: str,
               on_bytes: Callable[[int], None]) -> Optional[list[Optional[str]]]:
    """Does the root hold this layer whole, taken alone (`snap verify`: the order of the layers is
    its index's to apply)? Its stat pass, directories' mtimes left out, then its rebuilt hash, always
    (no restore record vouches for a verify). A part layer is never held, nor one whose skeleton is
    not usable. Per member of the skeleton, the digest of its bytes as read from the root (None for
    a member without): the layer's own bytes, as the rebuilt tar hashes to its diff_id. None if the
    layer is not held."""
    if _part_of(desc)[0] is not None:
        return None
    try:
        members = members_of(skeleton, label, EntryCount())
        check = check_layer(members, desc, rules, root, {m.name.strip("/") for m in members if m.isdir()})
    except IntegrityError:
        return None  # a hostile name, or past the entry cap: the layer is read, with the image's checks
    if not check.ok:
        return None
    contents: list[Optional[str]] = []
    try:
        if rebuilt_diff_id(skeleton, check.sources, rules.root, on_bytes, threading.Event(), contents) != diff_id:
            return None
    except OSError:
        return None  # unreadable: the layer is read from the registry
    return contents


@dataclass
class _Hashed:
    failed: set[int]
    bytes: int


def _hash_layers(to_hash: list[int], parsed: dict, checks: dict[int, LayerCheck], pending: list, start: int,
                 root: str, reasons: dict[int, str]) -> _Hashed:
    """Rebuild and hash the layers `to_hash`, several at once; those whose hash is not their diff_id fail."""
    total = sum(s.size for n in to_hash for s in checks[n].sources if s is not None)
    failed: set[int] = set()
    read = [0]
    lock = threading.Lock()
    stop = threading.Event()
    with progress.bar("hashing what the root holds", total) as bar:
        update = progress.safe_update(bar)

        def on_bytes(k: int) -> None:
            with lock:
                read[0] += k
            update(k)

        def one(n: int) -> bool:
            try:
                return rebuilt_diff_id(parsed[n][0], checks[n].sources, root, on_bytes, stop) == pending[n - start][2]
            except OSError:
                return False  # unreadable: the layer downloads

        # The biggest first: the pool ends when its longest hash does.
        order = sorted(to_hash, key=lambda n: -sum(s.size for s in checks[n].sources if s is not None))
        with ThreadPoolExecutor(HASH_WORKERS) as pool:
            futures = {n: pool.submit(one, n) for n in order}
            try:
                for n, f in futures.items():
                    if not f.result():
                        failed.add(n)
                        reasons[n] = "its files' bytes differ from the layer's"
            except BaseException:
                stop.set()
                raise
    return _Hashed(failed, read[0])
