"""Docker's config and its credential helpers as input snap does not trust (issue 33, classes 2 and
3): helper names are program names on every use; a helper gets a bounded wait and bounded output,
and what it prints never reaches snap's; config.json is opened without blocking and without
following a symlink in a directory another user owns, capped, its entries checked; as root, snap
writes no credentials into another user's directory or through their symlink. Real helper
programs, a real FIFO, real devices, a real registry; snap runs in a subprocess with a time and
memory limit, so that a snap without these rules fails the test instead of hanging it."""

import base64
import json
import os
import resource
import select
import sys
import threading

import pytest

from snapshotter.errors import AuthError
from snapshotter.registry.credentials import docker_credentials, save_docker_credentials

from support.credentials import basic
from support.registry import RegistryServer
from support.run import assert_one_line_error, snap

USER, PASSWORD = "snapuser", "Leaky-Pa55-7c1e"
ANOTHER_USER = 65534  # nobody
RUN_LIMIT_S = 30  # no command here needs a tenth of it


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    reg = RegistryServer(str(tmp_path_factory.mktemp("auth-registry")), auth=(USER, PASSWORD)).start()
    yield reg
    reg.stop()


def bounded_snap(*args, env=None, input=None):
    """snap's command line, killed past RUN_LIMIT_S and held to 2 GiB of address space: a snap that
    waits on a FIFO or reads /dev/zero fails the test (TimeoutExpired, MemoryError), never hangs it."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return snap(*args, input=input, env=env, timeout=RUN_LIMIT_S, preexec_fn=limit)


def helper_program(tmp_path, name: str, body: str) -> str:
    """A real `docker-credential-NAME` running `body` (Python; `action` and `data` are its argv[1]
    and stdin). Returns PATH with it first."""
    bin_dir = tmp_path / "helper-bin"
    bin_dir.mkdir(exist_ok=True)
    prog = bin_dir / f"docker-credential-{name}"
    prog.write_text(f"#!{sys.executable}\nimport json, os, sys\naction, data = sys.argv[1], sys.stdin.read()\n{body}\n")
    prog.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


def config_dir(tmp_path, doc) -> str:
    """$DOCKER_CONFIG holding `doc` as config.json (a dict as JSON, bytes as they are)."""
    d = tmp_path / "docker-config"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_bytes(doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    return str(d)


# ---- 2. credential helpers: program names, bounded, silent ------------------------------------------

ODD_NAMES = ["/tmp/evil", "../evil", "/../evil", "-evil", "ev il", "evil\n", "ev\0il", "ev\til", "é"]


@pytest.mark.parametrize("named_by", ["credsStore", "credHelpers"])
@pytest.mark.parametrize("name", ODD_NAMES)
def test_a_helper_name_that_is_no_program_name_is_refused_on_every_use(tmp_path, monkeypatch, named_by, name):
    """Not only `snap login`: every command that reads credentials refuses it, naming it escaped.
    "/../evil" would have run ./docker-credential-/../evil, a program of the config's choosing."""
    evil = tmp_path / "evil"
    evil.write_text(f"#!/bin/sh\ntouch {tmp_path}/ran\n")
    evil.chmod(0o755)
    (tmp_path / "docker-credential-").mkdir()
    monkeypatch.chdir(tmp_path)
    more = {"credHelpers": {"ghcr.io": name}} if named_by == "credHelpers" else {"credsStore": name}
    monkeypatch.setenv("DOCKER_CONFIG", config_dir(tmp_path, {"auths": {}, **more}))
    with pytest.raises(AuthError, match="is no program name") as e:
        docker_credentials("ghcr.io")
    assert repr(name[:100]) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "ran").exists()


def test_a_helper_name_that_is_no_program_name_is_one_line(registry, tmp_path):
    r = bounded_snap("log", f"{registry.host}/box", env={"DOCKER_CONFIG": config_dir(tmp_path, {"credsStore": "../x"})})
    assert_one_line_error(r, 4, "credsStore", "'../x'", "no program name")


ECHO_AND_FAIL = """
out = data + json.dumps({"Username": "u", "Secret": "Helper-Secret-42"})
sys.stdout.write(out)
sys.stderr.write(out)
sys.exit(1)
"""


