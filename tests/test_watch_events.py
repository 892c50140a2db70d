"""`snap watch` with change notifications (box/events.py): a change is found by its event and sent
once the box is quiet, whatever the box's size; what notifications cannot tell (a lost queue, the
watch limit, a write through mmap) is found by the full scans that stay as the safety net.

Driven in process through Watcher.tick() with clocks the test moves (wall and CPU): a full scan
happens only when the test's clock says one is due, so a change committed between them was found by
its event. The watcher's trace (SNAP_WATCH_TRACE) says which scan ran."""

import mmap
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from snapshotter import restore_image
from snapshotter.box import memo as memo_module
from snapshotter.box.events import ChangeEvents
from snapshotter.box.memo import ScanMemo
from snapshotter.box.scan import scan_box
from snapshotter.profile import load_profile

from support.mapped import MappedWriter, mapped_name, stat_data
from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree
from support.watch import FakeClock, watcher

QUIET = 5
FULL_EVERY = 1000  # seconds between full scans: the CPU clock stands still, so min_scan sets it


@pytest.fixture(autouse=True)
def trace(monkeypatch):
    monkeypatch.setenv("SNAP_WATCH_TRACE", "1")


def evented(registry, base_ref, box, repo, lines, clock, **kw):
    """A watcher whose full scans come every FULL_EVERY seconds of the test's clock, no sooner."""
    return watcher(registry, base_ref, box, repo, lines, clock, every=10**6, quiet=QUIET, cpu_clock=FakeClock(),
                   min_scan=FULL_EVERY, **kw)


def scans(lines):
    return [line for line in lines if line.startswith("trace: scan: ")]


def snapshots(lines):
    return [line for line in lines if line.startswith("snapshot ")]


def assert_restores_to_box(registry, repo, box, tmp_path, name):
    out = tmp_path / name
    restore_image(f"{registry.host}/{repo}:v2", str(out))
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def quiet_then_tick(w, clock):
    """The change is seen (one step), then the box stays quiet: the next step sends it."""
    w.tick()
    clock.advance(QUIET)
    w.tick()


def test_a_change_deep_in_a_large_tree_is_sent_because_of_its_event(registry, base_ref, box, tmp_path):
    write_tree(box, {f"opt/venv/lib/pkg{i}/sub{j}/mod{k}.py": f"# {i} {j} {k}\n"
                     for i in range(40) for j in range(5) for k in range(10)})
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-deep", lines, clock)
    w.tick()
    assert scans(lines) == ["trace: scan: the whole box"] and len(snapshots(lines)) == 1
    deep = os.path.join(box, "opt/venv/lib/pkg17/sub3/new.py")
    with open(deep, "w") as f:
        f.write("x = 1\n")
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert len(snapshots(lines)) == 2, lines
    assert "the whole box" not in "".join(scans(lines)[1:])  # only the notified directories were listed
    assert_restores_to_box(registry, "ev-deep", box, tmp_path, "r")


def test_a_directory_made_and_filled_in_a_burst_is_captured_whole(registry, base_ref, box, tmp_path):
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-burst", lines, clock)
    w.tick()
    # Written before the watcher reads a single notification: the new directories' own files come
    # before their watches exist.
    write_tree(box, {f"opt/app/custom_nodes/node/{d}/f{i}.py": str(i)
                     for d in ("a", "a/b", "a/b/c", "e") for i in range(20)})
    clock.advance(1)
    quiet_then_tick(w, clock)
    write_tree(box, {"opt/app/custom_nodes/node/a/b/c/later.py": "after the watch"})  # the new watch works
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert len(snapshots(lines)) == 3 and "the whole box" not in "".join(scans(lines)[1:])
    assert_restores_to_box(registry, "ev-burst", box, tmp_path, "r")


