"""What `snap watch` keeps between its commits so that the final snapshot scales with what changed.

The scan memo (box/memo.py's ScanMemo): a watcher's scans take what an unchanged path held at the last
scan instead of reading it again, and still see every change: a name added to or removed from a
directory whose times were put back, a chmod, an xattr, a private key written over a file with its
size and mtime put back, a secret appearing, a symlink retargeted. The oracle is a scan without
memo: a scan with one must give the same entries and secrets.

The plan memo (memo.PlanMemo): a profile layer whose paths did not change is not split again, and
the plans (and their stat-cache keys) are those a plan without memo makes."""

import dataclasses
import errno
import hashlib
import json
import os
import random

import pytest

from snapshotter import restore_image
from snapshotter.box import scan as box_scan
from snapshotter.box.memo import ScanMemo
from snapshotter.box.scan import scan_box
from snapshotter.commit.commit import changes_in
from snapshotter.index.entry import Entry, gc_paused
from snapshotter.layer import memo as memo_module
from snapshotter.layer import plan as plan_module
from snapshotter.layer.memo import PlanMemo
from snapshotter.layer.plan import LayerPlan
from snapshotter.layer.planning import plan_layers
from snapshotter.profile import load_profile

from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree
from support.watch import FakeClock, watcher

PEM = b"-----BEGIN RSA PRIVATE KEY-----\nMIIEow" + b"A" * 58 + b"\n-----END RSA PRIVATE KEY-----\n"

LATER = lambda: 2**62  # noqa: E731  a clock long after every file's ctime: every path may be kept


def scan(box, profile, memo=None):
    return scan_box(box, profile, metadata_only=False, memo=memo)


def same_as_fresh(box, profile, memo):
    """Scan with the memo and without: the same entries (every field) and the same secrets."""
    with_memo, fresh = scan(box, profile, memo), scan(box, profile)
    assert with_memo.entries == fresh.entries
    assert with_memo.skipped_secrets == fresh.skipped_secrets
    return with_memo


def put_back_times(path, st):
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def test_an_unchanged_path_keeps_its_entry_and_is_not_read_again(box, monkeypatch):
    profile, memo = load_profile(), ScanMemo(LATER)
    first = scan(box, profile, memo)
    reads = []
    monkeypatch.setattr(box_scan, "read_xattrs", lambda path, *a: reads.append(path))
    second = scan(box, profile, memo)
    assert second.entries == first.entries and reads == []
    assert all(second.entries[p] is first.entries[p] for p in first.entries)


def test_a_path_changed_within_the_racy_window_is_read_again(box, monkeypatch):
    """Changed less than 2 s before the scan (by the memo's clock): not kept, a later change in the
    same clock tick could leave the same stat data."""
    profile = load_profile()
    st = os.lstat(os.path.join(box, "opt/app/main.py"))
    memo = ScanMemo(lambda: st.st_ctime_ns + 10**9)
    first = scan(box, profile, memo)
    second = scan(box, profile, memo)
    assert second.entries["opt/app/main.py"] is not first.entries["opt/app/main.py"]


def test_a_hard_link_kept_from_another_device_is_read_again(box):
    """The memo keeps entries across commits (snapshot/kept.py), and a remount gives the box a new
    device number: a hard-linked file kept with the old "dev:ino" would split its group from a name
    read anew (or join another device's file of the same inode number). Read again, it names the
    device it is on."""
    write_tree(box, {"opt/app/data/one.bin": b"linked\n"})
    os.link(os.path.join(box, "opt/app/data/one.bin"), os.path.join(box, "opt/app/data/two.bin"))
    profile, memo = load_profile(), ScanMemo(LATER)
    first = scan(box, profile, memo)
    here = first.entries["opt/app/data/one.bin"].inode
    assert here == first.entries["opt/app/data/two.bin"].inode
    dev, ino = here.split(":")
    context, seen = memo._last
    for rel in ("opt/app/data/one.bin", "opt/app/data/two.bin"):  # as the state dir keeps them, before a remount
        seen[rel] = dataclasses.replace(seen[rel], inode=f"{int(dev) + 1}:{ino}")
    second = same_as_fresh(box, profile, memo)
    assert second.entries["opt/app/data/one.bin"].inode == second.entries["opt/app/data/two.bin"].inode == here


