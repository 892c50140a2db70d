"""The cycle around the round trip, as a reclaimed box lives it: restore, watch, work, a signal, and the
moving tag must still hold what the box had. Against the real test registry.

- The tag moves only forward: from a snapshot this box came from (a finished restore) or made.
- A box that may not move it still saves its work: to TAG-diverged-<UTC time>, a tag of its own,
  until it may move the tag again (a restore of it finished, or the tag put on this box's snapshot).
- A file a restore wrote is not being written; one being written keeps the last snapshot's version
  (or is left out), never a partial; the final snapshot never runs beside the loop's commit.
- A seeded reclaim cycle: `snap watch` on a restored box, files saved in chunks and rewritten in place,
  SIGTERM at seeded moments; the tag restores to every settled file and no torn one. One box starts
  in a registry outage: its restore fails, and what it did is in its diverged tag."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from datetime import datetime, timezone

import pytest

from snapshotter import CommitOptions, commit_box, progress, restore_image
from snapshotter.box.writers import open_for_writing
from snapshotter.commit import push as push_module
from snapshotter.commit.model import CommitHooks
from snapshotter.errors import SnapError
from snapshotter.oci.reference import is_tag
from snapshotter.profile import parse_profile
from snapshotter.restore.restore import RestoreOptions
from snapshotter.snapshot import diverged
from snapshotter.watch import hooks as hooks_module

from support.images import push_base_image, snap_layers
from support.registry import blobs_in, digest_of, diverged_tags
from support.run import TIMEOUT, snap
from support.trees import NOT_CAPTURED, SMALL_WEIGHTS, make_base_rootfs, make_box, snapshot_of_tree, write_tree
from support.watch import FakeClock, WatchProcess, watcher

MiB = 1024 * 1024
WEIGHT = "opt/app/models/checkpoints/model.safetensors"


def profile_file(tmp_path) -> str:
    path = tmp_path / "small-weights.yaml"
    path.write_text(SMALL_WEIGHTS)
    return str(path)


# ---- the tag moves only forward ------------------------------------------------------------------------


def test_a_commit_moves_a_tag_only_from_a_snapshot_the_box_came_from_or_made(registry, base_ref, box, base_rootfs,
                                                                             tmp_path):
    target = f"{registry.host}/forward:v2"
    snap("commit", target, "--base", base_ref, "--root", box, check=True)  # a new tag
    write_tree(box, {"opt/app/more.txt": "second\n"})
    snap("commit", target, "--base", base_ref, "--root", box, check=True)  # one this box made
    made = digest_of(registry, "forward", "v2")

    # A fresh box from the base (nothing restored): the tag is not its to move.
    bare = tmp_path / "bare"
    subprocess.run(["cp", "-a", base_rootfs, str(bare)], check=True)
    before = blobs_in(registry)
    r = snap("commit", target, "--base", base_ref, "--root", str(bare))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("snap: error:")]
    assert len(lines) == 1 and "neither came from" in lines[0] and "--force" in lines[0] and "snap restore" in lines[0]
    assert "--diverge" in lines[0]  # the way on that keeps the work
    assert repr(str(bare)) in lines[0]
    assert digest_of(registry, "forward", "v2") == made and blobs_in(registry) == before  # nothing written

    # Once it has restored the tag, it may; and --force always may.
    restored = tmp_path / "restored"
    snap("restore", target, "--root", str(restored), check=True)
    write_tree(str(restored), {"opt/app/after.txt": "restored, then changed\n"})
    snap("commit", target, "--base", base_ref, "--root", str(restored), check=True)
    assert digest_of(registry, "forward", "v2") != made
    snap("commit", target, "--base", base_ref, "--root", str(bare), "--force", check=True)
    assert snapshot_of_tree(str(bare), skip=NOT_CAPTURED) == _restored_tree(target, tmp_path / "check")


def _restored_tree(ref: str, out) -> dict:
    restore_image(ref, str(out))
    return snapshot_of_tree(str(out), skip=NOT_CAPTURED)


def test_a_failed_restore_does_not_count_as_coming_from_the_image(registry, proxy, base_ref, box, tmp_path,
                                                                  monkeypatch):
    """The trial: the registry fails at start, the restore exits non-zero, the watcher starts on the
    bare base. Neither it nor a commit may move the tag, even where an earlier restore had succeeded."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")  # the 503s are asked again at once, not over ~15 s
    snap("commit", f"{registry.host}/failed:v2", "--base", base_ref, "--root", box, check=True)
    good = digest_of(registry, "failed", "v2")
    root = tmp_path / "root"
    restore_image(f"{registry.host}/failed:v2", str(root), RestoreOptions())  # once fine...
    write_tree(box, {"opt/app/newer.txt": "made elsewhere\n"})
    snap("commit", f"{registry.host}/failed:v3", "--base", base_ref, "--root", box, check=True)
    layers = {d["digest"] for d in registry.manifest("failed", "v3")["layers"]}
    proxy.answer = lambda method, path: (503, {}) if method == "GET" and path.rsplit("/", 1)[-1] in layers else None
    with pytest.raises(SnapError):  # ... then a restore of another snapshot fails half-way
        restore_image(f"{proxy.host}/failed:v3", str(root), RestoreOptions(only_snapshot=True))
    r = snap("commit", f"{registry.host}/failed:v2", "--base", base_ref, "--root", str(root))
    assert r.returncode == 2 and "neither came from" in r.stderr, r.stderr
    lines = []
    w = watcher(registry, base_ref, str(root), "failed", lines, every=0)
    w.tick()  # not refused, and not the tag: the box's own
    assert digest_of(registry, "failed", "v2") == good
    [tag] = diverged_tags(registry, "failed")
    assert any("neither came from" in line and f"failed:{tag}" in line for line in lines), lines
    assert _restored_tree(f"{registry.host}/failed:{tag}", tmp_path / "out") == snapshot_of_tree(str(root),
                                                                                                 skip=NOT_CAPTURED)


