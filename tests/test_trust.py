"""Trust boundaries of the registry client: credentials go only to the registry's own origin (and
to its token realm over https unless the registry itself is plain http) and to no process snap
starts; no request reaches a link-local, metadata or unspecified address, whatever a realm or a
redirect says; every token or registry answer is read bounded and parsed defensively.

A command that must refuse an address runs under an audit hook that blocks (and notes) every
connection and name lookup off loopback: nothing ever leaves the machine, and a refusal is seen
to come before any attempt."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from snapshotter.errors import IntegrityError, RegistryError
from snapshotter.registry.credentials import Credentials
from snapshotter.registry.remote import Reference, Remote
from snapshotter.registry.transport import TransportOptions

from support.faults import FaultProxy, HostileServer
from support.images import push, repo_for
from support.registry import RegistryServer
from support.run import PEAK_LIMIT_KIB, RUN_TIMEOUT, assert_one_line_error, snap, snap_with_peak
from support.tars import member, tar_bytes

USER, PASSWORD = "snapuser", "s3cret-Pa55"
JSON = {"Content-Type": "application/json"}

# snap's command line, with every connect() and getaddrinfo() off loopback refused and noted; a name
# in $SNAP_TEST_RESOLVE ("name=address") resolves to that address without asking any resolver.
_OFF_LOOPBACK_GUARD = """
import ipaddress, os, runpy, socket, sys

_real_getaddrinfo = socket.getaddrinfo
_name, _, _address = os.environ.get("SNAP_TEST_RESOLVE", "").partition("=")

def getaddrinfo(host, port, *args, **kw):
    if _name and host == _name:
        family = socket.AF_INET6 if ":" in _address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (_address, port))]
    return _real_getaddrinfo(host, port, *args, **kw)

socket.getaddrinfo = getaddrinfo

def loopback(host):
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"

def guard(event, args):
    if event == "socket.connect" and isinstance(args[1], tuple):
        host = args[1][0]
    elif event == "socket.getaddrinfo":
        host = args[0]
    else:
        return
    host = host.decode() if isinstance(host, bytes) else str(host)
    if not loopback(host):
        with open(os.environ["SNAP_TEST_OFF_LOOPBACK"], "a") as f:
            f.write(f"{event} {host}\\n")
        raise OSError(101, "off loopback: refused by the test")

