"""`snap run` against an engine that fails mid-run as a real one does (support.engine_faults: a real
HTTP server speaking the Engine API calls snap makes): a dockerd restart cutting the pull, the
attach or the wait is the engine's failure (exit 8, one line naming it), never a local disk's (7);
a 5xx to the create is the engine's too, a 4xx our request's (2); SIGTERM stops the attached
container as Ctrl-C does (143 and 130)."""

import signal
import subprocess

import pytest

from support.engine_faults import CONTAINER_ID, CONTAINER_NAME, FaultyEngine
from support.run import SNAP, TIMEOUT, assert_one_line_error, snap

pytest.importorskip("docker")


@pytest.fixture
def engine(monkeypatch):
    server = FaultyEngine().start()
    monkeypatch.setenv("DOCKER_HOST", server.address)
    yield server
    server.stop()


def absent(registry) -> str:
    """A ref snap cannot read (not in the registry): the engine is asked to pull it as given."""
    return f"{registry.host}/engine-faults:v1"


@pytest.mark.parametrize("fault, doing", [("pull-cut", "pulling"), ("attach-cut", "attaching to container faulty"),
                                          ("wait-cut", "waiting for container faulty")])
def test_an_engine_that_drops_the_connection_is_exit_8_naming_it(registry, engine, fault, doing):
    engine.fault = fault
    r = snap("run", absent(registry), "--no-gpu")
    assert_one_line_error(r, 8, f"the Docker engine at {engine.address} failed while {doing}")
    assert "local I/O" not in r.stderr and "check the disk" not in r.stderr, r.stderr
    if fault == "wait-cut":
        assert r.stdout == "hello\n"  # what the container said before the engine went away


def test_a_create_or_start_the_engine_fails_is_exit_8_and_one_it_refuses_exit_2(registry, engine):
    engine.fault = "create-500"
    assert_one_line_error(snap("run", absent(registry), "--no-gpu"), 8,
                          f"the Docker engine at {engine.address} failed to create the container",
                          "the engine says create-500")
    engine.fault = "create-403"
    assert_one_line_error(snap("run", absent(registry), "--no-gpu"), 2,
                          "the Docker engine refused to create the container", "the engine says create-403")
    engine.fault = "start-500"
    assert_one_line_error(snap("run", absent(registry), "--no-gpu"), 8,
                          f"the Docker engine at {engine.address} failed to start the container",
                          "the engine says start-500")
    assert ("DELETE", f"containers/{CONTAINER_ID}") in engine.seen  # it never ran: nothing left behind


def test_the_container_runs_attached_and_exits_with_its_code(registry, engine):
    r = snap("run", absent(registry), "--no-gpu")
    assert (r.returncode, r.stdout) == (3, "hello\n"), r.stderr
    assert ("POST", f"containers/{CONTAINER_ID}/stop") not in engine.seen


@pytest.mark.parametrize("sig, code, how", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_sigterm_stops_the_attached_container_as_ctrl_c_does(registry, engine, sig, code, how):
    engine.fault = "hold"
    proc = subprocess.Popen([*SNAP, "run", absent(registry), "--no-gpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"  # the container runs, attached
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), code,
                          f"{how}: container {CONTAINER_NAME} stopped")
    assert engine.stopped.is_set() and ("POST", f"containers/{CONTAINER_ID}/stop") in engine.seen
