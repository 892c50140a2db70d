"""The registry as the scale-out engine: the suite's docker-registry (distribution) with its S3
storage driver, on a real S3 API server on loopback (moto's server mode). Commit, watch, restore
and cross-repository mounts work on it as on a registry disk (blob downloads are redirects to the
bucket), and 8 boxes sharing a base and a venv, committing at once, store little more than one."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from support.faults import FaultProxy
from support.images import push_base_image
from support.registry import RegistryServer
from support.run import SNAP, TIMEOUT, free_port, snap, stop_process
from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree
from support.watch import FakeClock, watcher

NO_MOTO = "moto[server] (in the test extras) is not installed: no S3 API server to run the registry's S3 driver on"
if importlib.util.find_spec("moto") is None:  # looked up, not imported: moto hooks into botocore when imported
    pytest.skip(NO_MOTO, allow_module_level=True)
boto3 = pytest.importorskip("boto3", reason=NO_MOTO)  # moto's own dependency

MiB = 1024 * 1024
BLOBS = "docker/registry/v2/blobs/"  # where distribution keeps blobs (layers, configs, manifests) by digest
# Dummy credentials: moto accepts any, and nothing here may find real ones (the S3 API is on loopback).
KEY, SECRET, REGION = "snap-test-key", "snap-test-secret", "us-east-1"


class S3Server:
    """moto's S3 API server (`python -m moto.server`) on 127.0.0.1, in a process of its own."""

    def __init__(self, workdir: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(workdir, "moto.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION=REGION)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_until_it_listens()
        self.client = boto3.session.Session(aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                                            region_name=REGION).client("s3", endpoint_url=self.endpoint)

    def _wait_until_it_listens(self) -> None:
        """Poll its port; between tries wait on the process itself, so that one that exits is seen at once."""
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                try:
                    self.proc.wait(0.05)
                    break  # it exited
                except subprocess.TimeoutExpired:
                    pass
        self.stop()
        raise RuntimeError(f"moto's S3 server did not start: see {self.log}")

    def stop(self) -> None:
        stop_process(self.proc, 10)

    def registry(self, workdir: str, bucket: str) -> RegistryServer:
        """A new bucket, and a registry that keeps everything in it."""
        self.client.create_bucket(Bucket=bucket)
        return RegistryServer(workdir, s3={"regionendpoint": self.endpoint, "bucket": bucket, "region": REGION,
                                           "accesskey": KEY, "secretkey": SECRET, "secure": False, "v4auth": True,
                                           "rootdirectory": "/"}).start()

    def stored_bytes(self, bucket: str) -> int:
        """What the bucket holds under the registry's blob store: the bytes a team pays for."""
        total = 0
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=BLOBS):
            total += sum(o["Size"] for o in page.get("Contents", []))
        return total


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(str(tmp_path_factory.mktemp("s3")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def s3_registry(s3, tmp_path_factory, base_rootfs):
    """One registry on the bucket `team`, the base image pushed to it."""
    reg = s3.registry(str(tmp_path_factory.mktemp("s3-registry")), "team")
    push_base_image(reg, "base", "1", base_rootfs)
    yield reg
    reg.stop()


def test_commit_and_restore_byte_for_byte_on_object_storage(s3, s3_registry, box, tmp_path):
    reg = s3_registry
    before = s3.stored_bytes("team")
    r = snap("commit", f"{reg.host}/s3-box:v1", "--base", f"{reg.host}/base:1", "--root", box, "--json", check=True)
    assert json.loads(r.stdout)["layers"]
    assert s3.stored_bytes("team") - before > 2 * MiB  # the box's layers are in the bucket (its weights alone: 2.5 MB)
    # Blob downloads are redirects to the bucket (distribution's default on S3): followed, checked.
    blob = reg.manifest("s3-box", "v1")["layers"][-1]["digest"]
    answer = reg.session().get(f"{reg.url}/v2/s3-box/blobs/{blob}", allow_redirects=False)
    assert answer.status_code == 307 and answer.headers["Location"].startswith(s3.endpoint)
    out = tmp_path / "restored"
    snap("restore", f"{reg.host}/s3-box:v1", "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


@pytest.fixture
def s3_proxy(s3_registry):
    """A FaultProxy in front of the registry on S3, counting what snap sends it."""
    p = FaultProxy(s3_registry.host).start()
    yield p
    p.stop()


def test_a_second_repository_mounts_the_blobs_instead_of_uploading(s3, s3_registry, s3_proxy, box):
    reg, via = s3_registry, s3_proxy.host
    base = f"{via}/base:1"
    first = json.loads(snap("commit", f"{via}/team/a:v1", "--base", base, "--root", box, "--json", check=True).stdout)
    stored, sent, manifests = s3.stored_bytes("team"), s3_proxy.upload_bytes(), s3_proxy.body_bytes["PUT manifest"]
    second = json.loads(snap("commit", f"{via}/team/b:v1", "--base", base, "--root", box, "--json", check=True).stdout)
    assert [layer["digest"] for layer in second["layers"]] == [layer["digest"] for layer in first["layers"]]
    assert all(layer["status"].startswith("mounted from team/a") for layer in second["layers"]), second["layers"]
    manifest = reg.manifest("team/b", "v1")
    for d in manifest["layers"]:
        assert reg.has_blob("team/b", d["digest"])
    # Only the new config went up, and the bucket gained at most it and the manifests: a mount copies nothing.
    assert s3_proxy.upload_bytes() - sent == manifest["config"]["size"]
    new_manifests = s3_proxy.body_bytes["PUT manifest"] - manifests
    assert 0 < s3.stored_bytes("team") - stored <= manifest["config"]["size"] + new_manifests


def test_the_watcher_pushes_a_change_to_object_storage(s3_registry, s3_proxy, box, tmp_path):
    """Driven in process with a clock the test moves (no sleeps): a first snapshot, one change, a second
    that sends the changed layer only."""
    reg = s3_registry
    lines, clock = [], FakeClock()
    w = watcher(s3_proxy, f"{s3_proxy.host}/base:1", box, "s3-watched", lines, clock, every=0)
    w.tick()
    sent = s3_proxy.upload_bytes()
    assert sent > 2 * MiB  # the first snapshot: the whole box
    write_tree(box, {"opt/app/notes.txt": "edited on the box\n"})
    clock.advance(1)
    w.tick()
    tags = reg.session().get(f"{reg.url}/v2/s3-watched/tags/list").json()["tags"]
    assert len([t for t in tags if t.startswith("v2-")]) == 2, tags
    assert s3_proxy.upload_bytes() - sent < 64 * 1024  # the changed layer and its metadata, not the box again
    out = tmp_path / "restored"
    snap("restore", f"{reg.host}/s3-watched:v2", "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


# ---- 8 boxes at once -------------------------------------------------------------------------------


def make_team_box(base_rootfs: str, venv: str, dest: str, n: int) -> str:
    """A box of the team: the shared base and venv (copied, times and all), and a little work of its own."""
    subprocess.run(["cp", "-a", base_rootfs, dest], check=True)
    subprocess.run(["cp", "-a", venv, os.path.join(dest, "opt/app/venv")], check=True)
    write_tree(dest, {f"opt/app/work/notes-{n}.txt": f"box {n}'s notes\n" * 50, "etc/app.conf": f"box = {n}\n"})
    return dest


@pytest.fixture(scope="module")
def shared_venv(tmp_path_factory):
    """A 6 MB venv of a few packages, written once."""
    venv = tmp_path_factory.mktemp("shared") / "venv"
    files = {"pyvenv.cfg": "home = /usr/bin\nversion = 3.11.7\n", "bin/python": "->/usr/bin/python3"}
    for pkg, size in (("torch", 3 * MiB), ("numpy", MiB), ("safetensors", MiB), ("tqdm", MiB)):
        site = f"lib/python3.11/site-packages/{pkg}"
        files[f"{site}/__init__.py"] = f"# {pkg}\n" + "import os\n" * 100
        files[f"{site}/_core.so"] = os.urandom(size)
        files[f"{site}-1.0.dist-info/RECORD"] = f"{pkg}/__init__.py,,\n{pkg}/_core.so,,\n"
    write_tree(str(venv), files)
    return str(venv)


def commit_at_once(targets: list[tuple[str, str]], base: str, tmp_path) -> None:
    """`snap commit` of each (target, root), all started together, each its own machine (state dir)."""
    procs = []
    for i, (target, root) in enumerate(targets):
        env = {**os.environ, "SNAP_STATE_DIR": str(tmp_path / f"state-{i}")}
        procs.append(subprocess.Popen([*SNAP, "commit", target, "--base", base,
                                       "--root", root], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
    failed = [(p.args, p.returncode, err) for p in procs for _, err in [p.communicate(timeout=TIMEOUT)] if p.returncode]
    assert not failed, failed


def test_eight_boxes_committing_at_once_store_little_more_than_one(s3, base_rootfs, shared_venv, tmp_path):
    boxes = [make_team_box(base_rootfs, shared_venv, str(tmp_path / f"box-{n}"), n) for n in range(8)]
    alone = s3.registry(str(tmp_path / "alone-registry"), "alone")
    team = s3.registry(str(tmp_path / "team-registry"), "team8")
    try:
        for reg in (alone, team):
            push_base_image(reg, "base", "1", base_rootfs)
        commit_at_once([(f"{alone.host}/box-0:v1", boxes[0])], f"{alone.host}/base:1", tmp_path / "alone")
        one_box = s3.stored_bytes("alone")
        commit_at_once([(f"{team.host}/box-{n}:v1", b) for n, b in enumerate(boxes)], f"{team.host}/base:1",
                       tmp_path / "team")
        eight_boxes = s3.stored_bytes("team8")
        for n, b in enumerate(boxes):  # each is there, whole
            assert team.manifest(f"box-{n}", "v1")["layers"]
        assert one_box > 6 * MiB  # the measure is of a real box: the venv is in it
        assert eight_boxes <= 1.2 * one_box, (eight_boxes, one_box)
        out = tmp_path / "restored-7"
        snap("restore", f"{team.host}/box-7:v1", "--root", str(out), check=True)
        assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(boxes[7], skip=NOT_CAPTURED)
    finally:
        alone.stop()
        team.stop()