def test_a_rename_across_directories_is_one_change_not_a_loss(registry, base_ref, box, tmp_path):
    write_tree(box, {f"opt/app/work/run1/{n}": n for n in ("a.txt", "b/c.txt", "b/d/e.txt")})
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-move", lines, clock)
    w.tick()
    os.makedirs(os.path.join(box, "opt/app/done"))
    os.rename(os.path.join(box, "opt/app/work/run1"), os.path.join(box, "opt/app/done/run1"))
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert len(snapshots(lines)) == 2
    assert_restores_to_box(registry, "ev-move", box, tmp_path, "r1")
    # The moved directory's watches go on under its new name.
    write_tree(box, {"opt/app/done/run1/b/d/f.txt": "written after the move"})
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert len(snapshots(lines)) == 3 and "the whole box" not in "".join(scans(lines)[1:])
    assert_restores_to_box(registry, "ev-move", box, tmp_path, "r2")


def test_a_lost_queue_falls_back_to_a_full_scan_with_its_line(registry, base_ref, box, tmp_path):
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-overflow", lines, clock)
    w.tick()
    with open("/proc/sys/fs/inotify/max_queued_events") as f:
        queued = int(f.read())
    a, b = os.path.join(box, "opt/app/a.txt"), os.path.join(box, "opt/app/b.txt")
    write_tree(box, {"opt/app/a.txt": "a", "opt/app/b.txt": "b"})
    for i in range(queued // 2 + 8):  # two events that differ are never merged by the kernel: the queue overflows
        os.chmod(a, 0o600 + i % 2)
        os.chmod(b, 0o600 + i % 2)
    write_tree(box, {"opt/app/lost-in-the-flood.txt": "found by the full scan"})
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert [line for line in lines if "the kernel's event queue overflowed" in line] == [
        f"change notifications: lost (the kernel's event queue overflowed (more than {queued} events unread)); "
        "scanning the whole box now, and at the CPU budget from now on"]
    assert "trace: scan: the whole box" in scans(lines)[1:] and len(snapshots(lines)) == 2
    assert_restores_to_box(registry, "ev-overflow", box, tmp_path, "r")


def test_the_watch_limit_falls_back_to_full_scans_with_its_line(registry, base_ref, box, tmp_path):
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-limit", lines, clock, max_watches=3)
    w.tick()
    told = [line for line in lines if line.startswith("change notifications: none from ")]
    assert len(told) == 1 and "the inotify watch limit is reached (3 watches: fs.inotify.max_user_watches)" in told[0]
    assert told[0].endswith("changes there are found by scans of the whole box at the CPU budget")
    unwatched = [p for p in ("opt/app", "etc", "usr", "root") if os.path.isdir(os.path.join(box, p))]
    write_tree(box, {f"{p}/unwatched.txt": "seen by a full scan" for p in unwatched})
    clock.advance(1)
    quiet_then_tick(w, clock)
    clock.advance(FULL_EVERY)  # the next full scan is due
    quiet_then_tick(w, clock)
    assert len(snapshots(lines)) == 2
    assert_restores_to_box(registry, "ev-limit", box, tmp_path, "r")


def test_a_write_through_mmap_is_caught_by_the_safety_scan(registry, base_ref, box, tmp_path):
    path = os.path.join(box, "opt/app/state.bin")
    write_tree(box, {"opt/app/state.bin": b"\0" * 4096})
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-mmap", lines, clock)
    w.tick()
    clock.advance(10)
    w.tick()  # what changed within the memo's racy window of the first scan is looked at again: nothing
    with open(path, "r+b") as f:
        m = mmap.mmap(f.fileno(), 4096)
    w.changes.events.drain()  # the open and close for writing are notified, not the writes through the map
    m[:11] = b"through map"  # (a database keeps its map: the close when it is unmapped comes much later)
    m.flush()
    assert w.changes.events.drain() == (set(), None)
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert len(snapshots(lines)) == 1  # not seen yet
    clock.advance(FULL_EVERY)
    quiet_then_tick(w, clock)
    m.close()
    whole = [i for i, line in enumerate(lines) if line == "trace: scan: the whole box"]
    assert len(snapshots(lines)) == 2 and len(whole) == 2 and whole[1] < lines.index(snapshots(lines)[1])
    assert_restores_to_box(registry, "ev-mmap", box, tmp_path, "r")


@pytest.mark.parametrize("seed", range(4))
def test_a_scan_of_the_notified_directories_is_the_full_scan(tmp_path, seed):
    """Random creates, deletes, renames across directories, directory swaps, chmods and symlinks:
    after each round, the scan of the directories the notifications named, from the last one, is
    the scan of the whole tree."""
    root = str(tmp_path / "tree")
    rnd = random.Random(seed)
    os.makedirs(root)
    for i in range(60):
        d = random_dir(rnd, root)
        if rnd.random() < 0.3:
            os.makedirs(os.path.join(d, f"d{i}"))
        else:
            write_tree(d, {f"f{i}": "x" * i})
    profile = load_profile()
    events = ChangeEvents(root, lambda rel: bool(profile.exclude.match(rel)))
    memo = ScanMemo(lambda: time.time_ns() + 100 * 10**9)  # every path settled: kept by the memo
    last = scan_box(root, profile, memo=memo)
    for n in range(25):
        for k in range(rnd.randint(1, 6)):
            mutate(rnd, root, f"{n}_{k}")
        dirty, lost = events.drain()
        assert lost is None
        part = scan_box(root, profile, memo=memo, previous=last, dirty=dirty)
        assert listing(part) == listing(scan_box(root, profile)), f"round {n}, notified {sorted(dirty)}"
        last = part


def random_dir(rnd, root):
    return rnd.choice(sorted(d for d, _, _ in os.walk(root)))


def mutate(rnd, root, tag):
    r, d = rnd.random(), random_dir(rnd, root)
    try:
        if r < 0.2:
            write_tree(d, {f"n{tag}/inner": "y"})
        elif r < 0.4:
            write_tree(d, {f"g{tag}": "z" * len(tag)})
        elif r < 0.55:
            files = sorted(f for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))
            if files:
                os.unlink(os.path.join(d, rnd.choice(files)))
        elif r < 0.7 and d != root:
            to = os.path.join(random_dir(rnd, root), f"mv{tag}")
            if not to.startswith(d + "/"):
                os.rename(d, to)
        elif r < 0.8 and d != root:
            shutil.rmtree(d)
            if rnd.random() < 0.5:
                os.makedirs(d)  # the same name, another directory
        elif r < 0.9:
            os.chmod(d, 0o700 if rnd.random() < 0.5 else 0o755)
        else:
            os.symlink("target", os.path.join(d, f"l{tag}"))
    except FileNotFoundError:
        pass