def test_a_failing_helper_s_output_never_reaches_snap_s(registry, tmp_path):
    """A helper that echoes the secret it was given (and one it keeps) to stdout and stderr, then
    fails: snap says its name and exit code in one line, and neither secret appears anywhere."""
    path = helper_program(tmp_path, "echo", ECHO_AND_FAIL)
    cfg = config_dir(tmp_path, {"credsStore": "echo"})
    env = {"DOCKER_CONFIG": cfg, "PATH": path}
    login = bounded_snap("login", registry.host, "-u", USER, "--password-stdin", input=PASSWORD + "\n", env=env)
    assert_one_line_error(login, 4, "docker-credential-echo", "store", "exited with code 1")
    read = bounded_snap("log", f"{registry.host}/box", env=env)
    assert_one_line_error(read, 4, "docker-credential-echo", "get", "exited with code 1")
    for r in (login, read):
        assert PASSWORD not in r.stdout + r.stderr and "Helper-Secret-42" not in r.stdout + r.stderr
    assert json.loads(open(os.path.join(cfg, "config.json")).read()) == {"credsStore": "echo"}  # nothing written


BLOCK_ON_FIFO = """
import subprocess
child = subprocess.Popen(["cat", os.environ["HELPER_FIFO"]])  # what a helper starts (a keyring's client)
open(os.environ["HELPER_PID"], "w").write(f"{os.getpid()} {child.pid}")
sys.stdout.write("x" * int(os.environ.get("HELPER_OUTPUT", "0")))
sys.stdout.flush()
open(os.environ["HELPER_FIFO"]).read()  # no writer: waits until killed
"""


def _blocking_helper(tmp_path, output: int = 0) -> dict:
    fifo = tmp_path / "helper-waits-here"
    os.mkfifo(fifo)
    return {"PATH": helper_program(tmp_path, "stuck", BLOCK_ON_FIFO), "HELPER_FIFO": str(fifo),
            "HELPER_PID": str(tmp_path / "helper.pid"), "HELPER_OUTPUT": str(output),
            "DOCKER_CONFIG": config_dir(tmp_path, {"credsStore": "stuck"})}


def _release(env: dict) -> None:
    """Let a helper a snap without the bound left waiting go (a writer opens and closes its FIFO)."""
    try:
        os.close(os.open(env["HELPER_FIFO"], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader left: it is gone


def _gone(pid_file: str) -> bool:
    """Whether the helper and the child it started have both ended (a SIGKILL takes effect a moment
    after it is sent: each pid's pidfd is waited on, RUN_LIMIT_S at most, an event, not a sleep)."""
    def ended(pid: int) -> bool:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return True
        try:
            return bool(select.select([fd], [], [], RUN_LIMIT_S / 6)[0])
        finally:
            os.close(fd)

    return all(ended(int(pid)) for pid in open(pid_file).read().split())


def test_a_helper_that_does_not_answer_is_killed_after_the_wait(registry, tmp_path):
    """A helper waiting on a FIFO (as one waits for a keyring's prompt): killed, with the child it
    started, when $SNAP_CREDENTIAL_HELPER_TIMEOUT has passed; one line that names it and the wait."""
    env = _blocking_helper(tmp_path)
    try:
        r = bounded_snap("log", f"{registry.host}/box", env={**env, "SNAP_CREDENTIAL_HELPER_TIMEOUT": "0.5"})
        gone = _gone(env["HELPER_PID"])  # before the FIFO lets a survivor go
    finally:
        _release(env)
    assert_one_line_error(r, 4, "docker-credential-stuck", "did not get within 0.5 s", "SNAP_CREDENTIAL_HELPER_TIMEOUT")
    assert gone


def test_a_helper_that_answers_too_much_is_killed_past_1_mib(registry, tmp_path):
    """3 MiB from a helper that then waits: snap stops reading and kills it past 1 MiB, well before
    the 30 s wait (the default, left in force here) is over."""
    env = _blocking_helper(tmp_path, output=3 << 20)
    try:
        r = bounded_snap("log", f"{registry.host}/box", env=env)
        gone = _gone(env["HELPER_PID"])  # before the FIFO lets a survivor go
    finally:
        _release(env)
    assert_one_line_error(r, 4, "docker-credential-stuck", "more than 1 MiB")
    assert gone


@pytest.mark.parametrize("wait", ["soon", "1e10"])  # 1e10: past threading's bound (an OverflowError once)
def test_a_helper_wait_that_is_no_number_of_seconds_is_a_usage_error(tmp_path, wait):
    env = {**_blocking_helper(tmp_path), "SNAP_CREDENTIAL_HELPER_TIMEOUT": wait}
    try:
        r = bounded_snap("logout", "ghcr.io", env=env)  # logout asks the credsStore helper
    finally:
        _release(env)
    assert_one_line_error(r, 2, f"SNAP_CREDENTIAL_HELPER_TIMEOUT={wait!r}", "not a number of seconds")
    assert not os.path.exists(env["HELPER_PID"])  # never started


# ---- 3. config.json is input like any other ----------------------------------------------------------

def test_a_fifo_as_config_is_refused_without_waiting(tmp_path, monkeypatch):
    """A FIFO nobody writes to: the read is refused at once (the code's own non-blocking open), in
    every command (docker_credentials) and in logout; a snap that waited fails the test."""
    cfg = tmp_path / "docker-config"
    cfg.mkdir()
    os.mkfifo(cfg / "config.json")
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    done, raised = threading.Event(), []

    def read():
        try:
            docker_credentials("ghcr.io")
        except Exception as e:  # noqa: BLE001 - what it raised is the result
            raised.append(e)
        done.set()

    threading.Thread(target=read, daemon=True).start()
    finished = done.wait(RUN_LIMIT_S)
    if not finished:
        os.close(os.open(cfg / "config.json", os.O_WRONLY | os.O_NONBLOCK))  # let the reader go
    assert finished, "reading a FIFO as Docker's config waited on it"
    assert isinstance(raised[0], AuthError) and "is a FIFO" in str(raised[0])
    r = bounded_snap("logout", "ghcr.io")
    assert_one_line_error(r, 4, repr(str(cfg / "config.json")), "is a FIFO")


@pytest.mark.parametrize("what,kind", [("/dev/zero", "a character device"), ("/dev/null", "a character device"),
                                       ("dir", "a directory")])
def test_a_device_or_directory_as_config_is_refused(tmp_path, monkeypatch, what, kind):
    """config.json a symlink (of ours, followed) to /dev/zero or /dev/null, or a directory: one line,
    exit 4; /dev/zero is never read (a snap that read it runs out of memory in the test)."""
    cfg = tmp_path / "docker-config"
    cfg.mkdir()
    if what == "dir":
        (cfg / "config.json").mkdir()
    else:
        (cfg / "config.json").symlink_to(what)
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    r = bounded_snap("logout", "ghcr.io")
    assert_one_line_error(r, 4, "Docker's config", kind, "not a file")
    if what != "/dev/zero":
        with pytest.raises(AuthError, match=kind):
            docker_credentials("ghcr.io")


def test_a_config_over_4_mib_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_CONFIG", config_dir(tmp_path, {"auths": {"ghcr.io": basic(USER, PASSWORD)},
                                                              "pad": "x" * (4 << 20)}))
    with pytest.raises(AuthError, match="larger than 4 MiB"):
        docker_credentials("ghcr.io")
    assert_one_line_error(bounded_snap("logout", "ghcr.io"), 4, "larger than 4 MiB")


