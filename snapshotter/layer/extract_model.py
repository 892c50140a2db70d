"""What applying a layer (extract.py) is told and tells back: its options, its counts, what a
member leaves at its path (shape_of), which members it makes (creates), and NeedsSerial."""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, field

NAMES_KEPT = 1000  # names kept per kind for the report; the counts go on, so memory stays flat for any layer
SYMLINK_SHAPE, LINK_SHAPE, OTHER_SHAPE = -1, -2, -3  # shape_of a non-directory that is not a file of a known size
PLAIN_TYPES = frozenset((*tarfile.REGULAR_TYPES, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE))
DEVICE_TYPES = frozenset((tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE))


@dataclass
class ExtractOptions:
    same_owner: bool = field(default_factory=lambda: os.geteuid() == 0)
    allow_devices: bool = False
    allow_setuid: bool = False
    fsync: bool = False  # fsync each file before its rename (power-loss safety; slower)
    # Globs (the profile's `exclude`: /etc/hostname, /etc/resolv.conf, /proc, /tmp, ...) of paths the
    # machine owns: never written, replaced or deleted, whatever the layers hold.
    never_write: tuple[str, ...] = ()
    run_token: str = ""  # in this run's temp names: the sweep spares them (other extractors of the run write them)
    in_place_log: str = ""  # where each process notes the file it writes in place (inplace.py); "": nowhere


class NeedsSerial(Exception):
    """A layer applied beside others holds a whiteout, would remove a directory or put one where a
    non-directory is (or finds one a layer applied meanwhile put there), or links to a file it was
    not told of: raised before that entry changes anything; the caller applies it again, alone."""


@dataclass
class ExtractStats:
    files: int = 0
    bytes: int = 0
    skipped_devices: list[str] = field(default_factory=list)  # the first NAMES_KEPT of them
    # setuid/setgid bits or file capabilities stripped (the first NAMES_KEPT)
    stripped_setuid: list[str] = field(default_factory=list)
    stale_tmp_removed: int = 0
    left_alone: int = 0  # entries skipped because they are under ExtractOptions.never_write
    skipped_devices_count: int = 0
    stripped_setuid_count: int = 0

    def skipped_device(self, path: str) -> None:
        self.skipped_devices_count += 1
        if len(self.skipped_devices) < NAMES_KEPT:
            self.skipped_devices.append(path)

    def stripped(self, path: str) -> None:
        self.stripped_setuid_count += 1
        if len(self.stripped_setuid) < NAMES_KEPT:
            self.stripped_setuid.append(path)

    def add(self, other: "ExtractStats") -> None:
        """Fold in another extractor's counts (restore applies layers in several at once)."""
        self.files += other.files
        self.bytes += other.bytes
        self.stale_tmp_removed += other.stale_tmp_removed
        self.left_alone += other.left_alone
        self.skipped_devices_count += other.skipped_devices_count
        self.skipped_devices += other.skipped_devices[:max(0, NAMES_KEPT - len(self.skipped_devices))]
        self.add_stripped(other)

    def add_stripped(self, other: "ExtractStats") -> None:
        """Fold in another extractor's setuid strips (restore's part joins run beside the applier)."""
        self.stripped_setuid_count += other.stripped_setuid_count
        self.stripped_setuid += other.stripped_setuid[:max(0, NAMES_KEPT - len(self.stripped_setuid))]




SYMLINK_SHAPE, LINK_SHAPE, OTHER_SHAPE = -1, -2, -3  # shape_of a non-directory that is not a file of a known size


def shape_of(m: tarfile.TarInfo) -> int:
    """What a non-directory member leaves at its path: a regular file's size; a symlink; a hardlink
    (a regular file, of its target's size); a device node or FIFO."""
    if m.isreg():
        return m.size
    return SYMLINK_SHAPE if m.issym() else LINK_SHAPE if m.islnk() else OTHER_SHAPE


def creates(m: tarfile.TarInfo, allow_devices: bool) -> bool:
    """Does the extractor make something for member `m` (not a whiteout)? A plain type; a device node
    with --allow-devices as root; a FIFO (which a reader can block on) with --allow-devices. Other
    tar types (GNU sparse etc.) carry nothing a rootfs needs."""
    if m.type in PLAIN_TYPES:
        return True
    return m.type in DEVICE_TYPES and allow_devices and (m.isfifo() or os.geteuid() == 0)
