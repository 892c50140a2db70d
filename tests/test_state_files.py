"""The files snap keeps in its state dir: a box root's files are named by its key (the same names
whatever snap's version, so an upgraded snap finds them), and a file that names another format
version than this snap writes is ignored, never read as this version's."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from snapshotter.errors import WaitTimeout
from snapshotter.registry.blobsources import BlobSources
from snapshotter.restore import landing
from snapshotter.restore.journal import Journal
from snapshotter.snapshot import record, statcache
from snapshotter.state import RootFiles, read_versioned, versioned, write_versioned
from snapshotter.watch import daemon

MANIFEST = "sha256:" + "a" * 64


def key(root, length: int) -> str:
    return hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:length]


def test_a_roots_files_are_named_by_the_sha256_of_its_real_path(state_dir, tmp_path):
    (tmp_path / "box").mkdir()
    os.symlink("box", tmp_path / "link")
    root = str(tmp_path / "link")  # spelt through a symlink: the same root
    real = tmp_path / "box"
    assert os.path.basename(daemon.watch_files(root).pid) == key(real, 16) + ".pid"
    assert os.path.basename(landing.progress_path(RootFiles(root))) == key(real, 32) + ".json"
    assert os.path.basename(record._path(RootFiles(root))) == key(real, 32) + ".json"
    assert os.path.basename(statcache._last_commit_path(root)) == key(real, 32) + ".json"
    journal = Journal(str(tmp_path / "journals"), RootFiles(root), MANIFEST, [], fsync=False)
    assert os.path.basename(journal.path) == key(real, 32) + ".json"


def test_versioned_takes_only_an_object_of_that_version():
    assert versioned({"version": 2, "x": 1}, 2) == {"version": 2, "x": 1}
    for doc in ({"version": 3, "x": 1}, {"x": 1}, {"version": "2"}, [2], 2, None):
        assert versioned(doc, 2) is None


def test_a_versioned_file_is_written_version_first_and_read_back_only_at_its_version(tmp_path):
    path = str(tmp_path / "f.json")
    write_versioned(path, 2, {"b": 1, "a": [1, 2]})
    assert open(path).read() == '{"version": 2, "b": 1, "a": [1, 2]}'
    assert read_versioned(path, 2) == {"version": 2, "b": 1, "a": [1, 2]}
    assert read_versioned(path, 3) is None
    assert read_versioned(str(tmp_path / "missing.json"), 2) is None
    (tmp_path / "f.json").write_text('{"version": 2,')
    assert read_versioned(path, 2) is None


def next_version(path: str) -> None:
    """Make the file at `path` name the next format version, its content otherwise the same."""
    with open(path) as f:
        doc = json.load(f)
    with open(path, "w") as f:
        json.dump({**doc, "version": doc["version"] + 1}, f)


def state_files(root: str) -> dict:
    """Each state file a run leaves for `root` (and the blob sources), written; path -> what reads it
    back (None where it is ignored)."""
    files = daemon.watch_files(root)
    lock = daemon.take_lock(files, root)
    daemon.note_pid(files, lock, "reg/box:v1", 4)
    os.close(lock)
    statcache.note_last_commit(root, MANIFEST, "reg/box:v1", MANIFEST, ())
    write_versioned(record._path(RootFiles(root)), record.VERSION,
                    {"root": os.path.realpath(root), "manifest": MANIFEST})
    sources = BlobSources()
    sources.note("reg", "box", [MANIFEST])
    sources.save()
    read = {files.pid: lambda: daemon._read_json(files.pid).get("pid"),
            statcache._last_commit_path(root): lambda: statcache.last_base(root),
            record._path(RootFiles(root)): lambda: record.restored_from(root),
            sources.path: lambda: BlobSources().repositories("reg", MANIFEST) or None}
    assert all(got() is not None for got in read.values())
    return read


def test_state_files_of_another_version_are_ignored(state_dir, tmp_path):
    for path, got in state_files(str(tmp_path)).items():
        next_version(path)
        assert got() is None, path


def test_state_files_nested_deeper_than_the_parser_goes_are_damaged_ones(state_dir, tmp_path):
    """A state file damaged into JSON nested past Python's recursion limit is ignored as any damaged
    one is, never an "internal error" (RecursionError) of every later command."""
    for path, got in state_files(str(tmp_path)).items():
        with open(path, "w") as f:
            f.write("[" * 100_000 + "]" * 100_000)
        assert got() is None, path


def test_wait_does_not_take_a_progress_file_of_another_version_for_a_landed_file(state_dir, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    path = landing.progress_path(RootFiles(str(root)))
    write_versioned(path, landing.VERSION, {"pid": os.getpid(), "state": "running", "files": {"w.bin": True}})
    landing.wait_landed(str(root / "w.bin"), str(root), timeout=0)
    next_version(path)
    with pytest.raises(WaitTimeout):
        landing.wait_landed(str(root / "w.bin"), str(root), timeout=0)


def test_a_layer_being_built_is_kept_by_its_writers_lock_not_its_pid(tmp_path):
    """A killed build's `.building-PID-N` is swept whatever its pid now names: this very process
    (a container's restarted pid 1 has the dead one's pid) or a live one. A live build stays: its
    writer holds a shared flock on it, or it was written within the last minute (before the lock is
    taken, between its close and its rename)."""
    import fcntl
    import time

    from snapshotter.state import BUILDING_QUIET, sweep_leftovers

    layers = tmp_path / "layers"
    layers.mkdir()
    old = time.time() - BUILDING_QUIET - 60
    dead_mine, dead_live_pid = layers / f".building-{os.getpid()}-1", layers / f".building-{os.getppid()}-2"
    locked, fresh = layers / f".building-{os.getpid()}-3", layers / ".building-4000000-4"
    for p in (dead_mine, dead_live_pid, locked, fresh):
        p.write_bytes(b"x" * 4096)
    for p in (dead_mine, dead_live_pid, locked):
        os.utime(p, (old, old))
    with open(locked, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_SH)  # as build_layer holds it while it writes
        sweep_leftovers(str(tmp_path))
        assert sorted(p.name for p in layers.iterdir()) == sorted([locked.name, fresh.name])


# A process that builds a layer of `root`'s file NAME into the state dir's layers/ as a commit's
# sender does, and holds it as the sender holds it until its upload is done: it says the blob's
# path, waits for a line on stdin, then reads the blob by its path (as an upload, or its resume,
# does) and says its sha256, and ends (the blob removed, as after its upload).
LAYER_USER = r"""
import hashlib, os, sys
from snapshotter.index.entry import entry_from_stat
from snapshotter.layer.generate import build_layer
from snapshotter.layer.plan import LayerPlan
from snapshotter.state import BUILT_LAYERS, holding, sub