NO_COLON = base64.b64encode(b"Inline-Secret-9").decode()
MALFORMED = {
    "auth-number": ({"auths": {"ghcr.io": {"auth": 42}}}, "\"auth\" for 'ghcr.io'"),
    "auths-list": ({"auths": []}, '"auths" that is not an object'),
    "entry-string": ({"auths": {"quay.io": "x"}}, "entry for 'quay.io' that is not an object"),
    "helper-number": ({"credHelpers": {"quay.io": 5}}, "helper for 'quay.io', 5, that is no program name"),
    "helpers-list": ({"credHelpers": ["x"]}, '"credHelpers" that is not an object'),
    "store-number": ({"credsStore": 7}, '"credsStore" 7 that is no program name'),
    "not-base64": ({"auths": {"quay.io": {"auth": "Inline-Secret-9!"}}}, "not the base64 of user:password"),
    "no-colon": ({"auths": {"quay.io": {"auth": NO_COLON}}}, "not the base64 of user:password"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_config_is_one_line_on_every_use(tmp_path, monkeypatch, case):
    """Any malformed entry (not only the registry's) refuses the file, as Docker does: one line, exit
    4, in every command and in logout, never a traceback; an inline secret is never printed."""
    doc, words = MALFORMED[case]
    monkeypatch.setenv("DOCKER_CONFIG", config_dir(tmp_path, doc))
    with pytest.raises(AuthError) as e:
        docker_credentials("ghcr.io")
    assert words in str(e.value)
    r = bounded_snap("logout", "ghcr.io")
    assert_one_line_error(r, 4, words)
    assert "Inline-Secret-9" not in r.stderr + str(e.value)


def _another_users_dir(tmp_path, name: str = "theirs"):
    d = tmp_path / name
    d.mkdir()
    os.chown(d, ANOTHER_USER, ANOTHER_USER)
    return d


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@needs_root
def test_a_symlink_in_another_user_s_directory_is_not_followed(tmp_path, monkeypatch):
    """Their config.json a symlink to root's own config: not followed (one line); a regular config
    there is read; root's own symlink in root's own directory is followed, as Docker does, but not
    one that belongs to them."""
    mine = tmp_path / "root-config.json"
    mine.write_text(json.dumps({"auths": {"ghcr.io": basic("root", "Root-Pa55")}}))
    theirs = _another_users_dir(tmp_path)
    (theirs / "config.json").symlink_to(mine)
    os.lchown(theirs / "config.json", ANOTHER_USER, ANOTHER_USER)
    monkeypatch.setenv("DOCKER_CONFIG", str(theirs))
    with pytest.raises(AuthError, match=f"is a symlink in a directory uid {ANOTHER_USER} owns: not following it"):
        docker_credentials("ghcr.io")
    assert_one_line_error(bounded_snap("logout", "ghcr.io"), 4, "symlink", f"uid {ANOTHER_USER}")
    assert json.loads(mine.read_text())["auths"]  # untouched
    (theirs / "config.json").unlink()
    (theirs / "config.json").write_text(json.dumps({"auths": {"ghcr.io": basic("them", "Their-Pa55")}}))
    assert docker_credentials("ghcr.io") == ("them", "Their-Pa55")
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "config.json").symlink_to(mine)
    monkeypatch.setenv("DOCKER_CONFIG", str(ours))
    assert docker_credentials("ghcr.io") == ("root", "Root-Pa55")
    os.lchown(ours / "config.json", ANOTHER_USER, ANOTHER_USER)  # their symlink, even in our directory
    with pytest.raises(AuthError, match=f"is a symlink uid {ANOTHER_USER} owns: not following it"):
        docker_credentials("ghcr.io")


@needs_root
@pytest.mark.parametrize("how", ["their-directory", "their-symlink", "our-symlink-into-their-directory"])
def test_root_writes_no_credentials_where_another_user_could_swap_the_file(tmp_path, monkeypatch, how):
    """As root, `snap login`'s write (and logout's) is refused in one line when DOCKER_CONFIG is
    another user's directory, when config.json is their symlink, or when it leads into their
    directory: nothing is written anywhere. In root's own directory the write is whole and 0600."""
    theirs = _another_users_dir(tmp_path)
    ours = tmp_path / "ours"
    ours.mkdir()
    target = (theirs if how == "our-symlink-into-their-directory" else tmp_path) / "target.json"
    target.write_text(json.dumps({"auths": {"ghcr.io": basic("old", "Old-Pa55")}}))
    before = target.read_text()
    if how == "their-directory":
        cfg = theirs
        (cfg / "config.json").write_text(before)
        target = cfg / "config.json"
    else:
        cfg = ours
        (cfg / "config.json").symlink_to(target)
        if how == "their-symlink":
            os.lchown(cfg / "config.json", ANOTHER_USER, ANOTHER_USER)
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg))
    refused = "not following it" if how == "their-symlink" else "not writing credentials there"  # read first
    with pytest.raises(AuthError, match=f"uid {ANOTHER_USER}.*{refused}"):
        save_docker_credentials("ghcr.io", USER, PASSWORD)
    assert_one_line_error(bounded_snap("logout", "ghcr.io"), 4, f"uid {ANOTHER_USER}", refused)
    assert target.read_text() == before
    assert sorted(os.listdir(cfg)) == ["config.json"] and not [n for n in os.listdir(target.parent) if ".tmp." in n]
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "root-own"))
    save_docker_credentials("ghcr.io", USER, PASSWORD)
    written = tmp_path / "root-own" / "config.json"
    assert json.loads(written.read_text()) == {"auths": {"ghcr.io": basic(USER, PASSWORD)}}
    assert os.stat(written).st_mode & 0o777 == 0o600 and os.listdir(written.parent) == ["config.json"]


