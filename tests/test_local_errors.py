"""Failures of the local machine (state dir, profile file, restore target) are one line, not a traceback."""

import errno
import hashlib
import os
import shutil
import subprocess
import threading

import pytest

from snapshotter import CommitOptions, commit_box, restore_image
from snapshotter.commit import push as push_module
from snapshotter.commit import sender as sender_module
from snapshotter.commit.model import CommitHooks
from snapshotter.errors import quoted_path
from snapshotter.progress import Stopped

from support.images import push
from support.run import SNAP, TIMEOUT, assert_clean, assert_one_line_error, snap
from support.tars import member, tar_bytes
from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree


def test_state_dir_that_cannot_be_created(registry, base_ref, box, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    r = snap("commit", f"{registry.host}/x:v1", "--base", base_ref, "--root", box,
             env={"SNAP_STATE_DIR": str(blocker / "state")})
    assert_one_line_error(r, 7, str(blocker))


def test_profile_file_that_is_not_text(registry, base_ref, box, tmp_path):
    prof = tmp_path / "binary.yaml"
    prof.write_bytes(b"\xff\xfe\x00layers: []\n")
    r = snap("commit", f"{registry.host}/x:v1", "--base", base_ref, "--root", box, "--profile", str(prof))
    assert_one_line_error(r, 2, "profile")


def test_restore_root_that_cannot_be_created(registry, base_ref, tmp_path):
    r = snap("restore", base_ref, "--root", "/proc/snap-cannot-be-here")
    assert_one_line_error(r, 7, "cannot create the restore root", "'/proc/snap-cannot-be-here'")


# ---- an I/O error names the file (issue 33) -------------------------------------------------------

BAD = "opt/app/bad\x1b[2J.bin"  # whose reads fail with EIO: open and stat work, its data does not
BAD_KEY = "opt/app/server\n.key"  # the same, and a private-key candidate: the scan reads its head


@pytest.fixture
def eio_disk(tmp_path):
    """A real ext4 (a loop device) holding BAD and BAD_KEY, whose extent index blocks are zeroed:
    each opens and stats as a 40 KiB file, and every read of its data fails with EIO. Yields (its
    mount point, the tree's files before, as snapshot_of_tree)."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("mkfs.ext4", "debugfs", "mount")):
        pytest.skip("needs root, mkfs.ext4 and debugfs")
    img, disk = tmp_path / "disk.img", tmp_path / "disk"
    with open(img, "wb") as f:
        f.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "1024", str(img)], check=True, capture_output=True)
    disk.mkdir()
    mount = ["mount", "-o", "loop,errors=continue", str(img), str(disk)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a loop device here")
    try:
        write_tree(str(disk), {"opt/app/good.txt": "good\n", "etc/app.conf": "threads = 8\n"})
        # Written a block at a time beside another file: more extents than an inode holds, so the
        # file's extents live in a block of their own.
        fds = [os.open(disk / p, os.O_WRONLY | os.O_CREAT, 0o644) for p in (BAD, BAD_KEY, "opt/app/other.bin")]
        for _ in range(40):
            for fd, byte in zip(fds, b"AKB"):
                os.write(fd, bytes([byte]) * 1024)
                os.fsync(fd)
        for fd in fds:
            os.close(fd)
        before = snapshot_of_tree(str(disk))
        subprocess.run(["umount", str(disk)], check=True)
        for bad in (BAD, BAD_KEY):
            stat = subprocess.run(["debugfs", "-R", f"stat /{bad}", str(img)], capture_output=True, check=True).stdout
            block = int(stat.split(b"(ETB0):")[1].split(b",")[0])
            with open(img, "r+b") as f:
                f.seek(block * 1024)
                f.write(bytes(1024))
        subprocess.run(mount, check=True)
        for bad in (BAD, BAD_KEY):
            with open(disk / bad, "rb") as f, pytest.raises(OSError) as e:
                f.read()
            assert e.value.errno == errno.EIO
        yield str(disk), before
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_file_the_disk_cannot_read_is_held_back_by_name_and_the_rest_committed(registry, eio_disk, tmp_path):
    disk, before = eio_disk
    r = snap("commit", f"{registry.host}/eio:v1", "--base", "scratch", "--root", disk)
    assert r.returncode == 0, r.stderr
    assert_clean(r)
    (line,) = [line for line in r.stderr.splitlines() if "bad" in line]
    assert line.startswith(f"held back: {quoted_path(BAD)} (could not be read: Input/output error)"), line
    (line,) = [line for line in r.stderr.splitlines() if "server" in line]  # its head, read by the scan
    assert "may not read" in line and quoted_path(BAD_KEY) in line, line
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/eio:v1", "--root", str(out), check=True)
    got = snapshot_of_tree(str(out))
    assert BAD not in got and BAD_KEY not in got and {p: got[p] for p in ("opt/app/good.txt", "opt/app/other.bin")} == \
        {p: before[p] for p in ("opt/app/good.txt", "opt/app/other.bin")}


def test_verify_names_a_file_the_disk_cannot_read_and_compares_the_rest(registry, request, eio_disk):
    """One line for the file the disk cannot read (a difference of its own); the rest compared."""
    disk, _ = eio_disk
    data = {BAD: b"A" * 40960, "opt/app/other.bin": b"C" * 40960}
    ref = push(registry, request, tar_bytes(member("opt/", "dir"), member("opt/app/", "dir"),
                                            *(member(p, data=d, mode=0o644) for p, d in data.items())))
    r = snap("verify", ref, "--root", disk)
    assert_clean(r)
    assert r.returncode == 9, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"{quoted_path(BAD)}: content differs: unreadable (Input/output error), "
                                     f"expected sha256:{hashlib.sha256(data[BAD]).hexdigest()[:12]}",
                                     "/opt/app/other.bin: content differs: "
                                     f"sha256:{hashlib.sha256(b'B' * 40960).hexdigest()[:12]}, "
                                     f"expected sha256:{hashlib.sha256(data['opt/app/other.bin']).hexdigest()[:12]}"]


def test_a_directory_snap_may_not_read_is_named_quoted_in_the_error(registry, tmp_path):
    """Root without the capabilities that let it read anything: verify meets a directory it may not
    enter; the one error line names the path, quoted and escaped."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop root's capabilities")
    root = tmp_path / "root"
    locked = "opt/locked\x1b[2J"
    write_tree(str(root), {f"{locked}/f.txt": "hello\n"})
    ref = f"{registry.host}/locked-dir:v1"
    snap("commit", ref, "--base", "scratch", "--root", str(root), check=True)
    os.chmod(root / locked, 0)
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search",
           *SNAP, "verify", ref, "--root", str(root)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert_clean(r)
    assert_one_line_error(r, 7, repr(str(root / locked / "f.txt")), "Permission denied")