root, name = sys.argv[1:3]
plan = LayerPlan("models", "zstd", [entry_from_stat(name, os.lstat(os.path.join(root, name)))])
blob = build_layer(root, plan, sub(BUILT_LAYERS))
with holding(blob.path):
    print(blob.path, flush=True)
    sys.stdin.readline()
    with open(blob.path, "rb") as f:
        print("sha256:" + hashlib.sha256(f.read()).hexdigest(), flush=True)
"""


def layer_user(root, name: str) -> tuple[subprocess.Popen, str]:
    """A LAYER_USER process, started, and its blob's path once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", LAYER_USER, str(root), name], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert path, "the layer user ended before it built its layer"
    return proc, path


def finish(proc: subprocess.Popen) -> str:
    """Let a LAYER_USER read its blob and end: the digest it read."""
    out, _ = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, "the layer user could not read its blob"
    return out.strip()


def box_with(tmp_path, **files: bytes):
    root = tmp_path / "box"
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def test_two_builds_of_one_layer_never_remove_each_others_blob(tmp_path):
    """A watcher's background send and a commit of the same root (or two threads) build the same
    layer: the one whose upload ends first removes its blob; the other's blob is still whole for
    its upload (or its resume), which reads it by its path."""
    from snapshotter.index.entry import entry_from_stat
    from snapshotter.layer.generate import build_layer
    from snapshotter.layer.plan import LayerPlan
    from snapshotter.state import BUILT_LAYERS, holding, sub

    root = box_with(tmp_path, **{"w.bin": os.urandom(64 << 10)})
    other, other_path = layer_user(root, "w.bin")  # built and held, its upload not started
    plan = LayerPlan("models", "zstd", [entry_from_stat("w.bin", os.lstat(root / "w.bin"))])
    blob = build_layer(str(root), plan, sub(BUILT_LAYERS))  # the same layer, built here
    with holding(blob.path):
        pass  # sent: removed
    assert finish(other) == blob.digest  # the other's blob, read whole after this one went
    assert not os.path.exists(other_path) and not os.listdir(sub(BUILT_LAYERS))


