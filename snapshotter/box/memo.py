"""What one walk of a box learnt of each path, kept for the next walk of the same root (ScanMemo),
and the rule by which a path counts as unchanged since (its lstat)."""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from snapshotter.index.entry import FILE, Entry, clean_path, kind_of_mode, stat_stamp
from snapshotter.profile import Profile

RACY_WINDOW_NS = 2 * 10**9  # a path changed this close to a scan is not trusted to its stat data next time


def memo_stamp(st: os.stat_result) -> str:
    """A secret's mark in the ScanMemo: what unchanged() compares for an entry, as one string."""
    return f"{stat_stamp(st)}:{st.st_size}:{st.st_mode}:{st.st_uid}:{st.st_gid}"


def unchanged(last, st: os.stat_result) -> bool:
    """Is the path the one the last scan saw (ScanMemo)? Same inode, mtime and ctime in ns (the
    entry's stamp, the stat cache's rule), type, permissions and owner, and a file of the same size.
    (Type, permissions and owner are compared too: sshfs and some other FUSE mounts report a ctime
    that a chmod or chown does not move.) `last` is its entry, or for a secret its memo_stamp."""
    if isinstance(last, str):
        return last == memo_stamp(st)
    mode = st.st_mode
    return (last.stamp == stat_stamp(st) and last.mode == mode & 0o7777 and last.uid == st.st_uid
            and last.gid == st.st_gid and last.kind == kind_of_mode(mode)
            and (last.kind != FILE or last.size == st.st_size) and last.inode == _link_group(last.kind, st))


def _link_group(kind: str, st: os.stat_result) -> Optional[str]:
    """A hard link's group ("dev:ino"): an entry kept across a remount would split or join groups."""
    return f"{st.st_dev}:{st.st_ino}" if kind == FILE and st.st_nlink > 1 else None


class ScanMemo:
    """What one scan learnt of each path, kept for the next scan of the same root with the same
    profile and options (`snap watch` keeps one): a path whose lstat is the same as then (unchanged)
    keeps its entry, its symlink target, xattrs, readability and secret verdict, none of which is
    read again. The rule is the stat cache's: chmod, chown, a write, an xattr or ACL change, a new
    link all move the ctime, which cannot be set back, and a symlink's target changes only with a
    new inode. A path whose ctime is within RACY_WINDOW_NS of the scan is not kept (a later change
    in the same clock tick could leave the same stat data), nor one some process maps shared-writable
    (scan_box's `mapped`: a write through a mapping may change no stat data). Every directory is
    still listed and every path still lstat'ed: a name created, deleted or renamed is seen whatever
    the directory's times say, and no rule about directory mtimes is relied on."""

    def __init__(self, clock: Callable[[], int] = time.time_ns):
        self.clock = clock  # ns; injectable for tests
        # The last finished scan's context and paths, swapped as one: a watcher's final snapshot
        # may scan while its loop does, and a scan that fails leaves the memo as it was.
        self._last: tuple[Optional[tuple], dict[str, Entry | str]] = (None, {})

    @property
    def seen(self) -> dict[str, Entry | str]:
        """path -> its entry (for a secret, its memo_stamp), as the last finished scan left them."""
        return self._last[1]

    def start(self, context: tuple) -> tuple[dict, dict, int]:
        """(last scan's paths, this scan's, the ctime before which a path is kept) for a scan with
        `context`; a memo made under another context is not used."""
        last_context, seen = self._last
        return seen if last_context == context else {}, {}, self.clock() - RACY_WINDOW_NS

    def finish(self, context: tuple, seen: dict) -> None:
        self._last = (context, seen)


def scan_context(root: str, profile: Profile, extra_excludes: tuple[str, ...] = (),
                 metadata_only: bool = False) -> tuple:
    """What a ScanMemo is made for: a scan of another root, profile, excludes or depth does not use it."""
    return (os.path.realpath(root), profile, frozenset(clean_path(e) for e in extra_excludes), metadata_only)
