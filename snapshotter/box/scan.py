"""The walk of a live box: its entries as the profile selects them (what the next walk keeps of
this one: memo.py)."""

from __future__ import annotations

import errno
import functools
import os
import stat
from dataclasses import dataclass, field
from typing import Callable, Optional

from snapshotter.errors import StorageError, UsageError, quoted_path
from snapshotter.index.entry import (DIR, FILE, SYMLINK, Entry, entry_from_stat, self_and_parents)
from snapshotter.index.paths import entry_links, resolve_in_root
from snapshotter.profile import Profile, VenvRoots
from snapshotter.tar.rules import SKIP_XATTRS, WHITEOUT_PREFIX

from .memo import ScanMemo, memo_stamp, scan_context, unchanged
from .mounts import bind_mounted_files, pseudo_mounts
from .openat import DIR_FLAGS, head_at, open_beneath, open_root


def _in_dir(dir_fd: int, name: str) -> str:
    """A name in an open directory as a path that the kernel resolves through the handle (the
    directory the walk listed, whatever was renamed or swapped above it since) and that follows no
    symlink at its end (an lstat-like call): for the calls that take no dir_fd (xattrs)."""
    return f"/proc/self/fd/{dir_fd}/{name}"


@dataclass
class Scan:
    entries: dict[str, Entry]
    venv_roots: VenvRoots
    skipped_secrets: list[str] = field(default_factory=list)
    pseudo_mounts: set[str] = field(default_factory=set)  # kernel views (proc, sysfs, ...) not walked
    host_files: list[str] = field(default_factory=list)  # files bind-mounted from the host, and links to them
    unreadable: list[str] = field(default_factory=list)  # paths snap may not read (left out, named to the user)
    # What a scan of some directories alone (scan_box's `dirty`) starts from: the names each walked
    # directory held, and the directories with a path changed within the memo's racy window.
    listed: dict[str, list[str]] = field(default_factory=dict)
    racy_dirs: set[str] = field(default_factory=set)
    touched: Optional[set[str]] = None  # a scan of some directories: the paths it looked at, gone ones too
    kept_as: Optional[str] = None  # the digest of the stored walk that holds every entry (snapshot/kept.py)
    unkept: frozenset[str] = frozenset()  # entries some process maps shared-writable: in no memo (scan_box's `mapped`)
    whiteout_named: list[str] = field(default_factory=list)  # `.wh.*` paths left out (scan_box's `leave_out_whiteouts`)

    @functools.cached_property
    def _left_out(self) -> frozenset[str]:
        return frozenset(self.pseudo_mounts.union(self.skipped_secrets, self.host_files, self.unreadable))

    def not_walked(self, path: str) -> bool:
        """Under a pseudo mount, a left-out secret, a host file or a path snap may not read: base paths
        there are unknown, not deleted."""
        return any(p in self._left_out for p in self_and_parents(path))


def resolve_in_box(entries: dict[str, Entry], path: str) -> Optional[str]:
    """`path` with the symlinks of the box (its scan entries) resolved, as seen from inside the box
    (index/paths.py). None for a symlink loop."""
    return resolve_in_root(path, entry_links(entries))


def links_to(entries: dict[str, Entry], targets: set[str]) -> list[str]:
    """The symlinks of the box that lead (directly or through other links) to one of `targets`."""
    if not targets:
        return []
    return [rel for rel, e in entries.items() if e.kind == SYMLINK and resolve_in_box(entries, rel) in targets]


