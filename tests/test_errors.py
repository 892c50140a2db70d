"""Bad input ends in one line on stderr naming the cause, a distinct exit code, and no traceback."""

import os

import pytest
import requests
import typer

import snapshotter
from snapshotter import cli

from support.run import assert_one_line_error, free_port, snap
from support.sockets import RawServer


def test_unknown_base_image(registry, box):
    r = snap("commit", f"{registry.host}/x:v1", "--base", f"{registry.host}/nosuch:1", "--root", box)
    assert_one_line_error(r, 5, "not found", "nosuch")


def test_registry_not_reachable(box):
    port = free_port()
    r = snap("commit", f"127.0.0.1:{port}/x:v1", "--base", f"127.0.0.1:{port}/base:1", "--root", box)
    assert_one_line_error(r, 3, "not reachable", f"127.0.0.1:{port}")


NOT_RUNNING = "(check the host and port, and that the registry is running)"


@pytest.mark.parametrize("kind, said", [
    (None, f"registry {{host}} is not reachable: Connection refused {NOT_RUNNING}"),
    ("reset", f"registry {{host}} is not reachable: Connection reset by peer {NOT_RUNNING}"),
    ("garbage", f"registry {{host}} is not reachable: the server's answer is not HTTP {NOT_RUNNING}"),
    # plain http met a hang-up, TLS an EOF mid-handshake: TLS's failure is the one said
    ("close", "TLS to registry {host} failed: the TLS connection was closed mid-handshake (pass --ca-cert FILE for "
              "a private CA, or --plain-http for a registry without TLS)"),
], ids=["refused", "reset", "garbage", "tls-eof"])
def test_an_unreachable_registry_is_said_in_plain_words(kind, said, tmp_path):
    """The innermost cause of the connection's failure (short_error), never urllib3's repr cut short."""
    server = RawServer(kind).start() if kind else None
    host = server.host if server else f"127.0.0.1:{free_port()}"
    try:
        r = snap("restore", f"{host}/x:v1", "--root", str(tmp_path / "root"))
    finally:
        if server:
            server.stop()
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert r.stderr.splitlines() == [f"snap: error: {said.format(host=host)}"]


def test_a_proxy_that_refuses_is_said_to_be_the_proxy(registry, tmp_path):
    """Through HTTP(S)_PROXY a refused connection is the proxy's: said so, or the user looks at a
    registry that is running."""
    proxy = f"http://127.0.0.1:{free_port()}"
    env = {"HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "NO_PROXY": "", "no_proxy": ""}
    r = snap("restore", f"{registry.host}/x:v1", "--root", str(tmp_path / "root"), env=env)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert r.stderr.splitlines() == [f"snap: error: registry {registry.host} is not reachable: the proxy: "
                                     f"Connection refused {NOT_RUNNING}"]


def test_a_plain_http_registry_that_is_down_behind_its_proxy_is_not_reachable_not_a_tls_error(proxy, box):
    """A loopback proxy whose registry is down hangs up on plain http and answers TLS with plain http
    (a 400): the registry is not reachable; no TLS advice (--ca-cert) for a registry without TLS."""
    proxy.down.set()
    r = snap("restore", f"{proxy.host}/x:v1", "--root", box)
    assert_one_line_error(r, 3, "not reachable", proxy.host)
    assert "TLS" not in r.stderr and "--ca-cert" not in r.stderr, r.stderr


def test_root_that_does_not_exist(registry, base_ref, tmp_path):
    r = snap("commit", f"{registry.host}/x:v1", "--base", base_ref, "--root", str(tmp_path / "missing"))
    assert_one_line_error(r, 2, "does not exist")


@pytest.mark.parametrize("text,words", [
    ("layers: [unclosed", ("not valid YAML",)),
    ("layers:\n  - name: venv\n    compression: brotli\n", ("compression",)),
    ("layers:\n  - paths: [x]\n", ("name",)),
    ("- just\n- a list\n", ("mapping",)),
    ("layers:\n  - name: big\n    min_size: lots\n", ("size",)),
])
def test_bad_profile(registry, base_ref, box, tmp_path, text, words):
    prof = tmp_path / "bad.yaml"
    prof.write_text(text)
    r = snap("commit", f"{registry.host}/x:v1", "--base", base_ref, "--root", box, "--profile", str(prof))
    assert_one_line_error(r, 2, *words)


def test_unknown_profile_name(registry, base_ref, box):
    r = snap("commit", f"{registry.host}/x:v1", "--base", base_ref, "--root", box, "--profile", "nosuch")
    assert_one_line_error(r, 2, "no profile named", "default")


@pytest.mark.parametrize("ref", ["not a ref", "box:v1:v2", "127.0.0.1:5000/UPPER:v1"])  # more: test_reference.py
def test_malformed_reference(ref, box):
    r = snap("restore", ref, "--root", box)
    assert_one_line_error(r, 2, "reference")


def test_commit_to_a_digest(registry, base_ref, box):
    """A digest names content, not a place to push to: refused before anything is uploaded."""
    r = snap("commit", f"{registry.host}/pinned@sha256:{'0' * 64}", "--base", base_ref, "--root", box)
    assert_one_line_error(r, 2, "needs a tag")
    assert "pinned" not in requests.get(f"{registry.url}/v2/_catalog").json()["repositories"]


def test_restore_unknown_tag(registry, tmp_path):
    r = snap("restore", f"{registry.host}/base:nosuchtag", "--root", str(tmp_path / "x"))
    assert_one_line_error(r, 5, "not found")
    assert not (tmp_path / "x").exists()


def test_help_explains_each_command():
    for cmd in ("commit", "restore"):
        r = snap(cmd, "--help")
        assert r.returncode == 0
        assert "--root" in r.stdout
    r = snap("--help")
    assert "Exit codes" in r.stdout


def test_the_exit_codes_of_the_help_and_the_readme_are_errors_py_s():
    """One table (errors.exit_codes): the help text is made from it, the README's lists the same codes
    with the same meanings (its own words may add detail after them)."""
    from snapshotter.errors import exit_codes

    shown = " ".join(snap("--help").stdout.split())  # the help panel wraps lines
    for code, meaning in exit_codes():
        assert f"{code} {meaning}" in shown, (code, meaning)
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    table = readme.split("## Exit codes", 1)[1].split("\n\n", 2)[1]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(code) for code, _ in rows] == [code for code, _ in exit_codes()], rows
    for (_, said), (_, meaning) in zip(rows, exit_codes()):
        assert meaning.replace("`", "").split()[0].lower() in said.replace("`", "").lower(), (said, meaning)


