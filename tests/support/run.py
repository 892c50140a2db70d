"""Running things and waiting on them: snap's command line (with its peak memory), any process
stopped in time, a free port, what the whole run makes once, pip from the wheels .ci/setup fetched; and
snap's one-line errors."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

IS_ROOT = os.geteuid() == 0
TIMEOUT = 120  # generous overall bound for a process or a thread to get somewhere: reaching it means a hang


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], object]):
    """`make(directory)`'s result (JSON), made once for the whole run: the first test to ask makes it in a
    directory every xdist worker of this run shares while the others wait on a lock, then read it. A
    `make` that fails leaves nothing, so the next to ask tries again and fails with its own error."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name  # this run's alone
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "made.json"
        if not done.exists():
            shutil.rmtree(shared, ignore_errors=True)  # what a failed try left
            shared.mkdir()
            result = make(shared)
            done.write_text(json.dumps(result))
        return json.loads(done.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



# ---- the snap command line -------------------------------------------------------------------------

# `python -m snapshotter` is the `snap` entry point without PATH lookups (Ubuntu's snapd is also `snap`).
SNAP = [sys.executable, "-m", "snapshotter"]
RUN_TIMEOUT = 300  # far more than a refusal takes: reaching it means a hang
PEAK_LIMIT_KIB = 256 * 1024
# Runs the snap CLI in this process and notes its peak RSS (VmHWM: since its exec, unlike
# ru_maxrss, which counts the test process it was forked from) and that of its children (the
# extraction process, forked from it) in the file named by $SNAP_TEST_PEAK, in KiB.
_PEAK_WRAPPER = """
import os, resource, runpy
try:
    runpy.run_module("snapshotter", run_name="__main__", alter_sys=True)
finally:
    with open("/proc/self/status") as f:
        own = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    peak = max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    with open(os.environ["SNAP_TEST_PEAK"], "w") as f:
        f.write(str(peak))
"""


def snap(*args, input=None, env=None, check=False, timeout=600, command=SNAP, preexec_fn=None):
    """Run the real `snap` command line in a subprocess (`command`: how snap is started)."""
    e = {**os.environ, **(env or {})}
    r = subprocess.run([*command, *args], capture_output=True, text=True, input=input, env=e, timeout=timeout,
                       preexec_fn=preexec_fn)
    if check and r.returncode != 0:
        raise AssertionError(f"snap {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def snap_with_peak(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """(result, peak RSS in KiB) of the snap command line, which must not end in a traceback."""
    with tempfile.TemporaryDirectory() as d:  # not in tmp_path: the jail watches what appears there
        peak_file = os.path.join(d, "peak")
        r = snap(*args, env={"SNAP_TEST_PEAK": peak_file, **(env or {})}, timeout=RUN_TIMEOUT,
                 command=[sys.executable, "-c", _PEAK_WRAPPER])
        with open(peak_file) as f:
            peak = int(f.read())
    assert "Traceback" not in r.stderr, r.stderr
    return r, peak


def assert_one_line_error(r, code: int, *words: str) -> None:
    """snap exited `code` and said why in one `snap: error:` line holding each of `words`, without a traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("snap: error:")]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def assert_clean(r) -> None:
    """No raw control character (nor a name's undecodable byte) in snap's output but the newline
    ending each line."""
    for text in (r.stdout, r.stderr):
        bad = [c for c in text if c != "\n" and not c.isprintable()]
        assert not bad, (bad, text)



def commit_json(target, base, root, *extra):
    r = snap("commit", target, "--base", base, "--root", root, "--json", *extra, check=True)
    return json.loads(r.stdout)



# Wheels .ci/setup fetched for tests that pip-install into venvs of their own, never from an index.
WHEELS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".ci", "wheels"))
PIP_OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CONFIG_FILE": os.devnull}


def have_wheels(*names: str) -> bool:
    """Whether .ci/wheels holds a wheel of each distribution (names as in wheel file names)."""
    files = os.listdir(WHEELS) if os.path.isdir(WHEELS) else []
    return all(any(f.lower().startswith(n + "-") for f in files) for n in names)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def snap_dist(tmp_path_factory) -> dict[str, str]:
    """The sdist and wheel `make dist` builds, checked by twine as the index would, made once per run
    (once_per_run). {"sdist": path, "wheel": path}"""
    return once_per_run(tmp_path_factory, "dist", _build_dist)


def _build_dist(src: Path) -> dict[str, str]:
    """`make dist` in a copy of this tree's sources in `src` (the build writes build/ and *.egg-info next
    to them), with this suite's venv, set up already (-o: as is)."""
    for name in ("pyproject.toml", "README.md", "Makefile"):
        shutil.copy(os.path.join(REPO, name), src)
    for name in ("snapshotter", "layers", ".ci"):
        shutil.copytree(os.path.join(REPO, name), src / name, ignore=shutil.ignore_patterns("__pycache__", "wheels"))
    venv = os.path.dirname(os.path.dirname(sys.executable))
    r = subprocess.run(["make", f"VENV={venv}", "-o", f"{venv}/.setup.stamp", "dist"], cwd=src,
                       capture_output=True, text=True, env={**os.environ, **PIP_OFFLINE})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("PASSED") == 2, r.stdout  # twine check --strict: both render on the index
    found = {kind: [str(p) for p in (src / "dist").glob(pattern)] for kind, pattern in
             (("sdist", "boxsnap-*.tar.gz"), ("wheel", "boxsnap-*-py3-none-any.whl"))}
    assert all(len(paths) == 1 for paths in found.values()), found
    return {kind: paths[0] for kind, paths in found.items()}


def make_venv(path: str, python: str = sys.executable) -> None:
    """A fresh venv of `python` with no pip of its own: pip_install_offline installs into it with this
    suite's pip (its own, from ensurepip, took ~5 s per venv)."""
    subprocess.run([python, "-m", "venv", "--without-pip", path], check=True)


def pip_install_offline(venv: str, *args: str) -> subprocess.CompletedProcess:
    """`pip install ARGS` into the venv at `venv` (pip's --python: it runs under the venv's interpreter,
    which decides what fits), from .ci/wheels alone."""
    env = {**os.environ, **PIP_OFFLINE}
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "pip", "--python", os.path.join(venv, "bin/python"), "install", "-q",
                           "--no-index", "--find-links", WHEELS, *args], capture_output=True, text=True, env=env)
