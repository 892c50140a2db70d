"""The child worker processes under commit's packers and restore's extractors (snapshotter/workers.py):
jobs and their results, errors raised again in the parent, progress, a killed child, and a child
that ends with its parent even where PR_SET_PDEATHSIG cannot be armed."""

import os
import select
import signal
import subprocess
import sys
import threading

import pytest

from snapshotter.errors import StorageError
from snapshotter.workers import Worker, WorkerDied, WorkerPool

from support.packers import packer_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _echo_setup(prefix: str):
    def handle(job, on_bytes):
        if job == "fail":
            raise StorageError("disk full in /x", "free space")
        if job == "block":
            signal.pause()
        for _ in range(3):
            on_bytes(10)
        return prefix + str(job)

    return handle


def _ended(pid: int, timeout: float) -> bool:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


@pytest.fixture(params=["forked", "started"])
def fork(request, monkeypatch):
    """Both ways a worker starts: forked (the caller runs one thread) and started afresh with
    `python -c` (it does not: a test process with a registry's threads), loading the test's setup
    from tests/ as packers load the suite's hooks."""
    for name, value in packer_env().items():
        monkeypatch.setenv(name, value)
    return request.param == "forked"


def test_a_worker_answers_jobs_sends_progress_and_raises_its_errors_in_the_parent(fork):
    progress = []
    with Worker(_echo_setup, ("got ",), progress_every=15, fork=fork) as w:
        assert w.forked == (fork and threading.active_count() == 1)
        assert w.run(1, progress.append) == "got 1"
        assert sum(progress) == 30 and len(progress) == 2  # batched at 15 bytes, the rest at the end
        with pytest.raises(StorageError) as e:
            w.run("fail", progress.append)
        assert str(e.value) == "disk full in /x (free space)"  # the class and the hint cross over
        assert w.run(2, progress.append) == "got 2"  # it serves on after an error
    assert w.proc.poll() is not None


def test_a_worker_killed_mid_job_is_worker_died_and_a_pool_stopped_raises_its_stop(fork):
    with Worker(_echo_setup, ("",), fork=fork) as w:
        threading.Timer(0, lambda: os.kill(w.pid, signal.SIGKILL)).start()
        with pytest.raises(WorkerDied, match="killed by SIGKILL"):
            w.run("block", lambda n: None)

    class Stopped(Exception):
        pass

    with WorkerPool(2, Stopped, lambda: Worker(_echo_setup, ("",), fork=fork)) as pool:
        assert pool.run(7, lambda n: None) == "7"
        for _ in range(3):  # more errors than workers: each worker that said why serves on
            with pytest.raises(StorageError):
                pool.run("fail", lambda n: None)
        assert [pool.run(n, lambda n: None) for n in (8, 9, 10)] == ["8", "9", "10"]
        threading.Timer(0, pool.stop).start()
        with pytest.raises(Stopped):
            pool.run("block", lambda n: None)
    assert all(w.proc.poll() is not None for w in pool.all)


# A parent that starts a (forked) worker where PR_SET_PDEATHSIG is not to be had (prctl raises),
# tells the test the worker's pid, and dies at once, killed.
_ORPHANING_PARENT = """
import ctypes, os, signal, sys
from snapshotter import workers

def setup():
    return lambda job, on_bytes: job

def no_prctl(*args, **kwargs):
    raise OSError("no prctl here")

ctypes.CDLL = no_prctl
w = workers.Worker(setup)
assert w.forked and w.run(1, lambda n: None) == 1
print(w.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_ends_with_its_parent_without_pr_set_pdeathsig():
    parent = subprocess.run([sys.executable, "-c", _ORPHANING_PARENT], capture_output=True, text=True, cwd=ROOT,
                            timeout=60)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    pid = int(parent.stdout)
    assert _ended(pid, 30), f"worker {pid} outlived its parent"