def scan_box(root: str, profile: Profile, extra_excludes: tuple[str, ...] = (),
             progress: Optional[Callable[[int], None]] = None, metadata_only: bool = False,
             memo: Optional[ScanMemo] = None, previous: Optional[Scan] = None,
             dirty: Optional[set[str]] = None, mapped: frozenset[tuple[int, int]] = frozenset(),
             leave_out_whiteouts: bool = False) -> Scan:
    """Walk the live box. Excluded paths and pseudo filesystems are not descended into; secrets are
    left out (and listed) unless the profile opts in, and so are files bind-mounted from the host.
    `metadata_only` (a watcher looking for changes) reads no symlink targets, xattrs or permissions:
    a change of those changes the ctime. With the profile's `include` (root-relative paths) only
    those are walked, and their parent directories are entries of their own. With a `memo`
    (ScanMemo) what an unchanged path held at the last scan is taken from it.

    With `previous` (this root's last scan, with the same memo) and `dirty`, only the directories in
    `dirty` are listed again (a watcher's change notifications, box/events.py): the rest of the box
    is as `previous` had it, a directory that appeared is walked whole, and one that went is dropped
    with all below it. The full scan is the same walk with every directory dirty.

    `mapped`: the (st_dev, st_ino) of the files some process maps shared-writable (box/writers.py's
    `mapped_ids`): a path is matched by its lstat, whatever name the mapping was made through (a hard
    link outside the root, a bind mount). The memo keeps none of them (the scan's `unkept`), and
    takes their entries anew: a write through a mapping moves the times only at its first write to a
    clean page, and the writes after it change no stat data, so a verdict read from the content (a
    private key's head) is not kept either.

    A path named as an OCI whiteout (`.wh.NAME`), which no layer can hold, is refused (UsageError);
    with `leave_out_whiteouts` it is left out and listed (`whiteout_named`): a watcher must not lose
    the rest of the box over one name."""
    if not os.path.isdir(root):
        raise UsageError(f"root {root!r} does not exist or is not a directory")
    context = scan_context(root, profile, extra_excludes, metadata_only)
    root, _, extra, _ = context
    old, _, settled_ns = (memo or ScanMemo()).start(context)
    partial = previous is not None and dirty is not None and memo is not None and bool(old) and not profile.include
    walk = _Walk(root, profile, extra, metadata_only, old, settled_ns if memo is not None else None,
                 previous if partial else None, mapped)
    walk.leave_out_whiteouts = leave_out_whiteouts
    root_fd = open_root(root)  # (the root itself may be a symlink: --root names it)
    try:
        if profile.include:
            walk.included(root_fd, progress)
        elif partial:
            walk.dirty(root_fd, progress, dirty)
        else:
            walk.stack.append("")
            walk_stack(root_fd, walk, progress)
    finally:
        os.close(root_fd)
    if memo is not None:
        memo.finish(context, walk.new)
    return walk.scan()