def stamp(clock) -> str:
    return datetime.fromtimestamp(clock(), timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def test_a_box_that_may_not_move_the_tag_saves_every_snapshot_to_a_tag_of_its_own(registry, base_ref, box, base_rootfs,
                                                                                 tmp_path):
    """The trial: the restore failed at the box's start, the watcher refused the tag (right) and exited 2
    at its first snapshot, and what the box did next was lost at the reclaim. Now the tag stays where
    it is, the watcher goes on, and every snapshot (the final one included) goes to
    TAG-diverged-<UTC time>, moved forward; the start and each snapshot say so in one line. The
    same box again (a restarted watcher, a cron `snap commit --diverge`) goes on in that tag."""
    target = f"{registry.host}/diverge:v2"
    snap("commit", target, "--base", base_ref, "--root", box, check=True)
    good = digest_of(registry, "diverge", "v2")
    bare = tmp_path / "bare"  # the image alone: its restore failed
    subprocess.run(["cp", "-a", base_rootfs, str(bare)], check=True)
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, str(bare), "diverge", lines, clock, every=0)
    w.tick()
    tag = f"v2-diverged-{stamp(clock)}"
    assert diverged_tags(registry, "diverge") == [tag] and digest_of(registry, "diverge", "v2") == good
    said = [line for line in lines if "is not moved" in line]
    assert len(said) == 1 and f"diverge:{tag}" in said[0] and repr(str(bare)) in said[0], lines
    first = digest_of(registry, "diverge", tag)
    write_tree(str(bare), {"opt/app/work.txt": "done on the box\n"})
    clock.advance(5)
    w.tick()
    assert diverged_tags(registry, "diverge") == [tag] and digest_of(registry, "diverge", tag) != first
    write_tree(str(bare), {"opt/app/last.txt": "just before the reclaim\n"})
    assert w.final("signal SIGTERM") == 0, lines
    snaps = [line for line in lines if line.startswith(("snapshot ", "final snapshot "))]
    assert len(snaps) == 4 and all("v2 not moved" in line and tag in line for line in snaps), lines
    assert digest_of(registry, "diverge", "v2") == good
    assert [t for t in tags_of(registry, "diverge") if t != "v2"] == [tag]  # no TAG-<time> of this box
    assert _restored_tree(f"{registry.host}/diverge:{tag}", tmp_path / "out") == snapshot_of_tree(str(bare),
                                                                                                  skip=NOT_CAPTURED)

    write_tree(str(bare), {"opt/app/cron.txt": "a one-shot commit\n"})
    r = snap("commit", target, "--base", base_ref, "--root", str(bare))
    assert r.returncode == 2 and "--diverge" in r.stderr, r.stderr
    r = snap("commit", target, "--base", base_ref, "--root", str(bare), "--diverge", check=True)
    assert f"pushed {registry.host}/diverge:{tag}@" in r.stdout and "its own from before" in r.stderr, r.stderr
    lines.clear()
    again = watcher(registry, base_ref, str(bare), "diverge", lines, FakeClock(), every=0)
    write_tree(str(bare), {"opt/app/restarted.txt": "a watcher started again\n"})
    again.tick()
    assert diverged_tags(registry, "diverge") == [tag] and digest_of(registry, "diverge", "v2") == good
    assert _restored_tree(f"{registry.host}/diverge:{tag}", tmp_path / "out2") == snapshot_of_tree(str(bare),
                                                                                                   skip=NOT_CAPTURED)


def test_a_snapshot_that_deletes_the_bases_system_is_saved_to_a_diverged_tag_and_the_loop_goes_on(registry, tmp_path):
    """`rm -rf /usr/share/doc` (a system directory of more than 100 paths: box/deletions.py) on a
    watched box: the commit's refusal stopped the watcher (exit 2) and the work after it was saved
    nowhere. Now such a snapshot goes to the box's diverged tag, never the main tag, each snapshot
    line says why; once the directory is back the main tag moves again, and the final snapshot of a
    box that deletes it again goes on in the same diverged tag."""
    base = str(tmp_path / "base")
    os.makedirs(base)
    make_base_rootfs(base)
    write_tree(base, {f"usr/share/doc/pkg{i}/copyright": "c\n" for i in range(120)})
    push_base_image(registry, "doc-base", "1", base)
    box = make_box(base, str(tmp_path / "box"))
    lines, clock = [], FakeClock()
    w = watcher(registry, f"{registry.host}/doc-base:1", box, "doc-clean", lines, clock, every=0)
    w.tick()
    good = digest_of(registry, "doc-clean", "v2")
    shutil.rmtree(os.path.join(box, "usr/share/doc"))  # a common cleanup
    write_tree(box, {"opt/app/work.txt": "hours of work\n"})
    for i in range(2):
        clock.advance(10)
        w.tick()
        write_tree(box, {"opt/app/more.txt": f"{i}\n"})
    [tag] = diverged_tags(registry, "doc-clean")
    assert digest_of(registry, "doc-clean", "v2") == good
    snaps = [line for line in lines if line.startswith("snapshot ")][1:]
    assert len(snaps) == 2 and all(f"doc-clean:{tag} " in line and "v2 not moved (the box deletes " in line
                                   and "/usr/share/doc" in line for line in snaps), lines
    clock.advance(10)
    w.tick()
    assert _restored_tree(f"{registry.host}/doc-clean:{tag}", tmp_path / "out") == snapshot_of_tree(box,
                                                                                                    skip=NOT_CAPTURED)

    shutil.copytree(os.path.join(base, "usr/share/doc"), os.path.join(box, "usr/share/doc"))
    clock.advance(10)
    w.tick()
    assert digest_of(registry, "doc-clean", "v2") != good and diverged_tags(registry, "doc-clean") == [tag]
    assert any("moving it again" in line and f"doc-clean:{tag} keeps the work" in line for line in lines), lines
    shutil.rmtree(os.path.join(box, "usr/share/doc"))
    write_tree(box, {"opt/app/last.txt": "just before the reclaim\n"})
    main = digest_of(registry, "doc-clean", "v2")
    assert w.final("signal SIGTERM") == 0, lines
    assert f"doc-clean:{tag} names it (v2 not moved (the box deletes" in lines[-1], lines
    assert digest_of(registry, "doc-clean", "v2") == main and diverged_tags(registry, "doc-clean") == [tag]
    assert _restored_tree(f"{registry.host}/doc-clean:{tag}", tmp_path / "out2") == snapshot_of_tree(box,
                                                                                                     skip=NOT_CAPTURED)


def test_a_diverged_tag_is_a_valid_oci_tag_whatever_the_length_of_the_tag():
    """TAG-diverged-<UTC time>[-N] fits the OCI tag grammar (128 characters at most): a long TAG is cut,
    with 8 hex digits of its hash, so that two long tags with one start keep their diverged tags apart."""
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc).timestamp()
    assert diverged.new_name("v2", at, []) == "v2-diverged-20260102T030405Z"
    for tag in ("v2", "a" * 100, "b" * 128, "x" * 120 + "-1.0_y"):
        first = diverged.new_name(tag, at, [])
        second = diverged.new_name(tag, at, [first])
        assert all(is_tag(t) and len(t) <= 128 for t in (first, second)), (first, second)
        assert second == first + "-2" and diverged.names(tag, [second, "other", first]) == [first, second]
    assert diverged.prefix("c" * 120 + "1") != diverged.prefix("c" * 120 + "2")


def tags_of(registry, repo) -> list[str]:
    found = registry.session().get(f"{registry.url}/v2/{repo}/tags/list").json().get("tags") or []
    return sorted(t for t in found if not t.startswith("snap-index-") and t != "snap-skeletons")


