"""snap's wheel, built by `make dist`, installs into a fresh virtualenv with pip, from its declared dependencies
alone, on each Python a GPU box may have (3.10: Ubuntu 22.04; 3.11: Debian 12; 3.12: Ubuntu 24.04; 3.13), and a
commit made there has the very layers this suite's own Python makes of the same tree.

The wheels come from .ci/wheels (fetched by .ci/setup for each of these Pythons): pip runs with
--no-index, so the test never reaches a package index, and a module snap imports without declaring
it is simply not there. A Python this machine lacks is skipped, with the reason."""

import glob
import os
import shutil
import subprocess
import sys
from typing import Optional

import pytest

from support.images import snap_layer_files
from support.run import PIP_OFFLINE, WHEELS, commit_json, make_venv, pip_install_offline, snap_dist
from support.trees import NOT_CAPTURED, make_box, snapshot_of_tree, write_tree

PYTHONS = ("3.10", "3.11", "3.12", "3.13")
# snap's dependencies that are compiled, so have a wheel per Python (the rest are py3-none-any).
BINARY_WHEELS = ("zstandard", "pyyaml", "charset_normalizer", "rpds_py", "cryptography", "cffi")

# Every module of the package, imported the way the CLI's commands import them.
IMPORT_ALL = ("import importlib, pkgutil, snapshotter\n"
              "for m in pkgutil.walk_packages(snapshotter.__path__, 'snapshotter.'):\n"
              "    if m.name != 'snapshotter.__main__':  # that one runs the CLI\n"
              "        importlib.import_module(m.name)\n")


def find_python(version: str) -> Optional[str]:
    """An interpreter of `version` that can make a venv: this one, pythonX.Y on PATH (pyenv's
    shims only run the selected versions), or one of pyenv's installed versions."""
    if sys.version.startswith(version + "."):
        return sys.executable
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which(f"python{version}"),
                  *sorted(glob.glob(f"{pyenv}/versions/{version}.*/bin/python{version}"))]
    for python in filter(None, candidates):
        r = subprocess.run([python, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == version:
            return python
    return None


def missing_wheels(version: str) -> list[str]:
    """snap's compiled dependencies with no wheel for `version` in .ci/wheels."""
    tag = "cp" + version.replace(".", "")
    return [n for n in BINARY_WHEELS if not glob.glob(os.path.join(WHEELS, f"{n}-*-{tag}-*.whl"))
            and not glob.glob(os.path.join(WHEELS, f"{n}-*-abi3-*.whl"))]


def installed_snap(python: str, wheel: str, tmp_path) -> str:
    """A fresh venv of `python` with snap's wheel pip-installed from .ci/wheels alone (by this suite's pip,
    run under `python`: the same choice of wheels as the venv's own pip would make); the venv's path.
    --no-compile: no .pyc of every dependency written at install (most of an install's time); each
    module is compiled as it is first imported, as from a user's `pip install --no-compile`."""
    venv = tmp_path / "venv"
    make_venv(str(venv), python)
    r = pip_install_offline(str(venv), "--no-compile", wheel)
    assert r.returncode == 0, r.stderr
    return str(venv)


def add_awkward_files(box: str) -> None:
    """What makes tar headers differ between writers: ns mtimes (a base file edited within its second
    gets a PAX mtime record), an empty file, a big one, an xattr where the filesystem has them; the
    box already has a symlink and a hardlink."""
    state = os.path.join(box, "var/lib/app/state.db")  # "v1\n" at 1_600_000_000 s in the base
    with open(state, "w") as f:
        f.write("v2\n")
    os.utime(state, ns=(1_600_000_000_250_000_000, 1_600_000_000_250_000_000))
    write_tree(box, {"opt/app/empty": b"", "opt/app/models/big.bin": bytes(range(256)) * 24_000})
    os.utime(os.path.join(box, "opt/app/empty"), ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    try:
        os.setxattr(os.path.join(box, "opt/app/empty"), "user.snap.test", b"kept")
    except OSError:
        pass  # a filesystem without user xattrs: the rest still holds


def layer_digests(registry, repo: str, tag: str) -> list[str]:
    return [d["digest"] for d in registry.manifest(repo, tag)["layers"]]


@pytest.mark.parametrize("version", PYTHONS)
def test_install_on_each_python_then_a_commit_makes_the_same_layers(version, registry, base_ref, base_rootfs,
                                                                    tmp_path_factory, tmp_path):
    python = find_python(version)
    if python is None:
        pytest.skip(f"no Python {version} with venv on this machine")
    if not os.path.isdir(WHEELS) or missing_wheels(version):
        pytest.skip(f"no wheels of {', '.join(missing_wheels(version)) or 'snap dependencies'} for Python {version} "
                    "in .ci/wheels (run .ci/setup)")
    venv = installed_snap(python, snap_dist(tmp_path_factory)["wheel"], tmp_path)
    # nothing shared with the reference
    env = {**os.environ, **PIP_OFFLINE, "SNAP_STATE_DIR": str(tmp_path / "venv-state")}
    env.pop("PYTHONPATH", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([os.path.join(venv, "bin", args[0]), *args[1:]], capture_output=True, text=True,
                              env=env, cwd=tmp_path)

    r = run("snap", "--help")
    assert r.returncode == 0, r.stderr
    for command in ("commit", "restore", "verify", "run", "login", "logout"):
        assert command in r.stdout
    # Both commands start at __main__.run, which runs cli.main: that takes SNAP_USERNAME/SNAP_PASSWORD
    # out of the environment before anything can start a process (app() alone would skip that).
    for command in ("snap", "boxsnap"):
        assert "from snapshotter.__main__ import run" in open(os.path.join(venv, "bin", command)).read()
    # Both commands, one app; the version is the installed distribution's.
    r = run("python", "-c", "import importlib.metadata as m; print(m.version('boxsnap'))")
    assert r.returncode == 0, r.stderr
    for command in ("snap", "boxsnap"):
        v = run(command, "--version")
        assert (v.returncode, v.stdout) == (0, f"snap {r.stdout}")
    r = run("python", "-c", IMPORT_ALL)
    assert r.returncode == 0, r.stderr

    box = make_box(base_rootfs, str(tmp_path / "box"))
    add_awkward_files(box)
    tag = "py" + version.replace(".", "")
    commit_json(f"{registry.host}/pythons:ref-{tag}", base_ref, box)  # this suite's Python, this tree's code
    r = run("snap", "commit", f"{registry.host}/pythons:{tag}", "--base", base_ref, "--root", box)
    assert r.returncode == 0, r.stderr
    assert layer_digests(registry, "pythons", tag) == layer_digests(registry, "pythons", f"ref-{tag}")
    # the case compared
    assert "mtime" in snap_layer_files(registry, "pythons", tag)["var/lib/app/state.db"].pax_headers

    out = tmp_path / "restored"
    r = run("snap", "restore", f"{registry.host}/pythons:{tag}", "--root", str(out))
    assert r.returncode == 0, r.stderr
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    assert os.stat(out / "var/lib/app/state.db").st_mtime_ns == 1_600_000_000_250_000_000
