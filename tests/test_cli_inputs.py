"""Bad input at snap's edges (credentials, stdin, settings, references, paths, --timeout, stdout):
one `snap: error:` line naming the value, exit 2, never a traceback or an internal error."""

from __future__ import annotations

import os

import pytest

from tests.support.run import assert_one_line_error, snap

NOWHERE = "127.0.0.1:9/box:v1"  # credentials are checked before any registry is asked


def _closed_stdin():
    os.close(0)


def _stdin_from(path: str):
    def swap():
        fd = os.open(path, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
    return swap


@pytest.mark.parametrize("args", [("log", NOWHERE, "-u", "a", "--password-stdin"), ("login", "127.0.0.1:9")])
def test_a_closed_stdin_is_a_usage_error(args):
    assert_one_line_error(snap(*args, preexec_fn=_closed_stdin), 2)


@pytest.mark.parametrize("command", [("log", NOWHERE), ("login", "127.0.0.1:9")])
def test_a_password_on_stdin_that_is_no_utf8_is_a_usage_error(tmp_path, command):
    secret = tmp_path / "password"
    secret.write_bytes(b"\xff\xfesecret\n")
    r = snap(*command, "-u", "a", "--password-stdin", preexec_fn=_stdin_from(str(secret)))
    assert_one_line_error(r, 2, "password is not valid UTF-8")
    assert "secret" not in r.stderr


@pytest.mark.parametrize("command", [("log", NOWHERE), ("login", "127.0.0.1:9")])
def test_credentials_in_the_environment_that_are_no_utf8_are_a_usage_error(command):
    r = snap(*command, env={"SNAP_USERNAME": os.fsdecode(b"\xff"), "SNAP_PASSWORD": "secret"})
    assert_one_line_error(r, 2, "username '\\udcff' is not valid UTF-8")
    r = snap(*command, env={"SNAP_USERNAME": "a", "SNAP_PASSWORD": os.fsdecode(b"\xffsecret")})
    assert_one_line_error(r, 2, "the password is not valid UTF-8")
    assert "secret" not in r.stderr


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