def test_xattrs_the_disk_refused_once_are_read_again_next_time(box, monkeypatch):
    """A read of xattrs that failed (EIO; not a filesystem without them) is not kept: the next scan,
    with nothing changed and the disk well, reads them (kept, the snapshot would lack them for good)."""
    path = os.path.join(box, "opt/app/main.py")
    os.setxattr(path, "user.mark", b"keep-me", follow_symlinks=False)
    real = os.listxattr

    def refused(p, *a, **kw):
        if p.endswith("/main.py"):
            raise OSError(errno.EIO, "Input/output error")
        return real(p, *a, **kw)

    profile, memo = load_profile(), ScanMemo(LATER)
    with monkeypatch.context() as m:
        m.setattr(os, "listxattr", refused)
        assert scan(box, profile, memo).entries["opt/app/main.py"].xattrs is None
    assert same_as_fresh(box, profile, memo).entries["opt/app/main.py"].xattrs == {"user.mark": "keep-me"}


def test_every_change_is_seen_through_the_memo(box):
    profile, memo = load_profile(), ScanMemo(LATER)
    scan(box, profile, memo)
    app = os.path.join(box, "opt/app")
    dir_st = os.lstat(app)
    # A new file, a new secret and a deleted file in a directory whose times are put back.
    write_tree(box, {"opt/app/new.py": "x = 1\n", "opt/app/.env": "TOKEN=abc\n"})
    os.unlink(os.path.join(app, "config.yaml"))
    put_back_times(app, dir_st)
    # A chmod; a file rewritten as a private key with its size and mtime put back.
    os.chmod(os.path.join(app, "main.py"), 0o600)
    key = os.path.join(app, "server.pem")
    with open(key, "wb") as f:
        f.write(b"-" * len(PEM))
    memo_scan = same_as_fresh(box, profile, memo)
    assert "opt/app/server.pem" in memo_scan.entries
    key_st = os.lstat(key)
    with open(key, "r+b") as f:
        f.write(PEM)
    put_back_times(key, key_st)
    # A symlink retargeted in place (a new link renamed over it), its times put back.
    link = os.path.join(box, "opt/app/venv/bin/python")
    link_st = os.lstat(link)
    os.symlink("/usr/bin/python3.11", link + ".new")
    os.rename(link + ".new", link)
    put_back_times(link, link_st)
    memo_scan = same_as_fresh(box, profile, memo)
    assert "opt/app/new.py" in memo_scan.entries and "opt/app/config.yaml" not in memo_scan.entries
    assert "opt/app/.env" in memo_scan.skipped_secrets and "opt/app/server.pem" in memo_scan.skipped_secrets
    assert memo_scan.entries["opt/app/main.py"].mode == 0o600
    assert memo_scan.entries["opt/app/venv/bin/python"].linkname == "/usr/bin/python3.11"


def test_an_xattr_set_is_seen_through_the_memo(box):
    profile, memo = load_profile(), ScanMemo(LATER)
    path = os.path.join(box, "opt/app/main.py")
    scan(box, profile, memo)
    st = os.lstat(path)
    try:
        os.setxattr(path, "user.snap-test", b"v1", follow_symlinks=False)
    except OSError:
        pytest.skip("no user xattrs on this filesystem")
    put_back_times(path, st)
    assert same_as_fresh(box, profile, memo).entries["opt/app/main.py"].xattrs == {"user.snap-test": "v1"}


def test_the_watchers_final_snapshot_sees_a_file_added_where_nothing_looked_changed(registry, base_ref, box, tmp_path):
    """The watcher keeps its commit scans' memo between snapshots; a file added afterwards in a
    directory whose times are put back is in the final snapshot."""
    lines, clock = [], FakeClock()
    w = watcher(registry, base_ref, box, "w-memo", lines, clock, every=600, quiet=10**6)
    w.tick()
    assert w.commit_memo.seen == {}  # every file is younger than the racy window by the watcher's clock
    clock.advance(60)
    w.tick()  # nothing changed, no commit; then one that is due keeps a memo
    w.pacing.last_commit_at = float("-inf")
    write_tree(box, {"opt/app/notes.txt": "edited\n"})
    clock.advance(60)
    w.tick()
    assert "opt/app/main.py" in w.commit_memo.seen
    custom = os.path.join(box, "opt/app")
    st = os.lstat(custom)
    write_tree(box, {"opt/app/late.txt": "written just before the notice\n"})
    put_back_times(custom, st)
    assert w.final("test") == 0
    assert_tree = snapshot_of_tree(box, skip=NOT_CAPTURED)
    out = tmp_path / "restored"
    restore_image(f"{registry.host}/w-memo:v2", str(out))
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == assert_tree


