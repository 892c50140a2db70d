"""The state dir is the user's alone, as ~/.ssh is: one owned by another uid, writable by group or
others, reached through a symlink or holding a symlink, a hard link or another user's file is
refused in one line (exit 7); an older snap's 0755 dirs and 0644 files are tightened; what snap
makes there is 0700 / 0600; `snap watch --stop` signals only the process that holds the watch lock."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys

import pytest

from snapshotter.registry.blobsources import BlobSources
from snapshotter.restore.journal import Journal
from snapshotter.snapshot import statcache
from snapshotter.state import MARKER, RootFiles, exclusive, root_key, sub, write_versioned
from snapshotter.watch import daemon

from support.images import repo_for
from support.run import assert_one_line_error, snap


def commit(registry, base_ref, box, repo="private", tag="v1"):
    return snap("commit", f"{registry.host}/{repo}:{tag}", "--base", base_ref, "--root", box)


def modes(state_dir) -> dict[str, int]:
    """Mode of each entry snap keeps in the state dir (two levels: its own)."""
    out = {}
    for entry in [state_dir, *state_dir.iterdir(),
                  *(e for d in state_dir.iterdir() if d.is_dir() for e in d.iterdir())]:
        out[str(entry.relative_to(state_dir))] = stat.S_IMODE(entry.lstat().st_mode)
    return out


def test_a_state_dir_of_another_uid_is_refused(registry, base_ref, box, state_dir):
    state_dir.mkdir(mode=0o700)
    os.chown(state_dir, 65534, 65534)
    assert_one_line_error(commit(registry, base_ref, box), 7, repr(str(state_dir)), "uid 65534", "chown",
                          "SNAP_STATE_DIR")
    assert list(state_dir.iterdir()) == []


def test_a_state_dir_writable_by_others_is_refused(registry, base_ref, box, state_dir):
    state_dir.mkdir()
    state_dir.chmod(0o777)
    assert_one_line_error(commit(registry, base_ref, box), 7, repr(str(state_dir)), "writable by group or others",
                          "chmod", "SNAP_STATE_DIR")
    assert list(state_dir.iterdir()) == []


def test_a_state_dir_reached_through_a_symlink_is_refused(registry, base_ref, box, tmp_path):
    real = tmp_path / "real-state"
    real.mkdir(mode=0o700)
    link = tmp_path / "state-link"
    link.symlink_to(real)
    r = snap("commit", f"{registry.host}/private:v1", "--base", base_ref, "--root", box,
             env={"SNAP_STATE_DIR": str(link)})
    assert_one_line_error(r, 7, repr(str(link)), "symlink", "SNAP_STATE_DIR")
    assert list(real.iterdir()) == []


def test_an_older_snaps_modes_are_tightened_and_new_files_are_private(registry, base_ref, box, state_dir, request):
    old = os.umask(0o022)
    try:
        (state_dir / "stat-cache").mkdir(parents=True)  # as an older snap left them: 0755, 0644
        state_dir.chmod(0o755)
        (state_dir / "stat-cache" / "old.json").write_text("{}")
        (state_dir / "lock").write_text("")
        assert commit(registry, base_ref, box, repo_for(request)).returncode == 0
    finally:
        os.umask(old)
    seen = modes(state_dir)
    assert len(seen) > 5, seen  # the commit made its files: layers, indexes, caches
    assert {p: oct(m) for p, m in seen.items() if m & 0o077} == {}


def plant_symlink(path, elsewhere):
    path.unlink()
    path.symlink_to(elsewhere)


def plant_foreign(path, elsewhere):
    os.chown(path, 65534, 65534)


def plant_hard_link(path, elsewhere):
    path.unlink()
    os.link(elsewhere, path)


@pytest.mark.parametrize("plant", [plant_symlink, plant_foreign, plant_hard_link])
def test_a_planted_stat_cache_is_refused(registry, base_ref, box, state_dir, tmp_path, plant, request):
    """A forged stat cache would make the next commit push old content as "unchanged, not read"."""
    repo = repo_for(request)
    assert commit(registry, base_ref, box, repo).returncode == 0
    [cache] = (state_dir / "stat-cache").iterdir()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(cache.read_text())
    plant(cache, elsewhere)
    assert_one_line_error(commit(registry, base_ref, box, repo, "v2"), 7, repr(str(cache)),
                          "remove it" if plant is not plant_foreign else "chown")


def test_a_journal_symlink_is_refused(registry, base_ref, jail, state_dir, tmp_path):
    """A forged journal would make a restore report success on an empty root."""
    journals = state_dir / "restore-journal"
    journals.mkdir(parents=True, mode=0o700)
    (state_dir / ".snap-state-dir").write_text("")  # snap's own state dir
    forged = tmp_path / "forged.json"
    forged.write_text("{}\n")
    link = journals / f"{root_key(str(jail.root))}.json"
    link.symlink_to(forged)
    r = snap("restore", base_ref, "--root", str(jail.root))
    assert_one_line_error(r, 7, repr(str(link)), "symlink")
    assert forged.read_text() == "{}\n"


def test_snap_reads_its_files_without_following_a_symlink(state_dir, tmp_path):
    """Planted after this process checked the state dir (as a running watcher did): the stat cache,
    the last commit's record, a journal and the blob sources are read as missing, never through the symlink."""
    root = str(tmp_path / "box")
    sub()  # the check, once per process
    cache = statcache.StatCache(root, "sha256:" + "b" * 64)
    cache.record("fp", {"digest": "sha256:" + "c" * 64, "diff_id": "sha256:" + "d" * 64, "size": 1, "media_type": "x"})
    cache.save()
    statcache.note_last_commit(root, "base", "reg/box:v1", "sha256:" + "e" * 64, ())
    journal = Journal(sub("restore-journal"), RootFiles(root), "sha256:" + "f" * 64, ["sha256:" + "1" * 64],
                      fsync=False)
    journal.record_applied(1)
    sources = BlobSources()
    sources.note("reg.example", "me/box", ["sha256:" + "2" * 64])
    sources.save()
    for path in (cache.path, statcache._last_commit_path(root), journal.path, sources.path):
        forged = tmp_path / (os.path.basename(path) + ".forged")
        os.rename(path, forged)
        os.symlink(forged, path)
    assert statcache.StatCache(root, "sha256:" + "b" * 64).lookup("fp") is None
    assert statcache.last_base(root) is None
    assert not Journal(sub("restore-journal"), RootFiles(root), "sha256:" + "f" * 64, ["sha256:" + "1" * 64],
                       fsync=False).started_here()
    assert BlobSources().known == {}