def test_a_watcher_whose_tag_another_box_moves_goes_on_in_a_tag_of_its_own(registry, base_ref, box, base_rootfs,
                                                                          tmp_path):
    """Two boxes on one tag: the one that finds it moved by the other leaves it there and saves its
    own snapshots (the one just pushed first) to its diverged tag, instead of stopping (exit 2)."""
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "race", lines, clock, every=0)
    w.tick()
    other = tmp_path / "other"
    subprocess.run(["cp", "-a", base_rootfs, str(other)], check=True)
    write_tree(str(other), {"opt/other.txt": "another box\n"})
    snap("commit", f"{registry.host}/race:v2", "--base", base_ref, "--root", str(other), "--force", check=True)
    theirs = digest_of(registry, "race", "v2")
    write_tree(box, {"opt/app/mine.txt": "this box\n"})
    clock.advance(1)
    w.tick()
    assert digest_of(registry, "race", "v2") == theirs
    [tag] = diverged_tags(registry, "race")
    assert any("by someone else" in line and f"race:{tag}" in line for line in lines), lines
    assert _restored_tree(f"{registry.host}/race:{tag}", tmp_path / "out") == snapshot_of_tree(box, skip=NOT_CAPTURED)
    write_tree(box, {"opt/app/later.txt": "and on\n"})
    clock.advance(1)
    w.tick()
    assert digest_of(registry, "race", "v2") == theirs and diverged_tags(registry, "race") == [tag]
    assert _restored_tree(f"{registry.host}/race:{tag}", tmp_path / "out2") == snapshot_of_tree(box, skip=NOT_CAPTURED)


def _tag_and_bare_box(registry, base_ref, box, base_rootfs, tmp_path, repo: str, files: dict):
    """REPO:v2 committed from `box` with `files`, and a bare box (the base alone): the tag's name, its
    digest, and the bare box's root."""
    target = f"{registry.host}/{repo}:v2"
    write_tree(box, files)
    snap("commit", target, "--base", base_ref, "--root", box, check=True)
    root = tmp_path / "root"
    subprocess.run(["cp", "-a", base_rootfs, str(root)], check=True)
    return target, digest_of(registry, repo, "v2"), root


def _working_on_v2(registry, upstream, base_ref, box, tmp_path, repo: str):
    """v1 and v2 of a box committed, v2 restored into a root, a watcher of it that has snapshotted
    work done there: (root, watcher, its lines, its clock, v2's digest now, the tree v2 holds)."""
    for tag, notes in (("v1", "v1 notes\n"), ("v2", "v2 notes\n")):
        write_tree(box, {"opt/app/notes.txt": notes, f"opt/app/{tag}-only.txt": tag})
        snap("commit", f"{registry.host}/{repo}:{tag}", "--base", base_ref, "--root", box, check=True)
    root = tmp_path / "root"
    restore_image(f"{registry.host}/{repo}:v2", str(root))
    lines, clock = [], FakeClock()
    w = watcher(upstream, base_ref, str(root), repo, lines, clock, every=0)
    write_tree(str(root), {"opt/app/work.txt": "work on v2\n"})
    w.tick()
    return root, w, lines, clock, digest_of(registry, repo, "v2"), _restored_tree(f"{registry.host}/{repo}:v2",
                                                                                   tmp_path / "made")


def _failing_restore(registry, proxy, repo: str, tag: str, root) -> None:
    """A restore of `tag` into `root` that stops with an error before its snap layers are in (the
    registry answers 503 for them), as one that fails half-way: it wrote into the root (the restore
    record is the mark of its start), and the root is neither the image nor what it was."""
    layers = {d["digest"] for d in snap_layers(registry.manifest(repo, tag)).values()}
    proxy.answer = lambda method, path: (503, {}) if method == "GET" and path.rsplit("/", 1)[-1] in layers else None
    with pytest.raises(SnapError):
        restore_image(f"{proxy.host}/{repo}:{tag}", str(root), RestoreOptions(only_snapshot=True))
    proxy.answer = lambda method, path: None