def test_the_stat_cache_key_is_the_digest_of_the_documented_json():
    """Written a row at a time (for the memo), the key is the digest of the one json.dumps of the
    whole document: stat caches an earlier snap wrote hit after an upgrade, and no model is read again."""
    entries = [Entry("opt/é/a.py", "file", 0o644, 1, 2, 30, 1_700_000_000, inode="5:6", stamp="7:8:9",
                     xattrs={"user.b": "2", "user.a": "\udcff"}),
               Entry("opt/l", "symlink", 0o777, linkname="a.py", stamp="1:2:3")]
    plan = LayerPlan("venv", "zstd", entries, ["opt/gone"], slices={"x.snap-part-0001-of-0002": ("x", 0)},
                     part_links=["y"])
    for level, memo in ((3, None), (7, PlanMemo())):
        doc = {"compression": "zstd", "zstd_level": level,
               "entries": [[e.path, e.kind, e.mode, e.uid, e.gid, e.size, e.mtime, e.linkname, e.rdev, e.inode,
                            e.stamp, sorted((e.xattrs or {}).items())] for e in entries],
               "whiteouts": ["opt/gone"], "slices": [["x.snap-part-0001-of-0002", ["x", 0]]], "part_links": ["y"]}
        want = "sha256:" + hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()
        assert plan.fingerprint(level, memo) == want
    assert LayerPlan("models", "none", entries).fingerprint(3) == "sha256:" + hashlib.sha256(json.dumps(
        {"compression": "none", "zstd_level": None, "entries": doc["entries"], "whiteouts": [], "slices": [],
         "part_links": []}, separators=(",", ":")).encode()).hexdigest()


def test_every_row_of_the_stat_cache_key_is_the_json_of_its_fields():
    """Rows are written by hand on the common path: for names with any character (quotes,
    backslashes, control characters, non-ASCII, undecodable bytes as surrogates), any inode and
    xattrs, and fields of unusual types, each row is still exactly json.dumps of its fields."""
    rng = random.Random(7)
    alphabet = ["a", "Z", "0", "/", ".", " ", '"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "\u2028",
                "\U0001f600", "\udcff", "\udc80"]

    def text(n):
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))

    entries = []
    for i in range(3000):
        entries.append(Entry(text(40), rng.choice(["file", "dir", "symlink", "char"]), rng.randint(0, 0o7777),
                             rng.choice([0, 1000, 2**32 - 2]), rng.randint(0, 65535), rng.choice([0, 1, 2**40 + 3]),
                             rng.choice([0, 1_700_000_000, 2**33]), linkname=text(20), rdev=rng.choice([0, 259]),
                             inode=rng.choice([None, f"{i}:{i + 1}"]), stamp=text(12),
                             xattrs=rng.choice([None, {}, {text(8): text(8), "user.a": "\udcff"}])))
    # Fields of types a scan never makes: the encoder's text all the same.
    entries += [Entry("x", "file", 0o644, mtime=1.5), Entry("y", "file", True),
                Entry("z", "file", 0o644, linkname=None)]
    for e in entries:
        want = json.dumps([e.path, e.kind, e.mode, e.uid, e.gid, e.size, e.mtime, e.linkname, e.rdev, e.inode, e.stamp,
                           sorted(e.xattrs.items()) if e.xattrs else []], separators=(",", ":"))
        assert plan_module.fingerprint_row(e) == want, e


def test_an_unchanged_layer_is_not_split_again_and_the_plans_are_the_same(box, monkeypatch):
    profile, scan_memo, memo = load_profile(), ScanMemo(LATER), PlanMemo()
    splits = []
    real = memo_module.split_plan
    monkeypatch.setattr(memo_module, "split_plan", lambda p, rule, *a: splits.append(rule.name) or real(p, rule, *a))

    def plans(memo=None, scan_memo=None):
        scan = scan_box(box, profile, memo=scan_memo)
        d = changes_in(scan, box, profile, {})
        return [(p.label, p.fingerprint(3, memo), [e.path for e in p.entries], p.whiteouts)
                for p in plan_layers(d, scan, {}, profile, memo=memo)]

    first = plans(memo, scan_memo)
    assert first == plans()
    splits.clear()
    again = plans(memo, scan_memo)
    assert "venv" not in splits and "custom_nodes" not in splits
    assert again == first == plans()
    write_tree(box, {"opt/app/custom_nodes/NodeB/new.py": "y = 2\n"})
    splits.clear()
    changed = plans(memo, scan_memo)
    assert "custom_nodes" in splits and "venv" not in splits
    assert changed == plans() != first


