"""Bad input at snap's edges (credentials, stdin, settings, references, paths, --timeout, stdout):
one `snap: error:` line naming the value, exit 2, never a traceback or an internal error."""

from __future__ import annotations

import os

import pytest

from tests.support.run import assert_one_line_error, snap

NOWHERE = "127.0.0.1:9/box:v1"  # credentials are checked before any registry is asked


def _closed_stdin():
    os.close(0)


def _fd_onto(path: str, target: int, flags: int = os.O_RDONLY):
    """A preexec_fn: `path` opened as the child's fd `target` (0 stdin, 1 stdout)."""
    def swap():
        fd = os.open(path, flags)
        os.dup2(fd, target)
        os.close(fd)
    return swap


@pytest.mark.parametrize("args", [("log", NOWHERE, "-u", "a", "--password-stdin"), ("login", "127.0.0.1:9")])
def test_a_closed_stdin_is_a_usage_error(args):
    assert_one_line_error(snap(*args, preexec_fn=_closed_stdin), 2)


@pytest.mark.parametrize("command", [("log", NOWHERE), ("login", "127.0.0.1:9")])
def test_a_password_on_stdin_that_is_no_utf8_is_a_usage_error(tmp_path, command):
    secret = tmp_path / "password"
    secret.write_bytes(b"\xff\xfesecret\n")
    r = snap(*command, "-u", "a", "--password-stdin", preexec_fn=_fd_onto(str(secret), 0))
    assert_one_line_error(r, 2, "password is not valid UTF-8")
    assert "secret" not in r.stderr


@pytest.mark.parametrize("given", [b"", b"\n", b"\r\nsecret\n"], ids=["nothing", "empty-line", "empty-first-line"])
@pytest.mark.parametrize("command", [("log", NOWHERE), ("login", "127.0.0.1:9")])
def test_an_empty_password_on_stdin_is_a_usage_error(tmp_path, command, given):
    """An empty pipe (a CI secret never set) is said so, before any registry is asked with it."""
    secret = tmp_path / "password"
    secret.write_bytes(given)
    r = snap(*command, "-u", "a", "--password-stdin", preexec_fn=_fd_onto(str(secret), 0))
    assert_one_line_error(r, 2, "gave no password")
    assert "secret" not in r.stderr


@pytest.mark.parametrize("given, said", [("ftp://127.0.0.1:9", "is not valid"),
                                         ("https://127.0.0.1:9/v1/\x1b[2J", "not logged in to 127.0.0.1:9")])
def test_login_and_logout_name_the_registry_as_the_host_it_is(given, said, tmp_path):
    """Only http(s):// may lead a registry's name; what is printed is its host, not what was typed (a
    path, an escape sequence)."""
    r = snap("logout", given, env={"DOCKER_CONFIG": str(tmp_path)})
    assert said in r.stdout + r.stderr and "\x1b" not in r.stdout + r.stderr, (r.stdout, r.stderr)
    assert r.returncode == (2 if said == "is not valid" else 0)


def test_a_profile_file_too_big_to_be_one_is_refused_at_once(tmp_path):
    """A profile is a few KiB: a 12 MB one took 16 s and ~800 MB to parse before it was refused."""
    big = tmp_path / "big.yaml"
    big.write_bytes(b"exclude:\n" + b"  - /x\n" * (2 << 20 >> 3))
    r = snap("status", "--base", "scratch", "--root", str(tmp_path), "--profile", str(big))
    assert_one_line_error(r, 2, repr(str(big)), "KiB a profile may be")


@pytest.mark.parametrize("command", [("log", NOWHERE), ("login", "127.0.0.1:9")])
def test_credentials_in_the_environment_that_are_no_utf8_are_a_usage_error(command):
    r = snap(*command, env={"SNAP_USERNAME": os.fsdecode(b"\xff"), "SNAP_PASSWORD": "secret"})
    assert_one_line_error(r, 2, "username '\\udcff' is not valid UTF-8")
    r = snap(*command, env={"SNAP_USERNAME": "a", "SNAP_PASSWORD": os.fsdecode(b"\xffsecret")})
    assert_one_line_error(r, 2, "the password is not valid UTF-8")
    assert "secret" not in r.stderr


@pytest.mark.parametrize("reference", ["127.0.0.1:99999/box:v1", "127.0.0.1:65536/box", "127.0.0.1:0/box"])
def test_a_registry_port_out_of_range_is_refused_at_parse(reference):
    assert_one_line_error(snap("log", reference), 2, repr(reference), "port")


@pytest.mark.parametrize("registry", ["127.0.0.1:99999", "127.0.0.1:0"])
def test_a_login_registry_port_out_of_range_is_refused(registry):
    assert_one_line_error(snap("logout", registry), 2, repr(registry))


