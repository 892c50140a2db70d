"""A commit packs its layers on every core (layer/packers.py, commit/push.py): worker processes
read, tar, compress and hash them, the same bytes as in one process, with every guarantee of a
commit in one process: a file that changes while read is held back, a stop leaves no packer behind
and no manifest pushed, a packer that dies ends the commit with one line."""

import os
import select
import signal
import subprocess
import sys

from snapshotter import CommitOptions, commit_box, restore_image
from snapshotter.commit import push as push_module
from snapshotter.commit.model import CommitHooks
from snapshotter.profile import parse_profile

from support.packers import BlockOnRead, NoteReader, RewriteOnRead, packer_env
from support.registry import digest_of
from support.run import TIMEOUT, assert_one_line_error, snap
from support.trees import SMALL_WEIGHTS, write_tree

MiB = 1024 * 1024
# The default profile with the venv in bundles of 64 KiB (several layers) and weights of 1 MiB and more alone.
BUNDLED = SMALL_WEIGHTS.replace("    venv: true                  # every directory holding a pyvenv.cfg\n",
                                "    venv: true\n    bundle_max: 64KiB\n")


def many_layers(box: str) -> None:
    files = {f"opt/app/venv/lib/python3.11/site-packages/pkg{i:02d}/mod{j}.py": f"X = {i * j}\n" * (200 + 37 * j)
             for i in range(12) for j in range(6)}
    files.update({f"opt/app/custom_nodes/Node{i}/nodes.py": f"N = {i}\n" * 500 for i in range(5)})
    files.update({f"opt/app/models/loras/lora{i}.safetensors": os.urandom(MiB + i) for i in range(3)})
    files.update({"opt/app/output/state.db": os.urandom(50_000), "opt/app/output/ok.txt": "settled\n"})
    write_tree(box, files)


def readers(log: str) -> set[int]:
    with open(log) as f:
        return {int(line) for line in f}


def test_the_layers_are_the_same_with_any_number_of_jobs(registry, base_ref, box, tmp_path, monkeypatch):
    """The same tree gives the same layer digests packed in this process (--jobs 1) and in four packers."""
    many_layers(box)
    prof = parse_profile(BUNDLED)
    for k, v in packer_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(push_module, "PACK_APART_MIN", 0)
    log = str(tmp_path / "readers")
    hooks = CommitHooks(after_read=NoteReader(log))
    digests = {}
    for jobs in (1, 4):
        monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / f"state-{jobs}"))  # nothing known: every layer packed
        result = commit_box(f"{registry.host}/jobs:j{jobs}", base_ref, CommitOptions(root=box, profile=prof, jobs=jobs),
                            hooks)
        assert not [layer for layer in result.layers if "not read" in layer.status], result.layers
        digests[jobs] = [(layer.name, layer.digest) for layer in result.layers]
        if jobs == 1:
            assert readers(log) == {os.getpid()}
            os.unlink(log)
    assert len([d for d in digests[1] if d[0].startswith("venv (bundle")]) > 3, digests[1]
    assert len(readers(log) - {os.getpid()}) > 1  # read in packers, several
    assert digests[4] == digests[1]


def test_a_file_that_changes_while_a_packer_reads_it_is_held_back(registry, base_ref, box, tmp_path, monkeypatch):
    """As in one process (test_reclaim): never pushed as last read; the rest of its layer is."""
    many_layers(box)
    for k, v in packer_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(push_module, "PACK_APART_MIN", 0)
    log = str(tmp_path / "readers")
    hooks = CommitHooks(after_read=RewriteOnRead(log, box, {"opt/app/output/state.db"}))
    target = f"{registry.host}/torn-apart:v1"
    result = commit_box(target, base_ref, CommitOptions(root=box, profile=parse_profile(BUNDLED), jobs=3), hooks)
    assert result.held == {"opt/app/output/state.db": "changed while read"}
    assert readers(log) - {os.getpid()}
    out = tmp_path / "out"
    restore_image(target, str(out))
    assert not (out / "opt/app/output/state.db").exists()
    assert (out / "opt/app/output/ok.txt").read_text() == "settled\n"


# `snap commit TARGET --base BASE --root ROOT --jobs 2` with a hook in its packers (given through the
# commit's hooks, which the command line has no flag for), and layers packed apart however small. The
# library's commit_box in the command line's own wrapper, as cli/capture.py's commit runs it: SIGTERM
# stops it as Ctrl-C does, and it ends with one line and the exit code (app.command).
_WITH_HOOK = """
import os, pickle, sys
import typer
from snapshotter import CommitOptions, commit_box
from snapshotter.cli.app import command
from snapshotter.cli.output import say
from snapshotter.commit import push
from snapshotter.commit.model import CommitHooks
push.PACK_APART_MIN = 0
after_read = pickle.loads(bytes.fromhex(sys.argv[1]))
after_read.maker = os.getpid()  # snap's own process reads on (the weights)

@command
def commit(target, base, root):
    commit_box(target, base, CommitOptions(root=root, jobs=2, log=say), CommitHooks(after_read))

try:
    commit(*sys.argv[2:])
except typer.Exit as e:
    sys.exit(e.exit_code)
"""