def test_a_restore_of_the_tag_that_finishes_later_puts_the_watcher_back_on_it(registry, proxy, base_ref, box,
                                                                             base_rootfs, tmp_path, monkeypatch):
    """The rule for a restore that succeeds later (the registry came back), docs/watch.md: while
    diverged, a restore into the box leaves the diverged tag as it was (a half-restored box never
    replaces the work: its snapshots go to a new diverged tag); once a restore of the tag's snapshot
    has finished, the watcher moves the tag again, and the diverged tags stay, untouched."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    target, good, root = _tag_and_bare_box(registry, base_ref, box, base_rootfs, tmp_path, "later",
                                           {"opt/app/shared.txt": "the tag's version\n"})
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, str(root), "later", lines, clock, every=0)
    write_tree(str(root), {"opt/app/shared.txt": "this box's version\n", "opt/app/mine.txt": "work\n"})
    w.tick()
    [first] = diverged_tags(registry, "later")
    work, kept = snapshot_of_tree(str(root), skip=NOT_CAPTURED), digest_of(registry, "later", first)

    _failing_restore(registry, proxy, "later", "v2", root)  # a restore that fails half-way: the box is neither
    write_tree(str(root), {"opt/app/during.txt": "after the failed restore\n"})
    clock.advance(1)
    w.tick()
    assert digest_of(registry, "later", first) == kept and digest_of(registry, "later", "v2") == good
    second = diverged_tags(registry, "later")[1]
    assert any("a restore into" in line and f"later:{first} keeps the work" in line for line in lines), lines

    restore_image(f"{proxy.host}/later:v2", str(root), RestoreOptions(only_snapshot=True))
    write_tree(str(root), {"opt/app/after.txt": "on the tag again\n"})
    clock.advance(1)
    w.tick()
    assert digest_of(registry, "later", "v2") != good and diverged_tags(registry, "later") == [first, second]
    assert any("moving it again" in line and f"later:{second} keeps the work" in line for line in lines), lines
    assert _restored_tree(f"{registry.host}/later:{first}", tmp_path / "first") == work
    assert _restored_tree(target, tmp_path / "main") == snapshot_of_tree(str(root), skip=NOT_CAPTURED)
    assert (root / "opt/app/shared.txt").read_text() == "the tag's version\n"  # the restore's; the work's is in `first`


def test_a_restore_back_onto_the_tag_whose_snapshot_could_not_be_read_is_read_at_the_next_look(
        registry, proxy, base_ref, box, base_rootfs, tmp_path, monkeypatch):
    """The watcher goes back to the tag after a restore of it finished, and reading the tag's
    snapshot fails (503): the next look reads it again, so the restored weight is not taken for one
    still being written (the restore's end read) and is in the tag's next snapshot, not kept at the
    diverged tag's version."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    write_tree(box, {WEIGHT: os.urandom(2 * MiB)})
    os.utime(os.path.join(box, WEIGHT), (1_700_000_000, 1_700_000_000))  # long stable, as restored
    target, good, root = _tag_and_bare_box(registry, base_ref, box, base_rootfs, tmp_path, "reread", {})
    lines, clock = [], FakeClock()
    w = watcher(proxy, base_ref, str(root), "reread", lines, clock, profile=parse_profile(SMALL_WEIGHTS), every=0,
                stable=5)
    write_tree(str(root), {"opt/app/mine.txt": "work\n"})
    w.tick()
    [first] = diverged_tags(registry, "reread")

    restore_image(f"{proxy.host}/reread:v2", str(root), RestoreOptions(only_snapshot=True))
    write_tree(str(root), {"opt/app/after.txt": "on the tag again\n"})
    proxy.answer = lambda method, path: (503, {}) if method == "GET" and path.endswith(f"/manifests/{good}") else None
    clock.advance(1)
    w.tick()
    assert any("moving it again" in line for line in lines) and "trying again in 1s" in lines[-1], lines
    proxy.answer = lambda method, path: None
    clock.advance(1)
    w.tick()
    assert not [line for line in lines if "held back" in line], lines
    assert digest_of(registry, "reread", "v2") != good and WEIGHT in snap_layers(registry.manifest("reread", "v2"))
    assert _restored_tree(target, tmp_path / "main") == snapshot_of_tree(str(root), skip=NOT_CAPTURED)


def test_a_diverged_tag_is_never_moved_again_once_a_restore_wrote_into_the_root(registry, proxy, base_ref, box,
                                                                                base_rootfs, tmp_path, monkeypatch):
    """Red-team finding: the restore failed, the watcher saved the work to v2-diverged-T1; the box
    restarted, the restore failed half-way again and wrote over the work, and the next watcher (or a
    cron `snap commit --diverge`) went on in T1, "its own from before": T1 then restored to the
    restore's text and the work was in no tag. A diverged tag goes on only from a snapshot the box
    made since the last restore into it: after a restore, a new one; T1 keeps the work."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    target, good, root = _tag_and_bare_box(registry, base_ref, box, base_rootfs, tmp_path, "rewritten",
                                           {"opt/app/notes.txt": "the tag's notes\n"})
    _failing_restore(registry, proxy, "rewritten", "v2", root)
    lines = []
    w = watcher(registry, base_ref, str(root), "rewritten", lines, every=0)
    write_tree(str(root), {"opt/app/notes.txt": "USER WORK\n"})
    w.tick()
    [first] = diverged_tags(registry, "rewritten")
    work, kept = snapshot_of_tree(str(root), skip=NOT_CAPTURED), digest_of(registry, "rewritten", first)

    # The box starts again: its restore fails half-way again, writing over the work.
    _failing_restore(registry, proxy, "rewritten", "v2", root)
    write_tree(str(root), {"opt/app/notes.txt": "the restore's notes\n"})
    r = snap("commit", target, "--base", base_ref, "--root", str(root), "--diverge", check=True)
    assert "a tag of its own" in r.stderr and digest_of(registry, "rewritten", first) == kept, r.stderr
    [second] = set(diverged_tags(registry, "rewritten")) - {first}
    again = watcher(registry, base_ref, str(root), "rewritten", lines, every=0)
    write_tree(str(root), {"opt/app/later.txt": "the same line of work\n"})
    again.tick()  # goes on in the tag it made since the restore
    assert set(diverged_tags(registry, "rewritten")) == {first, second}, lines
    assert digest_of(registry, "rewritten", first) == kept and digest_of(registry, "rewritten", "v2") == good
    assert _restored_tree(f"{registry.host}/rewritten:{first}", tmp_path / "first") == work
    assert _restored_tree(f"{registry.host}/rewritten:{second}", tmp_path / "second") == snapshot_of_tree(
        str(root), skip=NOT_CAPTURED)


def test_a_watcher_on_the_tag_stops_moving_it_once_a_restore_into_its_root_fails(registry, proxy, base_ref, box,
                                                                                tmp_path, monkeypatch):
    """Red-team finding: a box restored from v2 and watched, then a restore of v1 into it failed
    half-way; `snap commit v2` refused (right), but the watcher went on moving v2, to a tree of v1's
    notes beside v2's files, and v2's good snapshot lost its tag. A snapshot made before a restore
    wrote into the root is no longer this box's work: the watcher sees the restore at its next
    snapshot and saves to a diverged tag, as `snap commit` refuses."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    root, w, lines, clock, made, work = _working_on_v2(registry, registry, base_ref, box, tmp_path, "rollback")
    assert work == snapshot_of_tree(str(root), skip=NOT_CAPTURED)  # made: this box's snapshot now

    _failing_restore(registry, proxy, "rollback", "v1", root)
    write_tree(str(root), {"opt/app/notes.txt": "v1 notes\n"})  # what the half-way restore wrote
    r = snap("commit", f"{registry.host}/rollback:v2", "--base", base_ref, "--root", str(root))
    assert r.returncode == 2 and "neither came from" in r.stderr, r.stderr
    clock.advance(1)
    w.tick()
    assert digest_of(registry, "rollback", "v2") == made, lines
    [tag] = diverged_tags(registry, "rollback")
    assert any("neither came from" in line and f"rollback:{tag}" in line for line in lines), lines
    assert _restored_tree(f"{registry.host}/rollback:{tag}", tmp_path / "out") == snapshot_of_tree(
        str(root), skip=NOT_CAPTURED)
    assert _restored_tree(f"{registry.host}/rollback:v2", tmp_path / "v2") == work


def test_a_restore_seen_while_the_registry_fails_is_still_seen_once_it_answers(registry, proxy, base_ref, box,
                                                                              tmp_path, monkeypatch):
    """The look at the tag after a restore into the root failed half-way fails too (the registry's
    tag list answers 503): the restore is not noted as seen until a look succeeds, so the next tick
    does not move the tag onto the half-restored box, and the tag's snapshot of the work stays."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    root, w, lines, clock, made, work = _working_on_v2(registry, proxy, base_ref, box, tmp_path, "rollback-outage")

    _failing_restore(registry, proxy, "rollback-outage", "v1", root)
    write_tree(str(root), {"opt/app/notes.txt": "v1 notes\n"})
    proxy.answer = lambda method, path: (503, {}) if "/tags/list" in path else None
    clock.advance(1)
    w.tick()
    assert "trying again in 1s" in lines[-1], lines
    proxy.answer = lambda method, path: None
    clock.advance(1)
    w.tick()
    assert digest_of(registry, "rollback-outage", "v2") == made, lines
    [tag] = diverged_tags(registry, "rollback-outage")
    assert _restored_tree(f"{registry.host}/rollback-outage:{tag}", tmp_path / "out") == snapshot_of_tree(
        str(root), skip=NOT_CAPTURED)
    assert _restored_tree(f"{registry.host}/rollback-outage:v2", tmp_path / "v2") == work


def test_a_diverged_tag_adopted_with_snap_tag_puts_the_watcher_back_on_the_tag(registry, base_ref, box, base_rootfs,
                                                                              tmp_path):
    """Adopting: `snap tag` moves the tag onto the diverged snapshot (only with --force where it names
    another, and the line says how to put it back); the tag then names a snapshot this box made, and
    the watcher moves it again from there."""
    target = f"{registry.host}/adopt:v2"
    snap("commit", target, "--base", base_ref, "--root", box, check=True)
    good = digest_of(registry, "adopt", "v2")
    bare = tmp_path / "bare"
    subprocess.run(["cp", "-a", base_rootfs, str(bare)], check=True)
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, str(bare), "adopt", lines, clock, every=0)
    w.tick()
    [tag] = diverged_tags(registry, "adopt")
    ours = digest_of(registry, "adopt", tag)
    r = snap("tag", f"{registry.host}/adopt:{tag}", "v2")
    assert r.returncode == 2 and "--force" in r.stderr and digest_of(registry, "adopt", "v2") == good, r.stderr
    r = snap("tag", f"{registry.host}/adopt:{tag}", "v2", "--force", check=True)
    assert r.stdout.strip() == (f"{target} names {ours} (it named {good}: "
                                f"`snap tag {registry.host}/adopt@{good} v2 --force` puts it back)")
    assert digest_of(registry, "adopt", "v2") == ours
    write_tree(str(bare), {"opt/app/adopted.txt": "on the tag now\n"})
    clock.advance(1)
    w.tick()
    assert digest_of(registry, "adopt", "v2") not in (good, ours) and digest_of(registry, "adopt", tag) == ours
    assert _restored_tree(target, tmp_path / "out") == snapshot_of_tree(str(bare), skip=NOT_CAPTURED)


def test_a_watcher_started_in_an_outage_decides_its_tag_once_the_registry_is_back(registry, proxy, base_ref, box,
                                                                                  base_rootfs, tmp_path, monkeypatch):
    """The registry unreachable at the box's start: the check cannot be made, so nothing is pushed
    anywhere (the loop retries, it does not stop); once the registry answers, the box that did not
    come from the tag's snapshot saves to its diverged tag, and the tag stays."""
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    snap("commit", f"{registry.host}/outage-start:v2", "--base", base_ref, "--root", box, check=True)
    good = digest_of(registry, "outage-start", "v2")
    bare = tmp_path / "bare"
    subprocess.run(["cp", "-a", base_rootfs, str(bare)], check=True)
    proxy.down.set()
    lines, clock = [], FakeClock()
    w = watcher(proxy, base_ref, str(bare), "outage-start", lines, clock, every=0)
    write_tree(str(bare), {"opt/app/early.txt": "done while the registry was down\n"})
    w.tick()
    assert "trying again in 1s" in lines[-1] and tags_of(registry, "outage-start") == ["v2"], lines
    proxy.down.clear()
    clock.advance(1)
    w.tick()
    [tag] = diverged_tags(registry, "outage-start")
    assert digest_of(registry, "outage-start", "v2") == good
    assert _restored_tree(f"{registry.host}/outage-start:{tag}", tmp_path / "out") == snapshot_of_tree(str(bare),
                                                                                                       skip=NOT_CAPTURED)


def test_the_watcher_goes_on_when_this_box_commits_to_its_tag(registry, base_ref, box, tmp_path):
    """A `snap commit` of the same box to the watched tag is this box's own snapshot, not a race."""
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "own-commit", lines, clock, every=0)
    w.tick()
    write_tree(box, {"opt/app/by-hand.txt": "committed by hand\n"})
    snap("commit", f"{registry.host}/own-commit:v2", "--base", base_ref, "--root", box, check=True)
    write_tree(box, {"opt/app/later.txt": "then the watcher\n"})
    clock.advance(1)
    w.tick()
    got = _restored_tree(f"{registry.host}/own-commit:v2", tmp_path / "out")
    assert got == snapshot_of_tree(box, skip=NOT_CAPTURED)