@needs_root
def test_login_into_another_user_s_directory_is_refused_before_the_registry_is_asked(tmp_path):
    """The refusal comes first: an unreachable registry (exit 3) is never even tried, nothing is made."""
    theirs = _another_users_dir(tmp_path)
    r = bounded_snap("login", "127.0.0.1:1", "-u", USER, "--password-stdin", input=PASSWORD + "\n",
                     env={"DOCKER_CONFIG": str(theirs)})
    assert_one_line_error(r, 4, f"directory {str(theirs)!r} belongs to uid {ANOTHER_USER}", "not writing credentials")
    assert os.listdir(theirs) == [] and PASSWORD not in r.stderr


@needs_root
@pytest.mark.parametrize("owner", ["their-symlink", "root-s-symlink-in-their-directory"])
@pytest.mark.parametrize("below", ["", "docker"])
def test_docker_config_through_another_user_s_symlink_is_neither_read_nor_written(tmp_path, monkeypatch,
                                                                                   owner, below):
    """DOCKER_CONFIG (or a directory on its way) a symlink they own (even in root's directory), or
    root's in their directory (they may swap it), pointing at root's directory that holds another program's
    config.json: every name on the way is looked at, not only where it leads. Nothing read, nothing made, nothing
    written."""
    theirs = _another_users_dir(tmp_path)
    victim = tmp_path / "etc-someapp"  # root's directory
    (victim / "docker").mkdir(parents=True)
    for config in (victim / "config.json", victim / "docker" / "config.json"):
        config.write_text(json.dumps({"auths": {"ghcr.io": basic("root", "Root-Pa55")}, "setting": 1}))
        config.chmod(0o644)
    before = _tree(victim)
    ours = tmp_path / "ours"
    ours.mkdir()
    link = (ours if owner == "their-symlink" else theirs) / "dc"
    link.symlink_to(victim)
    if owner == "their-symlink":
        os.lchown(link, ANOTHER_USER, ANOTHER_USER)
    monkeypatch.setenv("DOCKER_CONFIG", str(link / below))
    refused = f"{str(link)!r} is a symlink {'' if owner == 'their-symlink' else 'in a directory '}uid {ANOTHER_USER}"
    with pytest.raises(AuthError, match=f"{refused}.*not following it"):
        docker_credentials("ghcr.io")
    with pytest.raises(AuthError, match=f"{refused}.*not following it"):
        save_docker_credentials("ghcr.io", USER, PASSWORD)
    assert_one_line_error(bounded_snap("logout", "ghcr.io"), 4, refused, "not following it")
    assert _tree(victim) == before