def _blocked_commit(tmp_path, registry, base_ref, box, repo):
    """`snap commit --jobs 2` started with its packers blocked in their first read: (process, packer pids)."""
    import pickle
    ready, never = str(tmp_path / "ready"), str(tmp_path / "never")
    os.mkfifo(ready)
    os.mkfifo(never)
    many_layers(box)
    for name in os.listdir(os.path.join(box, "opt/app/models/loras")):  # no weight: read in snap's own process
        os.unlink(os.path.join(box, "opt/app/models/loras", name))
    hook = pickle.dumps(BlockOnRead(ready, never)).hex()
    fd = os.open(ready, os.O_RDWR)  # a reader, and a writer so that it never reads the end
    p = subprocess.Popen([sys.executable, "-c", _WITH_HOOK, hook, f"{registry.host}/{repo}:v1", base_ref, box],
                         env={**os.environ, **packer_env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert select.select([fd], [], [], TIMEOUT)[0], "no packer read a file"
    first = int(os.read(fd, 64).split()[0])
    os.close(fd)
    return p, first, _children(p.pid)


def _ended(p: subprocess.Popen, packers: set[int]) -> tuple[str, str]:
    """snap's output once it exits; if it hangs, it and its packers are killed (the test fails)."""
    try:
        return p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            for pid in packers | {p.pid}:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()


def _children(pid: int) -> set[int]:
    kids = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.add(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigterm_during_a_parallel_commit_stops_it_and_its_packers(registry, base_ref, box, tmp_path):
    p, first, packers = _blocked_commit(tmp_path, registry, base_ref, box, "term-apart")
    assert first in packers and len(packers) == 2, packers
    p.send_signal(signal.SIGTERM)
    out, err = _ended(p, packers)
    assert p.returncode == 143, (out, err)
    assert "Traceback" not in err and "snap: terminated" in err, err
    assert all(_gone(pid) for pid in packers)
    assert digest_of(registry, "term-apart", "v1") is None


def test_a_packer_that_dies_ends_the_commit_with_one_line(registry, base_ref, box, tmp_path):
    p, first, packers = _blocked_commit(tmp_path, registry, base_ref, box, "died-apart")
    os.kill(first, signal.SIGKILL)  # as the kernel's OOM killer would
    out, err = _ended(p, packers)
    assert p.returncode == 1, (out, err)
    lines = [line for line in err.splitlines() if line.startswith("snap: error:")]
    assert len(lines) == 1 and "died (killed by SIGKILL)" in lines[0] and "nothing was pushed" in lines[0], err
    assert "Traceback" not in err, err
    assert all(_gone(pid) for pid in packers)
    assert digest_of(registry, "died-apart", "v1") is None
    state = os.environ["SNAP_STATE_DIR"]
    assert not [n for n in os.listdir(os.path.join(state, "layers")) if n.startswith(".building-")]


def test_a_bad_jobs_setting_is_one_line_before_anything_is_read(registry, base_ref, box):
    r = snap("commit", f"{registry.host}/badjobs:v1", "--base", base_ref, "--root", box, env={"SNAP_JOBS": "many"})
    assert_one_line_error(r, 2, "SNAP_JOBS='many'")
    r = snap("commit", f"{registry.host}/badjobs:v1", "--base", base_ref, "--root", box, "--jobs", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    r = snap("commit", f"{registry.host}/badjobs:v1", "--base", base_ref, "--root", box, env={"SNAP_JOBS": "0"})
    assert_one_line_error(r, 2, "SNAP_JOBS='0'", "at least 1")
    assert digest_of(registry, "badjobs", "v1") is None


def test_packers_load_this_snap_not_another_in_the_working_directory(registry, base_ref, box, tmp_path, monkeypatch):
    """Run from a directory that holds another `snapshotter` (a checkout of another version): the
    packers use the snap this commit runs, as `python -c` would otherwise import the one there."""
    many_layers(box)
    for k, v in packer_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(push_module, "PACK_APART_MIN", 0)
    hooks = CommitHooks(after_read=NoteReader(str(tmp_path / "readers")))
    other = tmp_path / "checkout"
    (other / "snapshotter").mkdir(parents=True)
    (other / "snapshotter" / "__init__.py").write_text("raise ImportError('another snapshotter')\n")
    monkeypatch.chdir(other)
    result = commit_box(f"{registry.host}/cwd:v1", base_ref, CommitOptions(root=box, profile=parse_profile(BUNDLED),
                                                                           jobs=4), hooks)
    assert len(readers(str(tmp_path / "readers")) - {os.getpid()}) > 1  # packed in packers
    assert all(layer.status == "uploaded" for layer in result.layers), result.layers