# ---- files being written ---------------------------------------------------------------------------


def _restored_box_with_weight(registry, base_ref, box, tmp_path, repo):
    """A box with a weight (its own layer), committed and restored into a new root, as a new pod does."""
    weight = os.urandom(2 * MiB)
    write_tree(box, {WEIGHT: weight})
    prof = parse_profile(SMALL_WEIGHTS)
    commit_box(f"{registry.host}/{repo}:v2", base_ref, CommitOptions(root=box, profile=prof))
    root = tmp_path / "pod"
    restore_image(f"{registry.host}/{repo}:v2", str(root))
    return str(root), weight, prof


def test_files_a_restore_wrote_are_not_being_written(registry, base_ref, box, tmp_path):
    """The trial: right after a restore every file has a fresh ctime; the watcher took the weight for
    one being written, moved the tag onto a snapshot without it, then said nothing changed."""
    root, weight, prof = _restored_box_with_weight(registry, base_ref, box, tmp_path, "fresh-ctime")
    lines, clock = [], FakeClock()  # now: the restore has just ended
    w = watcher(registry, base_ref, root, "fresh-ctime", lines, clock, profile=prof, every=0, stable=5)
    write_tree(root, {"opt/app/work.txt": "after the restore\n"})
    w.tick()
    assert not [line for line in lines if "held back" in line], lines
    assert WEIGHT in snap_layers(registry.manifest("fresh-ctime", "v2"))
    assert w.final("stopped") == 0
    out = tmp_path / "after"
    restore_image(f"{registry.host}/fresh-ctime:v2", str(out))
    assert (out / WEIGHT).read_bytes() == weight
    assert (out / "opt/app/work.txt").read_text() == "after the restore\n"


class Writer:
    """Another process that holds a file open for writing, as a training run saving a checkpoint: it
    writes `head` at `offset` (r+b: in place; else a new file), then waits for a line on stdin, writes
    `tail`, and exits. Its first line on stdout says the head is written."""

    CODE = ("import sys\n"
            "path, mode = sys.argv[1], sys.argv[2]\n"
            "offset, head, tail = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])\n"
            "f = open(path, mode)\n"
            "f.seek(offset); f.write(b'\\x01' * head); f.flush()\n"
            "print('head', flush=True)\n"
            "sys.stdin.readline()\n"
            "f.write(b'\\x02' * tail); f.close()\n")

    def __init__(self, path: str, mode: str, offset: int, head: int, tail: int):
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, path, mode, str(offset), str(head), str(tail)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "head\n"

    def finish(self) -> None:
        self.proc.communicate("go\n", timeout=TIMEOUT)


# mmap(2) through ctypes: Python's mmap module keeps a duplicate of the descriptor open, which
# /proc/PID/fd would show; this process keeps none, so only /proc/PID/maps tells.
MAPPER = ("import ctypes, os, sys\n"
          "libc = ctypes.CDLL(None, use_errno=True); libc.mmap.restype = ctypes.c_void_p\n"
          "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,\n"
          "                      ctypes.c_long]\n"
          "fd = os.open(sys.argv[1], os.O_RDWR); addr = libc.mmap(None, 4096, 3, 1, fd, 0); os.close(fd)\n"
          "assert addr not in (None, ctypes.c_void_p(-1).value); ctypes.memmove(addr, b'hello', 5)\n"
          "assert sys.argv[1] not in [os.path.realpath(f'/proc/self/fd/{n}') for n in os.listdir('/proc/self/fd')]\n"
          "print('mapped', flush=True); sys.stdin.readline()\n")