@pytest.mark.parametrize("value", ["1e10", "-1e10", "nan", "x"])
def test_a_knob_past_its_bound_is_taken_as_unset(monkeypatch, value):
    """SNAP_RETRY_SCALE=1e10 once overflowed time.sleep halfway through a push: a knob past
    SETTING_MAX is a bad value, and a bad knob's value is its default."""
    from snapshotter import settings
    from snapshotter.registry import retry

    monkeypatch.setenv(retry.RETRY_SCALE_ENV, value)
    assert retry.scaled(2.0) == 2.0
    monkeypatch.setenv(retry.RETRY_SCALE_ENV, str(settings.SETTING_MAX))
    assert retry.scaled(2.0) == 2.0 * settings.SETTING_MAX


@pytest.mark.parametrize("timeout", ["nan", "inf", "-5"])
def test_a_wait_timeout_that_is_no_finite_number_from_0_is_a_usage_error(tmp_path, timeout):
    """nan never timed out; -5 said "timed out after -5s"."""
    (tmp_path / "there").write_text("x")  # landed: without the check the wait ends at once, exit 0
    r = snap("restore", "--wait", str(tmp_path / "there"), "--root", str(tmp_path), "--timeout", timeout)
    assert_one_line_error(r, 2, f"--timeout {timeout}")


@pytest.mark.parametrize("args, said", [
    (("--timeout", "5"), "--timeout goes with --wait"),
    (("--then", ""), "--then needs a command"), (("--then", "  "), "--then needs a command"),
    (("--ca-cert", "."), "is not a file"), (("--ca-cert", "missing\n.pem"), repr("missing\n.pem")),
])
def test_restore_options_that_cannot_do_what_they_say_are_refused(tmp_path, args, said):
    """A --timeout without --wait was ignored, an empty --then 'started', and a directory given as
    --ca-cert was said not to exist: each is one line, exit 2, before any registry is asked."""
    args = tuple(str(tmp_path) if a == "." else a for a in args)
    r = snap("restore", NOWHERE, "--root", str(tmp_path / "root"), *args)
    assert_one_line_error(r, 2, said)


@pytest.mark.parametrize("profile", ["/dev/zero", "dir"])
def test_a_profile_that_is_no_regular_file_is_named_for_what_it_is(tmp_path, profile):
    """Both exist: "does not exist" was wrong about them."""
    path = profile if profile.startswith("/") else str(tmp_path)
    r = snap("commit", NOWHERE, "--base", "ubuntu:22.04", "--root", str(tmp_path), "--profile", path)
    assert_one_line_error(r, 2, f"profile file {path!r} is not a regular file")


@pytest.mark.parametrize("command, name", [(c, n) for c in ("commit", "verify") for n in (b"\xff\xfe", b"a\nb")]
                         + [(c, b"file") for c in ("commit", "verify", "restore")])  # restore makes a missing root
def test_a_bad_root_is_named_quoted(tmp_path, command, name):
    """An undecodable byte, a newline (a forged second line), a file: the root is repr-quoted."""
    root = os.path.join(os.fsencode(tmp_path), name)
    if name == b"file":
        open(root, "w").close()
    extra = ("--base", "ubuntu:22.04") if command == "commit" else ()
    r = snap(command, NOWHERE, "--root", os.fsdecode(root), *extra)
    assert_one_line_error(r, 2, repr(os.fsdecode(root)))


@pytest.mark.parametrize("option", [("--compression", "bogus"), ("--compression", ""), ("--max-layer-size", "0")])
@pytest.mark.parametrize("daemon", [(), ("--daemon",)], ids=["foreground", "daemon"])
def test_a_watch_option_a_commit_refuses_is_refused_before_the_watch_starts(tmp_path, option, daemon):
    """What `snap commit` refuses, `snap watch` refuses too, at once and before it detaches: not a
    watcher that says it runs, then dies (or, with the registry away, retries for ever)."""
    box = tmp_path / "box"
    box.mkdir()
    r = snap("watch", NOWHERE, "--base", "scratch", "--root", str(box), *option, *daemon,
             env={"SNAP_STATE_DIR": str(tmp_path / "state")}, timeout=120)  # unrefused, a foreground one runs on
    assert_one_line_error(r, 2, option[0], repr(option[1]) if option[0] == "--compression" else "1MiB")
    assert not (tmp_path / "state" / "watch").exists(), "refused after its lock and pid file were made"


@pytest.mark.parametrize("args", [("--help",), ("restore", "--help"), ("--version",)])
def test_help_or_version_onto_a_full_stdout_is_one_line(args):
    """/dev/full refuses every write: --help ended in rich's traceback."""
    r = snap(*args, preexec_fn=_fd_onto("/dev/full", 1, os.O_WRONLY))
    assert_one_line_error(r, 7, "No space left on device")