def listing(scan):
    return ({p: (e.kind, e.mode, e.size, e.stamp, e.linkname) for p, e in scan.entries.items()},
            scan.skipped_secrets, scan.unreadable)


@pytest.fixture
def old_files(monkeypatch):
    """The box's files count as older than the scan memo's racy window, as on a real box (here they
    were written a moment ago, and their directories would be listed again whatever the events)."""
    monkeypatch.setattr(memo_module, "RACY_WINDOW_NS", 0)


def linked_pair(box):
    write_tree(box, {"opt/app/z/data.txt": "first\n"})
    os.makedirs(os.path.join(box, "opt/app/a"))
    os.link(os.path.join(box, "opt/app/z/data.txt"), os.path.join(box, "opt/app/a/data.txt"))


@pytest.mark.parametrize("change", ["write", "link", "unlink"])
def test_a_change_through_one_name_of_a_file_is_sent_for_all_its_names(registry, base_ref, box, tmp_path, old_files,
                                                                        change):
    # A write, a link or an unlink through one name notifies that name's directory only, yet the
    # file's other names changed too (their content, link count and ctime).
    if change == "link":
        write_tree(box, {"opt/app/z/data.txt": "one file\n"})
        os.makedirs(os.path.join(box, "opt/app/a"))
    else:
        linked_pair(box)
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, f"ev-{change}", lines, clock)
    w.tick()
    if change == "write":
        with open(os.path.join(box, "opt/app/z/data.txt"), "a") as f:
            f.write("second, longer than the first\n")
    elif change == "link":
        os.link(os.path.join(box, "opt/app/z/data.txt"), os.path.join(box, "opt/app/a/data.txt"))
    else:
        os.unlink(os.path.join(box, "opt/app/z/data.txt"))
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert len(snapshots(lines)) == 2, lines
    assert not [line for line in lines if line.startswith("held back")], lines
    assert_restores_to_box(registry, f"ev-{change}", box, tmp_path, "r")