def test_the_files_other_processes_write_are_seen_open_or_mapped(tmp_path):
    """writers.py: a file held open for writing, and one mapped shared-writable after its descriptor
    was closed; not one only read, nor one outside the root."""
    paths = {name: tmp_path / name for name in ("written", "mapped", "read")}
    for p in paths.values():
        p.write_bytes(bytes(4096))
    writing = Writer(str(paths["written"]), "r+b", 0, 10, 0)
    mapping = subprocess.Popen([sys.executable, "-c", MAPPER, str(paths["mapped"])], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    reading = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'rb'); sys.stdin.readline()",
                                str(paths["read"])], stdin=subprocess.PIPE)
    try:
        assert mapping.stdout.readline() == "mapped\n"
        found = open_for_writing()
        assert found.under(str(tmp_path)) == {"written", "mapped"}
        assert found.under(str(tmp_path / "elsewhere")) == set()
    finally:
        writing.finish()
        mapping.communicate("\n", timeout=TIMEOUT)
        reading.communicate(b"\n", timeout=TIMEOUT)
    assert "written" not in open_for_writing().under(str(tmp_path))


def test_a_mapped_file_whose_name_holds_a_newline_is_seen(tmp_path):
    """/proc/PID/maps writes a newline in a name as \\012 (and a backslash as is): both names are
    read back, as they are (issue 33: an odd name is a name like any other)."""
    names = ["map\nped\x1b", "lit\\012eral"]
    mappers = []
    try:
        for name in names:
            (tmp_path / name).write_bytes(bytes(4096))
            mappers.append(subprocess.Popen([sys.executable, "-c", MAPPER, str(tmp_path / name)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True))
            assert mappers[-1].stdout.readline() == "mapped\n"
        assert set(names) <= open_for_writing().under(str(tmp_path))
    finally:
        for m in mappers:
            m.communicate("\n", timeout=TIMEOUT)


def test_a_file_being_written_keeps_its_last_snapshot_version_or_is_left_out(registry, base_ref, box, tmp_path):
    """After a restore, a weight rewritten in place and a new image saved in chunks, both still open for
    writing at the final snapshot: the tag keeps the restored weight (its layer, never read) and has
    no partial image; a small file written and closed is taken."""
    root, weight, prof = _restored_box_with_weight(registry, base_ref, box, tmp_path, "writing")
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, root, "writing", lines, clock, profile=prof, every=3600, stable=5)
    w.tick()  # the restored box: current already
    rewrite = Writer(os.path.join(root, WEIGHT), "r+b", 4096, 300_000, 10)
    image = os.path.join(root, "opt/app/output/img-0001.png")
    os.makedirs(os.path.dirname(image))
    saving = Writer(image, "wb", 0, 80_000, 20_000)
    write_tree(root, {"opt/app/notes.txt": "closed before the signal\n"})
    try:
        assert w.final("signal SIGTERM") == 0, lines
    finally:
        rewrite.finish()
        saving.finish()
    held = f"held back: '/{WEIGHT}' (being written); kept the last snapshot's version"
    assert any(held in line for line in lines), lines
    assert any("held back: '/opt/app/output/img-0001.png' (being written); left out" in line for line in lines), lines
    out = tmp_path / "after"
    restore_image(f"{registry.host}/writing:v2", str(out))
    assert (out / WEIGHT).read_bytes() == weight
    assert not (out / "opt/app/output/img-0001.png").exists()
    assert (out / "opt/app/notes.txt").read_text() == "closed before the signal\n"


def test_a_final_snapshot_with_a_file_still_being_written_says_which_and_is_not_current(registry, base_ref, box):
    """A file held back from the last snapshot and still being written at the signal: the final
    snapshot does not say "nothing changed: ... is current" (the box as the last snapshot has it,
    held files aside), and names the file held, which is in no snapshot as it is."""
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "held-final", lines, clock, every=0, stable=3600)
    image = os.path.join(box, "opt/app/output/img-0001.png")
    os.makedirs(os.path.dirname(image))
    saving = Writer(image, "wb", 0, 80_000, 20_000)
    held = "held back: '/opt/app/output/img-0001.png' (being written); left out"
    try:
        clock.advance(60)  # no path changed within the scans' 2 s window: only the file being written tells
        w.tick()
        assert any(held in line for line in lines), lines
        del lines[:]
        assert w.final("signal SIGTERM") == 0, lines
    finally:
        saving.finish()
    assert any(held in line for line in lines) and lines[-1].startswith("final snapshot "), lines
    assert not any(line.startswith("nothing changed") for line in lines), lines


def test_a_final_snapshot_after_one_whose_scan_was_racy_reads_those_files_again(registry, base_ref, box, tmp_path):
    """A path changed within the scan memo's 2 s window of the last snapshot's scan may be written again
    in the same clock tick, its stat data unmoved: the final snapshot reads it rather than trusting
    that data (it said "nothing changed" and kept the last snapshot's bytes)."""
    reads: list[str] = []
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "racy-final", lines, clock, every=0,
                after_read=lambda path, attempt: reads.append(path))
    w.tick()
    write_tree(box, {"opt/app/notes.txt": "written in the scan's clock tick\n"})
    clock.advance(1)
    w.tick()
    reads.clear()
    assert w.final("signal SIGTERM") == 0, lines
    assert "opt/app/notes.txt" in reads and lines[-1].startswith("final snapshot "), lines
    assert _restored_tree(f"{registry.host}/racy-final:v2", tmp_path / "out") == snapshot_of_tree(box,
                                                                                                 skip=NOT_CAPTURED)


def test_a_restored_file_an_app_opens_for_writing_is_not_being_written(registry, base_ref, box, tmp_path):
    """An app that opens a restored database read-write (and writes nothing yet): the restore's ctime
    is not a write, and the snapshot keeps the file."""
    db = "opt/app/state.db"
    write_tree(box, {db: os.urandom(30_000)})
    commit_box(f"{registry.host}/open-db:v2", base_ref, CommitOptions(root=box))
    root = tmp_path / "pod"
    restore_image(f"{registry.host}/open-db:v2", str(root))
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, str(root), "open-db", lines, clock, every=0)
    app = Writer(os.path.join(root, db), "r+b", 0, 0, 0)
    try:
        write_tree(str(root), {"opt/app/work.txt": "after the restore\n"})
        w.tick()
    finally:
        app.finish()
    assert not [line for line in lines if "held back" in line], lines
    got = _restored_tree(f"{registry.host}/open-db:v2", tmp_path / "out")
    assert got == snapshot_of_tree(str(root), skip=NOT_CAPTURED)


def test_a_commit_to_a_new_tag_after_a_restore_keeps_the_restored_version_of_a_file_being_written(
        registry, base_ref, box, tmp_path):
    """The tag is new, but the box came from v2 of the same repository: that is its last snapshot."""
    root, weight, prof = _restored_box_with_weight(registry, base_ref, box, tmp_path, "newtag")
    rewrite = Writer(os.path.join(root, WEIGHT), "r+b", 0, 100_000, 0)
    try:
        result = commit_box(f"{registry.host}/newtag:v3", base_ref, CommitOptions(root=root, profile=prof))
    finally:
        rewrite.finish()
    assert result.carried == [WEIGHT]
    out = tmp_path / "out"
    restore_image(f"{registry.host}/newtag:v3", str(out))
    assert (out / WEIGHT).read_bytes() == weight


