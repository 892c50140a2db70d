"""Big files written past the page cache (layer/direct.py), and the weights' download priority
(restore/priority.py): the bytes are exact whatever the filesystem takes, the page cache holds none
of what went direct, and a restore writes its weights that way."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest

from snapshotter.box.mounts import filesystem_type
from snapshotter.layer.direct import DIRECT_FS, DIRECT_MIN, DirectFile, direct_allowed
from snapshotter.restore.priority import UNPACKING_NICE, WEIGHTS_NICE, WeightsPriority, undoable
from support.run import snap
from support.trees import SMALL_WEIGHTS

MODEL = "opt/app/models/checkpoints/big.safetensors"


@pytest.fixture
def disk_dir():
    """A directory on a local disk's filesystem (not the suite's tmpfs) where direct writes bypass
    the page cache, removed afterwards."""
    d = tempfile.mkdtemp(prefix="snap-direct-", dir="/var/tmp")
    try:
        kind = filesystem_type(os.path.realpath(d))
        if kind not in DIRECT_FS:
            pytest.skip(f"/var/tmp is on {kind!r} here, not a local disk's filesystem")
        probe = os.path.join(d, "probe")
        if not write_in_pieces(probe, pattern(1 << 16), [], buffer=1 << 16).direct or resident_bytes(probe):
            pytest.skip(f"direct writes on this {kind} go through the page cache all the same")
        os.unlink(probe)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ramfs(tmp_path, tmpfs):
    """A ramfs: a filesystem that refuses O_DIRECT."""
    return str(tmpfs(tmp_path / "ramfs", kind="ramfs"))


def resident_bytes(path: str) -> int:
    """How much of a file the page cache holds (mincore over a private mapping of it)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        start = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(start)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del start
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def pattern(size: int) -> bytes:
    block = hashlib.sha256(str(size).encode()).digest() * 2048  # 64 KiB, not zeros
    return (block * (size // len(block) + 1))[:size]


def write_in_pieces(path: str, data: bytes, pieces: list[int], buffer: int) -> DirectFile:
    f = DirectFile(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), buffer)
    at = 0
    for n in pieces:
        f.write(data[at:at + n])
        at += n
    f.write(data[at:])
    direct = f.direct
    f.close()
    f.direct = direct  # as it was before the tail
    return f


SIZES = [0, 1, 4095, 4096, 4097, 65536, 65536 * 3 + 17, 1 << 20]
PIECES = [[], [1, 4095, 3], [70000, 7], [65536, 65536]]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("pieces", PIECES)
def test_a_direct_file_holds_exactly_its_bytes(disk_dir, size, pieces):
    path = os.path.join(disk_dir, "f")
    data = pattern(size)
    f = write_in_pieces(path, data, pieces, buffer=65536)
    with open(path, "rb") as r:
        assert r.read() == data
    assert f.direct or size < 65536  # a whole buffer went out directly


def test_what_went_direct_is_not_in_the_page_cache(disk_dir):
    data = pattern((8 << 20) + 100)
    direct, cached = os.path.join(disk_dir, "direct"), os.path.join(disk_dir, "cached")
    write_in_pieces(direct, data, [3 << 20], buffer=1 << 20)
    with open(cached, "wb") as f:
        f.write(data)
    assert resident_bytes(cached) >= len(data) // 2  # the measure sees a file written through the cache
    assert resident_bytes(direct) <= mmap.PAGESIZE  # the tail only
    with open(direct, "rb") as f:
        assert f.read() == data


def test_a_filesystem_that_refuses_o_direct_gets_the_bytes_through_the_cache(ramfs):
    data = pattern((1 << 20) + 5)
    path = os.path.join(ramfs, "f")
    f = write_in_pieces(path, data, [12345], buffer=65536)
    assert not f.direct
    with open(path, "rb") as r:
        assert r.read() == data


def test_a_write_the_disk_refuses_direct_goes_on_through_the_cache(disk_dir):
    """A buffer of no block's multiple: its first direct write is refused (EINVAL), and the rest of
    the file is written through the page cache from there."""
    data = pattern(100_000)
    path = os.path.join(disk_dir, "f")
    f = write_in_pieces(path, data, [999, 1], buffer=1000)
    if filesystem_type(os.path.realpath(disk_dir)) in ("ext4", "xfs"):  # btrfs takes it through its cache itself
        assert not f.direct
    with open(path, "rb") as r:
        assert r.read() == data


def test_direct_writes_only_on_a_local_disks_filesystem(disk_dir, tmpfs, tmp_path):
    assert direct_allowed(disk_dir)
    shm = tmp_path / "shm"
    tmpfs(shm, "1m")
    assert not direct_allowed(str(shm))
    assert not direct_allowed(str(shm / "below" / "not-made-yet"))  # the deepest mount above it


def test_a_mount_hidden_by_one_over_it_does_not_count(tmp_path, tmpfs):
    """A ramfs at a/b, then a tmpfs mounted over a: a/b/x is on the tmpfs, whatever mountinfo still lists."""
    a = tmp_path / "a"
    tmpfs(a / "b", kind="ramfs")
    tmpfs(a, "1m")
    assert filesystem_type(str(a / "b" / "x")) == "tmpfs"
    (a / "b").mkdir()
    assert filesystem_type(str(a / "b")) == "tmpfs"


def _nice_of(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _lowered_then(priority: WeightsPriority, then, times: int = 1) -> tuple[int, int]:
    """The nice value of a thread right after it lowered itself `times` times (a weight each), and
    after `then()` ran."""
    seen: list = []
    go_on, lowered = threading.Event(), threading.Event()

    def thread() -> None:
        for _ in range(times):
            priority.lower()
        seen.append(_nice_of(threading.get_native_id()))
        lowered.set()
        go_on.wait(60)
        seen.append(_nice_of(threading.get_native_id()))

    t = threading.Thread(target=thread)
    t.start()
    assert lowered.wait(60)
    then()
    go_on.set()
    t.join(60)
    return seen[0], seen[1]


def test_a_weights_thread_runs_far_below_the_unpacking_until_the_app_is_in_then_below_the_app():
    if not undoable():
        pytest.skip("a thread of this process cannot go back to a lower nice value (no CAP_SYS_NICE)")
    if _nice_of(0) >= WEIGHTS_NICE:
        pytest.skip("the suite itself runs at a nice value of WEIGHTS_NICE or more")
    priority = WeightsPriority(app_in=False)
    assert _lowered_then(priority, priority.app_in) == (UNPACKING_NICE, WEIGHTS_NICE)
    twice = WeightsPriority(app_in=False)  # a thread that takes a second weight before the app is in
    assert _lowered_then(twice, twice.app_in, times=2) == (UNPACKING_NICE, WEIGHTS_NICE)
    # Lowered once the app is in: below the app at once.
    assert _lowered_then(priority, lambda: None) == (WEIGHTS_NICE, WEIGHTS_NICE)
    assert _nice_of(0) < WEIGHTS_NICE  # the other threads keep their own


def test_without_the_right_to_go_back_weights_run_at_the_nice_value_below_the_app():
    """Where a thread could not go back from UNPACKING_NICE (a container without CAP_SYS_NICE), it is
    never put there: a CPU-bound app would all but starve the weights it waits for."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("dropping CAP_SYS_NICE needs root and setpriv")
    code = ("import os, resource, threading; from snapshotter.restore.priority import WeightsPriority, undoable\n"
            "resource.setrlimit(resource.RLIMIT_NICE, (0, 0))\n"
            "p = WeightsPriority(app_in=False); seen = []\n"
            "def t():\n"
            "    p.lower(); seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))\n"
            "th = threading.Thread(target=t); th.start(); th.join()\n"
            "print(undoable(), os.getpriority(os.PRIO_PROCESS, 0), *seen)\n")
    r = subprocess.run(["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    can, own, lowered = r.stdout.split()
    assert can == "False" and int(lowered) == max(int(own), WEIGHTS_NICE)


def test_a_restore_writes_a_big_weight_past_the_page_cache(registry, base_ref, box, disk_dir, tmp_path):
    """A weight of DIRECT_MIN or more lands byte for byte, and none of it is in the page cache (the
    restore root on a local disk's filesystem); a small weight is written as before."""
    profile = tmp_path / "small-weights.yaml"
    profile.write_text(SMALL_WEIGHTS)
    data = pattern(DIRECT_MIN + 4321)
    with open(os.path.join(box, MODEL), "wb") as f:
        f.write(data)
    snap("commit", f"{registry.host}/direct:v1", "--base", base_ref, "--root", box, "--profile", str(profile),
         check=True)
    root = os.path.join(disk_dir, "root")
    snap("restore", f"{registry.host}/direct:v1", "--root", root, check=True)
    assert resident_bytes(os.path.join(root, MODEL)) <= 2 * mmap.PAGESIZE  # before it is read here
    with open(os.path.join(root, MODEL), "rb") as f:
        assert f.read() == data