def test_the_final_snapshot_sees_a_write_through_a_map_still_held(registry, base_ref, box, tmp_path, old_files):
    # A database keeps its file mapped: its writes send no notification and no full scan follows
    # the final snapshot, which must look at the files mapped for writing itself.
    write_tree(box, {"opt/app/db/state.bin": b"\0" * 4096})
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-final-map", lines, clock)
    w.tick()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys\n"
        f"f = open({os.path.join(box, 'opt/app/db/state.bin')!r}, 'r+b')\n"
        "m = mmap.mmap(f.fileno(), 4096)\n"
        "f.close()\n"  # the map alone holds the file: its close comes when it is unmapped
        "m[:11] = b'through map'\n"
        "m.flush()\n"
        "print('written', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "written\n"
        w.changes.events.drain()  # the open and close are notified; the write through the map is not
        assert w.changes.events.drain() == (set(), None)
        clock.advance(60)  # the write is older than the stable time: it is sent, not held back
        assert w.final("signal SIGTERM") == 0, lines
    finally:
        holder.communicate("")
    assert any(line.startswith("final snapshot ") for line in lines), lines[-3:]
    out = tmp_path / "r"
    restore_image(f"{registry.host}/ev-final-map:v2", str(out))
    with open(out / "opt/app/db/state.bin", "rb") as f:
        assert f.read(11) == b"through map"


@pytest.mark.parametrize("where", ["excluded", "outside"])
def test_the_final_snapshot_sees_a_write_through_a_hard_link_no_notification_covers(registry, base_ref, box, tmp_path,
                                                                                   old_files, where):
    # A file of the box with another name where no notification comes from: in a directory the
    # profile leaves out (/tmp; uv's cache links its packages into venvs) or outside the root.
    path = os.path.join(box, "opt/app/db/log.txt")
    write_tree(box, {"opt/app/db/log.txt": "first\n"})
    other = os.path.join(box, "tmp/log.txt") if where == "excluded" else str(tmp_path / "elsewhere.txt")
    os.makedirs(os.path.dirname(other), exist_ok=True)
    os.link(path, other)
    lines, clock = [], FakeClock()
    repo = f"ev-final-link-{where}"
    w = evented(registry, base_ref, box, repo, lines, clock)
    w.tick()
    with open(other, "a") as f:
        f.write("written through the other name\n")
    w.changes.events.drain()
    assert w.changes.events.drain() == (set(), None)  # nothing notified
    clock.advance(60)
    assert w.final("signal SIGTERM") == 0, lines
    assert any(line.startswith("final snapshot ") for line in lines), lines[-3:]
    out = tmp_path / "r"
    restore_image(f"{registry.host}/{repo}:v2", str(out))
    assert (out / "opt/app/db/log.txt").read_text() == "first\nwritten through the other name\n"


