"""Output made for logs: without a terminal, progress is a plain line now and then (no carriage
return, no escape code), timed by the clock its caller gives; a closed stdout ends a command quietly."""

import itertools
import os
import subprocess

import pytest

from snapshotter import progress

from support.run import SNAP, assert_one_line_error, snap

MiB = 1024 * 1024
LOUD = {"SNAP_QUIET": ""}  # the suite sets SNAP_QUIET=1; an empty value is unset


@pytest.fixture
def loud(monkeypatch):
    for name in ("SNAP_QUIET", "SNAP_PROGRESS", "SNAP_PROGRESS_EVERY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def assert_plain(text: str) -> None:
    assert "\r" not in text and "\x1b" not in text, repr(text)


def test_without_a_terminal_a_line_at_most_every_interval_with_a_start_and_an_end(loud, capsys):
    seconds = itertools.count(1000)  # one second passes on every reading of the clock
    with progress.bar("downloading", 100 * MiB, clock=lambda: next(seconds)) as b:
        for _ in range(100):
            b.update(MiB)  # one clock reading per update
    err = capsys.readouterr().err
    assert_plain(err)
    lines = err.splitlines()
    assert lines[0] == "downloading: started (100.0 MiB)"
    assert lines[1] == "downloading: 10.0 MiB of 100.0 MiB (10%), 1.0 MiB/s"  # 10 MiB in 10 s
    assert lines[-1] == "downloading: done, 100.0 MiB in 1 min 41 s (1013.9 KiB/s)"
    assert len(lines) == 12  # start, one per 10 s of 100 s, end

    loud.setenv("SNAP_PROGRESS_EVERY", "30")
    with progress.bar("scanning box", unit="files", clock=lambda: next(seconds)) as b:  # started by its first update
        for _ in range(90):
            b.update(1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "scanning box: started" and lines[1] == "scanning box: 30 files, 1.0 files/s"
    assert len(lines) == 5 and lines[-1].startswith("scanning box: done, 90 files in ")


def test_the_lines_go_to_the_sink_the_caller_names_and_nowhere_else(loud, capsys):
    """A transfer's lines go where its caller says (`snap watch`: its log, with their time), passed
    explicitly: no module global is set for them, so two sinks can be in use at once."""
    loud.setenv("SNAP_PROGRESS", "lines")
    watch_log, other_log = [], []
    with progress.bar("uploading", 2 * MiB, sink=watch_log.append) as up, \
            progress.bar("scanning box", unit="files", sink=other_log.append) as scan:
        up.update(2 * MiB)
        scan.update(1)
    assert watch_log[0] == "uploading: started (2.0 MiB)" and watch_log[-1].startswith("uploading: done, 2.0 MiB")
    assert other_log[0] == "scanning box: started" and other_log[-1].startswith("scanning box: done, 1 files")
    assert capsys.readouterr().err == ""


def test_a_transfer_that_fails_says_where_it_stopped_and_one_with_nothing_to_do_says_nothing(loud, capsys):
    with pytest.raises(progress.Stopped):
        with progress.bar("uploading", 4 * MiB) as b:
            b.update(MiB)
            raise progress.Stopped()
    assert capsys.readouterr().err.splitlines()[-1] == "uploading: stopped at 1.0 MiB of 4.0 MiB (25%)"
    with progress.bar("copying base layers", 0):
        pass
    assert capsys.readouterr().err == ""


def test_the_settings_choose_bars_lines_or_nothing(loud, capsys):
    def shown(**env):
        for k, v in env.items():
            loud.setenv(k, v)
        with progress.bar("reading", 2 * MiB) as b:
            b.update(MiB)
        for k in env:
            loud.delenv(k)
        return capsys.readouterr().err

    assert shown().startswith("reading: started")  # stderr is no terminal here
    assert shown(SNAP_PROGRESS="lines").startswith("reading: started")
    assert "\r" in shown(SNAP_PROGRESS="bars") and "\r" in shown(SNAP_PROGRESS="1")  # tqdm's bar, forced
    assert shown(SNAP_PROGRESS="off") == shown(SNAP_QUIET="1") == shown(SNAP_QUIET="1", SNAP_PROGRESS="bars") == ""


def test_a_label_from_the_image_cannot_forge_a_line(loud, capsys):
    with progress.bar("extracting evil\nsnap: done\x1b[2J", MiB) as b:
        b.update(MiB)
    err = capsys.readouterr().err
    assert_plain(err)
    assert all(line.startswith("extracting evil\\nsnap: done\\x1b[2J: ") for line in err.splitlines())


def test_a_misspelt_setting_is_one_line_before_any_work():
    assert_one_line_error(snap("profiles", env={"SNAP_PROGRESS": "line"}), 2, "SNAP_PROGRESS", "lines")
    assert_one_line_error(snap("profiles", env={"SNAP_PROGRESS_EVERY": "10s"}), 2, "SNAP_PROGRESS_EVERY")


def test_commit_and_restore_into_a_log_say_what_and_how_much(registry, base_ref, box, tmp_path):
    """The real commands with stderr a pipe: progress lines, plain; SNAP_PROGRESS_EVERY=0 prints one
    on every update, so the test needs no clock."""
    ref = f"{registry.host}/logged:v1"
    every_update = {**LOUD, "SNAP_PROGRESS_EVERY": "0"}
    r = snap("commit", ref, "--base", base_ref, "--root", box, env=every_update, check=True)
    assert_plain(r.stderr)
    for what in ("scanning box: started", "packing: started (", "uploading: started", "uploading: done, "):
        assert any(line.startswith(what) for line in r.stderr.splitlines()), (what, r.stderr)

    r = snap("restore", ref, "--root", str(tmp_path / "out"), env=every_update, check=True)
    assert_plain(r.stderr)
    lines = r.stderr.splitlines()
    assert any(line.startswith("downloading: started (") for line in lines), r.stderr
    assert any(line.startswith("downloading: done, ") for line in lines), r.stderr
    venv = [line for line in lines if line.startswith("extracting venv: ")]
    assert venv[0].startswith("extracting venv: started (") and venv[-1].startswith("extracting venv: done, ")
    assert any(" of " in line and "/s" in line for line in venv[1:-1]), venv

    quiet = snap("restore", ref, "--root", str(tmp_path / "quiet"), check=True)  # SNAP_QUIET=1, as the suite runs
    assert not any(line.startswith(("downloading", "extracting")) for line in quiet.stderr.splitlines())

    # verify says what it does through the whole run: reading the layers, comparing the paths, then
    # hashing the files (it was silent for that half), each to its end.
    r = snap("verify", ref, "--root", str(tmp_path / "out"), env=every_update, check=True)
    assert_plain(r.stderr)
    lines = r.stderr.splitlines()
    for what in ("comparing paths", "checking contents"):
        said = [line for line in lines if line.startswith(f"{what}: ")]
        assert said[0].startswith(f"{what}: started (") and said[-1].startswith(f"{what}: done, "), (what, r.stderr)
        assert any(" of " in line for line in said[1:-1]), said
    # The total announced is what was read: the image's files the profile does not leave out.
    said = [line for line in lines if line.startswith("checking contents: ")]
    assert said[0].split("(", 1)[1].split(")")[0] == said[-1].split("done, ", 1)[1].split(" in ")[0], said


def run_with_stdout_closed(*args: str) -> subprocess.CompletedProcess:
    """snap with stdout a pipe whose reader is gone before snap writes (`snap log | head -1`, once
    head has its line)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([*SNAP, *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        os.close(write_end)


def test_a_closed_stdout_ends_the_command_quietly_with_its_own_exit_code(registry, base_ref, box, tmp_path):
    ref = f"{registry.host}/piped:v1"
    snap("commit", ref, "--base", base_ref, "--root", box, check=True)
    for args in (("log", ref), ("log", ref, "--json"), ("profiles",)):
        r = run_with_stdout_closed(*args)
        assert (r.returncode, r.stderr) == (0, ""), args
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)
    (out / "etc/app.conf").write_text("changed\n")
    r = run_with_stdout_closed("verify", ref, "--root", str(out))  # its differences go nowhere: still exit 9
    assert_one_line_error(r, 9, "differ")
    assert r.stderr.count("\n") == 1

    # As a reader does it: one line read, then the pipe closed while snap may still write.
    p = subprocess.Popen([*SNAP, "log", ref], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    first = p.stdout.readline()
    p.stdout.close()
    assert "piped" not in first and "v1" in first
    assert (p.wait(timeout=600), p.stderr.read()) == (0, "")
    p.stderr.close()
