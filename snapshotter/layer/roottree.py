"""The root a layer is applied onto, as the extractor (extract.py) sees it: paths resolved inside
the root (following symlinks as if the root were '/', never the final component), the directories
on the way made, the temp files a killed run left swept, removals that never empty a mounted
volume, and the times of the directories a layer changes, put back after it."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from typing import Optional

from snapshotter.errors import IntegrityError, StorageError
from snapshotter.index.paths import resolve_in_root

from .extract_model import ExtractOptions, ExtractStats, NeedsSerial
from .fileops import has_default_acl, join, mount_below, utime
from .inplace import InPlaceLog

TMP_PREFIX = ".snap-tmp-"
_STALE_TMP = re.compile(r"\.snap-tmp-(?:join-)?\d+(?:-.*)?", re.S)  # ours (and restore's part joins), any pid


class RootTree:
    def __init__(self, root: str, options: Optional[ExtractOptions] = None):
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self._root_prefix = os.path.join(self.root, "")  # a resolved path, less this, is root-relative
        self.opts = options or ExtractOptions()
        self.stats = ExtractStats()
        self._cleaned: set[str] = set()  # directories already swept for stale temp files this run
        # Resolved parent directories (rel -> real path). Resolution only goes through existing
        # directories, so only removing or replacing a directory or a symlink can change an
        # answer: those clear the cache.
        self._dir_cache: dict[str, str] = {}
        self.parallel = False  # other extractors write into the root meanwhile (see NeedsSerial)
        self.layer_touched_dirs: dict[str, tuple[int, int]] = {}
        # The files written at their paths (Extractor.apply's in_place), noted for a killed run's to be removed
        self.in_place_log = InPlaceLog(self.opts.in_place_log) if self.opts.in_place_log else None
        self._reset_dir_times()

    def _reset_dir_times(self) -> None:
        self._dir_times: dict[str, tuple[int, int]] = {}  # dirs we only wrote into: their times before
        self._layer_dirs: dict[str, tuple[int, int]] = {}  # dirs this layer defines: their header times
        self._written: set[str] = set()  # real paths this layer created (whiteouts must spare them)
        self._new_dirs: set[str] = set()  # directories this layer created: they hold only what it wrote
        self._times_right: set[str] = set()  # of _layer_dirs: those with their header's times, unchanged since
        self._acl_dirs: dict[str, bool] = {}  # directories -> whether they have a default ACL (_umask_rules)

    def put_back_dir_times(self) -> None:
        """Put back the times of directories we only wrote into, then set this layer's own directory
        times (deepest first, since setting a child can touch its parent)."""
        for path, (at, mt) in self._dir_times.items():
            if path not in self._layer_dirs:
                utime(path, at, mt)
        for path in sorted(self._layer_dirs, key=lambda p: p.count("/"), reverse=True):
            if path not in self._times_right:
                at, mt = self._layer_dirs[path]
                utime(path, at, mt)
        self.layer_touched_dirs = {self._rel(p): times for p, times in self._dir_times.items()
                                   if p not in self._layer_dirs}
        self._reset_dir_times()

    def _dir_stat(self, path: str) -> Optional[os.stat_result]:
        """The lstat of `path` if it is a real directory inside the root, reached without a symlink; else None."""
        rel = self._rel(path)
        parent, _, name = rel.rpartition("/")
        try:
            above = self._dir_cache.get(parent) or self._resolve_dir(parent, create=False) if rel else None
            if rel and above != self._real(parent):
                return None  # reached through a symlink: its name is not its path
            if rel:
                self._dir_cache[parent] = above
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        self._dir_cache[rel] = path  # what lies below resolves from it
        return st

    def _umask_rules(self, made: str) -> bool:
        """Whether `made`, just created, got its mode from the umask: not where its directory has a
        default ACL, which the kernel applies instead (a file created 0644 under `default:other::---`
        is 0640). Read once per directory and layer (another extractor may meanwhile give one an
        ACL from its header), and again once a header is applied to it (_header_applied)."""
        pdir = made.rpartition("/")[0]
        acl = self._acl_dirs.get(pdir)
        if acl is None:
            acl = self._acl_dirs[pdir] = has_default_acl(pdir)
        return not acl

    def _rel(self, path: str) -> str:
        return path[len(self._root_prefix):] if path != self.root else ""

    # ---- the tree outside a layer (restore/parts.py joins part layers) ---------------------------------

    def parent_dir(self, rel: str) -> str:
        """The real directory that holds /rel, resolved inside the root, made by nothing (a
        missing one raises FileNotFoundError); stale temp files there are swept."""
        return self._locate(rel, create=False)[0]

    def will_change(self, pdir: str) -> None:
        """`pdir`'s entries are about to change: its times are put back after (put_back_dir_times)."""
        self._note_parent(pdir)

    def forget_dirs(self) -> None:
        """Resolve parent directories anew: other extractors changed the tree since."""
        self._dir_cache.clear()

    def dir_at(self, rel: str) -> Optional[str]:
        """The real directory /rel is, or leads to (a link to one), resolved inside the root; else None."""
        try:
            return self._resolve_dir(rel, create=False)
        except (FileNotFoundError, NotADirectoryError, IntegrityError):
            return None

    # ---- path resolution, scoped to the root ------------------------------------------------

    def _resolve_dir(self, rel: str, create: bool = True) -> str:
        """Real path of directory `rel`, following symlinks as if self.root were '/' (index/paths.py).
        Missing directories are created (0755, as the runtimes do)."""
        parent, _, name = rel.rpartition("/")
        above = self._dir_cache.get(parent) if parent else None
        if above is not None:  # its parent resolved already: only its own name to look at
            path = join(above, name)
            try:
                if stat.S_ISDIR(os.lstat(path).st_mode):
                    return path
            except FileNotFoundError:
                pass  # made, or refused, below
        resolved = resolve_in_root(rel, lambda here: self._dir_on_the_way(here, create))
        if resolved is None:
            raise IntegrityError(f"too many symlinks resolving /{rel}: refusing a hostile layer")
        return self._real(resolved)

    def _dir_on_the_way(self, here: str, create: bool) -> Optional[str]:
        """The target of the symlink at `here` (a resolved path on the way to a directory); else
        `here` is made a directory if it is not one (with create=False, FileNotFoundError)."""
        path = self._real(here)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if not create:
                raise
            self._note_parent(self._real(here.rpartition("/")[0]))
            try:
                os.mkdir(path, 0o755)
            except FileExistsError:
                if not self.parallel:
                    raise
                return self._dir_on_the_way(here, create)  # another extractor made it meanwhile
            self._made_dir(path)
            return None
        if stat.S_ISLNK(st.st_mode):
            return os.readlink(path)
        if not stat.S_ISDIR(st.st_mode):
            if not create:
                raise FileNotFoundError(path)
            # A non-directory stands where a directory is needed: the new layer replaces it.
            if self.parallel:
                raise NeedsSerial(here)  # perhaps an upper layer's, applied meanwhile
            self._note_parent(self._real(here.rpartition("/")[0]))
            os.unlink(path)
            os.mkdir(path, 0o755)
            self._made_dir(path)
        return None

    def _real(self, rel: str) -> str:
        """The path on disk of `rel`, a path relative to the root with its symlinks resolved."""
        return os.path.join(self.root, rel) if rel else self.root

    def _made_dir(self, path: str) -> None:
        """Note a directory this layer made: it holds only what the layer writes, and no temp file
        of a killed run: no sweep, which saves a directory read per new directory."""
        self._new_dirs.add(path)
        self._cleaned.add(path)
        self._acl_dirs.pop(path, None)  # perhaps one removed, that had no default ACL: it inherits its parent's

    def _header_applied(self, path: str) -> None:
        """Directory `path` has its header's attributes (its xattrs may give it a default ACL); its
        times are set once what it holds is in."""
        self._dir_times.pop(path, None)
        self._acl_dirs.pop(path, None)

    def _locate(self, rel: str, create: bool = True) -> tuple[str, str]:
        """(real parent dir, final path) for a member; the final component is not followed.
        With create=False a missing parent raises FileNotFoundError instead of being made."""
        parent, _, base = rel.rpartition("/")
        pdir = self._dir_cache.get(parent)
        if pdir is None:
            pdir = self._dir_cache[parent] = self._resolve_dir(parent, create)
        if pdir not in self._cleaned:
            self._cleaned.add(pdir)
            self._sweep_stale_tmp(pdir)
        return pdir, join(pdir, base)

    def _sweep_stale_tmp(self, pdir: str) -> None:
        """Remove temp files an interrupted run left in `pdir` (this extractor has none open there
        yet; other extractors of this run, whose names end in its token, may)."""
        own = f"-{self.opts.run_token}" if self.opts.run_token else None
        self._times_right.discard(pdir)  # reading it gives it a new atime: its header's times are set again
        with os.scandir(pdir) as it:
            stale = [de.path for de in it if de.name.startswith(TMP_PREFIX) and _STALE_TMP.fullmatch(de.name)
                     and not (own and de.name.endswith(own))]
        for path in stale:
            self._note_parent(pdir)
            self._remove_any(path)
            self.stats.stale_tmp_removed += 1

    # ---- directory mtimes ---------------------------------------------------------------------

    def _note_parent(self, pdir: str) -> None:
        """Remember a directory's times before we change its contents, to put them back."""
        self._times_right.discard(pdir)
        if pdir not in self._dir_times and pdir not in self._layer_dirs:
            try:
                st = os.lstat(pdir)
                self._dir_times[pdir] = (st.st_atime_ns, st.st_mtime_ns)
            except FileNotFoundError:
                pass

    def _remove_any(self, path: str) -> None:
        """Remove a path of any type; the final component is never followed."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            self._remove_tree(path)
            return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass  # another extractor of this run swept it first
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            shown = "/" + os.path.relpath(path, self.root)
            raise StorageError(f"the image deletes or replaces {shown}, but a file is mounted over it: refusing",
                               "unmount it, or restore into another directory") from e

    def _remove_tree(self, path: str) -> None:
        """shutil.rmtree, refused when a filesystem is mounted at or below `path`: rmtree would
        empty the mounted volume before failing on the mount point itself."""
        if self.parallel:
            raise NeedsSerial(path)
        mp = mount_below(path)
        if mp is not None:
            shown = "/" + os.path.relpath(path, self.root)
            raise StorageError(f"the image deletes or replaces the directory {shown}, but {mp} is a mount point: "
                               "refusing to empty a mounted filesystem",
                               "unmount it, or restore into another directory")
        self._dir_cache.clear()
        shutil.rmtree(path)
