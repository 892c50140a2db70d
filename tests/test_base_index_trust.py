"""The base's index is trusted as far as its source (index/base.py): one built on this machine from
the base's layers serves every commit; one a snapshot carried from a repository serves only commits
into that repository. A forged index shipped in someone else's repository never makes a commit into
the user's own leave a file out as the base's, and never spreads there."""

import gzip
import json
import os
import subprocess
from dataclasses import astuple

import pytest

from snapshotter import CommitOptions, commit_box
from snapshotter.commit.history import box_status
from snapshotter.index.entry import Entry
from snapshotter.state import open_own, sub

from support.registry import digest_of
from support.run import snap
from support.trees import write_tree
from support.watch import watcher

INDEX = "dev.snap.base-index"
APP, APP_TEXT, T = "srv/app.py", "print('the app the user builds on')\n", 1_650_000_000


def app_box(box: str) -> str:
    """The box with an app the base lacks, its stat whole seconds (what a forged row can match exactly)."""
    write_tree(box, {APP: APP_TEXT}, mtime=T)
    os.utime(os.path.join(box, "srv"), (T, T))
    return box


def forged_index(registry, repo: str, tag: str, box: str) -> bytes:
    """The index repo:tag carries, with rows that claim the base holds srv/ and srv/app.py as `box` has
    them; its header (the base's diff_ids) left as it is: what a forger copies."""
    manifest = registry.manifest(repo, tag)
    lines = gzip.decompress(registry.blob(repo, manifest["annotations"][INDEX])).decode().splitlines()
    rows = []
    for rel, kind in (("srv", "dir"), (APP, "file")):
        st = os.lstat(os.path.join(box, rel))
        rows.append(Entry(rel, kind, st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_size if kind == "file" else 0,
                          int(st.st_mtime)))
    return gzip.compress(("\n".join(lines + [json.dumps(astuple(e)) for e in rows]) + "\n").encode())


def plant(registry, repo: str, tag: str, data: bytes) -> str:
    """Push `data` into repo and name it as the index of repo:tag's snapshot (the manifest put again)."""
    digest = registry.push_blob(repo, data)
    manifest = registry.manifest(repo, tag)
    manifest["annotations"][INDEX] = digest
    registry.session().put(f"{registry.url}/v2/{repo}/manifests/{tag}", data=json.dumps(manifest).encode(),
                           headers={"Content-Type": manifest["mediaType"]}).raise_for_status()
    return digest


def restored_elsewhere(ref: str, tmp_path, name: str):
    """`ref` restored whole on another machine (a state dir and a root of its own)."""
    root = tmp_path / name
    snap("restore", ref, "--root", str(root), env={"SNAP_STATE_DIR": str(tmp_path / (name + "-state"))}, check=True)
    return root


def base_layer_gets(proxy, base_manifest, since):
    digests = {d["digest"] for d in base_manifest["layers"]}
    return [p for m, p, s in proxy.log[since:] if m == "GET" and "/blobs/" in p and p.rsplit("/", 1)[-1] in digests]


@pytest.mark.parametrize("how", ["whole", "only-snapshot"])
def test_a_forged_index_from_another_repository_leaves_no_file_out(registry, base_ref, base_rootfs, box, tmp_path,
                                                                   monkeypatch, how):
    """Someone else's snapshot (repository forger-*) carries an index with a row for srv/app.py; the
    user restores it on a new machine (whole, or its layers onto a box started from the base), works,
    and commits into their own repository on the same base: srv/app.py is in that snapshot, and the
    forged index is not named there."""
    forger, own = f"forger-{how}", f"own-{how}"
    commit_box(f"{registry.host}/{forger}:v1", base_ref, CommitOptions(root=app_box(box)))
    forged = plant(registry, forger, "v1", forged_index(registry, forger, "v1", box))

    victim = {"SNAP_STATE_DIR": str(tmp_path / "victim")}
    root = tmp_path / "root"
    extra = []
    if how == "only-snapshot":
        subprocess.run(["cp", "-a", base_rootfs, str(root)], check=True)
        extra = ["--only-snapshot"]
    snap("restore", f"{registry.host}/{forger}:v1", "--root", str(root), *extra, env=victim, check=True)
    assert (root / APP).read_text() == APP_TEXT
    write_tree(str(root), {"srv/notes.txt": "the user's work\n"})
    monkeypatch.setenv("SNAP_STATE_DIR", victim["SNAP_STATE_DIR"])
    commit_box(f"{registry.host}/{own}:v1", base_ref, CommitOptions(root=str(root)))

    out = restored_elsewhere(f"{registry.host}/{own}:v1", tmp_path, "elsewhere")
    assert (out / "srv/notes.txt").exists()
    assert (out / APP).exists()  # not left out as the base's
    assert registry.manifest(own, "v1")["annotations"][INDEX] != forged  # it did not spread


def test_a_carried_index_serves_commits_into_its_own_repository_only(registry, proxy, base_ref, base_rootfs, box,
                                                                     tmp_path, monkeypatch):
    """RunPod's cycle: a new machine, a box started from the base, the snapshot's layers restored onto
    it; then watch, commit and status for the same repository read no base layer (the index came
    with the snapshot). A commit into another repository does not take that index's word: it reads the base."""
    base = f"{proxy.host}/base:1"  # base_ref's, read through the proxy: its GETs are counted
    base_manifest = registry.manifest("base", "1")
    commit_box(f"{proxy.host}/cycle:v1", base, CommitOptions(root=box))
    state = tmp_path / "new-machine"
    monkeypatch.setenv("SNAP_STATE_DIR", str(state))
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", base_rootfs, str(root)], check=True)
    snap("restore", f"{proxy.host}/cycle:v1", "--root", str(root), "--only-snapshot",
         env={"SNAP_STATE_DIR": str(state)}, check=True)
    write_tree(str(root), {"srv/notes.txt": "work\n"})

    since = len(proxy.log)
    lines: list[str] = []
    watcher(proxy, base, str(root), "cycle", lines).tick()
    assert registry.manifest("cycle", "v2")["annotations"][INDEX]  # the watch's snapshot was made
    commit_box(f"{proxy.host}/cycle:v3", base, CommitOptions(root=str(root)))
    assert box_status(None, CommitOptions(root=str(root))).tag == f"{proxy.host}/cycle:v3"
    assert base_layer_gets(proxy, base_manifest, since) == [], lines

    since = len(proxy.log)
    commit_box(f"{proxy.host}/another:v1", base, CommitOptions(root=str(root)))
    assert base_layer_gets(proxy, base_manifest, since) != []


def test_an_older_snaps_cache_of_unknown_source_is_not_trusted(registry, base_ref, box, tmp_path, monkeypatch):
    """An older snap kept a carried index under the built index's name: a state dir from then may hold
    a forged one (an earlier restore of someone else's snapshot). That file is not used, and is
    removed: the commit reads the base, and its snapshot holds srv/app.py."""
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "forger"))
    commit_box(f"{registry.host}/old-forger:v1", base_ref, CommitOptions(root=app_box(box)))
    forged = forged_index(registry, "old-forger", "v1", box)
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "older-snap"))
    old = os.path.join(sub("base-index"), digest_of(registry, "base", "1").split(":")[1] + ".jsonl.gz")
    with open_own(old, "wb") as f:
        f.write(forged)

    commit_box(f"{registry.host}/after-upgrade:v1", base_ref, CommitOptions(root=box))
    out = restored_elsewhere(f"{registry.host}/after-upgrade:v1", tmp_path, "elsewhere")
    assert (out / APP).exists()
    assert not os.path.exists(old)
