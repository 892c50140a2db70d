"""`snap watch` against the real test registry: snapshots when the box changes, the moving tag only on
complete snapshots, big files sent ahead and never half-written, --keep, registry outages, signals,
provider notices (emulated metadata services), --daemon/--stop, kill -9 at random moments.

The loop is driven two ways, both without sleeps: in-process through Watcher.tick() with a clock the
test moves, and as the real `snap watch` process, waited on through the lines it prints."""

import json
import os
import random
import re
import select
import signal
import subprocess
import sys

import pytest

from snapshotter import CommitOptions, restore_image
from snapshotter.commit import push as push_module
from snapshotter.errors import SnapError
from snapshotter.profile import load_profile, parse_profile
from snapshotter.registry.remote import Remote
from snapshotter.restore.restore import RestoreOptions
from snapshotter.state import read_versioned
from snapshotter.watch import daemon
from snapshotter.watch.notices import detect_provider, notice_watcher
from snapshotter.watch.watcher import STOP_SIGNALS, Watcher, WatchOptions, watch

from support.faults import HostileServer, MetadataServer, fake_dmi
from support.images import push_base_image, snap_layers
from support.registry import RegistryServer, digest_of, diverged_tags
from support.run import SNAP, TIMEOUT, assert_one_line_error, snap
from support.trees import NOT_CAPTURED, SMALL_WEIGHTS, snapshot_of_tree, write_tree
from support.watch import FAST, FakeClock, WatchProcess, watcher

MiB = 1024 * 1024


def tags(registry, repo):
    """The repository's tags but the artifact tags of the base index and the skeletons (index/base.py,
    snapshot/skeleton.py)."""
    found = registry.session().get(f"{registry.url}/v2/{repo}/tags/list").json().get("tags") or []
    return sorted(t for t in found if not t.startswith("snap-index-") and t != "snap-skeletons")


def assert_restores_to(ref, tree, tmp_path, name):
    out = tmp_path / name
    restore_image(ref, str(out))
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == tree


# ---- the loop, in process -------------------------------------------------------------------------


def test_changes_are_snapshotted_at_most_once_per_interval_and_the_tag_moves(registry, base_ref, box, tmp_path):
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "w-every", lines, clock, every=600, quiet=10**6)
    w.tick()
    first = [t for t in tags(registry, "w-every") if t != "v2"]
    assert len(first) == 1 and digest_of(registry, "w-every", "v2") == digest_of(registry, "w-every", first[0])
    assert_restores_to(f"{registry.host}/w-every:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r1")

    w.tick()  # nothing changed: no snapshot
    write_tree(box, {"opt/app/notes.txt": "edited\n"})
    clock.advance(60)
    w.tick()  # changed, but the interval is not over
    assert len(tags(registry, "w-every")) == 2
    clock.advance(600)
    w.tick()
    snaps = [t for t in tags(registry, "w-every") if t != "v2"]
    assert len(snaps) == 2 and all(t.startswith("v2-") and t.endswith("Z") for t in snaps)
    assert digest_of(registry, "w-every", "v2") == digest_of(registry, "w-every", max(snaps))
    assert_restores_to(f"{registry.host}/w-every:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r2")


def test_the_scan_pace_budgets_the_whole_check_not_only_the_scan(registry, base_ref, box, monkeypatch):
    """An idle watcher's CPU is its checks': the scan and the comparison of its paths with the last
    ones. The pace keeps all of it near the budget (paced on the scan alone, it went 10-20% over).
    Without change notifications, as on a box where inotify is not available."""
    cpu = FakeClock()
    w = watcher(registry, base_ref, box, "w-pace", [], every=600, quiet=10**6, cpu_clock=cpu, scan_budget=0.01,
                min_scan=2,
                events=False)
    w.tick()  # the first snapshot
    observe = w._observe

    def costly_observe(scan, now):
        cpu.advance(3.0)  # comparing this scan with the last one took 3 CPU s
        return observe(scan, now)

    monkeypatch.setattr(w, "_observe", costly_observe)
    w.tick()  # nothing changed: a check only
    assert w.next_interval() == pytest.approx(3.0 / 0.01)


def test_the_watcher_looks_at_its_repository_through_one_connection(registry, base_ref, box, monkeypatch):
    """The lineage checks, the tag moves, the first snapshot's comparison and --keep's pruning share
    one connection to the moving tag's repository per round (each made its own: a ping, a token);
    a new round makes a new one (a ping again, the credentials read again). The pushes' own are
    commit/push.py's."""
    made = []
    real_init = Remote.__init__

    def counting_init(self, ref, options=None):
        if ref.repository == "w-one-remote":
            made.append(sys._getframe(1).f_globals["__name__"])
        real_init(self, ref, options)

    monkeypatch.setattr(Remote, "__init__", counting_init)
    clock = FakeClock()
    w = watcher(registry, base_ref, box, "w-one-remote", [], clock, every=0, quiet=10**6, keep=1)
    w.tick()
    write_tree(box, {"opt/app/notes.txt": "a second snapshot\n"})
    clock.advance(60)
    w.tick()
    assert len(w.tags.snapshot_tags(tags(registry, "w-one-remote"))) == 1  # pruned: the second went in
    assert [m for m in made if m != "snapshotter.commit.push"] == ["snapshotter.snapshot.diverged"] * 2


