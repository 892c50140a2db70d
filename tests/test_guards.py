"""Refusals that keep a wrong --root from deleting the system: a commit or watch whose box deletes
the base's system pushes nothing, and a restore onto a live system never applies such deletions,
unless forced (issue 23, item 3; counted from the layers: issue 33, class 1)."""

import json
import os
import shutil
import subprocess
import threading

import pytest

from support.registry import blobs_in, digest_of
from support.run import SNAP, snap
from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree


def empty_roots(tmp_path):
    """An empty directory, and one holding only /workspace: what a wrong --root points at."""
    empty = tmp_path / "empty"
    empty.mkdir()
    workspace = tmp_path / "only-workspace"
    write_tree(str(workspace), {"workspace/notes.txt": "my work\n"})
    return {"empty": str(empty), "workspace": str(workspace)}


@pytest.fixture
def tagged(registry, base_ref, box):
    """A repository whose tag already names a good snapshot of the box."""
    def make(repo):
        snap("commit", f"{registry.host}/{repo}:v1", "--base", base_ref, "--root", box, check=True)
        return f"{registry.host}/{repo}:v1", digest_of(registry, repo, "v1")
    return make


@pytest.mark.parametrize("which", ["empty", "workspace"])
def test_a_commit_of_a_root_without_the_system_is_refused_and_pushes_nothing(which, registry, base_ref, tagged,
                                                                              tmp_path):
    root = empty_roots(tmp_path)[which]
    ref, before = tagged(f"guard-commit-{which}")
    blobs = blobs_in(registry)
    # A new tag: one that names a snapshot of another box is refused before that (lineage.py).
    r = snap("commit", ref.replace(":v1", ":v2"), "--base", base_ref, "--root", root)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("snap: error: ") and repr(root) in line and "Traceback" not in r.stderr
    assert "of the base's top-level directories (" in line and all(f"/{d}," in line for d in ("etc", "opt", "usr"))
    assert "--force" in line
    assert digest_of(registry, ref.split("/", 1)[1].split(":")[0], "v1") == before
    assert digest_of(registry, ref.split("/", 1)[1].split(":")[0], "v2") is None
    assert blobs_in(registry) == blobs