class _Walk:
    """One scan's state, and what it does at each path. A scan of some directories (`previous`
    given) starts from the last scan's findings and forgets what it finds gone."""

    def __init__(self, root: str, profile: Profile, extra: frozenset[str], metadata_only: bool,
                 old: dict[str, Entry | str], settled_ns: Optional[int], previous: Optional[Scan],
                 mapped: frozenset[tuple[int, int]] = frozenset()):
        self.root, self.profile, self.extra, self.metadata_only = root, profile, extra, metadata_only
        self.mapped_ids = mapped  # files a process maps shared-writable: not kept for the next scan (scan_box)
        self.mapped: set[str] = set()  # the paths looked at that are such a file
        self.skip_mounts = pseudo_mounts(root)
        self.mounted = bind_mounted_files(root)
        self.special = extra | self.skip_mounts | self.mounted  # paths not walked (look_names)
        self.old = old  # the last scan's paths (ScanMemo)
        self.keeping = settled_ns is not None  # a memo to fill
        self.settled_ns = settled_ns if settled_ns is not None else -1  # paths changed before this are kept
        self.previous = previous
        self.entries: dict[str, Entry] = dict(previous.entries) if previous else {}
        self.listed: dict[str, list[str]] = dict(previous.listed) if previous else {}
        self.venvs = previous.venv_roots if previous else VenvRoots()
        self.secrets: set[str] = set(previous.skipped_secrets) if previous else set()
        self.unreadable: set[str] = set(previous.unreadable) if previous else set()
        self.host_files: set[str] = set(previous.host_files) if previous else set()
        self.new: dict[str, Entry | str] = dict(old) if previous else {}  # this scan's paths, for the memo
        self.unsure: set[str] = set()  # paths read incompletely (an xattr the disk refused): not kept
        self.leave_out_whiteouts = False  # see scan_box
        self.whiteout_named: set[str] = set()  # the `.wh.*` paths this walk left out
        self.racy: set[str] = set()  # directories holding a path the memo does not keep (changed within its window)
        self.touched: set[str] = set()
        self.linked: set[str] = set()  # inode numbers of files with other names, looked at in a partial scan
        self.walked: set[str] = set()
        self.new_venvs = False
        self.dirty_dirs: set[str] = set()
        self.stack: list[str] = []

    def included(self, root_fd: int, progress: Optional[Callable[[int], None]]) -> None:
        """The profile's `include` paths, each with its parents as entries of their own."""
        for rel in self.profile.include:
            _check_include(self.root, rel, self.profile)
            for parent in reversed(list(self_and_parents(rel))[1:]):
                if parent not in self.entries:
                    _visit_at(root_fd, parent, self.visit, walk=False)
            _visit_at(root_fd, rel, self.visit)
        if progress:
            progress(len(self.entries))
        walk_stack(root_fd, self, progress)

    def dirty(self, root_fd: int, progress: Optional[Callable[[int], None]], dirty: set[str]) -> None:
        """A scan of the `dirty` directories alone, then of the other names of files changed in them."""
        self.dirty_dirs = dirty
        for top in sorted(dirty):
            if top in self.listed and top not in self.walked:
                # Its own entry (times, mode) is in its parent's listing: looked at again first.
                if top:
                    _visit_at(root_fd, top, self.visit, missing_ok=True)
                else:
                    self.stack.append(top)
            walk_stack(root_fd, self, progress)
        if self.linked:
            # A write, link or unlink through one name of a file notifies that name's directory
            # alone, yet the lstat of every other name moved with it: those are looked at again.
            for rel in [p for p, e in self.entries.items()
                        if e.kind == FILE and p not in self.touched and _inode(e) in self.linked]:
                _visit_at(root_fd, rel, self.visit, missing_ok=True)

    def forget(self, rel: str) -> None:
        """`rel` as the last scan knew it, and all below it, dropped (it is looked at again, or gone)."""
        todo = [rel]
        while todo:
            p = todo.pop()
            e = self.entries.pop(p, None)
            self.new.pop(p, None)
            self._drop_verdicts(p)
            if e is not None and e.inode:
                self.linked.add(_inode(e))
            if p.endswith("pyvenv.cfg"):
                self.new_venvs = True
            if e is not None and e.kind == DIR:
                todo.extend(f"{p}/{n}" for n in self.listed.pop(p, ()))

    def _drop_verdicts(self, rel: str) -> None:
        self.secrets.discard(rel)
        self.unreadable.discard(rel)
        self.host_files.discard(rel)
        self.touched.add(rel)

    def visit(self, rel: str, dir_fd: int, name: str, walk: bool = True) -> int:
        """Add the entry of `rel` (`name` in the open directory `dir_fd`), unless the profile leaves
        it out; a directory is walked if `walk`. The number of entries added (0 or 1). In a scan of
        some directories, a directory known from the last scan is listed again if it is dirty or its
        stamp moved, and what lay below it is forgotten only if it is another directory now."""
        prefix = rel[:len(rel) - len(name)]
        if self.previous is None:
            return self.look_names(dir_fd, prefix, (name,), walk)
        before = self.entries.pop(rel, None)
        self._drop_verdicts(rel)
        was_dir = before is not None and before.kind == DIR and rel in self.listed
        same = before.stamp if was_dir and rel not in self.dirty_dirs else None
        added = self.look_names(dir_fd, prefix, (name,), walk, same)
        now = self.entries.get(rel)
        if before is None or now is None or before.stamp != now.stamp:
            self.linked.update(_inode(x) for x in (before, now) if x is not None and x.inode)
        if was_dir and not (now is not None and now.kind == DIR and _inode(now) == _inode(before)):
            for n in self.listed.pop(rel, ()):
                self.forget(f"{rel}/{n}")
        return added

    def look_names(self, dir_fd: int, prefix: str, names, walk: bool = True, same: Optional[str] = None) -> int:
        """For any scan, each of `names` in the open directory `dir_fd` (path: `prefix` + name) lstat'ed,
        its entry taken from the memo or made, and noted: the number of entries added. One loop for a
        directory (what it reads of the walk bound once): its cost per path is a scan's beyond the lstat."""
        old, special, exclude, stat = self.old.get, self.special, self.profile.exclude.match, os.stat
        mapped_ids, settled_ns, unsure = self.mapped_ids, self.settled_ns, self.unsure
        new, entries = self.new, self.entries
        added = 0
        for name in names:
            rel = prefix + name
            last = old(rel)  # a path the last scan kept was not excluded (a path-only verdict)
            if rel in special:  # left out, or a file bind-mounted from the host (unless left out)
                if not (rel in self.extra or rel in self.skip_mounts or (last is None and exclude(rel))):
                    self.host_files.add(rel)
                continue
            if last is None and exclude(rel):
                continue
            if name.startswith(WHITEOUT_PREFIX):
                if not self.leave_out_whiteouts:
                    _refuse_whiteout_name(rel)
                self.whiteout_named.add(rel)
                continue
            try:
                st = stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except PermissionError:
                self.unreadable.add(rel)
                continue
            mapped = bool(mapped_ids) and (st.st_dev, st.st_ino) in mapped_ids
            if mapped:
                self.mapped.add(rel)
            if last is not None and not mapped and unchanged(last, st):
                e = None if isinstance(last, str) else last
            else:
                e = self._read(rel, dir_fd, name, st)
                if e is _NOT_CONTENT:
                    continue
            if mapped:
                new.pop(rel, None)  # its stat data does not tell its bytes (scan_box)
            elif st.st_ctime_ns < settled_ns and rel not in unsure:
                new[rel] = e if e is not None else memo_stamp(st)
            elif self.keeping:
                new.pop(rel, None)
                self.racy.add(rel.rpartition("/")[0])
            if e is None:
                self.secrets.add(rel)
                continue
            entries[rel] = e
            added += 1
            if e.kind == DIR and walk and e.stamp != same:
                self.stack.append(rel)
            elif name == "pyvenv.cfg" and e.kind == FILE:
                self.venvs.add(rel.rpartition("/")[0])
        return added

    def _read(self, rel: str, dir_fd: int, name: str, st: os.stat_result):
        """_new_entry(), with a path snap may not read noted as such (and _NOT_CONTENT returned)."""
        try:
            e = _new_entry(rel, dir_fd, name, st, self.profile, self.metadata_only, self.unsure.add)
        except FileNotFoundError:
            return _NOT_CONTENT
        except OSError:  # permissions, or a read the disk refused (EIO: a key candidate's head)
            e = _UNREADABLE
        if e is _UNREADABLE:
            self.unreadable.add(rel)
            return _NOT_CONTENT
        return e

    def scan(self) -> Scan:
        """The Scan this walk found: host files (and links to them) left out, the root readable."""
        entries, venvs = self.entries, self.venvs
        if self.previous is not None:
            if self.new_venvs:
                venvs = VenvRoots(p.rpartition("/")[0] for p, e in entries.items()
                                  if e.kind == FILE and p.rpartition("/")[2] == "pyvenv.cfg")
            fresh = any(p in entries and entries[p].kind == SYMLINK for p in self.touched)
            links = links_to(entries, self.mounted) if fresh and self.mounted else []
        else:
            links = links_to(entries, self.mounted)
        self.host_files.update(links)
        for rel in self.host_files:
            entries.pop(rel, None)
        if "/" in self.unreadable:  # the root itself: there is no box to commit
            raise StorageError(f"cannot read the box root {self.root!r}", "run snap as root")
        # Any other path snap may not read is left out, and named: one such path must not cost the
        # rest of the box its snapshot (a reclaim gives no second try).
        return Scan(entries, venvs, sorted(self.secrets), self.skip_mounts, sorted(self.host_files),
                    sorted(self.unreadable), listed=self.listed, racy_dirs=self.racy,
                    touched=self.touched if self.previous is not None else None,
                    unkept=frozenset(p for p in self.mapped if p in entries),
                    whiteout_named=sorted(self.whiteout_named))