def test_after_a_restore_the_watcher_adds_no_snapshot_until_something_changes(registry, base_ref, box, tmp_path):
    """The container recipe: restore the last snapshot, then watch. The restored box is the moving
    tag's snapshot already (the restore's record says which layers it wrote): nothing is pushed."""
    lines = []
    watcher(registry, base_ref, box, "w-restored", lines, every=0).tick()
    out = tmp_path / "restored"
    restore_image(f"{registry.host}/w-restored:v2", str(out))
    before = tags(registry, "w-restored")
    clock = FakeClock()
    w = watcher(registry, base_ref, str(out), "w-restored", lines, clock, every=0)
    w.tick()
    assert tags(registry, "w-restored") == before
    assert lines[-1].endswith("already holds this box: nothing to send")
    write_tree(str(out), {"opt/app/after-restore.txt": "new work\n"})
    clock.advance(1)
    w.tick()
    assert len(tags(registry, "w-restored")) == len(before) + 1
    assert_restores_to(f"{registry.host}/w-restored:v2", snapshot_of_tree(str(out), skip=NOT_CAPTURED),
                       tmp_path, "again")


def test_a_vm_without_base_image_is_watched_with_base_scratch(registry, box, tmp_path):
    lines, clock = [], FakeClock()
    w = watcher(registry, "scratch", box, "w-scratch", lines, clock, every=0)
    w.tick()
    write_tree(box, {"opt/app/vm-work.txt": "on a VM\n"})
    clock.advance(1)
    w.tick()
    m = registry.manifest("w-scratch", "v2")
    assert m["annotations"]["dev.snap.base-layers"] == "0"
    assert len([t for t in tags(registry, "w-scratch") if t != "v2"]) == 2
    assert_restores_to(f"{registry.host}/w-scratch:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")


def test_a_burst_of_writes_is_snapshotted_once_it_is_quiet(registry, base_ref, box):
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "w-burst", lines, clock, profile=parse_profile(SMALL_WEIGHTS),
                every=3600, quiet=30, stable=5)
    w.tick()
    write_tree(box, {f"opt/app/models/loras/l{i}.safetensors": os.urandom(MiB + i) for i in range(3)})
    w.tick()  # the burst: still going as far as the watcher knows
    clock.advance(10)
    w.tick()  # quiet for 10 s: not yet (the weights are sent ahead, being stable)
    assert len(tags(registry, "w-burst")) == 2
    clock.advance(25)
    w.tick()  # quiet for 35 s: snapshot now, long before --every
    assert len(tags(registry, "w-burst")) == 3
    m = registry.manifest("w-burst", "v2")
    assert {f"opt/app/models/loras/l{i}.safetensors" for i in range(3)} <= set(snap_layers(m))


def test_big_files_go_ahead_when_stable_and_never_half_written(registry, base_ref, box, tmp_path):
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "w-ahead", lines, clock, profile=parse_profile(SMALL_WEIGHTS),
                every=0, quiet=10**6, stable=5)
    w.tick()
    path = os.path.join(box, "opt/app/models/checkpoints/new.safetensors")
    data = os.urandom(3 * MiB)
    with open(path, "wb") as f:
        f.write(data[:MiB])  # half-written: the download is still going
    w.tick()  # --every 0: a snapshot now, without the file being written
    held = "held back: '/opt/app/models/checkpoints/new.safetensors' (still being written)"
    assert any(held in line for line in lines), lines
    m = registry.manifest("w-ahead", "v2")
    assert "opt/app/models/checkpoints/new.safetensors" not in snap_layers(m)
    with open(path, "ab") as f:
        f.write(data[MiB:])
    clock.advance(2)
    w.tick()  # complete, but not stable yet: still held back
    assert "opt/app/models/checkpoints/new.safetensors" not in snap_layers(registry.manifest("w-ahead", "v2"))

    # Stable: its layer goes up first, then the snapshot finds it in the registry.
    clock.advance(5)
    w.opts.every = 3600  # sent ahead only; no snapshot due
    w.tick()
    ahead = [line for line in lines
             if line.startswith("sent ahead: 'models (opt/app/models/checkpoints/new.safetensors)'")]
    assert ahead and "uploaded" in ahead[0]
    assert "opt/app/models/checkpoints/new.safetensors" not in snap_layers(registry.manifest("w-ahead", "v2"))
    w.opts.every = 0
    w.tick()
    layer = snap_layers(registry.manifest("w-ahead", "v2"))["opt/app/models/checkpoints/new.safetensors"]
    assert layer["size"] > 3 * MiB
    pushed = [line for line in lines if line.startswith("snapshot ")][-1]
    # the weight was not sent again
    assert "; sent " in pushed and not any(unit in pushed for unit in (" MiB", " GiB")), pushed
    assert_restores_to(f"{registry.host}/w-ahead:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")


# The default profile with big files (1 MiB and up) in layers of their own only under models/: a big
# file elsewhere is not a weight (min_size stays 64 MiB) and shares the `rest` layer with small files.
BIG_ELSEWHERE = open(os.path.join(os.path.dirname(__file__), "..", "layers", "default.yaml")).read() \
    .replace("file_layer_min: 64MiB", "file_layer_min: 1MiB")


def train(registry, base_ref, box, repo, profile, path: str, data: bytes, monkeypatch):
    """A watcher (a snapshot at every tick) sees a training run write a file and a log: a snapshot
    while the file is new (it is held back), then one once it is stable (5 s by the test's clock).
    The watcher, its clock, its lines, and the box files its commits read (CommitHooks.after_read)
    from now on; the stat cache trusts new files."""
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)  # a layer built now goes into the stat cache
    reads: list[str] = []
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, repo, lines, clock, profile=parse_profile(profile), every=0, quiet=10**6,
                stable=5, after_read=lambda path, attempt: reads.append(path))
    w.tick()
    write_tree(box, {path: data, "opt/app/train.log": "step 1\n"})
    w.tick()
    clock.advance(5)
    w.tick()
    reads.clear()
    return w, clock, lines, reads


def overwrite_while_due(w: Watcher, box: str, path: str) -> None:
    """The run overwrites a third of the file in place, and the log, when the next snapshot is due."""
    with open(os.path.join(box, path), "r+b") as f:
        f.write(os.urandom(MiB))
    write_tree(box, {"opt/app/train.log": "step 100\n"})
    w.tick()


