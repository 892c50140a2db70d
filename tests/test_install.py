"""snap installs into a fresh virtualenv with pip, from its declared dependencies alone.

The wheels come from .ci/wheels (fetched by .ci/setup): pip runs with --no-index, so the test never
reaches a package index, and a module snap imports without declaring it is simply not there."""

import os
import shutil
import subprocess
import sys

import pytest

from support import PIP_OFFLINE, have_wheels, pip_install_offline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every module of the package, imported the way the CLI's commands import them.
IMPORT_ALL = ("import importlib, pkgutil, snapshotter\n"
              "for m in pkgutil.walk_packages(snapshotter.__path__, 'snapshotter.'):\n"
              "    if m.name != 'snapshotter.__main__':  # that one runs the CLI\n"
              "        importlib.import_module(m.name)\n")


@pytest.mark.skipif(not have_wheels("setuptools", "typer", "docker", "oras", "zstandard"),
                    reason="no wheels of snap's dependencies in .ci/wheels (run .ci/setup)")
def test_pip_install_into_a_fresh_venv_then_snap_help(tmp_path):
    # A copy of the sources: the build writes build/ and *.egg-info next to them.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src)
    for name in ("snapshotter", "layers"):
        shutil.copytree(os.path.join(REPO, name), src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = pip_install_offline(str(venv), str(src))
    assert r.returncode == 0, r.stderr
    env = {**os.environ, **PIP_OFFLINE}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([str(venv / "bin/snap"), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for command in ("commit", "restore", "verify", "run", "login", "logout"):
        assert command in r.stdout
    # The installed `snap` starts at cli.main, which takes SNAP_USERNAME/SNAP_PASSWORD out of the
    # environment before anything can start a process (app() alone would skip that).
    assert "from snapshotter.cli import main" in (venv / "bin/snap").read_text()
    r = subprocess.run([str(venv / "bin/python"), "-c", IMPORT_ALL], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
