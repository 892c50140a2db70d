"""The mounts this process sees (/proc/self/mountinfo): the one parser of that file.

Field 5 of a mountinfo line is the mount point, with space, tab, newline and backslash written as
octal escapes (`\\040`). The escapes stand for bytes, and a mount point is bytes in the filesystem's
encoding: decode the escapes on the bytes, then the whole name with os.fsdecode, so `mod\\040èle`
comes back as `mod èle` (decoding the escapes as text would turn the UTF-8 bytes of `è` into `Ã¨`).
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import Optional

from snapshotter.index.entry import clean_path

MOUNTINFO = "/proc/self/mountinfo"
_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    point: str  # absolute path of the mount point
    fstype: str
    dev: str = field(default="", compare=False)  # "major:minor", as the st_dev of a file there


def unescape(field: bytes) -> str:
    return os.fsdecode(_OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def parse_mountinfo(data: bytes) -> list[Mount]:
    """The mounts of a mountinfo text; malformed lines are skipped."""
    out = []
    for line in data.splitlines():
        fields = line.split(b" ")
        try:
            sep = fields.index(b"-", 6)  # optional fields (shared:N, master:N) end at a lone "-"
        except ValueError:
            continue
        if sep + 1 < len(fields):
            out.append(Mount(unescape(fields[4]), unescape(fields[sep + 1]), fields[2].decode(errors="replace")))
    return out


def read_mounts(path: str = MOUNTINFO) -> Optional[list[Mount]]:
    """The mounts this process sees, or None if mountinfo cannot be read (no /proc)."""
    try:
        with open(path, "rb") as f:
            return parse_mountinfo(f.read())
    except OSError:
        return None


def inside(root: str, point: str) -> Optional[str]:
    """`point` relative to `root` ('' for the root itself) if it lies inside it, else None. Both are
    real absolute paths."""
    if point == root:
        return ""
    prefix = root.rstrip("/") + "/"
    return point[len(prefix):] if point.startswith(prefix) else None


def filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem `path` (a real absolute path) is on, as /proc/self/mountinfo says:
    the deepest mount above it whose device is the one its nearest existing directory is on (not one
    mounted over since), the last one mounted there; None where mountinfo cannot be read."""
    dev = _device(path)
    best: Optional[tuple[bool, int, str]] = None
    for m in read_mounts() or ():
        if inside(m.point, path) is not None:
            rank = (m.dev == dev, len(m.point.rstrip("/")), m.fstype)
            if best is None or rank[:2] >= best[:2]:
                best = rank
    return best[2] if best else None


def _device(path: str) -> Optional[str]:
    """ "major:minor" of the device of `path`, or of its nearest existing parent."""
    while True:
        try:
            st = os.stat(path)
        except OSError:
            if path in ("/", ""):
                return None
            path = os.path.dirname(path)
            continue
        return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


# Filesystems that are views of the kernel, never content of the box.
PSEUDO_FS = {
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "mqueue", "debugfs", "tracefs", "securityfs",
    "pstore", "bpf", "fusectl", "configfs", "hugetlbfs", "autofs", "binfmt_misc", "nsfs", "rpc_pipefs", "efivarfs",
}


def pseudo_mounts(root: str) -> set[str]:
    """Root-relative mount points under `root` whose filesystem is a kernel view (proc, sysfs, ...)."""
    root = os.path.realpath(root)
    found = (inside(root, m.point) for m in read_mounts() or () if m.fstype in PSEUDO_FS)
    return {clean_path(rel) for rel in found if rel is not None}


# Filesystems whose changes may come from elsewhere (another machine, a FUSE daemon): inotify
# reports only what this kernel did there.
REMOTE_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs", "lustre", "gpfs", "afs", "virtiofs"}


def remote_mounts(root: str) -> dict[str, str]:
    """Root-relative mount points under `root` of network and FUSE filesystems, with their type."""
    root = os.path.realpath(root)
    found = {}
    for m in read_mounts() or ():
        rel = inside(root, m.point)
        if rel is not None and (m.fstype in REMOTE_FS or m.fstype == "fuse" or m.fstype.startswith("fuse.")):
            found[clean_path(rel)] = m.fstype
    return found


def bind_mounted_files(root: str) -> set[str]:
    """Root-relative paths of single files mounted over a path inside `root`: what a container runtime
    injects from the host (the NVIDIA toolkit's libcuda.so.<driver version>, nvidia-smi, Docker's
    /etc/hosts). They belong to the host, not the box."""
    root = os.path.realpath(root)
    found = set()
    for m in read_mounts() or ():
        rel = inside(root, m.point)
        if rel:
            try:
                if stat.S_ISREG(os.lstat(m.point).st_mode):
                    found.add(clean_path(rel))
            except OSError:
                continue
    return found