sys.addaudithook(guard)
runpy.run_module("snapshotter", run_name="__main__", alter_sys=True)
"""


def snap_on_loopback(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, str]:
    """(result, what it tried off loopback) of the snap command line."""
    noted = tmp_path / "off-loopback"
    r = snap(*args, env={"SNAP_TEST_OFF_LOOPBACK": str(noted), **(env or {})}, timeout=RUN_TIMEOUT,
             command=[sys.executable, "-c", _OFF_LOOPBACK_GUARD])
    return r, noted.read_text() if noted.exists() else ""


@pytest.fixture
def hostile():
    servers: list[HostileServer] = []

    def make(workdir: str | None = None) -> HostileServer:
        servers.append(HostileServer(workdir).start())
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def challenging(registry: HostileServer, challenge: str) -> None:
    """`registry` answers every request 401 with this Www-Authenticate challenge."""
    registry.answer = lambda method, path: (401, {"WWW-Authenticate": challenge, **JSON}, [b'{"errors": []}'])


@pytest.fixture
def basic_proxy(tmp_path):
    """A FaultProxy in front of a registry with htpasswd auth (plain http): Basic credentials up front."""
    reg = RegistryServer(str(tmp_path / "basic-registry"), auth=(USER, PASSWORD)).start()
    front = FaultProxy(reg.host).start()
    yield front
    front.stop()
    reg.stop()


def with_credentials(host: str, repo: str) -> Remote:
    remote = Remote(Reference.parse(f"{host}/{repo}:x"), TransportOptions(credentials=Credentials(USER, PASSWORD)))
    remote.transport.sleep = lambda seconds: None
    return remote


# ---- 1. credentials go only where they belong ------------------------------------------------------

def test_credentials_stay_off_an_upload_location_on_another_host(basic_proxy, hostile, request):
    other = hostile()
    repo = repo_for(request)
    basic_proxy.answer = lambda method, path: ((202, {"Location": f"http://{other.host}/v2/{repo}/blobs/uploads/u"})
                                               if method == "POST" and "/blobs/uploads/" in path else None)
    data = b"layer bytes"
    with pytest.raises(Exception):
        with_credentials(basic_proxy.host, repo).upload_from(lambda out: out.write(data), "sha256:" + "0" * 64,
                                                             len(data))
    assert other.seen, "the upload never went to its Location"
    assert [auth for _, _, auth in other.seen if auth] == []


def test_credentials_stay_off_a_next_page_on_another_host(basic_proxy, hostile, request):
    other = hostile()
    repo = repo_for(request)
    other.answer = lambda method, path: (200, JSON, [json.dumps({"name": repo, "tags": ["b"]}).encode()])
    page = json.dumps({"name": repo, "tags": ["a"]}).encode()
    link = f'<http://{other.host}/v2/{repo}/tags/list?last=a>; rel="next"'
    basic_proxy.lie = lambda method, path: ((200, {**JSON, "Link": link}, [page]) if "/tags/list" in path else None)
    assert with_credentials(basic_proxy.host, repo).list_tags() == ["a", "b"]
    assert other.seen and [auth for _, _, auth in other.seen if auth] == []


def test_credentials_go_to_no_realm_over_plain_http_from_a_tls_registry(hostile, tmp_path):
    registry, tokens = hostile(str(tmp_path)), hostile()
    challenging(registry, f'Bearer realm="http://{tokens.host}/token",service="s"')
    tokens.answer = lambda method, path: (200, JSON, [b'{"token": "t"}'])
    r = snap("log", f"{registry.host}/box", "--insecure-tls", env={"SNAP_USERNAME": USER, "SNAP_PASSWORD": PASSWORD})
    assert_one_line_error(r, 4, "plain http", repr("127.0.0.1"))
    assert tokens.seen == []


def test_the_app_started_by_then_gets_no_credential_variable(registry, request, tmp_path):
    ref = push(registry, request, tar_bytes(member("f", data=b"x")))
    root, seen = tmp_path / "root", tmp_path / "app-env"
    root.mkdir()
    # The app holds snap's stdout: snap's run returns once the app has written its environment and exited.
    snap("restore", ref, "--root", str(root), "--then", f"env > {seen}", check=True,
         env={"SNAP_USERNAME": USER, "SNAP_PASSWORD": PASSWORD})
    names = {line.split("=", 1)[0] for line in seen.read_text().splitlines()}
    assert "PATH" in names and not names & {"SNAP_USERNAME", "SNAP_PASSWORD"}, names


# ---- 2. no request to link-local or metadata addresses -------------------------------------------------

FORBIDDEN = ["169.254.169.254", "169.254.1.1", "[fe80::1]", "[fd00:ec2::254]", "0.0.0.0", "[::]",
             "[::ffff:169.254.169.254]", "2852039166", "metadata.google.internal"]


@pytest.mark.parametrize("host", FORBIDDEN)
def test_a_realm_at_a_metadata_address_is_refused_before_connecting(hostile, tmp_path, host):
    registry = hostile()
    challenging(registry, f'Bearer realm="http://{host}/latest/meta-data/iam",service="s"')
    r, off = snap_on_loopback(tmp_path, "log", f"{registry.host}/box")
    assert_one_line_error(r, 4, "refusing to connect", repr(host.strip("[]")))
    assert off == ""


@pytest.mark.parametrize("host", FORBIDDEN)
def test_a_blob_redirect_to_a_metadata_address_is_refused_before_connecting(registry, proxy, request, tmp_path,
                                                                            host):
    ref = push(registry, request, tar_bytes(member("f", data=b"x")))
    proxy.answer = lambda method, path: ((307, {"Location": f"http://{host}/latest/meta-data/"})
                                         if "/blobs/sha256:" in path else None)
    root = tmp_path / "root"
    root.mkdir()
    r, off = snap_on_loopback(tmp_path, "restore", ref.replace(registry.host, proxy.host), "--root", str(root))
    assert_one_line_error(r, 10, "refusing to connect", repr(host.strip("[]")))
    assert off == ""


# ---- 3. every answer bounded, parsed defensively ---------------------------------------------------------

@pytest.mark.parametrize("lie", ["no-realm", "list", "not-json", "token-not-a-string", "huge"])
def test_a_lying_token_service_is_one_line(hostile, tmp_path, lie):
    registry, tokens = hostile(), hostile()
    challenging(registry, 'Bearer service="s"' if lie == "no-realm" else f'Bearer realm="http://{tokens.host}/t",service="s"')
    body = {"list": [b'["token", "t"]'], "not-json": [b"\xff not json"], "token-not-a-string": [b'{"token": 5}'],
            "huge": [b" " * (1 << 20)] * 300}.get(lie, [])
    tokens.answer = lambda method, path: (200, JSON, body)
    r, peak = snap_with_peak("log", f"{registry.host}/box")
    assert_one_line_error(r, 4, "'127.0.0.1")
    assert peak < PEAK_LIMIT_KIB, f"peaked at {peak // 1024} MiB"


@pytest.mark.parametrize("pages", ["itself", "endless"])
def test_tag_pages_that_never_end_are_one_line(registry, proxy, request, pages):
    repo = repo_for(request)
    push(registry, request, tar_bytes(member("f", data=b"x")))
    page = json.dumps({"name": repo, "tags": ["v1"]}).encode()

    def lie(method, path):
        if "/tags/list" not in path:
            return None
        n = int(path.rpartition("last=")[2]) + 1 if "last=" in path and pages == "endless" else 0
        nxt = path if pages == "itself" else f"/v2/{repo}/tags/list?n=1000&last={n}"
        return 200, {**JSON, "Link": f'<{nxt}>; rel="next"'}, [page]

    proxy.lie = lie
    r = snap("log", f"{proxy.host}/{repo}")
    assert_one_line_error(r, 10, "tag list", repr(proxy.host))


def test_a_huge_upload_answer_is_refused(proxy, request):
    repo = repo_for(request)
    proxy.lie = lambda method, path: ((202, {"Location": f"/v2/{repo}/blobs/uploads/u"}, [b" " * (1 << 20)] * 300)
                                      if method == "POST" else None)
    remote = Remote(Reference.parse(f"{proxy.host}/{repo}:x"))
    remote.transport.sleep = lambda seconds: None
    with pytest.raises(RegistryError, match="longer than"):
        remote.upload_from(lambda out: out.write(b"x"), "sha256:" + "0" * 64, 1)


def test_a_manifest_digest_of_an_unknown_algorithm_is_refused_before_asking(registry):
    """The command line refuses such a reference; an index may still name one (a lying registry)."""
    remote = Remote(Reference.parse(f"{registry.host}/any:v1"), TransportOptions())
    with pytest.raises(IntegrityError, match="'md5:0+' uses an algorithm"):
        remote.get_manifest("md5:" + "0" * 32)


def test_a_download_does_not_write_through_a_planted_part_file(registry, request, tmp_path):
    """A name planted where a download writes (its `.part`) is replaced, never followed."""
    data = b"the blob\n" * 100
    ref = Reference.parse(push(registry, request, tar_bytes(member("f", data=data))))
    remote = Remote(ref, TransportOptions())
    digest = remote.resolve().manifest["layers"][0]["digest"]
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me\n")
    dest = tmp_path / "blob"
    os.symlink(victim, str(dest) + ".part")
    remote.download_blob(digest, str(dest))
    assert victim.read_bytes() == b"keep me\n"
    assert not os.path.islink(dest) and os.path.getsize(dest) > 0


@pytest.mark.parametrize("address", ["169.254.169.254", "fd00:ec2::254", "0.0.0.0"])
def test_a_name_that_resolves_to_a_metadata_address_is_never_connected_to(hostile, tmp_path, address):
    registry = hostile()
    challenging(registry, 'Bearer realm="http://token.example/token",service="s"')
    r, off = snap_on_loopback(tmp_path, "log", f"{registry.host}/box",
                              env={"SNAP_TEST_RESOLVE": f"token.example={address}"})
    assert_one_line_error(r, 4, "refusing to connect", "'token.example'", "resolves to")
    assert off == ""  # no connect() to it was attempted
