"""SIGTERM stops any command that waits (on a registry that never answers, on a restore) as Ctrl-C
does: one `snap: terminated` line and exit 143, never a silent death by the default handler."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import select
import signal
import struct
import subprocess

import pytest

from snapshotter.restore.landing import VERSION, progress_path
from snapshotter.state import RootFiles
from support.images import TAR
from support.run import SNAP, TIMEOUT
from support.sockets import RawServer
from support.tars import member, tar_bytes

TERMINATED = "snap: terminated (run the command again: a commit re-sends only what is missing, a restore resumes)"


@pytest.fixture
def silent():
    """A registry that takes every connection and never answers."""
    s = RawServer("silent").start()
    yield s
    s.stop()


def _start(*args: str) -> subprocess.Popen:
    p = subprocess.Popen([*SNAP, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    p.stdin.write("secret\n")  # snap login's --password-stdin; unread by the others
    p.stdin.close()
    p.stdin = None  # communicate() must not flush it again
    return p


def _assert_terminated(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=TIMEOUT)
    assert p.returncode == 143, (p.returncode, out, err)
    assert [line for line in err.splitlines() if line.startswith("snap:")] == [TERMINATED], err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("command", [
    ["verify", "{host}/box:v1", "--root", "{root}"],
    ["log", "{host}/box:v1"],
    ["status", "--base", "{host}/base:1", "--root", "{root}"],
    ["tag", "{host}/box:v1-diverged-20260101T120000Z", "v1"],
    ["login", "{host}", "--username", "someone", "--password-stdin"],
    ["restore", "{host}/box:v1", "--root", "{root}"],
    ["commit", "{host}/box:v1", "--base", "{host}/base:1", "--root", "{root}"],
], ids=lambda c: c[0])
def test_sigterm_while_a_registry_is_waited_for_is_one_line_and_143(silent, tmp_path, command):
    root = tmp_path / "box"
    root.mkdir()
    (root / "file.txt").write_text("x\n")
    p = _start(*(arg.format(host=silent.host, root=root) for arg in command))
    assert silent.connected.wait(TIMEOUT), p.communicate()  # it waits on the registry's answer now
    _assert_terminated(p)


def test_sigterm_while_verify_reads_a_layer_gives_the_layer_up(registry, proxy, tmp_path):
    """verify reads layers in threads: at SIGTERM the one being read is given up at its next chunk,
    not read to its end first (a multi-GB layer took minutes, past a `docker stop`'s 10 s)."""
    big = os.urandom(32 << 20)
    tar = tar_bytes(member("weights.bin", data=big))
    registry.push_image("sigterm-verify", "v1", [tar], layer_media_type=TAR,
                        diff_ids=["sha256:" + hashlib.sha256(tar).hexdigest()])
    proxy.throttle, proxy.midway_at = 512 << 10, 1 << 20  # the whole layer: about a minute
    root = tmp_path / "root"
    root.mkdir()
    p = _start("verify", f"{proxy.host}/sigterm-verify:v1", "--root", str(root))
    assert proxy.midway.wait(TIMEOUT), p.communicate()
    _assert_terminated(p)
    assert proxy.blob_bytes_sent < len(tar), "the layer was read to its end after the signal"


def test_sigterm_to_a_daemon_starter_says_the_watcher_goes_on(silent, tmp_path, state_dir):
    """`snap watch --daemon` waits for its watcher to be ready; stopped then (SIGTERM, as a start
    script's timeout does), the starter says the watcher goes on and how to stop it: not "run the
    command again", which a second watcher of the root would refuse."""
    box = tmp_path / "box"
    box.mkdir()
    p = _start("watch", f"{silent.host}/box:v1", "--base", "scratch", "--root", str(box), "--every", "1h", "--daemon")
    assert silent.connected.wait(TIMEOUT), p.communicate()  # the watcher asks the registry: not ready yet
    pid = json.loads(next((state_dir / "watch").glob("*.pid")).read_text())["pid"]
    try:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=TIMEOUT)
        said = [line for line in err.splitlines() if line.startswith("snap:")]
        assert p.returncode == 143 and len(said) == 1 and "the watcher goes on" in said[0], err
        os.kill(pid, 0)  # it does
    finally:
        os.kill(pid, signal.SIGKILL)


def test_sigterm_while_restore_wait_waits_is_one_line_and_143(tmp_path):
    """`restore --wait` on a restore that runs (its progress file says so) and has not landed the
    file: once snap has read the progress file twice, it is in its loop, waiting."""
    root = tmp_path / "root"
    root.mkdir()
    progress = progress_path(RootFiles(str(root)))
    running = {"version": VERSION, "state": "running", "pid": os.getpid(), "files": {}}
    with open(os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        json.dump(running, f)
    with _reads_of(progress) as reads:
        p = _start("restore", "--wait", str(root / "weights.bin"), "--root", str(root))
        reads(p, 2)
    _assert_terminated(p)


IN_CLOSE_NOWRITE = 0x10
_EVENT = struct.Struct("iIII")  # struct inotify_event without its name: a file's own watch has none


@contextlib.contextmanager
def _reads_of(path: str):
    """reads(p, n): return once process p has read `path` (opened it and closed it, writing nothing)
    n times, as inotify tells; fail at once if p ends first."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0 and libc.inotify_add_watch(fd, os.fsencode(path), IN_CLOSE_NOWRITE) >= 0, ctypes.get_errno()

    def reads(p: subprocess.Popen, n: int) -> None:
        gone = os.pidfd_open(p.pid)  # readable once p has ended
        try:
            while n > 0:
                ready = select.select([fd, gone], [], [], TIMEOUT)[0]
                assert fd in ready, ("ended" if ready else "hung", p.poll() is not None and p.communicate())
                events = os.read(fd, 4096)
                n -= sum(_EVENT.unpack_from(events, at)[1] & IN_CLOSE_NOWRITE != 0
                         for at in range(0, len(events), _EVENT.size))
        finally:
            os.close(gone)

    try:
        yield reads
    finally:
        os.close(fd)