def test_a_big_file_rewritten_at_snapshot_time_keeps_its_last_snapshotted_version(registry, base_ref, box, tmp_path,
                                                                                  monkeypatch):
    """A checkpoint overwritten by a training run when a snapshot is due: the snapshot keeps the
    version the last one holds (its layer reused, the file not read: it would tear) instead of losing
    it; once stable, the next snapshot takes the new version. One no snapshot had is left out."""
    ckpt = "opt/app/models/checkpoints/run.safetensors"
    v1, v2 = os.urandom(3 * MiB), os.urandom(3 * MiB)
    w, clock, lines, reads = train(registry, base_ref, box, "w-carry", SMALL_WEIGHTS, ckpt, v1, monkeypatch)
    # While new, in no snapshot yet: left out; once stable, sent ahead and in the snapshot.
    assert any(f"held back: '/{ckpt}' (still being written); left out;" in line for line in lines), lines
    held_snapshot = w.tags.snapshot_tags(tags(registry, "w-carry"))[1]
    assert ckpt not in snap_layers(registry.manifest("w-carry", held_snapshot))
    first = snap_layers(registry.manifest("w-carry", "v2"))[ckpt]

    overwrite_while_due(w, box, ckpt)
    assert any(f"held back: '/{ckpt}' (still being written); kept the last snapshot's version" in line
               for line in lines), lines
    assert "opt/app/train.log" in reads and ckpt not in reads
    assert snap_layers(registry.manifest("w-carry", "v2"))[ckpt]["digest"] == first["digest"]
    out = tmp_path / "r2"
    restore_image(f"{registry.host}/w-carry:v2", str(out))
    assert (out / ckpt).read_bytes() == v1
    assert (out / "opt/app/train.log").read_text() == "step 100\n"

    # Written whole, then seen unchanged for 5 s: the next snapshot takes it.
    with open(os.path.join(box, ckpt), "wb") as f:
        f.write(v2)
    w.tick()
    clock.advance(5)
    w.tick()
    assert snap_layers(registry.manifest("w-carry", "v2"))[ckpt]["digest"] != first["digest"]
    assert_restores_to(f"{registry.host}/w-carry:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r3")
    assert (tmp_path / "r3" / ckpt).read_bytes() == v2


def test_a_held_file_whose_layer_would_be_built_again_is_left_out_unread(registry, base_ref, box, tmp_path,
                                                                         monkeypatch):
    """A big file being rewritten whose last snapshot's layer cannot be reused whole (it shares the
    `rest` bundle with a file that changed too) is never read: it is left out, and the line says why."""
    big = "opt/app/data/cache.dat"
    v1 = os.urandom(2 * MiB)
    w, _, lines, reads = train(registry, base_ref, box, "w-carry-bundle", BIG_ELSEWHERE, big, v1, monkeypatch)
    out = tmp_path / "r1"
    restore_image(f"{registry.host}/w-carry-bundle:v2", str(out))
    assert (out / big).read_bytes() == v1

    reads.clear()
    overwrite_while_due(w, box, big)
    assert "opt/app/train.log" in reads and big not in reads
    assert any(f"held back: '/{big}' (still being written); left out: the last snapshot's version shares a layer"
               in line for line in lines), lines
    out = tmp_path / "r2"
    restore_image(f"{registry.host}/w-carry-bundle:v2", str(out))
    assert not (out / big).exists() and (out / "opt/app/train.log").read_text() == "step 100\n"


def test_the_final_snapshot_leaves_out_a_big_file_that_would_not_fit_in_the_grace(registry, base_ref, box, tmp_path):
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "w-grace", lines, clock, profile=parse_profile(SMALL_WEIGHTS),
                every=3600, quiet=10**6, stable=5, grace=4)
    w.tick()
    write_tree(box, {"opt/app/models/checkpoints/late.safetensors": os.urandom(2 * MiB),
                     "opt/app/notes.txt": "small, made it\n"})
    clock.advance(10)  # complete and stable, but never sent ahead (no tick since)
    w.big.throughput = 100_000  # bytes/s measured so far: 2 MiB would take 20 s
    assert w.final("test notice") == 0
    assert any("held back: '/opt/app/models/checkpoints/late.safetensors' (not sent yet, would not fit in the 4s grace)"
               in line for line in lines), lines
    m = registry.manifest("w-grace", "v2")
    assert "opt/app/models/checkpoints/late.safetensors" not in snap_layers(m)
    out = tmp_path / "r"
    restore_image(f"{registry.host}/w-grace:v2", str(out))
    assert (out / "opt/app/notes.txt").read_text() == "small, made it\n"
    assert not (out / "opt/app/models/checkpoints/late.safetensors").exists()


@pytest.mark.parametrize("deletes", [True, False], ids=["registry-deletes", "registry-refuses-deletes"])
def test_keep_deletes_the_oldest_snapshots(deletes, base_rootfs, box, tmp_path):
    reg = RegistryServer(str(tmp_path / "reg"), delete=deletes).start()
    try:
        push_base_image(reg, "base", "1", base_rootfs)
        lines, clock = [], FakeClock()
        w = watcher(reg, f"{reg.host}/base:1", box, "keep", lines, clock, every=0, keep=2)
        for i in range(4):
            write_tree(box, {"opt/app/counter.txt": f"{i}\n"})
            clock.advance(1)
            w.tick()
        snaps = [t for t in tags(reg, "keep") if t != "v2"]
        refusals = [line for line in lines if "does not allow deleting manifests" in line]
        if deletes:
            assert len(snaps) == 2 and not refusals
            assert digest_of(reg, "keep", "v2") == digest_of(reg, "keep", max(snaps))
        else:
            assert len(snaps) == 4 and len(refusals) == 1
        assert_restores_to(f"{reg.host}/keep:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")
    finally:
        reg.stop()