def _refuse_whiteout_name(rel: str) -> None:
    """A box file named `.wh.NAME` is what a layer says to delete NAME: no layer can hold it as a
    file, and a restore would delete its sibling instead. Refused before anything is read or sent
    (every other name, newlines and bytes that are not UTF-8 included, is taken as it is)."""
    parent, _, name = rel.rpartition("/")
    hidden = f"{parent}/{name[len(WHITEOUT_PREFIX):]}" if parent else name[len(WHITEOUT_PREFIX):]
    raise UsageError(f"{quoted_path(rel)} is named as an OCI whiteout ({WHITEOUT_PREFIX!r} first): no layer can "
                     f"hold it, and a restore would delete {quoted_path(hidden)} instead",
                     "rename it, or leave it out with the profile's exclude list")


def walk_stack(root_fd: int, walk: _Walk, progress: Optional[Callable[[int], None]]) -> None:
    """List each directory on the walk's stack and visit its names (visit() pushes the directories
    to walk). In a scan of some directories, the names a directory held at the last scan and no
    longer holds are forgotten."""
    stack, listed, unreadable, visit = walk.stack, walk.listed, walk.unreadable, walk.visit
    forget = walk.forget if walk.previous is not None else None
    while stack:
        rel_dir = stack.pop()
        try:
            # Opened below the root following no symlink (box/openat.py): a directory, or one on the
            # way, swapped for a symlink (or a file) since its lstat is not walked (a symlink's target
            # is not the box's content there), and a path longer than PATH_MAX is walked all the
            # same. Its entries are stat'ed through the handle.
            fd = open_beneath(root_fd, rel_dir, DIR_FLAGS) if rel_dir else os.dup(root_fd)
        except PermissionError:
            unreadable.add(rel_dir or "/")
            continue
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed or replaced while we walked (its parent is listed again, or was)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EXDEV):
                raise
            continue  # replaced by a symlink while we walked
        try:
            try:
                names = os.listdir(fd)  # names only: a DirEntry each cost ~1 us more at 35k paths
            except PermissionError:
                unreadable.add(rel_dir or "/")
                continue
            prefix = f"{rel_dir}/" if rel_dir else ""
            if forget is not None:
                now = set(names)
                for gone in [n for n in listed.get(rel_dir, ()) if n not in now]:
                    forget(prefix + gone)
            listed[rel_dir] = names
            walk.walked.add(rel_dir)
            added = (walk.look_names(fd, prefix, names) if forget is None
                     else sum(visit(prefix + name, fd, name) for name in names))
        finally:
            os.close(fd)
        if progress and added:
            progress(added)  # once per directory: a call per file costs as much as its lstat