def test_a_commit_never_pushes_a_file_that_changed_while_read(registry, base_ref, box, tmp_path):
    """A file that changes during every read (layer/generate.py reads it up to 3 times): never kept as last read.
    A weight with a version in the tag's snapshot keeps it (that layer, reused); a new file is left out."""
    prof = parse_profile(SMALL_WEIGHTS)
    v1 = os.urandom(2 * MiB)
    write_tree(box, {WEIGHT: v1})
    target = f"{registry.host}/torn:v2"
    commit_box(target, base_ref, CommitOptions(root=box, profile=prof))
    with open(os.path.join(box, WEIGHT), "r+b") as f:
        f.write(os.urandom(MiB))
    write_tree(box, {"opt/app/state.db": os.urandom(50_000), "opt/app/ok.txt": "settled\n"})
    keep_changing = {WEIGHT, "opt/app/state.db"}

    def rewrite(path, attempt):
        if path in keep_changing:
            with open(os.path.join(box, path), "r+b") as f:
                f.write(os.urandom(64))

    result = commit_box(target, base_ref, CommitOptions(root=box, profile=prof), CommitHooks(after_read=rewrite))
    assert result.held == {WEIGHT: "changed while read", "opt/app/state.db": "changed while read"}
    assert result.carried == [WEIGHT]
    out = tmp_path / "out"
    restore_image(target, str(out))
    assert (out / WEIGHT).read_bytes() == v1
    assert not (out / "opt/app/state.db").exists()
    assert (out / "opt/app/ok.txt").read_text() == "settled\n"


def test_a_file_written_between_the_scan_and_its_read_is_held_back(registry, base_ref, box, tmp_path):
    """An image saved in chunks with a pause: the scan saw one chunk, the read (still, whole) sees two,
    and there may be more to come. Not pushed as read: held back, and left out (no snapshot had it)."""
    image = "opt/app/output/chunked.png"
    write_tree(box, {image: b"\x89PNG" + os.urandom(50_000)})

    class AfterTheScan(CommitHooks):
        def hold(self, scan, root):  # commit's point between the scan and the reads
            with open(os.path.join(box, image), "ab") as f:
                f.write(os.urandom(50_000))
            return {}

    result = commit_box(f"{registry.host}/midsave:v1", base_ref, CommitOptions(root=box), AfterTheScan())
    assert result.held == {image: "changed since the scan"}
    out = tmp_path / "out"
    restore_image(f"{registry.host}/midsave:v1", str(out))
    assert not (out / image).exists() and (out / "etc/app.conf").read_text() == "threads = 8\n"


def test_a_file_that_tore_in_a_snapshot_is_taken_by_the_next_once_still(registry, base_ref, box, tmp_path):
    """A weight that changed during every read of one snapshot was kept there at its last version;
    the watcher must not count it as taken: the next snapshot, with the file still, has the new one."""
    prof = parse_profile(SMALL_WEIGHTS)
    write_tree(box, {WEIGHT: os.urandom(2 * MiB)})
    lines, clock = [], FakeClock()
    poking = threading.Event()  # while set, the weight changes during every read
    w = watcher(registry, base_ref, box, "tore-once", lines, clock, profile=prof, every=0, stable=5,
                after_read=lambda path, attempt: poking.is_set() and path == WEIGHT and _poke(box, WEIGHT))
    clock.advance(10)
    w.tick()  # the weight, still, in the first snapshot
    clock.advance(10)
    with open(os.path.join(box, WEIGHT), "r+b") as f:
        f.write(os.urandom(MiB))
    clock.advance(10)  # stable by its times: read, and it tears during every read
    poking.set()
    w.tick()
    held = f"held back: '/{WEIGHT}' (changed while read); kept the last snapshot's version"
    assert any(held in line for line in lines), lines
    poking.clear()
    clock.advance(10)
    w.tick()  # nothing changed since: but the snapshot has the old version, so this one takes the new
    out = tmp_path / "out"
    restore_image(f"{registry.host}/tore-once:v2", str(out))
    assert (out / WEIGHT).read_bytes() == open(os.path.join(box, WEIGHT), "rb").read()


def _poke(box: str, path: str) -> None:
    with open(os.path.join(box, path), "r+b") as f:
        f.write(os.urandom(16))


LOOP = "the loop's tick"  # the thread _final_beside_the_loop ticks in


def _final_beside_the_loop(w, clock, entered: threading.Event, lines: list) -> None:
    """The loop ticks, a commit due, in a thread of its own; once it is held (`entered`), the final
    snapshot starts, stops that commit and makes its own (exit 0)."""
    clock.advance(1)
    loop = threading.Thread(target=lambda: pytest.raises(progress.Stopped, w.tick), name=LOOP)
    loop.start()
    assert entered.wait(TIMEOUT)
    assert w.final("signal SIGTERM") == 0, lines
    loop.join(TIMEOUT)


def test_the_final_snapshot_stops_the_loops_commit_and_never_runs_beside_it(registry, base_ref, box, tmp_path,
                                                                            monkeypatch):
    """The trial: the final snapshot failed (a layer file of the state dir gone) while the loop's own
    commit ran. The final stops that commit, waits for it to give up, then makes its own."""
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "one-at-a-time", lines, clock, every=0)
    w.tick()
    inside, entered, stopped = [0], threading.Event(), threading.Event()
    overlap = []
    real_push_layers = push_module.push_layers

    def push_layers(cp, remote, plans):
        inside[0] += 1
        overlap.append(inside[0])
        try:
            if not entered.is_set():  # the loop's commit: held here until it is told to stop
                entered.set()
                assert remote.stopping.wait(TIMEOUT)
                stopped.set()
                raise progress.Stopped()
            return real_push_layers(cp, remote, plans)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(push_module, "push_layers", push_layers)
    write_tree(box, {"opt/app/late.txt": "written just before the reclaim\n"})
    _final_beside_the_loop(w, clock, entered, lines)
    assert stopped.is_set() and max(overlap) == 1
    out = tmp_path / "after"
    restore_image(f"{registry.host}/one-at-a-time:v2", str(out))
    assert (out / "opt/app/late.txt").read_text() == "written just before the reclaim\n"