def test_keep_prunes_only_the_diverged_tags_this_box_made_never_another_boxs(registry, proxy, base_ref, box,
                                                                            base_rootfs, tmp_path, monkeypatch):
    """Another box's diverged tag holds that box's work, however old it is (a box diverged for weeks
    has the oldest): --keep 1 deleted it. A box prunes only the diverged tags it made (its stat cache's
    made_from), the oldest beyond N, never another box's, never the tag."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    target = f"{registry.host}/keep-diverged:v2"
    snap("commit", target, "--base", base_ref, "--root", box, check=True)
    good = digest_of(registry, "keep-diverged", "v2")
    other = tmp_path / "other"  # a box diverged long ago, still working
    subprocess.run(["cp", "-a", base_rootfs, str(other)], check=True)
    write_tree(str(other), {"opt/app/work.txt": "the other box's\n"})
    snap("commit", target, "--base", base_ref, "--root", str(other), "--diverge", check=True)
    [theirs] = diverged_tags(registry, "keep-diverged")
    their_work = digest_of(registry, "keep-diverged", theirs)
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", base_rootfs, str(root)], check=True)
    lines, clock = [], FakeClock()
    clock.advance(1)  # after theirs
    w = watcher(registry, base_ref, str(root), "keep-diverged", lines, clock, every=0, keep=1)
    write_tree(str(root), {"opt/app/mine.txt": "work\n"})
    w.tick()
    [_, first] = diverged_tags(registry, "keep-diverged")
    layers = {d["digest"] for d in snap_layers(registry.manifest("keep-diverged", "v2")).values()}
    proxy.answer = lambda method, path: (503, {}) if method == "GET" and path.rsplit("/", 1)[-1] in layers else None
    with pytest.raises(SnapError):  # a restore that fails half-way: the next snapshots go to a new diverged tag
        restore_image(f"{proxy.host}/keep-diverged:v2", str(root), RestoreOptions(only_snapshot=True))
    write_tree(str(root), {"opt/app/after.txt": "after the failed restore\n"})
    clock.advance(1)
    w.tick()
    second = diverged_tags(registry, "keep-diverged")[-1]
    assert diverged_tags(registry, "keep-diverged") == [theirs, second] and second != first, lines
    assert f"deleted old snapshot {first}" in lines and not any(theirs in line for line in lines), lines
    assert digest_of(registry, "keep-diverged", theirs) == their_work
    assert digest_of(registry, "keep-diverged", "v2") == good
    assert_restores_to(f"{registry.host}/keep-diverged:{second}", snapshot_of_tree(str(root), skip=NOT_CAPTURED),
                       tmp_path, "r")


def test_the_final_snapshot_prunes_nothing(registry, proxy, base_ref, box, tmp_path, monkeypatch):
    """--keep's pruning is not done inside the final snapshot, after the tag moved (a registry whose
    tag list then fails would make `snap watch` exit non-zero): the next watcher prunes. The tag
    names the final snapshot, exit 0."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    lines, clock = [], FakeClock()
    w = watcher(proxy, base_ref, box, "final-keep", lines, clock, every=0, keep=1, grace=60)
    w.tick()
    write_tree(box, {"opt/app/last-minute.txt": "saved by the final snapshot\n"})
    proxy.answer = lambda method, path: (503, {}) if "/tags/list" in path else None
    assert w.final("signal SIGTERM") == 0, lines
    snaps = w.tags.snapshot_tags(tags(registry, "final-keep"))
    assert len(snaps) == 2 and lines[-1].startswith(f"final snapshot {snaps[-1]} pushed"), lines
    assert digest_of(registry, "final-keep", "v2") == digest_of(registry, "final-keep", snaps[-1])
    assert_restores_to(f"{registry.host}/final-keep:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")


class FullLog(list):
    """The watcher's lines; once `full`, writing a snapshot's line fails as on a full disk."""

    full = False

    def append(self, msg: str) -> None:
        if self.full and msg.startswith("snapshot "):
            raise OSError(28, "No space left on device")
        super().append(msg)


def test_a_final_snapshot_that_fails_after_its_tag_moved_says_the_tag_names_it(registry, base_ref, box, tmp_path):
    """What fails once the tag names the final snapshot (here its log line: the log's disk is full)
    loses nothing: exit 0, the tag named, the failure a warning, never "v2 still names" the one before."""
    lines, clock = FullLog(), FakeClock()
    w = watcher(registry, base_ref, box, "final-moved", lines, clock, every=0, grace=60)
    w.tick()
    write_tree(box, {"opt/app/last-minute.txt": "saved by the final snapshot\n"})
    lines.full = True
    assert w.final("signal SIGTERM") == 0, lines
    snaps = w.tags.snapshot_tags(tags(registry, "final-moved"))
    assert lines[-2].startswith(f"final snapshot {snaps[-1]} pushed; {registry.host}/final-moved:v2 names it"), lines
    assert lines[-1] == "warning: the final snapshot then failed: [Errno 28] No space left on device", lines
    assert digest_of(registry, "final-moved", "v2") == digest_of(registry, "final-moved", snaps[-1])
    assert_restores_to(f"{registry.host}/final-moved:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")