def test_a_memo_is_used_only_by_a_scan_with_the_same_options(box):
    """A metadata scan reads no xattrs or symlink targets: a full scan sharing its memo must not
    take its entries."""
    profile, memo = load_profile(), ScanMemo(LATER)
    metadata = scan_box(box, profile, metadata_only=True, memo=memo)
    assert metadata.entries["opt/app/venv/bin/python"].linkname == ""
    full = scan(box, profile, memo)
    assert full.entries == scan(box, profile).entries
    assert full.entries["opt/app/venv/bin/python"].linkname == "/usr/bin/python3"


def test_a_chmod_or_chown_is_seen_where_the_ctime_does_not_move(box, monkeypatch):
    """sshfs and some other FUSE mounts report a ctime a chmod or chown leaves alone: the memo
    compares the permissions and the owner too. Such a filesystem is played by giving lstat's
    answer for the file its times from before the change."""
    profile, memo = load_profile(), ScanMemo(LATER)
    path = os.path.join(box, "opt/app/main.py")
    before = os.lstat(path)
    scan(box, profile, memo)
    os.chmod(path, 0o600)
    os.chown(path, 1234, 5678)
    real_lstat = os.lstat

    def lstat_times_unmoved(p, *a, **k):
        st = real_lstat(p, *a, **k)
        if os.fspath(p) != path:
            return st
        names = ("st_atime", "st_mtime", "st_ctime")
        return os.stat_result([*st[:7], *(int(getattr(before, n)) for n in names)],
                              {**{n: getattr(before, n) for n in names},
                               **{n + "_ns": getattr(before, n + "_ns") for n in names}})

    monkeypatch.setattr(box_scan.os, "lstat", lstat_times_unmoved)
    entry = scan(box, profile, memo).entries["opt/app/main.py"]
    assert (entry.mode, entry.uid, entry.gid) == (0o600, 1234, 5678)


def test_a_scan_that_fails_leaves_the_memo_as_it_was(box):
    """A full scan interrupted after a metadata scan: the next full scan must not take the metadata
    scan's entries (they lack symlink targets) as its own."""
    profile, memo = load_profile(), ScanMemo(LATER)
    scan_box(box, profile, metadata_only=True, memo=memo)

    def interrupt(_):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scan_box(box, profile, metadata_only=False, memo=memo, progress=interrupt)
    full = scan(box, profile, memo)
    assert full.entries["opt/app/venv/bin/python"].linkname == "/usr/bin/python3"
    assert full.entries == scan(box, profile).entries


def test_the_cycle_collector_is_left_as_it_was_found():
    import gc
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_venv_is_found_at_any_depth():
    from snapshotter.profile import VenvRoots
    deep = "/".join(["d"] * 2000)
    roots = VenvRoots([deep[:999]])
    assert roots.contains(deep + "/f") and roots.contains(deep[:999] + "/x")
    assert not roots.contains("e/" + deep) and not roots.contains("d/x")