def test_a_killed_runs_built_layer_is_swept_and_a_live_ones_kept(state_dir, tmp_path):
    """A built layer in layers/ (named by its digest) that a killed run never sent is swept once the
    state lock is taken, as is an older snap's (named by its digest alone); one a live process holds
    for its upload stays however old, as does one written within BUILDING_QUIET (its user about to
    hold it)."""
    import signal

    from snapshotter.state import BUILDING_QUIET, BUILT_LAYERS, exclusive, sub

    root = box_with(tmp_path, **{"live.bin": os.urandom(32 << 10), "killed.bin": os.urandom(32 << 10)})
    live, live_path = layer_user(root, "live.bin")
    killed, killed_path = layer_user(root, "killed.bin")
    killed.send_signal(signal.SIGKILL)  # killed while it held its blob, before its upload
    killed.wait()
    layers = sub(BUILT_LAYERS)
    older_snaps, fresh = os.path.join(layers, "c" * 64), os.path.join(layers, "d" * 64 + "-1-1")
    for path in (older_snaps, fresh):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    old = time.time() - BUILDING_QUIET - 60  # as if the blobs were built long ago, not waited for
    for path in (live_path, killed_path, older_snaps):
        os.utime(path, (old, old))
    with exclusive():
        pass
    assert sorted(os.listdir(layers)) == sorted(os.path.basename(p) for p in (live_path, fresh))
    assert finish(live).startswith("sha256:")  # whole for its upload
    assert sorted(os.listdir(layers)) == [os.path.basename(fresh)]


def test_an_older_snaps_last_commit_file_keeps_its_base_and_its_made_snapshots_where_no_restore_ran(state_dir,
                                                                                                      tmp_path):
    """Format 2 had no restore marks: its base and target are read as they are, and the snapshots it
    says this box made count for a root never restored into (the box's own line of work), not for
    one a restore wrote into (made before or after it: not known)."""
    from snapshotter.snapshot.lineage import made_here

    root = str(tmp_path)
    write_versioned(statcache._last_commit_path(root), 2,
                    {"base": "reg/base:1", "target": "reg/box:v1", "made": [MANIFEST]})
    assert statcache.last_base(root) == "reg/base:1" and statcache.last_target(root) == "reg/box:v1"
    assert made_here(root) == [MANIFEST]
    write_versioned(record._path(RootFiles(root)), record.VERSION,
                    {"root": os.path.realpath(root), "manifest": MANIFEST, "restored_at_ns": 1})
    assert made_here(root) == []


def test_snapshots_noted_before_their_tag_moved_never_push_out_the_made_ones(state_dir, tmp_path):
    """A commit notes its snapshot before the registry moves the tag (a stop in between keeps the box
    its tag), one such note at a time: commits whose manifest the registry refused, however many,
    leave the snapshots noted as made where they were, the tag's among them."""
    root, mark = str(tmp_path / "box"), (1, 2, 3)
    statcache.note_last_commit(root, "base", "reg/box:v1", "sha256:" + "a" * 64, mark)
    for i in range(statcache.MADE_KEPT + 1):
        statcache.note_last_commit(root, "base", "reg/box:v1", f"sha256:{i:064x}", mark, pending=True)
    assert statcache.made_from(root, mark) == ["sha256:" + "a" * 64, f"sha256:{statcache.MADE_KEPT:064x}"]
    statcache.note_last_commit(root, "base", "reg/box:v1", f"sha256:{statcache.MADE_KEPT:064x}", mark)
    assert statcache.made_from(root, mark) == ["sha256:" + "a" * 64, f"sha256:{statcache.MADE_KEPT:064x}"]