def test_a_registry_outage_is_retried_and_never_stops_the_loop(base_rootfs, box, tmp_path):
    reg = RegistryServer(str(tmp_path / "reg")).start()
    try:
        push_base_image(reg, "base", "1", base_rootfs)
        lines, clock = [], FakeClock()
        w = watcher(reg, f"{reg.host}/base:1", box, "outage", lines, clock, every=0)
        w.tick()
        before = digest_of(reg, "outage", "v2")
        reg.stop()
        write_tree(box, {"opt/app/during-outage.txt": "x\n"})
        w.tick()
        assert "not reachable" in lines[-1] and "trying again in 1s" in lines[-1]
        clock.advance(1)
        w.tick()
        assert "trying again in 2s" in lines[-1]  # backoff grows
        reg.start()
        assert digest_of(reg, "outage", "v2") == before
        w.tick()  # still backing off: nothing tried
        clock.advance(2)
        w.tick()
        assert digest_of(reg, "outage", "v2") != before
        assert_restores_to(f"{reg.host}/outage:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")
    finally:
        reg.stop()


def test_credentials_that_fail_once_are_retried_and_never_stop_the_loop(base_rootfs, box, tmp_path, monkeypatch):
    """A credential helper that fails once (ecr-login's STS call, a locked keyring) stopped the loop
    for good (exit 4) and the box ran unprotected; it is retried with the outage's backoff, one line."""
    reg = RegistryServer(str(tmp_path / "reg"), auth=("u", "p")).start()
    try:
        helpers, failing = tmp_path / "bin", tmp_path / "helper-fails"
        helpers.mkdir()
        helper = helpers / "docker-credential-flaky"
        helper.write_text(f"#!{sys.executable}\nimport json, os, sys\nsys.stdin.read()\n"
                          f"if os.path.exists({str(failing)!r}):\n    sys.exit(1)\n"
                          "print(json.dumps({'Username': 'u', 'Secret': 'p'}))\n")
        helper.chmod(0o755)
        (tmp_path / "config.json").write_text(json.dumps({"credHelpers": {reg.host: "flaky"}}))
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
        monkeypatch.setenv("PATH", f"{helpers}:{os.environ['PATH']}")
        push_base_image(reg, "base", "1", base_rootfs)
        lines, clock = [], FakeClock()
        w = watcher(reg, f"{reg.host}/base:1", box, "flaky", lines, clock, every=0)
        w.tick()
        before = digest_of(reg, "flaky", "v2")
        failing.write_text("")
        write_tree(box, {"opt/app/work.txt": "work\n"})
        clock.advance(10)
        w.tick()
        assert "trying again in 1s" in lines[-1] and "SNAP_USERNAME" in lines[-1], lines[-1]
        failing.unlink()
        clock.advance(1)
        w.tick()
        assert digest_of(reg, "flaky", "v2") != before
        assert_restores_to(f"{reg.host}/flaky:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")
    finally:
        reg.stop()


def test_a_loop_that_fails_still_makes_the_final_snapshot_before_the_exit(registry, base_ref, box, tmp_path,
                                                                          monkeypatch):
    """A bug (or a usage error) that stops the loop: `snap watch` exited at once, and what the box did
    since its last snapshot was lost. The final snapshot still runs first; the code says why (1: a bug)."""
    real_step, steps = Watcher._step, []

    def step(self, now):
        steps.append(now)
        if len(steps) > 1:
            write_tree(box, {"opt/app/work.txt": "done since the last snapshot\n"})
            raise RuntimeError("a bug")
        real_step(self, now)

    monkeypatch.setattr(Watcher, "_step", step)
    lines = []
    opts = WatchOptions(commit=CommitOptions(root=box, profile=load_profile()), every=0, log=lines.append)
    handlers = {s: signal.getsignal(s) for s in STOP_SIGNALS}  # watch() sets its own: pytest's come back
    try:
        code = watch(f"{registry.host}/loop-bug:v2", base_ref, opts)
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert code == 1 and "snap: internal error: RuntimeError: a bug" in lines, lines
    assert "the watch loop stopped: final snapshot" in lines[-3] and lines[-1].startswith("final snapshot "), lines
    assert_restores_to(f"{registry.host}/loop-bug:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")


# ---- the real process: signals, notices, daemon, kill -9 ------------------------------------------


# The watchers these tests signal: a change made just before the signal is the final snapshot's (a
# box quiet for SNAP_WATCH_QUIET seconds would send it by itself first).
LEFT_FOR_THE_FINAL = {"SNAP_WATCH_QUIET": "3600"}


def start_watch(registry, base_ref, box, repo, *extra, env=None) -> WatchProcess:
    p = WatchProcess(f"{registry.host}/{repo}:v2", "--base", base_ref, "--root", box, "--every", "1h", *extra,
                     env={**LEFT_FOR_THE_FINAL, **(env or {})})
    p.wait_for("watching ")
    p.wait_for(" moved to it")  # the first snapshot
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_makes_one_final_snapshot_then_exit_0(sig, registry, base_ref, box, tmp_path):
    p = start_watch(registry, base_ref, box, f"sig-{sig.name.lower()}")
    write_tree(box, {"opt/app/last-minute.txt": "saved by the final snapshot\n"})
    p.proc.send_signal(sig)
    assert p.finish() == 0, "".join(p.seen)
    assert any(f"signal {sig.name}: final snapshot" in line for line in p.seen)
    assert any("final snapshot v2-" in line for line in p.seen)
    assert_restores_to(f"{registry.host}/sig-{sig.name.lower()}:v2", snapshot_of_tree(box, skip=NOT_CAPTURED),
                       tmp_path, "r")


def test_a_watcher_whose_state_disk_fills_up_still_snapshots_and_stops_with_its_own_code(registry, base_ref, box,
                                                                                        full_state_disk, tmp_path,
                                                                                        monkeypatch):
    """A model download fills the disk the state dir lives on while the watcher runs: its final
    snapshot still goes up (a layer compressed as it is sent), the tag names it, and the watcher
    ends with exit 0, noted in its exit file for `--stop` (the state dir's reserve)."""
    state, fill = full_state_disk
    monkeypatch.setenv("SNAP_STATE_DIR", str(state))
    p = start_watch(registry, base_ref, box, "full-watch")
    fill()
    write_tree(box, {"opt/app/custom_nodes/NodeC/weights.bin": os.urandom(6 << 20),
                     "opt/app/last-minute.txt": "saved while the disk was full\n"})
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 0, "".join(p.seen)
    assert any("no room to build it" in line for line in p.seen), "".join(p.seen)
    assert read_versioned(daemon.watch_files(box).exit, daemon.VERSION)["code"] == 0
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "elsewhere"))
    assert_restores_to(f"{registry.host}/full-watch:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")