_UNREADABLE, _NOT_CONTENT = object(), object()


def _inode(e: Entry) -> str:
    return e.stamp.partition(":")[0]


def _visit_at(root_fd: int, rel: str, visit: Callable[..., int], walk: bool = True, missing_ok: bool = False) -> int:
    """visit() a path given from the root (an --include path or its parent; a dirty directory): its
    directory opened below the root following no symlink."""
    parent, _, name = rel.rpartition("/")
    try:
        fd = open_beneath(root_fd, parent, DIR_FLAGS) if parent else os.dup(root_fd)
    except OSError as e:
        if missing_ok:
            return 0  # gone since: its parent's listing says so
        raise UsageError(f"--include {'/' + rel!r}: cannot open its directory: {e.strerror}")
    try:
        return visit(rel, fd, name, walk=walk)
    finally:
        os.close(fd)


def _new_entry(rel: str, dir_fd: int, name: str, st: os.stat_result, profile: Profile, metadata_only: bool,
               unsure: Callable[[str], None] = lambda rel: None):
    """The entry of a path not known from the last scan (`name` in the open directory `dir_fd`,
    lstat'ed as `st`): None for a secret the profile leaves out, _NOT_CONTENT for a socket,
    _UNREADABLE for a file snap cannot read. `unsure(rel)`: its xattrs could not all be read."""
    link = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) and not metadata_only else ""
    e = entry_from_stat(rel, st, link)
    if e is None:
        return _NOT_CONTENT
    if profile.is_secret(rel, e.kind == DIR, e.kind == FILE, functools.partial(head_at, dir_fd, name, st)):
        return None
    if not metadata_only:
        e.xattrs = read_xattrs(_in_dir(dir_fd, name), lambda: unsure(rel))
        # Through the handle's /proc path, not faccessat(AT_SYMLINK_NOFOLLOW): glibc tries the
        # faccessat2 syscall for that, which older container seccomp profiles answer with EPERM.
        if e.kind == FILE and not os.access(_in_dir(dir_fd, name), os.R_OK):
            return _UNREADABLE
    return e


def _check_include(root: str, rel: str, profile: Profile) -> None:
    """An included path must exist, lie below no symlink (its parents are captured as directories),
    and not be left out by the profile."""
    path = os.path.join(root, rel)
    if not os.path.lexists(path):
        raise UsageError(f"--include {'/' + rel!r} does not exist in {root!r}")
    for parent in list(self_and_parents(rel))[1:]:
        if os.path.islink(os.path.join(root, parent)):
            raise UsageError(f"--include {'/' + rel!r} lies below the symlink {'/' + parent!r}",
                             "include the path the symlink points to")
    if any(profile.leaves_out(p) for p in self_and_parents(rel)):
        raise UsageError(f"--include {'/' + rel!r} is left out by the profile (its exclude or secrets list)")


def read_xattrs(path: str, incomplete: Callable[[], None] = lambda: None) -> Optional[dict[str, str]]:
    """A path's extended attributes worth carrying (not trusted.*, not SELinux labels: the host's);
    a read the disk refused calls `incomplete` (the path is then not kept for the next scan)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
            incomplete()
        return None
    out = {}
    for name in names:
        if name.startswith(SKIP_XATTRS):
            continue
        try:
            out[name] = os.getxattr(path, name, follow_symlinks=False).decode("utf-8", "surrogateescape")
        except OSError as e:
            if e.errno != errno.ENODATA:
                incomplete()
    return out or None