def test_version_is_one_line_and_exit_0():
    """`snap --version` from a source tree: the version pyproject.toml builds with (test_install checks
    an installed one against its distribution's metadata)."""
    r = snap("--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"snap {snapshotter.__version__}\n", "")
    assert snapshotter.__version__.count(".") == 2


@pytest.mark.parametrize("cmd", ["commit", "verify", "watch", "status"])
def test_dash_p_means_publish_only(cmd):
    """`-p` is --publish, as in `docker run`; the commands that take a profile spell --profile out."""
    r = snap(cmd, "127.0.0.1:5000/box:v1", "-p", "comfyui")
    assert r.returncode == 2 and "No such option: -p" in r.stderr, r.stderr
    assert "--profile" in snap(cmd, "--help").stdout
    assert "--publish" in snap("run", "--help").stdout and "-p" in snap("run", "--help").stdout



COMMANDS = sorted(typer.main.get_command(cli.app).commands)
REFUSED = ([([cmd, "--password", "x"], "No such option: --password") for cmd in COMMANDS]
           + [(["--password"], "No such option: --password"), (["no-such-command"], "no-such-command"),
              (["log"], "Missing argument"), (["commit", "r", "--jobs", "0"], "--jobs"),
              (["verify", "r", "--root", "/", "-\x1b[2J"], "No such option: -\\x1b")])


@pytest.mark.parametrize("args,said", REFUSED, ids=[" ".join(a).encode("unicode_escape").decode() for a, _ in REFUSED])
def test_a_command_line_click_refuses_is_one_error_line(args, said):
    """An unknown option (of every command), an unknown command, a missing argument, a bad value:
    one `snap: error:` line naming what was wrong (escaped), exit 2; no usage panel."""
    r = snap(*args)
    assert_one_line_error(r, 2, said, "--help`")
    assert r.stderr.count("\n") == 1 and r.stdout == "", r.stderr
    assert not any(c in r.stderr for c in "╭│╰\x1b") and "Usage:" not in r.stderr, r.stderr


def test_snap_alone_still_shows_the_help():
    """On stdout, and nothing on stderr (it had a stray empty line)."""
    r = snap()
    assert r.returncode == 2 and "Usage:" in r.stdout and "commit" in r.stdout and r.stderr == "", r.stderr


# A watcher that does not end on SIGTERM: it holds the watch lock as `snap watch` does (flock, then
# the POSIX lock of note_pid), with a pid file whose grace has already run out, so `--stop`'s wait
# (grace + 30 s) is over at once; it ends when its stdin closes.
_STUBBORN_WATCHER = """
import signal, sys
from snapshotter.watch import daemon
signal.signal(signal.SIGTERM, signal.SIG_IGN)
files = daemon.watch_files(sys.argv[1])
daemon.note_pid(files, daemon.take_lock(files, sys.argv[1]), "127.0.0.1:1/box:v2", -30.0)
print("ready", flush=True)
sys.stdin.read()
"""


def test_watch_stop_past_its_wait_is_a_timeout_not_bad_input(box):
    """`snap watch --stop` whose watcher has not ended in time: exit 11, the wait that timed out
    (errors.WaitTimeout), one line naming its log; not 2, which would say the command line was wrong."""
    import subprocess
    import sys

    watcher = subprocess.Popen([sys.executable, "-c", _STUBBORN_WATCHER, box], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline() == "ready\n"
        r = snap("watch", "--stop", "--root", box)
        assert_one_line_error(r, 11, f"(pid {watcher.pid}) did not stop in time", "see its log")
        assert watcher.poll() is None  # SIGTERM was sent, and ignored
    finally:
        watcher.stdin.close()
        watcher.wait(timeout=60)