def test_a_full_state_dir_disk_costs_the_memos_not_the_commit(registry, base_ref, box, full_state_disk, tmp_path):
    """A model download filled the disk the state dir lives on: the memos and caches a commit keeps
    there are skipped (they only save reading), a layer there is no room to build is compressed as
    it is sent (measured first), and the note of what this box made takes the reserve kept for it:
    the snapshots hold the changes made while the disk was full, and the tag names the last."""
    state, fill = full_state_disk
    env, ref = {"SNAP_STATE_DIR": str(state)}, f"{registry.host}/fullstate:v1"
    snap("commit", ref, "--base", base_ref, "--root", box, env=env, check=True)
    write_tree(box, {"opt/app/custom_nodes/NodeA/nodes.py": "class A: made = 'while the disk was full'\n",
                     "opt/app/custom_nodes/NodeC/weights.bin": os.urandom(6 << 20)})  # more than the disk holds
    fill()
    r = snap("commit", ref, "--base", base_ref, "--root", box, env=env)
    assert r.returncode == 0, r.stderr
    assert_clean(r)
    assert f"no room to build it in {str(state / 'layers')!r}" in r.stderr
    # What was skipped is said with what to do: free space there (a new state dir would not know
    # what this box made, and its next commit would be refused from the tag).
    assert "not kept in the state dir" in r.stderr and "free space there" in r.stderr
    assert "SNAP_STATE_DIR" not in r.stderr
    # The note that this box made that snapshot took the state dir's reserve: the next commit, the
    # disk still full, moves the tag on.
    assert "next commit is refused" not in r.stderr
    write_tree(box, {"opt/app/custom_nodes/NodeA/nodes.py": "class A: made = 'still full'\n"})
    r = snap("commit", ref, "--base", base_ref, "--root", box, env=env)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), env={"SNAP_STATE_DIR": str(tmp_path / "elsewhere")}, check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_layers_packed_apart_with_a_full_state_disk_are_sent(registry, base_ref, box, full_state_disk, tmp_path,
                                                            monkeypatch):
    """The same with the layers packed in packer processes (side by side): the disk-full error
    comes back from the process as such, and each layer is measured and sent by the commit."""
    state, fill = full_state_disk
    monkeypatch.setenv("SNAP_STATE_DIR", str(state))
    monkeypatch.setattr(push_module, "PACK_APART_MIN", 0)  # packers whatever the layers' size
    ref = f"{registry.host}/fullstate-apart"
    commit_box(f"{ref}:v1", base_ref, CommitOptions(root=box, jobs=2))
    write_tree(box, {"opt/app/custom_nodes/NodeC/weights.bin": os.urandom(6 << 20),
                     "opt/app/venv/lib/python3.11/site-packages/newpkg/data.bin": os.urandom(6 << 20)})
    fill()
    result = commit_box(f"{ref}:v2", base_ref, CommitOptions(root=box, jobs=2))
    assert {r.name: r.status for r in result.layers if r.name in ("venv", "custom_nodes")} == \
        {"venv": "uploaded", "custom_nodes": "uploaded"}
    out = tmp_path / "out"
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "elsewhere"))
    restore_image(f"{ref}:v2", str(out))
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_a_file_changed_between_measuring_and_sending_a_layer_is_held_back(registry, base_ref, box,
                                                                           full_state_disk, tmp_path, monkeypatch):
    """No room to build the layer: it is measured, then compressed again as it is sent. A file that
    changed in between makes other bytes (here more of them): the layer is not sent as measured, the
    file is named and held back, and the commit goes on; the next commit sends it."""
    state, fill = full_state_disk
    monkeypatch.setenv("SNAP_STATE_DIR", str(state))
    ref = f"{registry.host}/fullstate-changed"
    commit_box(f"{ref}:v1", base_ref, CommitOptions(root=box, jobs=1))
    changing = "opt/app/custom_nodes/NodeC/table.py"
    write_tree(box, {changing: "x = 1\n" * 100_000, "opt/app/custom_nodes/NodeC/weights.bin": os.urandom(6 << 20)})
    fill()
    measure = sender_module.measure_layer

    def measure_then_change(root, plan, *args, **kwargs):
        blob = measure(root, plan, *args, **kwargs)
        if any(e.path == changing for e in plan.entries):
            with open(os.path.join(box, changing), "w") as f:  # the same size, bytes that compress worse
                f.write(hashlib.sha256(b"seed").hexdigest()[:6] * 100_000)
        return blob

    monkeypatch.setattr(sender_module, "measure_layer", measure_then_change)
    result = commit_box(f"{ref}:v1", base_ref, CommitOptions(root=box, jobs=1))
    assert changing in result.held, result.held
    monkeypatch.setattr(sender_module, "measure_layer", measure)
    commit_box(f"{ref}:v1", base_ref, CommitOptions(root=box, jobs=1))
    out = tmp_path / "out"
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "elsewhere"))
    restore_image(f"{ref}:v1", str(out))
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_a_stop_while_a_layer_is_measured_for_want_of_room_is_seen_at_once(registry, base_ref, box,
                                                                           full_state_disk, monkeypatch):
    """The measuring pass reports its progress as the build does: a stop (Ctrl-C, SIGTERM, the
    watcher's final snapshot) ends it at its next file, not once the whole layer is compressed."""
    state, fill = full_state_disk
    monkeypatch.setenv("SNAP_STATE_DIR", str(state))
    ref = f"{registry.host}/fullstate-stop"
    commit_box(f"{ref}:v1", base_ref, CommitOptions(root=box, jobs=1))
    write_tree(box, {f"opt/app/custom_nodes/NodeZ/f{i:03}.bin": os.urandom(200 << 10) for i in range(40)})
    fill()
    stop, measuring, read_after_stop = threading.Event(), [], []
    measure = sender_module.measure_layer

    def measure_marked(*args, **kwargs):
        measuring.append(True)
        try:
            return measure(*args, **kwargs)
        finally:
            measuring.pop()

    def after_read(path, attempt):
        if stop.is_set():
            read_after_stop.append(path)
        elif measuring:
            stop.set()

    monkeypatch.setattr(sender_module, "measure_layer", measure_marked)
    hooks = CommitHooks(after_read=after_read)
    hooks.stopping = stop
    with pytest.raises(Stopped):
        commit_box(f"{ref}:v1", base_ref, CommitOptions(root=box, jobs=1), hooks)
    measured_after_stop = [p for p in read_after_stop if "/NodeZ/" in p]  # other layers' threads: a file each
    assert len(measured_after_stop) <= 1, read_after_stop
