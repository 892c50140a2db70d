"""A restore that is killed, or runs out of disk, leaves no half-written file at an original path,
and a second run finishes the job: it skips the layers already applied and removes the temp files
the killed run left behind."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
import zstandard

from snapshotter import workers
from snapshotter.errors import IntegrityError, StorageError
from snapshotter.layer import inplace
from snapshotter.layer.extract import Extractor
from snapshotter.layer.extract_model import ExtractOptions
from snapshotter.layer.staging import SPLIT_SUFFIX, StagingDirs, download_split, staging_dirs
from snapshotter.restore import journal as journal_module
from snapshotter.restore import restore as restore_module
from snapshotter.restore.applier import ExtractWorker, LayerJob, apply_layer
from snapshotter.restore.restore import RestoreOptions, restore_image
from snapshotter.state import MARKER

from support.faults import FaultProxy
from support.images import TAR, part_ann, push_annotated
from support.run import SNAP, assert_one_line_error, snap
from support.tars import member, tar_bytes, tar_of_files

ZSTD = TAR + "+zstd"
MiB = 1024 * 1024
MTIME = 1_600_000_000


def layer(files: dict[str, bytes], dirs: tuple[str, ...] = ()) -> bytes:
    return tar_of_files(files, dirs, mode=0o640, mtime=MTIME)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MiB):
            h.update(chunk)
    return h.hexdigest()


def staged(root, manifest_digest: str):
    """The staging dir at the top of `root` a restore of that image downloads into (made, as an earlier run left it)."""
    root.mkdir(exist_ok=True)
    return type(root)(StagingDirs(str(root), manifest_digest).for_path(None))


def stale_temps(root) -> list[str]:
    return [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files if n.startswith(".snap-tmp-")]


# ---- killed mid-file, then resumed -----------------------------------------------------------

# `snap restore` whose extraction process holds still once it has taken PAUSE_AT bytes of one
# layer's blob: it writes a byte to the test's pipe and waits there, mid-file, until the test acts
# (no polling, no race with a restore that would finish first).
PAUSE_AT = 16 * MiB
# The big file such a restore is held inside: a third of it written, the rest still to come. (Its size
# need not make the extraction slow: the pause, not the clock, decides where it is stopped.)
HELD_FILE = 48 * MiB
_PAUSED_RESTORE = """
import os, runpy, sys, threading
from snapshotter.restore import applier

apply_layer = applier.apply_layer

def held(extractor, job, on_bytes):
    taken = 0
    def count(n):
        nonlocal taken
        taken += n
        if taken >= PAUSE_AT:
            os.write(FD, b"p")
            threading.Event().wait()
        on_bytes(n)
    return apply_layer(extractor, job, count)

applier.apply_layer = held
sys.argv = ["snap", *ARGS]
runpy.run_module("snapshotter", run_name="__main__")
"""


def start_paused_restore(ref: str, root, **popen) -> tuple[subprocess.Popen, list[int]]:
    """Start `snap restore ref --root root` and return once its extraction process holds still
    mid-layer: (the restore process, the extraction process ids)."""
    r, w = os.pipe()
    code = f"PAUSE_AT, FD, ARGS = {PAUSE_AT}, {w}, {['restore', ref, '--root', str(root)]!r}\n" + _PAUSED_RESTORE
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            pass_fds=(w,), **popen)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 120)
        held = ready and os.read(r, 1) == b"p"  # b"": every writer gone, the restore ended without pausing
    finally:
        os.close(r)
    if not held:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the restore never reached {PAUSE_AT} bytes of a layer: {err}")
    with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
        return proc, [int(c) for c in f.read().split()]


def wait_gone(pids: list[int], timeout: float = 30) -> bool:
    """Wait until every process in `pids` has exited (pidfds: no polling). True if they all have."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            pass  # gone already
    try:
        deadline = time.monotonic() + timeout
        while fds:
            ready, _, _ = select.select(fds, [], [], max(0, deadline - time.monotonic()))
            if not ready:
                return False
            for fd in ready:
                fds.remove(fd)
                os.close(fd)
        return True
    finally:
        for fd in fds:
            os.close(fd)