def test_a_watch_without_a_terminal_logs_its_snapshots_progress_with_their_time(registry, base_ref, box):
    p = start_watch(registry, base_ref, box, "logged-watch", env={"SNAP_QUIET": "", "SNAP_PROGRESS_EVERY": "0"})
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 0, "".join(p.seen)
    stamped = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (scanning box|packing|uploading): ")
    progress = [line for line in p.seen if stamped.match(line)]
    for what in ("scanning box: started", "uploading: started", "uploading: done, "):
        assert any(what in line for line in progress), (what, "".join(p.seen))
    assert not any("\r" in line or "\x1b" in line for line in p.seen)


def test_a_final_snapshot_that_cannot_finish_exits_non_zero_and_the_tag_stays(base_rootfs, box, tmp_path):
    reg = RegistryServer(str(tmp_path / "reg")).start()
    try:
        push_base_image(reg, "base", "1", base_rootfs)
        before = snapshot_of_tree(box, skip=NOT_CAPTURED)
        p = start_watch(reg, f"{reg.host}/base:1", box, "nograce", "--grace", "1")
        reg.stop()
        write_tree(box, {"opt/app/lost.txt": "the registry is gone\n"})
        p.proc.send_signal(signal.SIGTERM)
        assert p.finish() != 0
        errors = [line for line in p.seen if line.startswith("snap: error: ")]
        assert len(errors) == 1 and "final snapshot" in errors[0] and "v2 still names v2-" in errors[0], p.seen
        reg.start()
        assert_restores_to(f"{reg.host}/nograce:v2", before, tmp_path, "r")
    finally:
        reg.stop()


def test_the_provider_is_read_from_dmi_files_only(tmp_path):
    assert detect_provider(fake_dmi(str(tmp_path / "aws"), sys_vendor="Amazon EC2", product_name="m5.large")) == "aws"
    assert detect_provider(fake_dmi(str(tmp_path / "gcp"), sys_vendor="Google",
                                    product_name="Google Compute Engine")) == "gcp"
    assert detect_provider(fake_dmi(str(tmp_path / "az"), sys_vendor="Microsoft Corporation",
                                    chassis_asset_tag="7783-7084-3265-9085-8269-3286-77")) == "azure"
    # Hyper-V on a desk is Microsoft too, but not Azure; a container usually has no DMI at all.
    assert detect_provider(fake_dmi(str(tmp_path / "hv"), sys_vendor="Microsoft Corporation",
                                    chassis_asset_tag="none")) is None
    assert detect_provider(str(tmp_path / "missing")) is None
    assert notice_watcher("auto", "http://127.0.0.1:9", str(tmp_path / "missing")) is None


@pytest.mark.parametrize("provider,path,bad,good", [
    ("aws", "/latest/meta-data/spot/instance-action", b'"terminate"',
     b'{"action": "terminate", "time": "2026-12-03T12:00:00Z"}'),
    ("azure", "/metadata/scheduledevents?api-version=2020-07-01", b'{"Events": 3}',
     b'{"Events": [{"EventId": "A1", "EventType": "Preempt", "NotBefore": "soon"}]}'),
    ("azure", "/metadata/scheduledevents?api-version=2020-07-01", b"[1, 2]", b'{"Events": []}'),
], ids=["aws-string", "azure-events-number", "azure-list"])
def test_a_metadata_answer_of_no_notices_form_is_no_notice_said_once(provider, path, bad, good):
    """JSON that is not an object (or Events not a list) is no notice, said once: it must not end the
    notices thread, after which no reclaim notice would be seen again."""
    server = HostileServer().start()
    try:
        answers = {("PUT", "/latest/api/token"): [b"token"], ("GET", path): [bad]}
        server.answer = lambda method, p: (200, {"Content-Type": "application/json"}, answers[(method, p)]) \
            if (method, p) in answers else (404, {}, [])
        notices, lines = notice_watcher(provider, f"http://{server.host}"), []
        assert notices.check(lines.append) is None and notices.check(lines.append) is None
        assert len(lines) == 1 and "taken as no notice" in lines[0] and "not" in lines[0], lines
        answers[("GET", path)] = [good]
        assert (notices.check(lines.append) is not None) == (good != b'{"Events": []}')
        assert len(lines) == 1, lines
    finally:
        server.stop()


@pytest.mark.parametrize("provider,dmi", [
    ("aws", {"sys_vendor": "Amazon EC2"}),
    ("gcp", {"product_name": "Google Compute Engine"}),
    ("azure", {"chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77"}),
])
def test_a_reclaim_notice_makes_the_final_snapshot(provider, dmi, registry, base_ref, box, tmp_path):
    server = MetadataServer(provider).start()
    try:
        # The emulation itself refuses a request without the provider's header.
        import requests
        path = {"aws": "/latest/meta-data/spot/instance-action", "gcp": "/computeMetadata/v1/instance/preempted",
                "azure": "/metadata/scheduledevents?api-version=2020-07-01"}[provider]
        refusal = {"aws": 401, "gcp": 403, "azure": 400}[provider]  # each provider's answer to a bare request
        assert requests.get(server.url + path, timeout=5).status_code == refusal
        server.refused.clear()
        env = {"SNAP_DMI_DIR": fake_dmi(str(tmp_path / "dmi"), **dmi), "SNAP_METADATA_URL": server.url}
        p = start_watch(registry, base_ref, box, f"notice-{provider}", env=env)
        assert any(f"{provider} notices at {server.url}" in line for line in p.seen)
        assert server.answered.wait(TIMEOUT)  # it polls, headers and all
        write_tree(box, {"opt/app/before-reclaim.txt": provider})
        server.preempt()
        assert p.finish() == 0, "".join(p.seen)
        assert any("reclaim notice" in line for line in p.seen)
        assert not server.refused
        assert_restores_to(f"{registry.host}/notice-{provider}:v2", snapshot_of_tree(box, skip=NOT_CAPTURED),
                           tmp_path, "r")
    finally:
        server.stop()