def test_the_final_snapshot_stops_the_loops_commit_in_its_scan_and_scans_only_what_changed(
        registry, base_ref, box, tmp_path, monkeypatch):
    """The loop's commit is in its scan when the final snapshot starts: it gives up there, at its next
    directory, not after a scan and a plan the final then makes again inside its grace; and what it
    took of the changed directories is put back, so the final's own scan is of those, not the box."""
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "stop-in-scan", lines, clock, every=0, grace=60)
    clock.advance(60)  # the box long settled: the first scan's memo keeps every path
    w.tick()
    assert w.changes.events is not None, "change notifications: the commit scans are of changed directories"
    entered, planned = threading.Event(), []
    real_safe_update, real_hold = progress.safe_update, hooks_module.WatchHooks.hold

    def safe_update(b):  # the loop's commit scan: held at its first directory until the final starts
        update = real_safe_update(b)
        if threading.current_thread().name != LOOP:
            return update

        def held(n):
            if not entered.is_set():
                entered.set()
                assert w.handover.final_started.wait(TIMEOUT)
            update(n)
        return held

    def hold(self, scan, root):
        planned.append(threading.current_thread().name == LOOP)
        return real_hold(self, scan, root)

    monkeypatch.setattr(progress, "safe_update", safe_update)
    monkeypatch.setattr(hooks_module.WatchHooks, "hold", hold)
    for d in ("a", "b", "c"):  # several changed directories: the scan reports after each
        write_tree(box, {f"opt/app/late-{d}/note.txt": f"written just before the reclaim: {d}\n"})
    _final_beside_the_loop(w, clock, entered, lines)
    assert planned == [False], "the loop's commit planned after the final snapshot started"
    assert w.changes.commit_scan.touched is not None, "the final snapshot scanned the whole box"
    out = tmp_path / "after"
    restore_image(f"{registry.host}/stop-in-scan:v2", str(out))
    for d in ("a", "b", "c"):
        assert (out / f"opt/app/late-{d}/note.txt").read_text() == f"written just before the reclaim: {d}\n"


# ---- a seeded reclaim cycle ------------------------------------------------------------------------


WORKER = r"""
import hashlib, json, os, random, sys
root, seed, weight = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rng = random.Random(seed)
def say(*words):
    print(json.dumps(words), flush=True)
step = 0
while True:
    kind = rng.choice(["image", "rewrite", "note", "node"])
    if kind == "image":  # saved in chunks, open all along
        path, data = f"opt/app/output/img-{seed}-{step}.png", os.urandom(rng.randint(20_000, 400_000))
    elif kind == "rewrite":  # the weight rewritten in place
        path = weight
        data = os.urandom(os.path.getsize(os.path.join(root, path)))
    elif kind == "note":
        path, data = f"opt/app/notes/n{step % 7}.txt", f"note {seed} {step}\n".encode() * rng.randint(1, 50)
    else:
        path, data = f"opt/app/custom_nodes/N{step % 3}/__init__.py", f"V = {step}\n".encode()
    full = os.path.join(root, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "r+b" if kind == "rewrite" else "wb") as f:
        chunks = max(1, min(6, len(data) // 65536))
        for i in range(chunks):
            f.write(data[i * len(data) // chunks:(i + 1) * len(data) // chunks])
            f.flush()
            say("chunk", path, i)
            sys.stdin.readline()  # the test decides when the next chunk comes (and when the signal does)
    say("done", path, hashlib.sha256(data).hexdigest())
    sys.stdin.readline()
    step += 1
"""


def file_digests(root) -> dict[str, str]:
    """path -> sha256 of every regular file under `root`."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                with open(full, "rb") as f:
                    out[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("seed", [3, 17, 29])
def test_a_seeded_reclaim_cycle_keeps_every_settled_file_and_no_torn_one(seed, registry, proxy, base_ref, base_rootfs,
                                                                         box, tmp_path):
    """Three boxes: a new box restores the tag and runs `snap watch`; random work in steps the test
    paces (images saved in chunks, the weight rewritten in place, notes, a node) while snapshots are
    taken; SIGTERM after a seeded number of steps, with a file possibly half written. The tag then
    restores to every file as it last settled (the restored ones included), and no file in a state it
    never reached (a partial). The third box starts in a registry outage: its restore fails (exit 3),
    its watcher starts all the same; the tag stays on the second box's snapshot, and the union of
    the tag and the box's diverged tag holds every file the box had once quiet."""
    rng = random.Random(seed)
    repo = f"cycle-{seed}"
    ref = f"{registry.host}/{repo}:v2"
    write_tree(box, {WEIGHT: os.urandom(2 * MiB)})
    profile = profile_file(tmp_path)
    snap("commit", ref, "--base", base_ref, "--root", box, "--profile", profile, check=True)
    for round_ in range(3):
        root = tmp_path / f"pod-{round_}"
        outage = round_ == 2
        if outage:  # the provider's image, the snapshot's restore refused: the registry is down
            subprocess.run(["cp", "-a", base_rootfs, str(root)], check=True)
            write_tree(str(root), {WEIGHT: os.urandom(2 * MiB)})
            proxy.down.set()
            r = snap("restore", f"{proxy.host}/{repo}:v2", "--root", str(root), "--only-snapshot",
                     env={"SNAP_RETRY_SCALE": "0"})
            assert r.returncode == 3, r.stderr
            good = digest_of(registry, repo, "v2")
        else:
            snap("restore", ref, "--root", str(root), check=True)
        settled = file_digests(root)  # path -> the digest it last settled at
        reached = {path: {digest} for path, digest in settled.items()}  # every state each file was complete in
        in_progress: set[str] = set()
        p = WatchProcess(f"{proxy.host}/{repo}:v2", "--base", base_ref, "--root", str(root), "--every", "0",
                         "--profile", profile, "--grace", "60",
                         env={"SNAP_WATCH_STABLE": "30", "SNAP_RETRY_SCALE": "0"})
        p.wait_for("watching ")
        proxy.down.clear()  # the registry is back while the box works
        worker = subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(seed * 10 + round_), WEIGHT],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        steps = rng.randint(3, 25)
        try:
            for step in range(steps + 1):
                what, path, detail = json.loads(worker.stdout.readline())
                if what == "done":
                    in_progress.discard(path)
                    settled[path] = detail
                    reached.setdefault(path, set()).add(detail)
                else:
                    in_progress.add(path)
                if step < steps:
                    worker.stdin.write("\n")  # on to the next chunk; else the worker waits: the signal now
                    worker.stdin.flush()
                else:
                    break
            p.proc.send_signal(signal.SIGTERM)
            code = p.finish()
        finally:
            worker.kill()
            worker.wait()
        assert code == 0, "".join(p.seen)
        trees = [file_digests(_restore(ref, tmp_path / f"after-{round_}"))]
        if outage:
            assert digest_of(registry, repo, "v2") == good, "".join(p.seen)
            [tag] = diverged_tags(registry, repo)
            trees.append(file_digests(_restore(f"{registry.host}/{repo}:{tag}", tmp_path / "diverged")))
        for path, digest in settled.items():
            if path not in in_progress:
                assert any(got.get(path) == digest for got in trees), (round_, path, "".join(p.seen))
        own = trees[-1]  # the box's own tag: the main one, or its diverged tag
        for path in in_progress:  # being written at the signal: a state it had reached, or absent
            assert path not in own or own[path] in reached.get(path, set()), (round_, path, "".join(p.seen))


def _restore(ref: str, out) -> str:
    restore_image(ref, str(out))
    return str(out)
