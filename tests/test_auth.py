"""Registries with htpasswd auth and TLS (a self-signed certificate made by the test), a registry
with token auth (as Docker Hub, GHCR, GitLab, Harbor), and which registry gets which credentials."""

import base64
import json
import os
import subprocess
import sys

import pytest

from snapshotter.registry.credentials import docker_credentials

from support.credentials import basic, credential_helper, docker_config
from support.images import push_base_image
from support.registry import RegistryServer, TokenRegistryServer
from support.run import SNAP, assert_one_line_error, snap
from support.trees import NOT_CAPTURED, snapshot_of_tree

USER, PASSWORD = "snapuser", "s3cret-Pa55"
READER, READER_PASSWORD = "reader", "read-0nly"


@pytest.fixture(scope="module")
def secure_registry(tmp_path_factory, base_rootfs):
    reg = RegistryServer(str(tmp_path_factory.mktemp("secure-registry")), auth=(USER, PASSWORD), tls=True).start()
    push_base_image(reg, "base", "1", base_rootfs)
    yield reg
    reg.stop()


def test_tls_and_password_stdin_round_trip(secure_registry, box, tmp_path):
    reg = secure_registry
    tls = ["--ca-cert", reg.cert]
    r = snap("commit", f"{reg.host}/box:v1", "--base", f"{reg.host}/base:1", "--root", box, *tls,
             "--username", USER, "--password-stdin", input=PASSWORD + "\n", check=True)
    assert PASSWORD not in r.stdout + r.stderr
    out = tmp_path / "out"
    snap("restore", f"{reg.host}/box:v1", "--root", str(out), *tls, "--username", USER, "--password-stdin",
         input=PASSWORD + "\n", check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_docker_config_credentials(secure_registry, box, tmp_path):
    reg = secure_registry
    cfg_dir = docker_config(tmp_path, {reg.host: basic(USER, PASSWORD)})
    r = snap("commit", f"{reg.host}/box:v2", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert,
             env={"DOCKER_CONFIG": cfg_dir}, check=True)
    assert "pushed" in r.stdout
    assert reg.manifest("box", "v2")["layers"]


def test_credential_helper_credentials(secure_registry, box, tmp_path):
    """Credentials from a credential helper named in credHelpers (as `docker login` with
    docker-credential-pass or -ecr-login leaves them): the helper program is run."""
    reg = secure_registry
    path, log = credential_helper(tmp_path, "snaptest", {reg.host: (USER, PASSWORD)})
    cfg_dir = docker_config(tmp_path, {}, credHelpers={reg.host: "snaptest"})
    r = snap("commit", f"{reg.host}/box:v6", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert,
             env={"DOCKER_CONFIG": cfg_dir, "PATH": path}, check=True)
    assert PASSWORD not in r.stdout + r.stderr
    assert reg.manifest("box", "v6")["layers"]
    assert f"get {reg.host}" in open(log).read().splitlines()


def test_wrong_password(secure_registry, box):
    reg = secure_registry
    r = snap("commit", f"{reg.host}/box:v3", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert,
             "--username", USER, "--password-stdin", input="wrong\n")
    assert_one_line_error(r, 4, reg.host)
    assert "wrong" not in r.stderr


def test_no_credentials(secure_registry, box):
    reg = secure_registry
    r = snap("commit", f"{reg.host}/box:v3", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert)
    assert_one_line_error(r, 4, "credentials")


def test_untrusted_certificate(secure_registry, box):
    reg = secure_registry
    r = snap("restore", f"{reg.host}/base:1", "--root", box, "--username", USER, "--password-stdin", input=PASSWORD)
    assert_one_line_error(r, 3, "TLS", "--ca-cert")


# ---- token auth: a pull-scoped token must not be reused for a push --------------------------------

@pytest.fixture(scope="module")
def token_registry(tmp_path_factory, base_rootfs):
    reg = TokenRegistryServer(str(tmp_path_factory.mktemp("token-registry")),
                              users={USER: PASSWORD, READER: READER_PASSWORD}, read_only=(READER,)).start()
    push_base_image(reg, "base", "1", base_rootfs)
    yield reg
    reg.stop()


def test_token_auth_round_trip(token_registry, box, tmp_path):
    reg = token_registry
    r = snap("commit", f"{reg.host}/box:v1", "--base", f"{reg.host}/base:1", "--root", box,
             "--username", USER, "--password-stdin", input=PASSWORD + "\n", check=True)
    assert PASSWORD not in r.stdout + r.stderr
    assert reg.manifest("box", "v1")["layers"]
    # The first token was for pull; the push asked for a new one with the challenge's scope.
    asked = [set(one.rsplit(":", 1)[1].split(",")) for user, scope in reg.tokens.requests if user == USER
             for one in scope.split() if one.startswith("repository:box:")]
    assert {"pull", "push"} in asked, reg.tokens.requests
    out = tmp_path / "out"
    snap("restore", f"{reg.host}/box:v1", "--root", str(out), "--username", USER, "--password-stdin",
         input=PASSWORD + "\n", check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_token_auth_docker_config_credentials(token_registry, box, tmp_path):
    reg = token_registry
    cfg_dir = docker_config(tmp_path, {f"http://{reg.host}": basic(USER, PASSWORD)})
    snap("commit", f"{reg.host}/box:v2", "--base", f"{reg.host}/base:1", "--root", box,
         env={"DOCKER_CONFIG": cfg_dir}, check=True)
    assert reg.manifest("box", "v2")["layers"]


def test_token_auth_same_repository_push_then_pull(token_registry, base_rootfs, box, tmp_path):
    """Target and base in one repository share one Remote: after the push token, pulls still work."""
    reg = token_registry
    push_base_image(reg, "same", "base", base_rootfs)
    snap("commit", f"{reg.host}/same:snap", "--base", f"{reg.host}/same:base", "--root", box,
         "--username", USER, "--password-stdin", input=PASSWORD + "\n", check=True)
    out = tmp_path / "out"
    snap("restore", f"{reg.host}/same:snap", "--root", str(out), "--username", USER, "--password-stdin",
         input=PASSWORD + "\n", check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_token_auth_wrong_password(token_registry, box):
    reg = token_registry
    r = snap("commit", f"{reg.host}/box:v3", "--base", f"{reg.host}/base:1", "--root", box,
             "--username", USER, "--password-stdin", input="wrong\n")
    assert_one_line_error(r, 4, reg.host)
    assert "wrong" not in r.stderr


def test_token_auth_read_only_user_cannot_push(token_registry, box):
    """The token server grants only pull: one new token is asked for, then a clear error (no loop)."""
    reg = token_registry
    before = len(reg.tokens.requests)
    r = snap("commit", f"{reg.host}/box:v4", "--base", f"{reg.host}/base:1", "--root", box,
             "--username", READER, "--password-stdin", input=READER_PASSWORD + "\n")
    assert_one_line_error(r, 4, reg.host, "refused")
    assert len(reg.tokens.requests) - before < 10, reg.tokens.requests[before:]  # no token-asking loop


def test_token_auth_anonymous(token_registry, box):
    reg = token_registry
    r = snap("commit", f"{reg.host}/box:v5", "--base", f"{reg.host}/base:1", "--root", box)
    assert_one_line_error(r, 4, "credentials")


# ---- explicit credentials go to the target's registry only ---------------------------------------

@pytest.mark.parametrize("given", ["flags", "env"])
def test_explicit_credentials_not_sent_to_another_registry(given, tmp_path_factory, base_rootfs, box, tmp_path):
    """The base is on another registry whose user and password (from the docker config) differ:
    were --username/--password-stdin (or SNAP_USERNAME/SNAP_PASSWORD) sent there too, it would
    refuse them."""
    target = RegistryServer(str(tmp_path_factory.mktemp("target-registry")), auth=(USER, PASSWORD)).start()
    other = RegistryServer(str(tmp_path_factory.mktemp("other-registry")), auth=("otheruser", "other-Pa55")).start()
    try:
        push_base_image(other, "base", "1", base_rootfs)
        env = {"DOCKER_CONFIG": docker_config(tmp_path, {other.host: basic("otheruser", "other-Pa55")})}
        if given == "flags":
            how, stdin = ["--username", USER, "--password-stdin"], PASSWORD + "\n"
        else:
            how, stdin = [], None
            env.update(SNAP_USERNAME=USER, SNAP_PASSWORD=PASSWORD)
        snap("commit", f"{target.host}/box:v1", "--base", f"{other.host}/base:1", "--root", box, *how, input=stdin,
             env=env, check=True)
        assert target.manifest("box", "v1")["layers"]
    finally:
        target.stop()
        other.stop()


def _docker_config(tmp_path, monkeypatch, auths: dict, **more) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", docker_config(tmp_path, auths, **more))


def _found(registry: str):
    found = docker_credentials(registry)
    return base64.b64encode(":".join(found).encode()).decode() if found else None


HUB_AUTH = base64.b64encode(b"hubuser:hub-Pa55").decode()


@pytest.mark.parametrize("key", ["https://index.docker.io/v1/", "index.docker.io", "docker.io"])
@pytest.mark.parametrize("registry", ["docker.io", "index.docker.io", "registry-1.docker.io"])
def test_docker_hub_credentials_from_docker_login(tmp_path, monkeypatch, key, registry):
    _docker_config(tmp_path, monkeypatch, {key: {"auth": HUB_AUTH}})
    assert _found(registry) == HUB_AUTH


def test_docker_hub_credentials_stay_on_docker_hub(tmp_path, monkeypatch):
    local = base64.b64encode(b"me:local").decode()
    _docker_config(tmp_path, monkeypatch, {"https://index.docker.io/v1/": {"auth": HUB_AUTH},
                                           "http://127.0.0.1:5000": {"auth": local}})
    assert _found("ghcr.io") is None
    assert _found("mydocker.io") is None
    assert _found("127.0.0.1:5000") == local
    assert _found("localhost:5000") == local
    assert _found("docker.io") == HUB_AUTH


def test_docker_hub_credentials_from_a_helper(tmp_path, monkeypatch):
    """`docker login` with a credsStore keeps Docker Hub's credentials under its legacy key."""
    path, log = credential_helper(tmp_path, "snaptest", {"https://index.docker.io/v1/": ("hubuser", "hub-Pa55")})
    monkeypatch.setenv("PATH", path)
    _docker_config(tmp_path, monkeypatch, {}, credsStore="snaptest")
    assert _found("docker.io") == HUB_AUTH
    assert _found("ghcr.io") is None
    assert open(log).read().splitlines() == ["get https://index.docker.io/v1/", "get ghcr.io"]


def test_empty_docker_config_dir_is_not_the_users(tmp_path, monkeypatch):
    """$DOCKER_CONFIG names the only config: one without config.json means no credentials, never ~/.docker's."""
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    (home / ".docker" / "config.json").write_text(json.dumps({"auths": {"ghcr.io": basic("me", "home")}}))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty"))
    assert _found("ghcr.io") is None
    monkeypatch.delenv("DOCKER_CONFIG")
    assert _found("ghcr.io") == basic("me", "home")["auth"]


def test_no_docker_config_anywhere_is_no_credentials_without_the_docker_sdk(tmp_path):
    """Without $DOCKER_CONFIG and with no ~/.docker/config.json nor ~/.dockercfg, no credentials;
    the legacy ~/.dockercfg is read when it is the only one. The docker SDK is never imported for
    credentials (importing it slows every restore's start; snap reads the file and runs the helpers)."""
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_CONFIG"}
    env["HOME"] = str(tmp_path)
    code = ("import sys; from snapshotter.registry.credentials import docker_credentials\n"
            "print(docker_credentials('ghcr.io'), 'docker' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "False"]
    (tmp_path / ".dockercfg").write_text(json.dumps({"ghcr.io": basic("me", "legacy")}))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["('me',", "'legacy')", "False"]


def test_broken_credential_helper_is_one_line(secure_registry, box, tmp_path):
    reg = secure_registry
    cfg_dir = docker_config(tmp_path, {}, credHelpers={reg.host: "nosuchhelper"})
    r = snap("commit", f"{reg.host}/box:v9", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert,
             env={"DOCKER_CONFIG": cfg_dir})
    assert_one_line_error(r, 4, "credentials")


def test_oras_is_used_through_its_public_api_only():
    """No private attribute of oras-py (`_basic_auth`, `do_request.__wrapped__`, ...) is touched:
    those change with any oras release."""
    import ast
    import pathlib

    oras_private = {"_basic_auth", "_auth_config", "_load_auth", "_tls_verify", "_get_auth_from_creds_store",
                    "__wrapped__"}
    found = []
    for path in sorted(pathlib.Path(__file__).resolve().parent.parent.joinpath("snapshotter").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not (
                    node.attr.startswith("__") and node.attr != "__wrapped__"):
                if node.attr in oras_private or "oras" in ast.unparse(node.value):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


# ---- credentials from the environment (a provider's secret env vars: a pod has no `docker login`) ----

WAYS = ("snap login REGISTRY", "SNAP_USERNAME", "SNAP_PASSWORD", "--username", "--password-stdin", "docker login")


def test_env_credentials_for_every_command(secure_registry, box, tmp_path):
    """SNAP_USERNAME + SNAP_PASSWORD are used by commit, log and restore without --username; the
    password is in no output."""
    reg = secure_registry
    tls = ["--ca-cert", reg.cert]
    env = {"SNAP_USERNAME": USER, "SNAP_PASSWORD": PASSWORD}
    ref = f"{reg.host}/box:env"
    outs = [snap("commit", ref, "--base", f"{reg.host}/base:1", "--root", box, *tls, env=env, check=True)]
    outs.append(snap("log", ref, *tls, env=env, check=True))
    out = tmp_path / "out"
    outs.append(snap("restore", ref, "--root", str(out), *tls, env=env, check=True))
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    assert all(PASSWORD not in r.stdout + r.stderr for r in outs)


def test_every_auth_error_names_the_ways_to_give_credentials(secure_registry, box):
    reg = secure_registry
    cmd = ["commit", f"{reg.host}/box:env2", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert]
    wrong = snap(*cmd, env={"SNAP_USERNAME": USER, "SNAP_PASSWORD": "wr0ng-env-Pa55"})
    assert_one_line_error(wrong, 4, reg.host, "refused", *WAYS)
    assert "wr0ng-env-Pa55" not in wrong.stdout + wrong.stderr
    assert_one_line_error(snap(*cmd), 4, reg.host, "credentials we do not have", *WAYS)
    r = snap("restore", f"{reg.host}/box:env2", "--root", box, "--ca-cert", reg.cert)
    assert_one_line_error(r, 4, *WAYS)


@pytest.mark.parametrize("given,missing", [("SNAP_USERNAME", "SNAP_PASSWORD"), ("SNAP_PASSWORD", "SNAP_USERNAME")])
def test_one_env_credential_without_the_other_is_a_usage_error(given, missing, tmp_path):
    r = snap("restore", "127.0.0.1:1/box:v1", "--root", str(tmp_path / "out"), env={given: "x-Pa55", missing: ""})
    assert_one_line_error(r, 2, f"{given} is set but {missing} is not")
    assert "x-Pa55" not in r.stdout + r.stderr
    assert not (tmp_path / "out").exists()


# ---- snap login / logout: Docker's config written without Docker --------------------------------

def _tls(reg) -> list:
    return ["--ca-cert", reg.cert] if getattr(reg, "tls", False) else []


def _login(reg, password, *more, env=None):
    tls = _tls(reg)
    return snap("login", reg.host, *tls, "--username", USER, "--password-stdin", *more, input=password + "\n", env=env)


@pytest.fixture(params=["htpasswd+tls", "token"])
def any_auth_registry(request):
    return request.getfixturevalue("secure_registry" if request.param == "htpasswd+tls" else "token_registry")


def _token_requests(reg) -> list:
    return list(reg.tokens.requests) if hasattr(reg, "tokens") else []


def test_login_with_a_wrong_password_fails_and_writes_nothing(any_auth_registry, tmp_path):
    reg = any_auth_registry
    before = len(_token_requests(reg))
    r = _login(reg, "wr0ng-Pa55")
    assert_one_line_error(r, 4, reg.host, "refused", USER, "nothing was saved")
    assert "wr0ng-Pa55" not in r.stdout + r.stderr
    assert not (tmp_path / "docker-config").exists()
    if hasattr(reg, "tokens"):  # the token service was asked, and said no
        assert _token_requests(reg)[before:] == [(USER, "refused")]


def test_login_then_commit_and_restore_with_no_flags(any_auth_registry, box, tmp_path):
    """The login writes a 0600 config in a 0700 dir, under the registry's host[:port], that the
    next commands use."""
    reg = any_auth_registry
    before = len(_token_requests(reg))
    r = _login(reg, PASSWORD)
    assert r.returncode == 0, r.stderr
    if hasattr(reg, "tokens"):  # checked with the token service: a token for the user, for no scope
        assert _token_requests(reg)[before:] == [(USER, "")]
    assert PASSWORD not in r.stdout + r.stderr
    cfg = tmp_path / "docker-config" / "config.json"
    assert f"logged in to {reg.host}" in r.stdout and str(cfg) in r.stdout
    assert os.stat(cfg).st_mode & 0o777 == 0o600 and os.stat(cfg.parent).st_mode & 0o777 == 0o700
    assert json.loads(cfg.read_text()) == {"auths": {reg.host: basic(USER, PASSWORD)}}
    tls = _tls(reg)
    snap("commit", f"{reg.host}/box:login", "--base", f"{reg.host}/base:1", "--root", box, *tls, check=True)
    out = tmp_path / "out"
    snap("restore", f"{reg.host}/box:login", "--root", str(out), *tls, check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_login_keeps_the_config_s_other_keys_and_honours_docker_config(secure_registry, tmp_path):
    """An existing config (another registry, a helper for a third, Docker's own settings) keeps all
    of it; the login goes to $DOCKER_CONFIG, never to ~/.docker; logout takes out only its entry."""
    reg = secure_registry
    home = tmp_path / "home"
    home.mkdir()
    others = {"auths": {"ghcr.io": basic("me", "gh-Pa55"), reg.host: basic("old", "stale")},
              "credHelpers": {"123.dkr.ecr.us-east-1.amazonaws.com": "ecr-login"},
              "psFormat": "table {{.ID}}", "proxies": {"default": {"httpProxy": "http://127.0.0.1:3128"}}}
    cfg_dir = docker_config(tmp_path, {})
    cfg = os.path.join(cfg_dir, "config.json")
    with open(cfg, "w") as f:
        json.dump(others, f)
    env = {"HOME": str(home)}
    assert _login(reg, PASSWORD, env=env).returncode == 0
    written = json.loads(open(cfg).read())
    assert written == {**others, "auths": {"ghcr.io": basic("me", "gh-Pa55"), reg.host: basic(USER, PASSWORD)}}
    assert os.stat(cfg).st_mode & 0o777 == 0o600
    assert not (home / ".docker").exists()
    assert sorted(os.listdir(cfg_dir)) == ["config.json"]  # no temporary file left
    r = snap("logout", reg.host, env=env, check=True)
    assert r.stdout.strip() == f"logged out of {reg.host}"
    assert json.loads(open(cfg).read()) == {**others, "auths": {"ghcr.io": basic("me", "gh-Pa55")}}


def test_logout_then_no_credentials_and_a_second_logout_says_so(secure_registry, box):
    reg = secure_registry
    assert _login(reg, PASSWORD).returncode == 0
    snap("logout", reg.host, check=True)
    r = snap("commit", f"{reg.host}/box:out", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert)
    assert_one_line_error(r, 4, "credentials we do not have", "snap login REGISTRY")
    again = snap("logout", reg.host)
    assert again.returncode == 0 and again.stdout.strip() == f"not logged in to {reg.host}"


@pytest.mark.parametrize("named_by", ["credHelpers", "credsStore"])
def test_login_logout_through_a_credential_helper(named_by, secure_registry, box, tmp_path):
    """A config naming a helper for the registry (or for all): the login stores through it (the file
    keeps an empty entry and no secret), a commit gets them from it, the logout erases them there."""
    reg = secure_registry
    path, log = credential_helper(tmp_path, "test", {})
    cfg_dir = docker_config(tmp_path, {}, **({"credHelpers": {reg.host: "test"}} if named_by == "credHelpers"
                                             else {"credsStore": "test"}))
    env = {"PATH": path}
    r = _login(reg, PASSWORD, env=env)
    assert r.returncode == 0, r.stderr
    assert "docker-credential-test" in r.stdout
    assert json.loads(open(log + ".json").read()) == {reg.host: {"Username": USER, "Secret": PASSWORD}}
    config_text = open(os.path.join(cfg_dir, "config.json")).read()
    assert PASSWORD not in config_text and json.loads(config_text)["auths"] == {reg.host: {}}
    snap("commit", f"{reg.host}/box:{named_by.lower()}", "--base", f"{reg.host}/base:1", "--root", box,
         "--ca-cert", reg.cert, env=env, check=True)
    assert f"get {reg.host}" in open(log).read().splitlines()
    assert snap("logout", reg.host, env=env, check=True).stdout.strip() == f"logged out of {reg.host}"
    assert json.loads(open(log + ".json").read()) == {}
    assert f"erase {reg.host}" in open(log).read().splitlines()
    assert json.loads(open(os.path.join(cfg_dir, "config.json")).read())["auths"] == {}


def test_login_from_env_credentials(secure_registry, tmp_path):
    reg = secure_registry
    r = snap("login", reg.host, "--ca-cert", reg.cert, input="", env={"SNAP_USERNAME": USER, "SNAP_PASSWORD": PASSWORD})
    assert r.returncode == 0, r.stderr
    cfg = tmp_path / "docker-config" / "config.json"
    assert json.loads(cfg.read_text()) == {"auths": {reg.host: basic(USER, PASSWORD)}}
    r = snap("login", reg.host, "--ca-cert", reg.cert, input="", env={"SNAP_USERNAME": USER, "SNAP_PASSWORD": ""})
    assert_one_line_error(r, 2, "SNAP_USERNAME is set but SNAP_PASSWORD is not")


def test_login_without_a_password_or_a_terminal_is_one_line(secure_registry, tmp_path):
    r = snap("login", secure_registry.host, "--username", USER, input="")
    assert_one_line_error(r, 2, "no terminal", "--password-stdin", "SNAP_PASSWORD")
    assert not (tmp_path / "docker-config").exists()


def test_login_to_an_unreachable_registry_is_one_line(tmp_path):
    r = snap("login", "127.0.0.1:1", "--username", USER, "--password-stdin", input=PASSWORD + "\n")
    assert_one_line_error(r, 3, "127.0.0.1:1", "not reachable")
    assert not (tmp_path / "docker-config").exists()


def test_login_refuses_a_config_that_is_no_json_and_leaves_it(secure_registry, tmp_path):
    reg = secure_registry
    cfg_dir = tmp_path / "docker-config"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text('{"auths": {"ghcr.io": ')
    r = _login(reg, PASSWORD)
    assert_one_line_error(r, 4, str(cfg_dir / "config.json"), "not a JSON object")
    assert (cfg_dir / "config.json").read_text() == '{"auths": {"ghcr.io": '


@pytest.mark.parametrize("registry", ["docker.io", "index.docker.io", "https://index.docker.io/v1/"])
def test_docker_hub_login_key_is_docker_s_and_read_back(tmp_path, monkeypatch, registry):
    """What `snap login docker.io` keeps is under Docker's key for Docker Hub, found again for any of its names."""
    from snapshotter.oci.reference import parse_registry
    from snapshotter.registry.credentials import save_docker_credentials

    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "cfg"))
    save_docker_credentials(parse_registry(registry), "hubuser", "hub-Pa55")
    assert json.loads((tmp_path / "cfg" / "config.json").read_text()) == {
        "auths": {"https://index.docker.io/v1/": {"auth": HUB_AUTH}}}
    assert _found("docker.io") == _found("registry-1.docker.io") == HUB_AUTH


def test_login_asks_on_the_terminal_without_echoing_the_password(secure_registry, tmp_path):
    """No flags and no env: the user name and the password are asked for on the terminal (a real
    pty, snap's controlling terminal), the password not echoed."""
    import pty
    import select

    reg = secure_registry
    pid, fd = pty.fork()
    if pid == 0:  # the child: snap on the pty, and never back into pytest
        try:
            os.execv(sys.executable, [*SNAP, "login", reg.host, "--ca-cert", reg.cert])
        finally:
            os._exit(127)
    seen = b""

    def read_until(marker: bytes) -> None:
        nonlocal seen
        while marker not in seen:
            assert select.select([fd], [], [], 60)[0], seen  # a guard against a hang, not a timing
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: snap exited, the pty closed
                chunk = b""
            assert chunk, seen
            seen += chunk

    read_until(b"Username: ")
    os.write(fd, USER.encode() + b"\n")
    read_until(b"Password: ")
    os.write(fd, PASSWORD.encode() + b"\n")
    read_until(b"logged in to")
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, seen
    assert PASSWORD.encode() not in seen
    cfg = tmp_path / "docker-config" / "config.json"
    assert json.loads(cfg.read_text()) == {"auths": {reg.host: basic(USER, PASSWORD)}}


def test_login_to_a_name_that_is_no_registry_is_one_line_before_any_prompt(tmp_path):
    r = snap("login", "bad host", "--username", USER, "--password-stdin", input="")
    assert_one_line_error(r, 2, "'bad host' is not valid", "HOST[:PORT]")


def test_login_into_a_config_with_an_empty_creds_store_and_null_auths(tmp_path, monkeypatch):
    """`"credsStore": ""` and `"auths": null` (left by some tools) mean none, as Docker reads them."""
    from snapshotter.registry.credentials import save_docker_credentials

    _docker_config(tmp_path, monkeypatch, None, credsStore="", psFormat="x")
    save_docker_credentials("ghcr.io", "me", "gh-Pa55")
    assert json.loads((tmp_path / "docker-config" / "config.json").read_text()) == {
        "auths": {"ghcr.io": basic("me", "gh-Pa55")}, "credsStore": "", "psFormat": "x"}
    assert _found("ghcr.io") == basic("me", "gh-Pa55")["auth"]