@pytest.mark.parametrize("swap", ["symlink", "file"])
def test_a_directory_swapped_during_the_scan_is_not_walked(box, tmp_path, swap):
    """A directory replaced (after its lstat, before its listing) by a symlink to elsewhere or by a
    file: the scan neither walks the symlink's target nor fails. The swap is made from the scan's
    own progress callback, called after the root's listing, before /opt's."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "not-the-box.txt").write_text("x")
    link = tmp_path / "box-root"
    link.symlink_to(box)  # the root itself may be a symlink
    swapped = []

    def swap_opt(_):
        if not swapped:
            os.rename(os.path.join(box, "opt"), os.path.join(box, "opt-moved"))
            if swap == "symlink":
                os.symlink(outside, os.path.join(box, "opt"))
            else:
                open(os.path.join(box, "opt"), "w").close()
            swapped.append(True)

    got = scan_box(str(link), load_profile(), metadata_only=False, progress=swap_opt)
    assert swapped and "opt" in got.entries
    assert not any(p.startswith("opt/") for p in got.entries), sorted(got.entries)[:5]


def sparse(path, size):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "ab") as f:
        f.truncate(size)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_plan_with_memo_is_the_plan_without_through_a_series_of_changes(box, base_rootfs, seed):
    """A watcher's plans, each from the last one's memos (scan and plan), against a plan made from
    nothing, after each of a seeded series of changes: files added, deleted (whiteouts of the base's),
    moved, grown past the weights' min_size, a new venv root (pyvenv.cfg) taking a tree into the venv
    layer, an __init__.py that makes a namespace directory one unit. The venv is big enough (sparse
    files) to be cut into bundles at units. Same layers, same paths, same stat-cache keys."""
    rng = random.Random(seed)
    profile, scan_memo, memo = load_profile(), ScanMemo(LATER), PlanMemo()
    base = scan_box(base_rootfs, profile).entries
    site = "opt/app/venv/lib/python3.11/site-packages"
    for i in range(12):
        sparse(os.path.join(box, f"{site}/pkg{i}/core.py"), 8 * 1024**2)
    sparse(os.path.join(box, f"{site}/nvidia/cublas/lib.py"), 8 * 1024**2)
    sparse(os.path.join(box, f"{site}/nvidia/cudnn/lib.py"), 8 * 1024**2)
    write_tree(box, {"srv/tool/lib/a.py": "a\n", "srv/tool/lib/b.py": "b\n"})

    def files():
        return sorted(os.path.relpath(os.path.join(d, n), box) for d, _, names in os.walk(box) for n in names
                      if not os.path.relpath(d, box).startswith("tmp"))

    def add():
        folder = rng.choice([site + "/pkg3", "opt/app/custom_nodes/NodeC", "srv/tool/lib"])
        write_tree(box, {f"{folder}/n{rng.random()}.py": "x\n"})

    def delete():
        os.unlink(os.path.join(box, rng.choice(files())))

    def move():
        src = rng.choice(files())
        dst = rng.choice(["opt/app/custom_nodes/NodeA", site + "/pkg5", "srv/tool",
                          "etc"]) + "/" + os.path.basename(src)
        if not os.path.exists(os.path.join(box, dst)):
            os.rename(os.path.join(box, src), os.path.join(box, dst))

    def grow():
        sparse(os.path.join(box, rng.choice([site + "/pkg1/core.py", "srv/tool/lib/a.py", "etc/app.conf"])),
               65 * 1024**2)

    def venv_root():
        write_tree(box, {rng.choice(["srv/tool", "opt/app/custom_nodes/NodeB"]) + "/pyvenv.cfg": "home = /usr/bin\n"})

    def namespace():
        write_tree(box, {f"{site}/nvidia/__init__.py": ""})

    def plans(scan_memo=None, memo=None):
        scan = scan_box(box, profile, memo=scan_memo)
        d = changes_in(scan, box, profile, base)
        return [(p.label, p.fingerprint(3, memo), [e.path for e in p.entries], p.whiteouts)
                for p in plan_layers(d, scan, base, profile, memo=memo)]

    with gc_paused():
        first = plans(scan_memo, memo)
        assert len([p for p in first if p[0].startswith("venv (bundle")]) > 1  # cut at units
        assert first == plans()
        changes = [add, delete, move, grow, venv_root, namespace] + [rng.choice([add, delete, move, grow])
                                                                    for _ in range(6)]
        rng.shuffle(changes)
        for change in changes:
            change()
            assert plans(scan_memo, memo) == plans(), change.__name__


def test_an_unchanged_entry_is_not_classified_again(box, monkeypatch):
    """The plan memo keeps each entry's profile layer: after one file changed, the plan classifies
    that file (and its directory, whose times moved), not the rest of the box."""
    profile, scan_memo, memo = load_profile(), ScanMemo(LATER), PlanMemo()
    classified = []
    real = type(profile).classify
    monkeypatch.setattr(type(profile), "classify", lambda self, path,
                        *a: classified.append(path) or real(self, path, *a))

    def plan():
        scan = scan_box(box, profile, memo=scan_memo)
        return plan_layers(changes_in(scan, box, profile, {}), scan, {}, profile, memo=memo)

    plan()
    assert "opt/app/custom_nodes/NodeB/__init__.py" in classified
    classified.clear()
    write_tree(box, {"opt/app/custom_nodes/NodeA/new.py": "z = 1\n"})
    plan()
    assert set(classified) == {"opt/app/custom_nodes/NodeA/new.py", "opt/app/custom_nodes/NodeA"}