def test_killed_restore_leaves_no_half_file_and_resumes(registry, tmp_path, state_dir):
    old = b"old content\n" * 1000
    big = os.urandom(MiB) * (HELD_FILE // MiB)
    small = {"data/a.txt": b"first layer\n", "data/b.txt": b"also first\n"}
    ref = f"{registry.host}/killed:v1"
    # Compressed: the big file is copied out of the stream (an uncompressed layer's big files are
    # renamed into place whole, never copied: nothing to kill mid-file there).
    tars = [layer(small, dirs=("data",)), layer({"data/big.bin": big, "data/after.txt": b"after big\n"})]
    registry.push_image("killed", "v1", [zstandard.ZstdCompressor(level=1).compress(t) for t in tars],
                        layer_media_type=ZSTD, diff_ids=["sha256:" + sha(t) for t in tars])
    root = tmp_path / "root"
    (root / "data").mkdir(parents=True)
    (root / "data/big.bin").write_bytes(old)  # restoring over an older tree

    proc, children = start_paused_restore(ref, root)
    assert children, "the layers are applied in a child process"
    [temp] = stale_temps(root)
    assert os.path.getsize(temp) > 0, "held in the middle of the big file"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert wait_gone(children), "the extraction process outlived a killed restore"  # it dies with its parent
    proc.stdout.close()
    proc.stderr.close()

    # (a) The original path holds a whole file, never a part of one: the old one, killed while the new
    # one was still being written beside it.
    assert file_sha(root / "data/big.bin") == sha(old)
    assert not (root / "data/after.txt").exists()
    assert stale_temps(root), "the killed run should have left its temp file (this test checks its cleanup)"
    assert (root / "data/a.txt").read_bytes() == small["data/a.txt"]  # layer 1 was applied and recorded

    # (b) A second run skips layer 1, applies layer 2, and cleans up after the killed run.
    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["resumed"] == 1 and doc["applied"] == ["base layer 2"], doc
    assert stale_temps(root) == []
    assert not os.listdir(state_dir / "restore-journal")  # the journal is gone once the restore is complete
    # The base (this whole plain image) was not all applied by this run: no index of it is built.
    assert not list((state_dir / "base-index").glob("*"))

    # Byte for byte: contents, modes, mtimes.
    want = {**small, "data/big.bin": big, "data/after.txt": b"after big\n"}
    got = {}
    for dirpath, _, files in os.walk(root):
        for n in files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            got[os.path.relpath(p, root)] = (file_sha(p), oct(st.st_mode & 0o7777), int(st.st_mtime))
    assert got == {k: (sha(v), "0o640", MTIME) for k, v in want.items()}
    assert snap("verify", ref, "--root", str(root)).returncode == 0


def _in_place_images(registry) -> tuple[str, str, bytes]:
    """v1: a big file in a directory its layer makes (new there: written at its path, no temp, before
    any app could read it); v2: another image, without that path. (v1, v2, the big file's bytes)."""
    big = os.urandom(MiB) * (HELD_FILE // MiB)
    for tag, tar in (("v1", layer({"app/big.bin": big, "app/after.txt": b"after\n"}, dirs=("app",))),
                     ("v2", layer({"other/x.txt": b"x\n"}, dirs=("other",)))):
        registry.push_image("in-place", tag, [zstandard.ZstdCompressor(level=1).compress(tar)],
                            layer_media_type=ZSTD, diff_ids=["sha256:" + sha(tar)])
    return f"{registry.host}/in-place:v1", f"{registry.host}/in-place:v2", big


def _held_in_place(registry, root) -> tuple[str, str, bytes, subprocess.Popen, list[int]]:
    """A restore of v1 held mid-way through its big file, written at its path."""
    v1, v2, big = _in_place_images(registry)
    proc, children = start_paused_restore(v1, root)
    assert children, "the layers are applied in a child process"
    assert stale_temps(root) == [] and 0 < os.path.getsize(root / "app/big.bin") < len(big), "held mid-file, in place"
    return v1, v2, big, proc, children


def test_a_file_a_killed_restore_was_writing_in_place_is_removed_by_the_next_restore_of_any_image(
        registry, tmp_path, state_dir):
    """Killed (kill -9) mid-way through a file written at its path, a restore leaves it half-written.
    The next restore into the root removes it first, and says so, even of another image that lacks
    the path: a torn file is never left where a restore said it was done."""
    root = tmp_path / "root"
    root.mkdir()
    _, v2, _, proc, children = _held_in_place(registry, root)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert wait_gone(children)
    proc.stdout.close()
    proc.stderr.close()
    assert (root / "app/big.bin").exists()  # half-written, as the killed run left it

    r = snap("restore", v2, "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert not (root / "app/big.bin").exists()
    assert [line for line in r.stderr.splitlines() if "half-written" in line and "/app/big.bin" in line], r.stderr
    assert (root / "other/x.txt").read_bytes() == b"x\n"
    assert not os.listdir(state_dir / "restore-journal") and not os.listdir(state_dir / "restore-in-place")


def test_a_restore_that_fails_removes_the_file_it_was_writing_in_place(registry, tmp_path, state_dir):
    """The extraction process dies mid-file (as it is stopped when another layer fails): the restore
    fails, and the half-written file does not stay at its path. A rerun restores it whole."""
    root = tmp_path / "root"
    root.mkdir()
    v1, _, big, proc, children = _held_in_place(registry, root)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode not in (0, None), err
    assert not (root / "app/big.bin").exists(), err
    assert [line for line in err.splitlines() if "half-written" in line and "/app/big.bin" in line], err

    r = snap("restore", v1, "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert file_sha(root / "app/big.bin") == sha(big)
    assert (root / "app/after.txt").read_bytes() == b"after\n"


def test_the_in_place_sweep_removes_only_each_processs_unfinished_file(tmp_path):
    """Of each process, only the file its last line names, and only while it is still one being
    written (regular, one name, mode 000): not one of a layer ended, nor one finished or replaced
    since, nor another process's, nor a path never made; a torn last line is ignored."""
    log_path = str(tmp_path / "log")

    def write(log: inplace.InPlaceLog, name: str, finish: bool = True) -> str:
        path = str(tmp_path / name)
        log.writing(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0)
        os.write(fd, b"part")
        if finish:
            os.fchmod(fd, 0o644)
        os.close(fd)
        return path

    log = inplace.InPlaceLog(log_path)
    write(log, "ended", finish=False)
    log.layer_ended()
    pid = os.fork()
    if pid == 0:  # another extraction process, stopped mid-file
        try:
            write(inplace.InPlaceLog(log_path), "child", finish=False)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert inplace.sweep(log_path) == ([str(tmp_path / "child")], [])
    assert sorted(os.listdir(tmp_path)) == ["ended"]  # the log is gone too

    for name, last in (("finished", lambda p: None), ("replaced", lambda p: (os.unlink(p), open(p, "wb").close())),
                       ("linked", lambda p: os.link(p, p + "-2")), ("never-made", os.unlink)):
        log = inplace.InPlaceLog(log_path)
        path = write(log, name, finish=name == "finished")
        last(path)
        with open(log_path, "ab") as f:
            f.write(b'[1, "/etc/pass')  # a kill while appending
        assert inplace.sweep(log_path) == ([], []), name
    assert sorted(os.listdir(tmp_path)) == ["ended", "finished", "linked", "linked-2", "replaced"]


def test_a_layer_given_up_ends_its_processs_in_place_line_and_a_finished_file_has_its_mode(tmp_path):
    """A layer that fails (a hostile member after a file written in place) ends the process's line:
    the file it finished keeps its mode and stays out of any sweep (an app may later reuse its inode
    or rewrite it); only the file a kill stops mid-way is left 000."""
    blob = tmp_path / "layer.tar"
    blob.write_bytes(tar_bytes(member("app/", "dir", mode=0o755), member("app/done.py", data=b"x = 1\n", mode=0o644),
                               member("../outside", data=b"hostile")))
    root, log_path = tmp_path / "root", str(tmp_path / "log")
    root.mkdir()
    extractor = Extractor(str(root), ExtractOptions(in_place_log=log_path))
    job = LayerJob(str(blob), TAR, "sha256:" + sha(blob.read_bytes()), False, "1", False, in_place=True)
    with pytest.raises(IntegrityError):
        apply_layer(extractor, job, lambda n: None)
    rows = [json.loads(line) for line in open(log_path, "rb").read().splitlines()]
    assert rows == [[os.getpid(), str(root / "app/done.py")], [os.getpid()]]
    assert stat.S_IMODE(os.lstat(root / "app/done.py").st_mode) == 0o644
    assert inplace.sweep(log_path) == ([], []) and (root / "app/done.py").read_bytes() == b"x = 1\n"


def test_a_file_the_image_leaves_with_no_permission_bits_never_goes_in_place(tmp_path):
    """A half-written file at its path is told by its mode 000: one the image wants at 000 (or left
    so once its setuid bit is stripped) goes by a temp name, so no sweep can take it for one."""
    blob = tmp_path / "layer.tar"
    blob.write_bytes(tar_bytes(member("app/", "dir", mode=0o755), member("app/locked", data=b"x", mode=0o000),
                               member("app/setuid", data=b"y", mode=0o4000), member("app/plain", data=b"z")))
    root, log_path = tmp_path / "root", str(tmp_path / "log")
    root.mkdir()
    extractor = Extractor(str(root), ExtractOptions(in_place_log=log_path, allow_setuid=False))
    apply_layer(extractor, LayerJob(str(blob), TAR, "sha256:" + sha(blob.read_bytes()), False, "1", False,
                                    in_place=True), lambda n: None)
    rows = [json.loads(line) for line in open(log_path, "rb").read().splitlines()]
    assert rows == [[os.getpid(), str(root / "app/plain")], [os.getpid()]]
    assert [stat.S_IMODE(os.lstat(root / "app" / n).st_mode) for n in ("locked", "setuid")] == [0, 0]


def test_stale_temp_files_are_removed_when_their_directory_is_written(registry, tmp_path):
    registry.push_image("stale", "v1", [layer({"d/x.txt": b"x\n"}, dirs=("d",))], layer_media_type=TAR)
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    for name in (".snap-tmp-4242-0", ".snap-tmp-join-77", ".snap-tmp-999-model.safetensors"):
        (root / "d" / name).write_bytes(b"left by a killed run")
    (root / "d" / ".snap-tmp-notes.txt").write_text("a user's file that only looks like ours")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / ".snap-tmp-4242-0").write_bytes(b"in a directory this image does not write")
    snap("restore", f"{registry.host}/stale:v1", "--root", str(root), check=True)
    assert sorted(os.listdir(root / "d")) == [".snap-tmp-notes.txt", "x.txt"]
    assert os.listdir(root / "elsewhere") == [".snap-tmp-4242-0"]


def test_names_of_the_longest_length_restore(registry, tmp_path):
    """A name of 255 bytes (NAME_MAX) in UTF-8: its temp file must still be a valid name."""
    name = "模型" * 42 + "x" * 3  # 84 three-byte characters + 3 = 255 bytes
    assert len(name.encode()) == 255
    registry.push_image("longname", "v1", [layer({f"m/{name}": b"weights"}, dirs=("m",))], layer_media_type=TAR)
    r = snap("restore", f"{registry.host}/longname:v1", "--root", str(tmp_path / "root"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "root/m" / name).read_bytes() == b"weights"


# ---- disk full ------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path, tmpfs):
    """A 2 MiB tmpfs, unmounted afterwards."""
    return lambda name, size="2m": tmpfs(tmp_path / name, size)


def test_disk_full_on_the_restore_root(registry, small_disk):
    old = b"previous version\n" * 100
    tar = layer({"app/small.txt": b"fits\n", "app/model.bin": os.urandom(3 * MiB),
                 "app/z-after.txt": b"never reached\n"},
                dirs=("app",))
    # Compressed (so not split): its download fits beside the old file, the unpacked model.bin does not.
    registry.push_image("diskfull", "v1", [zstandard.ZstdCompressor(level=1).compress(tar)], layer_media_type=ZSTD,
                        diff_ids=["sha256:" + sha(tar)])
    root = small_disk("root", "5m")
    (root / "app").mkdir()
    (root / "app/model.bin").write_bytes(old)
    r = snap("restore", f"{registry.host}/diskfull:v1", "--root", str(root))
    assert_one_line_error(r, 7, "disk full", str(root), "/app/model.bin")
    assert stale_temps(root) == []
    assert (root / "app/model.bin").read_bytes() == old  # the old file is whole: never a partial new one
    assert (root / "app/small.txt").read_bytes() == b"fits\n"
    assert not (root / "app/z-after.txt").exists()


def test_layers_too_big_for_the_target_are_refused_before_downloading(registry, small_disk):
    """The layers download onto the target's disk (a staging dir in the root): refused there, up front."""
    registry.push_image("targetfull", "v1", [layer({"big.bin": os.urandom(3 * MiB)})], layer_media_type=TAR)
    root = small_disk("root", "1m")
    r = snap("restore", f"{registry.host}/targetfull:v1", "--root", str(root))
    assert_one_line_error(r, 7, "disk full on the restore target", str(root))
    assert list(root.iterdir()) == []  # not even the staging dir


def test_journal_write_on_a_full_disk_is_one_line(registry, small_disk, tmp_path):
    data = layer({"f.txt": b"x\n"})
    manifest_digest = registry.push_image("journalfull", "v1", [data], layer_media_type=TAR)
    state = small_disk("state", "1m")
    state.chmod(0o700)  # a fresh tmpfs is 1777: a state dir must be ours alone (state.private)
    (state / MARKER).touch()  # snap's own state dir
    (state / "restore-journal").mkdir()
    root = tmp_path / "root"
    # Downloaded and verified by an earlier run (an uncompressed layer is kept split: staging.py).
    download_split([data], str(staged(root, manifest_digest) / (sha(data) + SPLIT_SUFFIX)))
    fd = os.open(state / "restore-journal" / "filler", os.O_WRONLY | os.O_CREAT)  # in snap's own folder
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    r = snap("restore", f"{registry.host}/journalfull:v1", "--root", str(root), env={"SNAP_STATE_DIR": str(state)})
    assert_one_line_error(r, 7, "disk full", "restore journal", "SNAP_STATE_DIR")
    os.unlink(state / "restore-journal" / "filler")
    r = snap("restore", f"{registry.host}/journalfull:v1", "--root", str(root), env={"SNAP_STATE_DIR": str(state)})
    assert r.returncode == 0, r.stderr
    assert (root / "f.txt").read_bytes() == b"x\n"


def test_a_root_that_cannot_be_created_is_one_line(registry):
    registry.push_image("badroot", "v1", [layer({"f.txt": b"x\n"})], layer_media_type=TAR)
    r = snap("restore", f"{registry.host}/badroot:v1", "--root", "/proc/snap-no-such-dir/root")
    assert_one_line_error(r, 7, "cannot create the restore root", "/proc/snap-no-such-dir/root")


# ---- resuming: layers are applied in order, whatever an earlier run did ----------------------------

class Interrupted(Exception):
    """Stands for a Ctrl-C or a kill at a chosen point of an in-process restore."""


def _interrupt_apply_after(monkeypatch, n: int):
    """Stop the restore when it hands layer n + 1 of the run to the extraction process (patched on
    the parent's side: the child may be spawned, and not see a patch). Returns a function that
    undoes the patch."""
    calls = []
    apply = ExtractWorker.apply

    def interrupting(self, job, on_bytes):
        if len(calls) == n:
            raise Interrupted()
        calls.append(1)
        return apply(self, job, on_bytes)

    monkeypatch.setattr(ExtractWorker, "apply", interrupting)
    return lambda: monkeypatch.setattr(ExtractWorker, "apply", apply)


SNAP_BUNDLE = {"dev.snap.layer": "rest", "dev.snap.content": "bundle 1"}


def test_interrupted_only_snapshot_then_full_restore_applies_layers_in_order(registry, tmp_path, monkeypatch):
    """An interrupted --only-snapshot run says nothing about a full restore of the same root: the
    base layers must not be applied on top of the snapshot layer the first run applied."""
    ref = push_annotated(registry, "order-restore", [
        (layer({"f.txt": b"base\n", "base-only.txt": b"b\n"}), {}),
        (layer({"f.txt": b"snapshot\n"}), SNAP_BUNDLE),
        (layer({"g.txt": b"g\n"}), {**SNAP_BUNDLE, "dev.snap.content": "bundle 2"}),
    ], {"dev.snap.base-layers": "1"})
    root = tmp_path / "root"
    put_back = _interrupt_apply_after(monkeypatch, 1)
    with pytest.raises(Interrupted):
        restore_image(ref, str(root), RestoreOptions(only_snapshot=True, seed_stat_cache=False))
    put_back()
    assert (root / "f.txt").read_bytes() == b"snapshot\n" and not (root / "g.txt").exists()

    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert (root / "f.txt").read_bytes() == b"snapshot\n", "a base layer was applied over a snapshot layer"
    assert (root / "g.txt").read_bytes() == b"g\n" and (root / "base-only.txt").exists()
    doc = json.loads(r.stdout)
    assert doc["resumed"] == 0 and len(doc["applied"]) == 3, doc
    assert "starting over" in r.stderr


LOST = {"keep/deep.bin": os.urandom(50_000), "keep/link": None, "old.txt": None}


@pytest.mark.parametrize("lost", [None, *LOST])
def test_a_resumed_restore_applies_again_from_the_first_layer_whose_files_are_gone(registry, tmp_path, state_dir,
                                                                                   monkeypatch,
                                                                                   lost):
    """Files an applied layer wrote, deleted between an interrupted run and the next: that layer and
    all after it are applied again, and the root ends byte for byte as the image says. Files a
    later layer replaced (another size) or whited out do not count as lost."""
    first = tar_bytes(member("keep/", "dir"), member("keep/deep.bin", data=LOST["keep/deep.bin"]),
                      member("keep/link", "symlink", linkname="deep.bin"), member("old.txt", data=b"old\n"),
                      member("gone.txt", data=b"g\n"), member("was-file", data=b"f\n"))
    second = tar_bytes(member("old.txt", data=b"newer, longer\n"), member(".wh.gone.txt"),
                       member("was-file/", "dir"), member("was-file/x", data=b"x\n"))
    third = layer({"c.txt": b"c\n"})
    registry.push_image("lost", "v1", [first, second, third], layer_media_type=TAR)
    ref, root = f"{registry.host}/lost:v1", tmp_path / "root"
    put_back = _interrupt_apply_after(monkeypatch, 2)
    with pytest.raises(Interrupted):
        restore_image(ref, str(root), RestoreOptions(seed_stat_cache=False))
    put_back()
    if lost:
        os.unlink(root / lost)
    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    if lost is None:
        assert doc["resumed"] == 2 and doc["applied"] == ["base layer 3"], r.stderr
    else:
        at = 2 if lost == "old.txt" else 1
        assert doc["resumed"] == at - 1 and len(doc["applied"]) == 4 - at, doc
        assert f"applying layers {at} to 3 again" in r.stderr and repr(lost)[1:-1] in r.stderr
    assert (root / "keep/deep.bin").read_bytes() == LOST["keep/deep.bin"]
    assert os.readlink(root / "keep/link") == "deep.bin"
    assert (root / "old.txt").read_bytes() == b"newer, longer\n" and not (root / "gone.txt").exists()
    assert (root / "was-file/x").read_bytes() == b"x\n" and (root / "c.txt").read_bytes() == b"c\n"


def test_a_layer_listed_twice_is_downloaded_once_and_applied_twice(registry, tmp_path, state_dir):
    one, two = layer({"f.txt": b"one\n"}), layer({"f.txt": b"two\n", "g.txt": b"g\n"})
    registry.push_image("twice", "v1", [one, two, one, two, one], layer_media_type=TAR)
    root = tmp_path / "root"
    r = snap("restore", f"{registry.host}/twice:v1", "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["applied"]) == 5
    assert (root / "f.txt").read_bytes() == b"one\n" and (root / "g.txt").read_bytes() == b"g\n"
    assert staging_dirs(root) == []  # each blob removed after its last use, then the staging dir


def test_reapplying_a_hardlink_to_a_lower_layer_file(registry, tmp_path):
    """A layer applied again (listed twice) over the tree it made: the hardlink's path already links
    to its target, so the rename of the temp link is a no-op that must not leave the temp behind."""
    relink = tar_bytes(member("a/y", "hardlink", linkname="a/x"), member("a/z", data=b"after the link\n"))
    ref = push_annotated(registry, "relink", [
        (tar_bytes(member("a/", "dir"), member("a/x", data=b"lower\n")), {}), (relink, {}), (relink, {}),
    ])
    root = tmp_path / "root"
    r = snap("restore", ref, "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert stale_temps(root) == []
    assert os.lstat(root / "a/y").st_ino == os.lstat(root / "a/x").st_ino
    assert (root / "a/z").read_bytes() == b"after the link\n"


def _two_parts_interrupted_at(registry, repo: str, root, monkeypatch, step: str) -> str:
    """A snapshot of /m/big cut into two part layers, restored into `root` by a run stopped when it
    reached restore.py's `step` (every layer applied by then); its reference."""
    part = "m/big.snap-part-{:04d}-of-0002"
    ref = push_annotated(registry, repo, [
        (layer({}, dirs=("m",)), {}),
        (layer({part.format(1): b"first\n"}), part_ann("m/big", "1/2")),
        (layer({part.format(2): b"second\n"}), part_ann("m/big", "2/2")),
    ])

    def killed(*args):
        raise Interrupted()

    with monkeypatch.context() as m:
        m.setattr(restore_module, step, killed)
        with pytest.raises(Interrupted):
            restore_image(ref, str(root), RestoreOptions(seed_stat_cache=False))
    return ref


def test_join_resumes_with_no_layer_left_and_a_stale_join_temp(registry, tmp_path, monkeypatch):
    """A run killed while joining parts: every layer is applied, a join temp file is left."""
    root = tmp_path / "root"
    ref = _two_parts_interrupted_at(registry, "joinresume", root, monkeypatch, "join_parts")
    (root / "m" / ".snap-tmp-join-4242").write_bytes(b"first\n")  # what the killed join had written
    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed"] == 3
    assert os.listdir(root / "m") == ["big"]
    assert (root / "m/big").read_bytes() == b"first\nsecond\n"


def test_a_resumed_restore_links_again_a_hardlink_name_replaced_by_a_separate_file(registry, tmp_path,
                                                                                   monkeypatch):
    """Interrupted with the hardlink's layer applied, then its name replaced by a copy (same size): the
    rerun does not take the copy for the link (the journal has its target) but applies that layer again."""
    registry.push_image("relinked", "v1", [
        tar_bytes(member("a/", "dir"), member("a/x", data=b"shared\n")),
        tar_bytes(member("a/y", "hardlink", linkname="a/x")), layer({"c.txt": b"c\n"}),
    ], layer_media_type=TAR)
    ref, root = f"{registry.host}/relinked:v1", tmp_path / "root"
    put_back = _interrupt_apply_after(monkeypatch, 2)
    with pytest.raises(Interrupted):
        restore_image(ref, str(root), RestoreOptions(seed_stat_cache=False))
    put_back()
    os.unlink(root / "a/y")
    (root / "a/y").write_bytes(b"shared\n")
    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed"] == 1 and "applying layers 2 to 3 again" in r.stderr, r.stderr
    assert os.lstat(root / "a/y").st_ino == os.lstat(root / "a/x").st_ino
    assert (root / "c.txt").read_bytes() == b"c\n"


def test_a_resumed_restore_joins_again_a_joined_file_cut_short(registry, tmp_path, monkeypatch):
    """Killed after the journal says /m/big is joined (at _finish), then /m/big cut short: the rerun
    does not take it as whole (the journal has its size) but applies its part layers again and joins."""
    root = tmp_path / "root"
    ref = _two_parts_interrupted_at(registry, "joinshort", root, monkeypatch, "_finish")
    assert (root / "m/big").read_bytes() == b"first\nsecond\n"
    os.truncate(root / "m/big", 3)
    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed"] == 1, r.stderr  # back to the first part layer
    assert os.listdir(root / "m") == ["big"]
    assert (root / "m/big").read_bytes() == b"first\nsecond\n"


# ---- mounted volumes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["file", "symlink", "whiteout", "opaque", "parent-replaced", "parent-whited-out"])
def test_a_layer_never_empties_a_mounted_volume(registry, tmp_path, tmpfs, request, how):
    root = tmp_path / "root"
    vol = root / "workspace" if not how.startswith("parent") else root / "data" / "vol"
    tmpfs(vol)
    (vol / "work.txt").write_text("precious\n")
    members = {
        "file": [member("workspace", data=b"a file now\n")],
        "symlink": [member("workspace", "symlink", linkname="elsewhere")],
        "whiteout": [member(".wh.workspace")],
        "opaque": [member(".wh..wh..opq"), member("new.txt", data=b"new\n")],
        "parent-replaced": [member("data", data=b"a file now\n")],
        "parent-whited-out": [member(".wh.data")],
    }[how]
    repo = "mounted-" + how
    registry.push_image(repo, "v1", [tar_bytes(*members)], layer_media_type=TAR)
    r = snap("restore", f"{registry.host}/{repo}:v1", "--root", str(root))
    assert (vol / "work.txt").read_text() == "precious\n", "the mounted volume was emptied"
    assert_one_line_error(r, 7, "mount point", str(vol))


# ---- uncompressed layers: big files renamed into place, written once ----------------------------

def _wchar() -> int:
    """Bytes this process passed to write() so far (all its threads)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def test_big_files_of_an_uncompressed_layer_are_written_once(registry, tmp_path, state_dir):
    big = os.urandom(24 * MiB)
    files = {"models/w.safetensors": big, "models/config.json": b"{}\n"}
    registry.push_image("once", "v1", [layer(files, dirs=("models",))], layer_media_type=TAR)
    before = _wchar()
    restore_image(f"{registry.host}/once:v1", str(tmp_path / "root"))
    written = _wchar() - before
    # Downloaded into a file of its own, then renamed into place: once, not downloaded then copied.
    assert 24 * MiB <= written < 30 * MiB, written / MiB
    for name, data in files.items():
        assert (tmp_path / "root" / name).read_bytes() == data
        assert oct(os.lstat(tmp_path / "root" / name).st_mode & 0o7777) == "0o640"
    assert staging_dirs(tmp_path / "root") == []  # the split layer is gone once applied


def test_a_weight_for_a_volume_mounted_in_the_root_is_staged_on_that_volume(registry, tmp_path, tmpfs):
    """A small root (a container disk) with a big volume mounted in it: a weight bound for the
    volume downloads onto the volume (its layer says where it lands) and is renamed there."""
    big = os.urandom(5 * MiB)
    tar = layer({"vol/models/w.bin": big}, dirs=("vol", "vol/models"))
    ref = push_annotated(registry, "volume",
                         [(tar, {"dev.snap.layer": "models", "dev.snap.content": "vol/models/w.bin"})])
    root = tmpfs(tmp_path / "root", "2m")  # cannot hold the weight
    vol = tmpfs(root / "vol", "16m")
    r = snap("restore", ref, "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert (vol / "models/w.bin").read_bytes() == big
    assert stale_temps(root) == []
    assert staging_dirs(root) == []


def test_a_file_landing_on_another_filesystem_than_its_staging_dir_is_copied(registry, tmp_path, tmpfs):
    big = os.urandom(5 * MiB)
    registry.push_image("exdev", "v1", [layer({"vol/w.bin": big}, dirs=("vol",))], layer_media_type=TAR)
    vol = tmpfs(tmp_path / "root/vol", "64m")  # no annotation says where it lands: staged at the root, EXDEV
    r = snap("restore", f"{registry.host}/exdev:v1", "--root", str(tmp_path / "root"))
    assert r.returncode == 0, r.stderr
    assert (vol / "w.bin").read_bytes() == big
    assert stale_temps(tmp_path / "root") == []
    assert staging_dirs(tmp_path / "root") == []


def test_a_split_layer_left_incomplete_is_downloaded_again(registry, tmp_path, state_dir):
    """A run killed after it renamed some of a split layer's files into place leaves the split
    incomplete: the next run must not trust it."""
    big, other = os.urandom(3 * MiB), os.urandom(2 * MiB)
    data = layer({"w.bin": big, "x.bin": other})
    manifest_digest = registry.push_image("partial", "v1", [data], layer_media_type=TAR)
    split = staged(tmp_path / "root", manifest_digest) / (sha(data) + SPLIT_SUFFIX)
    download_split([data], str(split))
    contents = sorted(n for n in os.listdir(split) if n.startswith("c"))
    assert len(contents) == 2  # both files kept apart from the tar
    os.unlink(split / contents[0])  # "renamed into place" by the killed run
    r = snap("restore", f"{registry.host}/partial:v1", "--root", str(tmp_path / "root"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "root/w.bin").read_bytes() == big
    assert (tmp_path / "root/x.bin").read_bytes() == other
    assert staging_dirs(tmp_path / "root") == []


def test_a_split_layer_of_another_format_is_downloaded_again(registry, tmp_path, state_dir):
    """A split layer left by a snap whose segments.json is laid out otherwise is not read: the
    layer is downloaded again."""
    big = os.urandom(2 * MiB)
    data = layer({"w.bin": big})
    manifest_digest = registry.push_image("splitfmt", "v1", [data], layer_media_type=TAR)
    split = staged(tmp_path / "root", manifest_digest) / (sha(data) + SPLIT_SUFFIX)
    download_split([data], str(split))
    doc = json.loads((split / "segments.json").read_text())
    # The next version, say, names each segment's fields.
    segments = [dict(zip(("kind", "name", "length") if seg[0] == "c" else ("kind", "length"), seg))
                for seg in doc["segments"]]
    (split / "segments.json").write_text(json.dumps({"version": doc["version"] + 1, "segments": segments}))
    r = snap("restore", f"{registry.host}/splitfmt:v1", "--root", str(tmp_path / "root"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "root/w.bin").read_bytes() == big
    assert staging_dirs(tmp_path / "root") == []


def test_a_journal_of_another_version_is_not_resumed_from(registry, tmp_path, state_dir):
    """A journal another version of snap left (here one saying every layer is applied) is not
    read as this version's: the restore starts over and applies every layer."""
    one, two = layer({"a.txt": b"a\n"}), layer({"b.txt": b"b\n"})
    manifest_digest = registry.push_image("journalfmt", "v1", [one, two], layer_media_type=TAR)
    root = tmp_path / "root"
    root_key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:32]
    journal = state_dir / "restore-journal" / (root_key + ".json")
    journal.parent.mkdir(parents=True)
    (state_dir / MARKER).touch()  # snap's own state dir
    layers = [d["digest"] for d in registry.manifest("journalfmt", "v1")["layers"]]
    journal.write_text(json.dumps({"version": journal_module.VERSION + 1, "manifest": manifest_digest,
                                   "layers": layers, "applied": 2, "joined": []}))
    r = snap("restore", f"{registry.host}/journalfmt:v1", "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed"] == 0 and "starting over" in r.stderr
    assert (root / "a.txt").read_bytes() == b"a\n" and (root / "b.txt").read_bytes() == b"b\n"


def test_a_restore_resumed_with_other_options_starts_over(registry, tmp_path, state_dir, monkeypatch):
    """A run with a profile that never writes /etc/app.conf and with --allow-setuid, interrupted after
    its first layer, then run again with neither: the layer it applied does not count as applied
    (it followed other rules), so the root ends as a restore with this run's options makes it."""
    first = tar_bytes(member("etc/", "dir"), member("etc/app.conf", data=b"conf\n"),
                      member("bin/", "dir"), member("bin/tool", data=b"tool\n", mode=0o4755))
    registry.push_image("rules", "v1", [first, layer({"b.txt": b"b\n"}), layer({"c.txt": b"c\n"})],
                        layer_media_type=TAR)
    ref, root = f"{registry.host}/rules:v1", tmp_path / "root"
    profile = tmp_path / "narrow.yaml"
    profile.write_text("name: narrow\nlayers:\n  - name: rest\nexclude:\n  - /etc/app.conf\n")
    put_back = _interrupt_apply_after(monkeypatch, 1)
    with pytest.raises(Interrupted):
        restore_image(ref, str(root), RestoreOptions(seed_stat_cache=False, profile=str(profile),
                                                     extract=ExtractOptions(allow_setuid=True)))
    put_back()
    assert not (root / "etc/app.conf").exists() and (root / "bin/tool").exists()
    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["resumed"] == 0 and "with other options" in r.stderr, r.stderr
    assert (root / "etc/app.conf").read_bytes() == b"conf\n"
    assert stat.S_IMODE(os.lstat(root / "bin/tool").st_mode) == 0o755  # without --allow-setuid: no setuid bit
    assert (root / "c.txt").read_bytes() == b"c\n"


# ---- the extraction process -------------------------------------------------------------------

def test_a_caller_running_threads_gets_a_spawned_extraction_process(registry, tmp_path, state_dir, monkeypatch):
    """A fork copies only the thread that forks: a library caller with threads of its own gets a
    spawned extraction process instead. Same result, and its errors come back whole."""
    files = {"app/a.txt": b"a\n" * 1000, "app/b.bin": os.urandom(2 * MiB)}
    tars = [layer(files, dirs=("app",))]
    registry.push_image("spawned", "v1", [zstandard.ZstdCompressor().compress(t) for t in tars],
                        layer_media_type=ZSTD, diff_ids=["sha256:" + sha(t) for t in tars])
    registry.push_image("spawned", "bad", [zstandard.ZstdCompressor().compress(t) for t in tars],
                        layer_media_type=ZSTD, diff_ids=["sha256:" + "0" * 64])
    methods = []
    start = workers.Worker.__init__

    def noting(worker, *args, **kwargs):
        start(worker, *args, **kwargs)
        methods.append("fork" if worker.forked else "spawn")

    monkeypatch.setattr(workers.Worker, "__init__", noting)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        restore_image(f"{registry.host}/spawned:v1", str(tmp_path / "root"), RestoreOptions(seed_stat_cache=False))
        with pytest.raises(IntegrityError, match="does not match its diff_id"):
            restore_image(f"{registry.host}/spawned:bad", str(tmp_path / "other"),
                          RestoreOptions(seed_stat_cache=False))
    finally:
        stop.set()
        other.join()
    assert methods == ["spawn", "spawn"]
    for name, data in files.items():
        assert (tmp_path / "root" / name).read_bytes() == data
    # An error crosses the process boundary with its hint (the exit code comes from its class).
    back = pickle.loads(pickle.dumps(StorageError("disk full in /x", "free space")))
    assert type(back) is StorageError and str(back) == "disk full in /x (free space)"


def _restore_while_writing(registry, repo: str, root, act) -> tuple[subprocess.Popen, list[int], str, bytes]:
    """Restore a one-layer image holding a HELD_FILE-sized file; once its extraction process is inside
    that file, call act(restore process, extraction pids). Returns (process, extraction pids,
    stderr, the big file's bytes)."""
    big = os.urandom(MiB) * (HELD_FILE // MiB)
    tars = [layer({"data/big.bin": big, "data/after.txt": b"after\n"}, dirs=("data",))]
    registry.push_image(repo, "v1", [zstandard.ZstdCompressor(level=1).compress(t) for t in tars],
                        layer_media_type=ZSTD, diff_ids=["sha256:" + sha(t) for t in tars])
    proc, children = start_paused_restore(f"{registry.host}/{repo}:v1", root, start_new_session=True)
    # Inside the big file: a layer before the app's start writes a new file at its path (in place).
    partial = root / "data/big.bin"
    try:
        assert children and partial.exists() and partial.stat().st_size < len(big), "held inside the big file"
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)  # not left paused
        proc.communicate()
        raise
    act(proc, children)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert not (root / "data/after.txt").exists()
    return proc, children, err, big


@pytest.mark.parametrize("weight_first", [False, True], ids=["weights-last", "weight-before-the-app"])
def test_a_weight_is_never_half_written_at_its_path_but_the_apps_files_are_written_in_place(registry, tmp_path,
                                                                                                state_dir,
                                                                                                weight_first):
    """Until the app's layers are applied nothing reads the root (`--then` starts the app after
    them): their new files are written at their paths. A weight's layer comes after, with the app
    running: paused inside its file (compressed, so written by the extractor), the path does not
    exist yet, only a temp; killed there, the next run lands it whole. So too for a weight that an
    image (not snap's) puts before one of the app's layers."""
    big = os.urandom(MiB) * (HELD_FILE // MiB)
    tars = [layer({"app/venv/mod.py": b"x = 1\n"}, dirs=("app", "app/venv")),
            layer({"app/models/w.bin": big}, dirs=("app/models",))]
    blobs = [zstandard.ZstdCompressor(level=1).compress(t) for t in tars]
    descs = [{"mediaType": ZSTD, "digest": registry.push_blob("halfweight", b), "size": len(b)} for b in blobs]
    descs[1]["annotations"] = {"dev.snap.layer": "models", "dev.snap.content": "app/models/w.bin"}
    if weight_first:
        tars, descs = tars[::-1], descs[::-1]
    cfg = json.dumps({"architecture": "amd64", "os": "linux",
                      "rootfs": {"type": "layers", "diff_ids": ["sha256:" + sha(t) for t in tars]},
                      "history": [{"created_by": "one"}, {"created_by": "two"}]}).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json", "layers": descs,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": registry.push_blob("halfweight", cfg),
                           "size": len(cfg)}}
    registry.session().put(f"{registry.url}/v2/halfweight/manifests/v1", data=json.dumps(manifest).encode(),
                           headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"}).raise_for_status()
    root = tmp_path / "root"
    proc, children = start_paused_restore(f"{registry.host}/halfweight:v1", root, start_new_session=True)
    try:
        assert weight_first or (root / "app/venv/mod.py").read_bytes() == b"x = 1\n"
        assert not (root / "app/models/w.bin").exists() and len(stale_temps(root / "app/models")) == 1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    r = snap("restore", f"{registry.host}/halfweight:v1", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert file_sha(root / "app/models/w.bin") == sha(big) and stale_temps(root) == []


def test_a_name_that_turns_out_to_be_there_is_replaced_not_lost_when_writing_in_place(tmp_path):
    """Written in place, a file new in a directory the layer made is expected absent. Where it is
    there after all (a directory that folds case holds it under another case, as ext4 +F or vfat
    do; here a file made just before the write), it is replaced by a rename like any existing
    file: the restore neither fails nor removes what it did not write."""
    from snapshotter.layer.extract import Extractor
    root = tmp_path / "root"
    made = []

    def twin_appears(offset, size):
        if not made:
            (root / "d/f").write_bytes(b"the twin\n")
            made.append(True)
        return None  # not staged: the data comes from the stream

    Extractor(str(root)).apply(io.BytesIO(layer({"d/f": b"layer\n", "d/g": b"g\n"}, dirs=("d",))), take=twin_appears,
                               in_place=True)
    assert made and (root / "d/f").read_bytes() == b"layer\n" and (root / "d/g").read_bytes() == b"g\n"
    assert stale_temps(root) == []


def test_an_extraction_process_that_dies_is_a_one_line_error(registry, tmp_path, state_dir):
    root = tmp_path / "root"
    kill = lambda proc, children: [os.kill(c, signal.SIGKILL) for c in children]  # noqa: E731 - as the OOM killer would
    proc, _, err, big = _restore_while_writing(registry, "childdies", root, kill)
    assert proc.returncode == 1, (proc.returncode, err)
    lines = [line for line in err.splitlines() if line.startswith("snap: error:")]
    assert len(lines) == 1 and "the extraction process died" in lines[0] and "base layer 1" in lines[0], err
    # The next run resumes (nothing was applied) and finishes.
    r = snap("restore", f"{registry.host}/childdies:v1", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert file_sha(root / "data/big.bin") == sha(big) and stale_temps(root) == []


def test_ctrl_c_stops_the_extraction_process_too(registry, tmp_path, state_dir):
    """Ctrl-C reaches the whole process group: the restore stops (130), and so does its child."""
    ctrl_c = lambda proc, children: os.killpg(proc.pid, signal.SIGINT)  # noqa: E731 - what a terminal does
    proc, children, err, _ = _restore_while_writing(registry, "ctrlc", tmp_path / "root", ctrl_c)
    assert proc.returncode == 130, (proc.returncode, err)
    assert wait_gone(children), "the extraction process outlived the interrupted restore"


@pytest.mark.parametrize("media_type", [TAR, ZSTD])
def test_ctrl_c_during_a_download(registry, tmp_path, state_dir, media_type):
    """Ctrl-C while a big layer is on a slow link: the restore stops (130) without waiting for the
    rest of it, nothing of that layer reaches the root or stays in the state dir, and the next
    run finishes the job."""
    big = os.urandom(32 * MiB)
    tars = [layer({"data/a.txt": b"first\n"}, dirs=("data",)), layer({"data/big.bin": big})]
    blobs = tars if media_type == TAR else [zstandard.ZstdCompressor(level=1).compress(t) for t in tars]
    registry.push_image("ctrlcdl", "v1", blobs, layer_media_type=media_type,
                        diff_ids=["sha256:" + sha(t) for t in tars])
    root = tmp_path / "root"
    proxy = FaultProxy(registry.host).start()
    proxy.throttle = 4 * MiB  # bytes per second: the big layer takes 8 s on this link
    try:
        proc = subprocess.Popen([*SNAP, "restore", f"{proxy.host}/ctrlcdl:v1", "--root", str(root)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert proxy.midway.wait(120), "the big layer never got on the wire"  # its first MiB passed
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does
        _, err = proc.communicate(timeout=120)
    finally:
        proxy.stop()
    assert proc.returncode == 130, (proc.returncode, err)
    assert "Traceback" not in err, err
    assert proxy.blob_bytes_sent < sum(map(len, blobs)), "the restore waited for the whole download before stopping"
    assert not (root / "data/big.bin").exists() and stale_temps(root) == []
    # not even a .part
    assert not [n for d in staging_dirs(root) for n in os.listdir(root / d) if n.startswith(sha(blobs[1]))]
    r = snap("restore", f"{registry.host}/ctrlcdl:v1", "--root", str(root))
    assert r.returncode == 0, r.stderr
    assert (root / "data/big.bin").read_bytes() == big and (root / "data/a.txt").read_bytes() == b"first\n"


def test_a_blob_store_that_stops_answering_is_named_as_such(registry, tmp_path):
    """A registry may send a blob's GET elsewhere (its object storage); when that host refuses
    connections, the one line names it (not the registry) and says nothing of what was pushed: a
    restore pushes nothing."""
    tar = tar_of_files({"data/a.txt": b"a\n"}, dirs=("data",))
    registry.push_image("blob-store-gone", "v1", [tar], layer_media_type=TAR, diff_ids=["sha256:" + sha(tar)])
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        gone = s.getsockname()[1]
    proxy = FaultProxy(registry.host).start()
    proxy.answer = lambda method, path: ((307, {"Location": f"http://127.0.0.1:{gone}/bucket/blob"})
                                         if method == "GET" and "/blobs/" in path else None)
    try:
        r = snap("restore", f"{proxy.host}/blob-store-gone:v1", "--root", str(tmp_path / "root"),
                 env={"SNAP_RETRY_SCALE": "0"})
    finally:
        proxy.stop()
    assert_one_line_error(r, 3, f"127.0.0.1:{gone}", f"registry {proxy.host}")
    assert "pushed" not in r.stderr, r.stderr