def test_stop_never_signals_a_process_that_does_not_hold_the_watch_lock(box, state_dir):
    """A pid file naming another process (stale, or forged) while the lock is held by another:
    `--stop` signals nothing and says so in one line."""
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys\n"
         "got = []\nsignal.signal(signal.SIGTERM, lambda *a: got.append('TERM'))\n"
         "print('ready', flush=True)\nsys.stdin.read()\nprint(got and got[0] or 'untouched', flush=True)"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert bystander.stdout.readline() == "ready\n"
        files = daemon.watch_files(str(box))
        write_versioned(files.pid, daemon.VERSION, {"pid": bystander.pid, "target": "reg/box:v1", "grace": 4})
        lock = os.open(files.lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # held by this test's process, not by the bystander
        try:
            r = snap("watch", "--stop", "--root", str(box))
        finally:
            os.close(lock)
        bystander.stdin.close()
        assert bystander.stdout.readline() == "untouched\n"
    finally:
        bystander.kill()
        bystander.wait()
    assert_one_line_error(r, 7, repr(files.pid), f"pid {bystander.pid}", "nothing signalled")


def tree_of(top) -> dict[str, tuple]:
    """Each entry under `top` (itself included): its mode, and its bytes or its link's target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for path in [dirpath, *(os.path.join(dirpath, n) for n in filenames + dirnames)]:
            st = os.lstat(path)
            content = (os.readlink(path) if stat.S_ISLNK(st.st_mode) else
                       open(path, "rb").read() if stat.S_ISREG(st.st_mode) else None)
            out[os.path.relpath(path, top)] = (stat.S_IMODE(st.st_mode), content)
    return out


def users_files(top) -> None:
    """What a user keeps in a folder: a name of each kind snap sweeps (a dead writer's temp file, a
    download's `.part`, a `.building-*`, any old file in layers/), 0644 and 0755 as a user makes
    them, and a symlink."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = 1_000_000_000  # 2001: long past BUILDING_QUIET
    for rel in ("README.md", "layers/checkpoint-3.pt", "datasets/c4/shard-00007.json.part",
                f"runs/exp1/metrics.tmp.{dead.pid}.1", "runs/.building-1-1/part-0"):
        path = top / rel
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        path.write_bytes(rel.encode())
        path.chmod(0o644)
        os.utime(path, (old, old))
    (top / "runs" / "exp1" / "latest").symlink_to(f"metrics.tmp.{dead.pid}.1")


def test_a_users_folder_as_state_dir_is_refused_and_left_as_it_was(registry, base_ref, box, state_dir):
    """SNAP_STATE_DIR at a folder of the user's (not empty, never snap's): one line, exit 7, before
    anything in it is removed, made private or written."""
    state_dir.mkdir(mode=0o755)
    state_dir.chmod(0o755)
    users_files(state_dir)
    before = tree_of(state_dir)
    assert_one_line_error(commit(registry, base_ref, box), 7, repr(str(state_dir)), "not snap's state dir",
                          "'README.md'", "point SNAP_STATE_DIR at a new empty directory")
    assert tree_of(state_dir) == before


def test_a_users_folder_of_names_snap_also_gives_is_refused(registry, base_ref, box, state_dir):
    """A user's folder that holds only names snap gives too ("layers", "blobs") but no lock of snap's:
    not an older snap's state dir; refused, nothing in it removed or made private."""
    (state_dir / "layers").mkdir(parents=True, mode=0o755)
    state_dir.chmod(0o755)
    (state_dir / "layers" / "conv1.pt").write_bytes(b"weights")
    (state_dir / "blobs").mkdir(mode=0o755)
    for path in (state_dir / "layers" / "conv1.pt", state_dir / "layers", state_dir / "blobs"):
        os.utime(path, (1_000_000_000,) * 2)
    before = tree_of(state_dir)
    assert_one_line_error(commit(registry, base_ref, box), 7, repr(str(state_dir)), "not snap's state dir",
                          "'blobs'", "'lock'")
    assert tree_of(state_dir) == before


def test_a_new_disks_lost_and_found_is_not_the_users(registry, base_ref, box, state_dir, request):
    """A state dir on a disk of its own holds the filesystem's lost+found: claimed as empty; lost+found
    is neither swept nor made private."""
    (state_dir / "lost+found").mkdir(parents=True, mode=0o755)
    assert commit(registry, base_ref, box, repo_for(request)).returncode == 0
    assert (state_dir / MARKER).is_file() and stat.S_IMODE((state_dir / "lost+found").stat().st_mode) == 0o755


def test_only_built_layers_are_swept_from_snaps_layers_folder(state_dir):
    """In snap's own layers/ folder, a killed run's built layer (digest-named) goes; a file of another
    name, which snap never builds there, stays."""
    built, other = state_dir / "layers" / (("d" * 64) + "-123-0"), state_dir / "layers" / "conv1.pt"
    sub("layers")
    for path in (built, other):
        path.write_bytes(b"x")
        os.utime(path, (1_000_000_000,) * 2)
    with exclusive():
        pass
    assert not built.exists() and other.read_bytes() == b"x"


def test_an_empty_folder_is_claimed_as_state_dir(registry, base_ref, box, state_dir, request):
    state_dir.mkdir(mode=0o700)
    assert commit(registry, base_ref, box, repo_for(request)).returncode == 0
    assert (state_dir / MARKER).is_file()
    assert commit(registry, base_ref, box, repo_for(request), "v2").returncode == 0  # its own now


def test_an_older_snaps_state_dir_is_claimed_and_swept(state_dir):
    """An older snap's state dir has no mark: it holds only names snap gives, so it is snap's; its
    leftovers are swept as ever."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftovers = [state_dir / "layers" / ("c" * 64), state_dir / "blobs" / "0123abcd.part",
                 state_dir / f"blob-sources.json.tmp.{dead.pid}.1"]
    kept = [state_dir / "lock", state_dir / "blob-sources.json", state_dir / "stat-cache" / "x.json"]
    for path in leftovers + kept:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_bytes(b"{}")
        os.utime(path, (1_000_000_000,) * 2)
    with exclusive():
        pass
    assert [p for p in leftovers if p.exists()] == [] and all(p.exists() for p in kept)
    assert (state_dir / MARKER).is_file()


def test_a_users_folder_in_snaps_state_dir_is_never_swept_nor_tightened(state_dir):
    """What a user drops into snap's own (marked) state dir is not snap's: nothing in it is removed
    or made private, and its symlink is not refused."""
    sub()  # snap's own state dir, marked
    users_files(state_dir / "mine")
    (state_dir / "mine" / "latest").symlink_to("runs")
    (state_dir / "notes.part").write_bytes(b"mine too")
    before = tree_of(state_dir / "mine"), (state_dir / "notes.part").read_bytes()
    with exclusive():
        pass
    assert (tree_of(state_dir / "mine"), (state_dir / "notes.part").read_bytes()) == before


def test_every_name_snap_gives_at_the_top_of_its_state_dir_is_listed_as_its_own():
    """What is not in OWN_NAMES is never swept nor tightened, and makes an unmarked dir the user's:
    each folder sub() is asked for, and each file snap keeps at the top, is listed there."""
    import re
    from pathlib import Path

    import snapshotter
    from snapshotter.registry.blobsources import FILE_NAME
    from snapshotter.restore.landing import PROGRESS_DIR
    from snapshotter.snapshot.encryption_state import ENCRYPTED_DIR
    from snapshotter.state import BUILT_LAYERS, LOCK_NAME, OWN_NAMES

    asked = set()
    for path in Path(snapshotter.__file__).parent.rglob("*.py"):
        asked |= set(re.findall(r'(?<![.\w])(?:_state_)?sub\("([^"]+)"', path.read_text()))
    assert len(asked) > 10, asked
    assert asked | {FILE_NAME, PROGRESS_DIR, ENCRYPTED_DIR, BUILT_LAYERS, LOCK_NAME, MARKER} <= OWN_NAMES
