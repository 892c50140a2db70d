"""The suite's temp folders on a tmpfs (tests/conftest.py).

The suite writes ~10 GB of registries, boxes and restores, ~3 GB at once as each passed test's
folder goes (pyproject.toml's retention policy): on this machine's ext4 (mounted with discard) the
full suite took 486 s, on a tmpfs 396-407 s, and on CI the disk filled. Run as root, a run's
pytest base folder is RUNS/run-<pid> on a tmpfs mounted at RUNS once and left mounted (empty, it
holds no memory). A green run's folder goes at its end, a failed one's stays for a look until the
next run (whose start removes the folders of runs no longer alive). Where that cannot be or should
not be (not root, no CAP_SYS_ADMIN, no `mount`, under 8 GiB of memory available, a tmpfs without
user xattrs: kernels before 6.6, SNAP_TEST_TMPFS=0), pytest's own temp root on the disk is used."""

import os
import shutil
import stat
import subprocess
import tempfile
from typing import Optional

RUNS = os.path.join(tempfile.gettempdir(), "snap-tests")
MIN_AVAILABLE = 8 << 30  # bytes: the suite's ~3 GB at once, and room left for the processes


def run_folder() -> Optional[str]:
    """This run's base folder on the tmpfs (not made yet: pytest makes it), or None for pytest's default."""
    if os.environ.get("SNAP_TEST_TMPFS") == "0" or os.geteuid() != 0 or _available() < MIN_AVAILABLE:
        return None
    try:
        os.mkdir(RUNS, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(RUNS)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:  # a symlink or another's folder: not ours to mount on
        return None
    if not os.path.ismount(RUNS) and not _mounted():
        return None
    for name in os.listdir(RUNS):  # the folders of runs that ended (a live one's process is there)
        pid = name.removeprefix("run-")
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(RUNS, name), ignore_errors=True)
    return os.path.join(RUNS, f"run-{os.getpid()}")


def _mounted() -> bool:
    """Mount the tmpfs at RUNS; False (nothing left mounted) where it cannot, or it has no user xattrs."""
    try:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "snap-tests", RUNS],
                          capture_output=True).returncode != 0:
            return False
    except OSError:
        return False
    probe = os.path.join(RUNS, ".xattr-probe")
    try:
        with open(probe, "w"):
            pass
        os.setxattr(probe, "user.snap.probe", b"1")
        os.unlink(probe)
        return True
    except OSError:
        subprocess.run(["umount", RUNS], capture_output=True)
        return False


def _available() -> int:
    """MemAvailable, in bytes (0 where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def end_run(folder: str, exitstatus: int) -> None:
    """A green run's folder goes; a failed one's stays until the next run."""
    if exitstatus == 0:
        shutil.rmtree(folder, ignore_errors=True)