@pytest.mark.parametrize("via", ["box", "hardlink", "bind"])
def test_the_final_snapshot_reads_a_mapped_file_whose_stat_data_did_not_move(registry, base_ref, box, tmp_path,
                                                                            old_files, via):
    # A write through a map moves the file's times at the first write to a clean page only: after
    # a snapshot of the first, the box's tokens are as that snapshot has them, yet the file is not.
    # The map may have been made through another name (support/mapped.py's mapped_name): /proc
    # shows that one, the file is known by its inode (tracking.py's mapped_dirs).
    path = os.path.join(box, "opt/app/db/state.bin")
    write_tree(box, {"opt/app/db/state.bin": b"\0" * 4096})
    with mapped_name(path, str(tmp_path / "elsewhere"), via) as name:
        _final_snapshot_of_a_mapped_file(registry, base_ref, box, tmp_path, path, name, f"ev-final-remap-{via}")


def _final_snapshot_of_a_mapped_file(registry, base_ref, box, tmp_path, path: str, name: str, repo: str) -> None:
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, repo, lines, clock)
    w.tick()
    writer = MappedWriter(name)
    try:
        writer.write("AAAA")  # no notification: the next full scan finds it by the times it moved
        clock.advance(FULL_EVERY)
        quiet_then_tick(w, clock)
        assert len(snapshots(lines)) == 2, lines
        before = stat_data(path)
        writer.write("BBBB")
        if stat_data(path) != before:
            pytest.skip("this filesystem moves a file's times at every write through a map")
        w.changes.events.drain()
        clock.advance(60)
        assert w.final("signal SIGTERM") == 0, lines
    finally:
        writer.exit()
    assert any(line.startswith("final snapshot ") for line in lines), lines[-3:]
    out = tmp_path / "r"
    restore_image(f"{registry.host}/{repo}:v2", str(out))
    assert (out / "opt/app/db/state.bin").read_bytes()[:4] == b"BBBB"


def test_the_final_snapshot_scans_the_directories_no_notification_comes_from(registry, base_ref, box, tmp_path,
                                                                              old_files):
    # Past the watch limit, a change is found by the loop's full scans only: a signal that comes
    # before the next one must not leave the change out of the final snapshot.
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-final-gap", lines, clock, max_watches=3)
    w.tick()
    unwatched = [p for p in ("opt/app", "etc", "usr", "root") if os.path.isdir(os.path.join(box, p))]
    write_tree(box, {f"{p}/unwatched.txt": "written just before the signal" for p in unwatched})
    clock.advance(1)
    assert w.final("signal SIGTERM") == 0, lines
    assert any(line.startswith("final snapshot ") for line in lines), lines[-3:]
    assert_restores_to_box(registry, "ev-final-gap", box, tmp_path, "r")


def test_a_file_whose_ctime_alone_moved_unnotified_is_not_lost_from_the_next_snapshots(registry, base_ref, box,
                                                                                      tmp_path, old_files):
    # A link made and removed elsewhere moves the file's ctime and notifies only the link's
    # directory: the commit finds the file unlike its scan and holds it back; its directory must be
    # listed again, else the snapshots leave the file out until the safety scan.
    write_tree(box, {"opt/app/z/data.txt": "kept\n", "opt/app/b/other.txt": "v1\n"})
    os.makedirs(os.path.join(box, "opt/app/a"))
    lines, clock = [], FakeClock()
    w = evented(registry, base_ref, box, "ev-ctime", lines, clock)
    w.tick()
    os.link(os.path.join(box, "opt/app/z/data.txt"), os.path.join(box, "opt/app/a/lock"))
    os.unlink(os.path.join(box, "opt/app/a/lock"))
    write_tree(box, {"opt/app/b/other.txt": "v2, in the same layer\n"})
    clock.advance(1)
    quiet_then_tick(w, clock)
    clock.advance(1)
    quiet_then_tick(w, clock)
    assert "the whole box" not in "".join(scans(lines)[1:])
    assert_restores_to_box(registry, "ev-ctime", box, tmp_path, "r")
