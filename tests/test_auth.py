"""Registries with htpasswd auth and TLS (a self-signed certificate made by the test)."""

import base64
import json

import pytest

from conftest import NOT_CAPTURED, snap
from support import RegistryServer, push_base_image, snapshot_of_tree
from test_errors import assert_one_line_error

USER, PASSWORD = "snapuser", "s3cret-Pa55"


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
    cfg_dir = tmp_path / "docker-config"
    cfg_dir.mkdir(exist_ok=True)
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (cfg_dir / "config.json").write_text(json.dumps({"auths": {reg.host: {"auth": token}}}))
    r = snap("commit", f"{reg.host}/box:v2", "--base", f"{reg.host}/base:1", "--root", box, "--ca-cert", reg.cert,
             env={"DOCKER_CONFIG": str(cfg_dir)}, check=True)
    assert "pushed" in r.stdout
    assert reg.manifest("box", "v2")["layers"]


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