def test_no_metadata_request_off_cloud(registry, base_ref, box, tmp_path):
    server = MetadataServer("aws").start()
    try:
        env = {"SNAP_DMI_DIR": fake_dmi(str(tmp_path / "dmi"), sys_vendor="QEMU"), "SNAP_METADATA_URL": server.url}
        p = start_watch(registry, base_ref, box, "offcloud", env=env)
        assert any("no provider notices" in line for line in p.seen)
        p.proc.send_signal(signal.SIGTERM)
        assert p.finish() == 0
        assert server.requests == []
    finally:
        server.stop()


def start_daemon(registry_host, base_ref, box, repo, stderr, env=None, **kw) -> subprocess.CompletedProcess:
    """`snap watch --daemon` with its stderr on `stderr` (a file or a pipe)."""
    return subprocess.run([*SNAP, "watch", f"{registry_host}/{repo}:v2", "--base",
                           base_ref, "--root", box, "--every", "1h", "--daemon"],
                           stdout=kw.pop("stdout", subprocess.DEVNULL),
                          stderr=stderr, env={**os.environ, **FAST, **LEFT_FOR_THE_FINAL, **(env or {})},
                          timeout=TIMEOUT,
                          **kw)


def test_daemon_returns_to_a_caller_that_reads_its_output(registry, base_ref, box, state_dir):
    """`out=$(snap watch ... --daemon)`: the call returns once the watcher runs (its end of file:
    the detached watcher holds neither of the pipes, nor any other descriptor its caller left open)."""
    r, w = os.pipe()  # a descriptor the caller leaves open to what it starts (a shell's, a supervisor's)
    os.set_blocking(r, False)
    try:
        start = start_daemon(registry.host, base_ref, box, "daemon-capture", subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, pass_fds=(w,))
        os.close(w)
        assert start.returncode == 0, start.stderr
        assert "watching " in start.stderr and "detached: pid file" in start.stderr
        assert os.read(r, 1) == b""  # end of file now: no process holds its other end any more
        pid = json.loads(next((state_dir / "watch").glob("*.pid")).read_text())["pid"]
        held = set()
        for n in os.listdir(f"/proc/{pid}/fd"):  # what it holds for good; a file its scan has open may close meanwhile
            try:
                held.add(os.readlink(f"/proc/{pid}/fd/{n}"))
            except FileNotFoundError:
                pass
        assert f"pipe:[{os.fstat(r).st_ino}]" not in held, held
        assert os.devnull in held and str(next((state_dir / "watch").glob("*.log"))) in held, held
    finally:
        os.close(r)
        stop = snap("watch", "--stop", "--root", box)
    assert stop.returncode == 0, stop.stderr


def test_daemon_one_per_root_and_stop(registry, base_ref, box, tmp_path, state_dir):
    """The detached watcher's lines go to its log (to its starter too until it is ready, and no more:
    it keeps no descriptor of its starter's); --stop waits for the final snapshot; a second --stop
    tells the code it ended with."""
    out = tmp_path / "starter-stderr"
    with open(out, "w") as err:
        start = start_daemon(registry.host, base_ref, box, "daemon", err)
    assert start.returncode == 0, out.read_text()
    assert "watching " in out.read_text() and "detached: pid file" in out.read_text()
    try:
        again = snap("watch", f"{registry.host}/daemon:v2", "--base", base_ref, "--root", box)
        assert again.returncode == 2
        assert again.stderr.count("\n") == 1 and "already watching" in again.stderr
    finally:
        write_tree(box, {"opt/app/daemon.txt": "flushed by --stop\n"})
        stop = snap("watch", "--stop", "--root", box)
    assert stop.returncode == 0, stop.stderr
    assert stop.stderr.splitlines()[-1].endswith("stopped after its final snapshot (exit code 0)")
    logs = [f for f in os.listdir(state_dir / "watch") if f.endswith(".log")]
    log = (state_dir / "watch" / logs[0]).read_text()
    assert "signal SIGTERM: final snapshot" in log and "final snapshot v2-" in log
    assert out.read_text().splitlines()[-1].startswith("detached: pid file")  # nothing after its starter left
    assert_restores_to(f"{registry.host}/daemon:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")
    ended = snap("watch", "--stop", "--root", box)  # nothing left to stop: says how the last one ended
    assert ended.returncode == 0 and ended.stderr.count("\n") == 1 and "had already ended with code 0" in ended.stderr


def test_daemon_outlives_the_stderr_it_was_started_with(registry, base_ref, box, tmp_path, state_dir):
    """A starter's stderr whose reader is gone (a closed terminal, a pipe closed: EPIPE): the
    watcher goes on, its log file alone, and its final snapshot is made."""
    r, w = os.pipe()
    start = start_daemon(registry.host, base_ref, box, "daemon-epipe", w)
    os.close(w)
    os.close(r)  # the reader is gone: the watcher's next write to it fails with EPIPE
    assert start.returncode == 0
    write_tree(box, {"opt/app/daemon.txt": "after the reader left\n"})
    stop = snap("watch", "--stop", "--root", box)
    assert stop.returncode == 0, stop.stderr
    log = next((state_dir / "watch").glob("*.log")).read_text()
    assert "signal SIGTERM: final snapshot" in log and "Traceback" not in log
    assert_restores_to(f"{registry.host}/daemon-epipe:v2", snapshot_of_tree(box, skip=NOT_CAPTURED), tmp_path, "r")