def watch_until_it_ends_or_pushes(*args) -> tuple[int, str]:
    """`snap watch` until it exits or moves its tag (then it is stopped: a refusal must come first)."""
    proc = subprocess.Popen([*SNAP, "watch", *args], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    timer = threading.Timer(120, proc.kill)  # a hung test still ends
    timer.start()
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if " moved to it" in line:
            proc.terminate()
    code = proc.wait()
    timer.cancel()
    return code, "".join(seen)


@pytest.mark.parametrize("which", ["empty", "workspace"])
def test_a_watch_of_a_root_without_the_system_exits_2_and_leaves_the_tag(which, registry, base_ref, tagged, tmp_path):
    root = empty_roots(tmp_path)[which]
    ref, before = tagged(f"guard-watch-{which}")
    blobs = blobs_in(registry)
    code, stderr = watch_until_it_ends_or_pushes(ref.replace(":v1", ":v2"), "--base", base_ref, "--root", root,
                                                 "--every", "1h")
    assert code == 2, stderr
    assert any(line.startswith("snap: error: the box at --root") and "--force" in line
               for line in stderr.splitlines()), stderr
    assert "Traceback" not in stderr
    assert digest_of(registry, ref.split("/", 1)[1].split(":")[0], "v1") == before
    assert digest_of(registry, ref.split("/", 1)[1].split(":")[0], "v2") is None
    assert blobs_in(registry) == blobs


def test_status_shows_the_refusal(registry, base_ref, tmp_path):
    r = snap("status", "--base", base_ref, "--root", empty_roots(tmp_path)["empty"])
    assert r.returncode == 2 and "deletes the base's system" in r.stderr


def test_legitimate_deletions_of_base_files_and_subdirectories_still_commit(registry, base_ref, box, tmp_path):
    shutil.rmtree(os.path.join(box, "var/lib/app"))  # a base subdirectory (and the box's deleted base file)
    snap("commit", f"{registry.host}/guard-legit:v1", "--base", base_ref, "--root", box, check=True)
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/guard-legit:v1", "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    assert not (out / "var/lib/app").exists() and not (out / "opt/app/old_cache.bin").exists()


@pytest.fixture
def forced(registry, base_ref, tmp_path):
    """A snapshot of a root holding only /workspace, pushed with --force."""
    ref = f"{registry.host}/guard-forced:v1"
    root = empty_roots(tmp_path)["workspace"]
    snap("commit", ref, "--base", base_ref, "--root", root, "--force", check=True)
    return ref


def live_root(base_rootfs, tmp_path):
    """A box running the base image: a live system (its etc/os-release)."""
    live = str(tmp_path / "live")
    subprocess.run(["cp", "-a", base_rootfs, live], check=True)
    return live


def test_force_pushes_and_the_manifest_records_the_deletions(registry, forced):
    m = registry.manifest("guard-forced", "v1")
    rec = json.loads(m["annotations"]["dev.snap.deletes"])
    assert {"etc", "opt", "usr", "var"} <= set(rec["top"]) and rec["paths"] * 2 > rec["of"]


def test_a_restore_onto_a_live_system_refuses_recorded_system_deletions_before_writing(forced, base_rootfs, tmp_path):
    live = live_root(base_rootfs, tmp_path)
    before = snapshot_of_tree(live)
    r = snap("restore", forced, "--root", live, "--only-snapshot")
    assert r.returncode == 6, r.stderr
    assert r.stderr.startswith("snap: error: ") and repr(live) in r.stderr and "--force" in r.stderr
    assert snapshot_of_tree(live) == before  # nothing written, nothing deleted
    snap("restore", forced, "--root", live, "--only-snapshot", "--force", check=True)
    assert (tmp_path / "live/workspace/notes.txt").read_text() == "my work\n"
    assert not os.path.exists(os.path.join(live, "usr")) and not os.path.exists(os.path.join(live, "etc"))


def test_an_image_without_the_record_is_counted_all_the_same(registry, forced, base_rootfs, tmp_path):
    """The record is information only: the layers' own whiteouts are counted (test_deletion_guard.py)."""
    m = registry.manifest("guard-forced", "v1")
    del m["annotations"]["dev.snap.deletes"]  # as an older snap, or another tool, made it
    r = registry.session().put(f"{registry.url}/v2/guard-forced/manifests/bare", data=json.dumps(m),
                               headers={"Content-Type": m["mediaType"]})
    r.raise_for_status()
    live = live_root(base_rootfs, tmp_path)
    before = snapshot_of_tree(live)
    r = snap("restore", f"{registry.host}/guard-forced:bare", "--root", live, "--only-snapshot")
    assert r.returncode == 6, r.stderr
    assert "snap: error: " in r.stderr and "live system" in r.stderr and "Traceback" not in r.stderr
    assert snapshot_of_tree(live) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_a_whiteout_never_deletes_a_file_mounted_over(registry, base_ref, box, base_rootfs, tmp_path):
    """A deleted base file that the next machine's runtime mounts over (as Docker does /etc/hosts):
    the restore stops with one line (exit 7) and the mount and its file stay."""
    ref = f"{registry.host}/guard-mounted:v1"
    snap("commit", ref, "--base", base_ref, "--root", box, check=True)  # deletes opt/app/old_cache.bin
    live = live_root(base_rootfs, tmp_path)
    host = tmp_path / "host-file"
    host.write_bytes(b"the host's\n")
    target = os.path.join(live, "opt/app/old_cache.bin")
    subprocess.run(["mount", "--bind", str(host), target], check=True)
    try:
        r = snap("restore", ref, "--root", live, "--only-snapshot")
        assert r.returncode == 7, r.stderr
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("snap: error: ") and "/opt/app/old_cache.bin" in line
        assert "mounted over" in line and "Traceback" not in r.stderr
        with open(target, "rb") as f:
            assert f.read() == b"the host's\n"
    finally:
        subprocess.run(["umount", target], check=False)