def _tree(top) -> dict:
    """Every name below `top` with its mode and, for a file, its text."""
    return {p: (p.stat().st_mode, p.is_file() and p.read_text()) for p in top.rglob("*")}


@needs_root
@pytest.mark.parametrize("sub", ["missing", "root-s"])
def test_root_makes_and_writes_nothing_below_another_user_s_directory(tmp_path, monkeypatch, sub):
    """DOCKER_CONFIG a directory in theirs: missing (snap would make it there, then write in it) or
    root's own (they may rename it and put a symlink in its place): refused in one line before
    anything is made. Below root's own directories a missing path is made one name at a time, 0700,
    also through a symlink of root's."""
    theirs = _another_users_dir(tmp_path)
    if sub == "root-s":
        (theirs / "sub").mkdir()
    monkeypatch.setenv("DOCKER_CONFIG", str(theirs / "sub"))
    with pytest.raises(AuthError, match=f"directory {str(theirs)!r} belongs to uid {ANOTHER_USER}"):
        save_docker_credentials("ghcr.io", USER, PASSWORD)
    r = bounded_snap("login", "127.0.0.1:1", "-u", USER, "--password-stdin", input=PASSWORD + "\n")
    assert_one_line_error(r, 4, f"directory {str(theirs)!r} belongs to uid {ANOTHER_USER}", "not writing credentials")
    assert os.listdir(theirs) == ([] if sub == "missing" else ["sub"])
    assert sub == "missing" or os.listdir(theirs / "sub") == []
    (tmp_path / "ours").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ours")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "link" / "a" / "b"))
    save_docker_credentials("ghcr.io", USER, PASSWORD)
    written = tmp_path / "ours" / "a" / "b" / "config.json"
    assert json.loads(written.read_text()) == {"auths": {"ghcr.io": basic(USER, PASSWORD)}}
    assert [os.stat(p).st_mode & 0o777 for p in (written.parent.parent, written.parent, written)] == [0o700, 0o700,
                                                                                                      0o600]


def test_a_helper_answer_that_is_no_utf8_is_one_line(registry, tmp_path):
    """JSON may escape a lone surrogate ("\\udcff"), which no Basic header can carry: it ended in
    'internal error: UnicodeEncodeError'. The secret is never shown."""
    answer = '{"Username": "\\udcff", "Secret": "s3cret-value"}'
    env = {"PATH": helper_program(tmp_path, "odd", f"print({answer!r})"),
           "DOCKER_CONFIG": config_dir(tmp_path, {"credsStore": "odd"})}
    r = bounded_snap("log", f"{registry.host}/box", env=env)
    assert_one_line_error(r, 4, "not valid UTF-8")
    assert "s3cret" not in r.stderr
