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

from snapshotter.restore.journal import Journal
from snapshotter.snapshot import statcache
from snapshotter.state import RootFiles, root_key, sub
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
    forged = tmp_path / "forged.json"
    forged.write_text("{}\n")
    link = journals / f"{root_key(str(jail.root))}.json"
    link.symlink_to(forged)
    r = snap("restore", base_ref, "--root", str(jail.root))
    assert_one_line_error(r, 7, repr(str(link)), "symlink")
    assert forged.read_text() == "{}\n"


def test_snap_reads_its_files_without_following_a_symlink(state_dir, tmp_path):
    """Planted after this process checked the state dir (as a running watcher did): the stat cache,
    the last commit's record and a journal are read as missing, never through the symlink."""
    root = str(tmp_path / "box")
    sub()  # the check, once per process
    cache = statcache.StatCache(root, "sha256:" + "b" * 64)
    cache.record("fp", {"digest": "sha256:" + "c" * 64, "diff_id": "sha256:" + "d" * 64, "size": 1, "media_type": "x"})
    cache.save()
    statcache.note_last_commit(root, "base", "reg/box:v1", "sha256:" + "e" * 64)
    journal = Journal(sub("restore-journal"), RootFiles(root), "sha256:" + "f" * 64, ["sha256:" + "1" * 64],
                      fsync=False)
    journal.record_applied(1)
    for path in (cache.path, statcache._last_commit_path(root), journal.path):
        forged = tmp_path / (os.path.basename(path) + ".forged")
        os.rename(path, forged)
        os.symlink(forged, path)
    assert statcache.StatCache(root, "sha256:" + "b" * 64).lookup("fp") is None
    assert statcache.last_base(root) is None
    assert not Journal(sub("restore-journal"), RootFiles(root), "sha256:" + "f" * 64, ["sha256:" + "1" * 64],
                       fsync=False).started_here()


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
        daemon.write_versioned(files.pid, daemon.VERSION, {"pid": bystander.pid, "target": "reg/box:v1", "grace": 4})
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