def test_stop_tells_the_code_of_a_watcher_that_already_ended(base_rootfs, box, tmp_path, state_dir):
    """A watcher that died of an auth error (no credentials for the registry): `--stop` says it had
    already ended, with the error, and exits 4, its code; 5 only for a root no watcher ever watched."""
    never = snap("watch", "--stop", "--root", box)
    assert never.returncode == 5 and "no snap watch has run" in never.stderr
    reg = RegistryServer(str(tmp_path / "auth-registry"), auth=("snapuser", "s3cret-Pa55")).start()
    try:
        push_base_image(reg, "base", "1", base_rootfs)
        out = tmp_path / "starter-stderr"
        with open(out, "w") as err:
            start_daemon(reg.host, f"{reg.host}/base:1", box, "box", err, env={"DOCKER_CONFIG": str(tmp_path)})
        stop = snap("watch", "--stop", "--root", box)
    finally:
        reg.stop()
    assert stop.returncode == 4, (stop.stderr, out.read_text())
    assert stop.stderr.count("\n") == 1, stop.stderr
    assert "had already ended with code 4: snap: error: registry" in stop.stderr and "SNAP_USERNAME" in stop.stderr
    assert "snap: error: registry" in out.read_text()  # the watcher's error reached its starter's stderr too


def test_stop_of_a_watcher_killed_with_9_says_it_left_no_exit_code(registry, base_ref, box, tmp_path, state_dir):
    """A detached watcher killed with -9 left no exit code: `--stop` says that, in one line, and exits 1."""
    with open(tmp_path / "starter-stderr", "w") as err:
        assert start_daemon(registry.host, base_ref, box, "killed-daemon", err).returncode == 0
    pid = json.loads(next((state_dir / "watch").glob("*.pid")).read_text())["pid"]
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        select.select([fd], [], [], TIMEOUT)  # gone: its lock with it
    finally:
        os.close(fd)
    stop = snap("watch", "--stop", "--root", box)
    assert stop.returncode == 1 and stop.stderr.count("\n") == 1, stop.stderr
    assert f"(pid {pid})" in stop.stderr and "leaving no exit code (killed?)" in stop.stderr, stop.stderr
    assert "with code" not in stop.stderr, stop.stderr


def test_kill_9_at_random_moments_leaves_the_tag_on_a_complete_snapshot(registry, base_ref, box, tmp_path):
    """The watcher is killed with -9 after a random one of its progress lines, several times; each
    time the moving tag must restore, byte for byte, to a state the box was in."""
    rng = random.Random(11)
    os.makedirs(os.path.join(box, "opt/app/data"))
    states = [snapshot_of_tree(box, skip=NOT_CAPTURED)]
    env = {"SNAP_WATCH_TRACE": "1"}
    for round_ in range(4):
        p = WatchProcess(f"{registry.host}/kill9:v2", "--base", base_ref, "--root", box, "--every", "0", env=env)
        # Changes land only between snapshots, as whole files (renamed into place).
        for step in range(rng.randint(1, 6)):
            p.wait_for("trace: ")
            if step % 2 == 0:
                part = tmp_path / "part"  # written outside the box, renamed in whole
                part.write_bytes(os.urandom(rng.randint(1, 200_000)))
                os.rename(part, os.path.join(box, f"opt/app/data/r{round_}-{step}.bin"))
                states.append(snapshot_of_tree(box, skip=NOT_CAPTURED))
        p.proc.kill()
        p.finish()
        if digest_of(registry, "kill9", "v2") is None:
            continue  # killed before the first snapshot was complete: no tag yet, which is fine
        out = tmp_path / f"restored-{round_}"
        restore_image(f"{registry.host}/kill9:v2", str(out))
        assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) in states
    assert digest_of(registry, "kill9", "v2") is not None


@pytest.mark.parametrize("args,env,said", [
    (["--grace", "nan"], {}, "--grace nan"),
    (["--grace", "inf"], {}, "--grace inf"),
    (["--grace", "1e10"], {}, "--grace 10000000000.0"),
    (["--grace", "0"], {}, "--grace 0.0"),
    ([], {"SNAP_WATCH_STABLE": "abc"}, "SNAP_WATCH_STABLE='abc'"),
    ([], {"SNAP_WATCH_QUIET": "-1"}, "SNAP_WATCH_QUIET='-1'"),
    ([], {"SNAP_WATCH_STABLE": "1e999"}, "SNAP_WATCH_STABLE='1e999'"),
    ([], {"SNAP_WATCH_MAX_WATCHES": "abc"}, "SNAP_WATCH_MAX_WATCHES='abc'"),
], ids=["grace-nan", "grace-inf", "grace-huge", "grace-zero", "stable-abc", "quiet-negative", "stable-huge",
        "max-watches-abc"])
def test_a_watch_setting_it_cannot_keep_is_refused_before_anything_is_read(registry, base_ref, box, args, env, said):
    """A grace that is no number of seconds would skip the final snapshot at the signal (a NaN wait
    ends at once; a huge one overflows): refused at the start, as is a tuning variable it cannot read."""
    r = snap("watch", f"{registry.host}/badwatch:v1", "--base", base_ref, "--root", box, "--provider", "none",
             *args, env=env, timeout=120)  # taken, the watcher would run on
    assert_one_line_error(r, 2, said)
    assert digest_of(registry, "badwatch", "v1") is None  # nothing pushed
