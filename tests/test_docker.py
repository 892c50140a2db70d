"""Interop with real engines and OCI tools: a dockerd started here pulls and runs snap's images
(`snap run`), skopeo and umoci read them, and `snap commit --from-container` takes a container's
changes from the engine's own diff. Nothing is mocked: dockerd, the registry, skopeo and umoci are
the real programs.

Debian 12's engine is Docker 20.10, which cannot unpack zstd layers (it can from 23.0), and its
umoci 0.4.7 cannot either: the images these tools must unpack are committed with
--compression gzip. snap's weights layers stay plain tar (application/vnd.oci.image.layer.v1.tar),
which both read."""

import gzip
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import threading
import uuid

import pytest

from snapshotter.engine.run import cannot_read_zstd

from support.engine import Dockerd, engine_api
from support.faults import FaultProxy, HostileServer
from support.ocicrypt import make_keys, skopeo_copy
from support.images import label, layers_by_name, push_base_image
from support.registry import RegistryServer, digest_of, diverged_tags
from support.run import (
    WHEELS,
    assert_one_line_error,
    commit_json,
    free_port,
    have_wheels,
    snap,
    snap_dist,
)
from support.tars import gzip_bytes, tar_of_files
from support.trees import (
    LINKED,
    NOT_CAPTURED,
    assert_content_written_once,
    hardlink_box,
    home_box,
    make_box,
    make_home_base,
    snapshot_of_tree,
)

docker = pytest.importorskip("docker")

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
# Files the engine puts into every container (its init layer, not in the engine's diff).
ENGINE_FILES = ("etc/hostname", "etc/hosts", "etc/resolv.conf", "etc/mtab", ".dockerenv")


@pytest.fixture(scope="session")
def dockerd(registry, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("the interop tests start their own dockerd, which needs root")
    if not shutil.which("dockerd"):
        pytest.skip("dockerd is not installed (Debian: apt-get install docker.io)")
    d = Dockerd(str(tmp_path_factory.mktemp("dockerd")), registry.host).start()
    yield d
    d.stop()


@pytest.fixture
def engine(dockerd, monkeypatch):
    """A client of the test dockerd; snap subprocesses find it through DOCKER_HOST."""
    monkeypatch.setenv("DOCKER_HOST", dockerd.host)
    return dockerd.client()


def engine_major(client) -> int:
    return int(re.match(r"\d+", client.version()["Version"]).group())


def sha256_file(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def need(tool):
    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed")


# ---- snap run --------------------------------------------------------------------------------


def test_gzip_snapshot_runs_in_docker_with_the_box_files(registry, base_ref, box, engine):
    """Docker 20.10 pulls a snapshot committed with --compression gzip, uncompressed weights layer
    included, and the container sees the box: venv, custom nodes, model bytes, the whiteout."""
    ref = f"{registry.host}/dock:gz"
    commit_json(ref, base_ref, box, "--compression", "gzip")
    types = {name: d["mediaType"] for name, d in layers_by_name(registry.manifest("dock", "gz")).items()}
    assert types["venv"] == types["custom_nodes"] == types["rest"] == LAYER_GZIP
    assert types["models"] == LAYER_TAR  # weights stay uncompressed, and Docker 20.10 pulls them

    model = "opt/app/models/checkpoints/sd15.safetensors"
    so = "opt/app/venv/lib/python3.11/site-packages/torch/_C.so"
    script = (f"cat /etc/app.conf /opt/app/custom_nodes/NodeA/nodes.py; sha256sum /{model} /{so}; "
              "readlink /opt/app/venv/bin/python; stat -c '%a %n' /opt/app/custom_nodes/NodeB/__init__.py; "
              "test -e /opt/app/old_cache.bin || echo old_cache.bin is gone; echo $GREETING >&2; exit 3")
    r = snap("run", "-e", "GREETING=hello-from-snap", ref, "--", "/bin/sh", "-c", script)
    assert r.returncode == 3, r.stderr  # the container's exit code is snap's
    out = r.stdout.splitlines()
    assert "threads = 8" in out and "class A: pass" in out
    assert f"{sha256_file(os.path.join(box, model))}  /{model}" in out
    assert f"{sha256_file(os.path.join(box, so))}  /{so}" in out
    assert "/usr/bin/python3" in out
    assert "600 /opt/app/custom_nodes/NodeB/__init__.py" in out
    assert "old_cache.bin is gone" in out
    assert "hello-from-snap" in r.stderr  # the container's stderr goes to snap's stderr
    assert "Traceback" not in r.stderr


def test_an_encrypted_snapshot_is_refused_by_run_and_runs_in_docker_once_skopeo_decrypts_it(
        registry, base_ref, box, engine, tmp_path):
    """Docker pulls no ocicrypt layer (containerd's imgcrypt would, given the key): snap run refuses
    snap's encrypted image in one line before the engine pulls, naming both ways out; the copy that
    `skopeo copy --decryption-key` makes runs on Docker 20.10 and the container sees the box."""
    make_keys(tmp_path)
    ref, clear = f"{registry.host}/dock-enc:gz", f"{registry.host}/dock-enc-clear:gz"
    commit_json(ref, base_ref, box, "--compression", "gzip", "--encrypt-to", str(tmp_path / "ec.pub"))
    manifest = registry.manifest("dock-enc", "gz")
    box_layers = manifest["layers"][int(manifest["annotations"]["dev.snap.base-layers"]):]
    assert box_layers and all(d["mediaType"].endswith("+encrypted") for d in box_layers)  # the base's stay clear

    r = snap("run", ref, "--", "/bin/true")
    assert_one_line_error(r, 8, repr(ref), "encrypted", "snap restore", "--decryption-key", "skopeo copy")
    assert r.stderr.count("\n") == 1 and not r.stdout
    with pytest.raises(docker.errors.ImageNotFound):
        engine.images.get(ref)  # refused before the engine pulled a byte

    skopeo_copy(tmp_path, f"docker://{ref}", f"docker://{clear}", "--decryption-key", str(tmp_path / "ec.pem"))
    model = "opt/app/models/checkpoints/sd15.safetensors"
    script = (f"cat /etc/app.conf; sha256sum /{model}; readlink /opt/app/venv/bin/python; "
              "stat -c '%a %n' /opt/app/custom_nodes/NodeB/__init__.py; "
              "test -e /opt/app/old_cache.bin || echo old_cache.bin is gone")
    r = snap("run", clear, "--", "/bin/sh", "-c", script)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "threads = 8" in out
    assert f"{sha256_file(os.path.join(box, model))}  /{model}" in out
    assert "/usr/bin/python3" in out
    assert "600 /opt/app/custom_nodes/NodeB/__init__.py" in out
    assert "old_cache.bin is gone" in out


class TagMover(FaultProxy):
    """A FaultProxy that calls `move` (once) when the engine first asks the registry for anything
    (dockerd's User-Agent says docker/): after every read of snap's, before the engine's pull."""

    def __init__(self, upstream: str, move):
        self.move, self.moved, self._once = move, threading.Event(), threading.Lock()
        super().__init__(upstream)

    def _handler(self):
        proxy, forward = self, super()._handler()

        class Handler(forward):
            def _any(self):
                with proxy._once:
                    if self.headers.get("User-Agent", "").startswith("docker/") and not proxy.moved.is_set():
                        proxy.move()
                        proxy.moved.set()
                forward._any(self)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        return Handler


def test_run_runs_the_manifest_it_checked_though_a_watcher_moves_the_tag(registry, base_ref, engine):
    """snap reads the tag's manifest once and checks it; the engine pulls and runs that manifest by
    its digest. Here the tag moves, once snap has read it, to an encrypted image (which snap would
    refuse and Docker cannot unpack): the container still runs the snapshot snap checked, and the
    engine names it by the tag, as a pull of the tag would."""
    base = [registry.blob("base", d["digest"]) for d in registry.manifest("base", "1")["layers"]]
    checked = registry.push_image("moving", "v1", base + [gzip_bytes(tar_of_files({"etc/which": b"checked\n"}))])
    registry.push_image("moving", "encrypted", [os.urandom(512)], diff_ids=["sha256:" + "ab" * 32],
                        layer_media_type=LAYER_GZIP + "+encrypted")
    s, oci = registry.session(), {"Content-Type": "application/vnd.oci.image.manifest.v1+json"}
    encrypted = s.get(f"{registry.url}/v2/moving/manifests/encrypted", headers={"Accept": oci["Content-Type"]})
    proxy = TagMover(registry.host, lambda: s.put(f"{registry.url}/v2/moving/manifests/v1", data=encrypted.content,
                                                  headers=oci).raise_for_status()).start()
    try:
        ref = f"{proxy.host}/moving:v1"
        r = snap("run", ref, "--", "/bin/sh", "-c", "cat /etc/which")
        assert proxy.moved.is_set() and digest_of(registry, "moving", "v1") != checked
        assert r.returncode == 0 and r.stdout == "checked\n", r.stderr
        assert f"pulling {proxy.host}/moving@{checked}, which {ref} names" in r.stderr
        # snap read the tag's manifest once (not once more to refuse unreadable layers); the engine, by digest
        assert [m for m, path, _ in proxy.log if path.endswith("/manifests/v1")] == ["GET"], proxy.log
        assert engine.images.get(ref).id == engine.images.get(f"{proxy.host}/moving@{checked}").id
    finally:
        proxy.stop()


def test_zstd_is_the_default_and_docker_20_cannot_pull_it(registry, base_ref, box, engine):
    """snap commit compresses code and venvs with zstd by default. Docker before 23.0 cannot unpack
    zstd layers (20.10 fails with 'archive/tar: invalid tar header'), which is why the interop tests
    commit with --compression gzip; snap run turns the failure into one line that says so."""
    ref = f"{registry.host}/dock:zstd"
    commit_json(ref, base_ref, box)  # the box's venv has random bytes: a layer the engine must pull
    layers = layers_by_name(registry.manifest("dock", "zstd"))
    assert {d["mediaType"] for n, d in layers.items() if not n.startswith("models")} == {LAYER_ZSTD}
    assert layers["models"]["mediaType"] == LAYER_TAR
    r = snap("run", ref, "--", "/bin/sh", "-c", "echo pulled")
    if engine_major(engine) >= 23:
        assert r.returncode == 0 and "pulled" in r.stdout, r.stderr
    else:
        assert_one_line_error(r, 8, "zstd", "--compression gzip", "snap restore")


# /version as engines answer it: Debian 12's docker.io, Docker CE releases, podman's Docker API.
DEBIAN_DOCKER_20 = {"Platform": {"Name": ""}, "Version": "20.10.24+dfsg1", "ApiVersion": "1.41",
                    "MinAPIVersion": "1.12",
                    "Os": "linux", "Arch": "amd64", "KernelVersion": "6.1.0-28-amd64",
                    "Components": [{"Name": "Engine", "Version": "20.10.24+dfsg1", "Details": {"ApiVersion": "1.41"}},
                                  {"Name": "containerd", "Version": "1.6.20~ds1"}]}
DOCKER_CE_24 = {"Platform": {"Name": "Docker Engine - Community"}, "Version": "24.0.7", "ApiVersion": "1.43",
                "MinAPIVersion": "1.12", "Os": "linux", "Arch": "amd64",
                "Components": [{"Name": "Engine", "Version": "24.0.7"}, {"Name": "containerd", "Version": "1.6.25"}]}
PODMAN_4 = {"Platform": {"Name": "linux/amd64/debian-12"}, "Version": "4.3.1", "ApiVersion": "1.41",
            "MinAPIVersion": "1.24", "Os": "linux", "Arch": "amd64",
            "Components": [{"Name": "Podman Engine", "Version": "4.3.1", "Details": {"APIVersion": "4.3.1"}},
                           {"Name": "Conmon", "Version": "conmon version 2.1.6"}]}


def with_version(doc: dict, version: str) -> dict:
    return {**doc, "Version": version, "Components": [{**doc["Components"][0], "Version": version}]}


def test_which_engines_cannot_read_zstd():
    """Docker unpacks zstd layers from 23.0 on; podman answers with its own version, and reads them."""
    assert cannot_read_zstd(DEBIAN_DOCKER_20) == "Docker 20.10.24+dfsg1"
    assert cannot_read_zstd(with_version(DOCKER_CE_24, "17.03.2-ce")) == "Docker 17.03.2-ce"
    assert cannot_read_zstd(with_version(DOCKER_CE_24, "1.13.1")) == "Docker 1.13.1"
    assert cannot_read_zstd(with_version(DOCKER_CE_24, "22.06.0-beta.0")) == "Docker 22.06.0-beta.0"
    for can in ("23.0.0", "24.0.7", "27.3.1", "100.0.1"):
        assert cannot_read_zstd(with_version(DOCKER_CE_24, can)) is None, can
    assert cannot_read_zstd(PODMAN_4) is None and cannot_read_zstd(with_version(PODMAN_4, "3.0.1")) is None
    for unsure in ({}, {"Version": "dev"}, {"Version": None}, []):  # no sure number: the pull decides
        assert cannot_read_zstd(unsure) is None


@pytest.fixture
def fake_engine(monkeypatch):
    """A real HTTP server answering as a Docker engine (helpers.engine_api), snap's DOCKER_HOST."""
    server = HostileServer().start()
    monkeypatch.setenv("DOCKER_HOST", f"tcp://{server.host}")
    yield server
    server.stop()


def engine_calls(server) -> list[str]:
    return [f"{method} {path.split('?')[0]}" for method, path, _ in server.seen]


def test_run_on_an_engine_too_old_for_zstd_says_so_before_the_engine_pulls(registry, base_ref, box, fake_engine):
    zstd_ref, gzip_ref = f"{registry.host}/old-engine:zstd", f"{registry.host}/old-engine:gz"
    commit_json(zstd_ref, base_ref, box)
    commit_json(gzip_ref, base_ref, box, "--compression", "gzip")

    fake_engine.answer = engine_api(DEBIAN_DOCKER_20)
    r = snap("run", zstd_ref, "--", "/bin/true")
    assert_one_line_error(r, 8, "Docker 20.10.24+dfsg1 cannot read zstd layers (needs 23.0 or later)", zstd_ref,
                          "upgrade Docker", "--compression gzip", "snap restore")
    assert r.stderr.count("\n") == 1 and not r.stdout
    assert all(call.endswith(("/version", "/_ping")) for call in engine_calls(fake_engine)), fake_engine.seen

    # What the engine can read, and an engine that reads zstd: the engine is asked to pull.
    for version, ref in ((DEBIAN_DOCKER_20, gzip_ref), (DOCKER_CE_24, zstd_ref), (PODMAN_4, zstd_ref)):
        fake_engine.seen.clear()
        fake_engine.answer = engine_api(version)
        r = snap("run", ref, "--", "/bin/true")
        assert r.returncode == 10 and "this engine pulls nothing" in r.stderr, (version["Version"], r.stderr)
        assert any(call.endswith("/images/create") for call in engine_calls(fake_engine)), fake_engine.seen
        # no weights from the origin to bind: the engine is not asked where it runs
        assert not any(call.endswith("/info") for call in engine_calls(fake_engine)), fake_engine.seen


def test_run_refuses_encrypted_layers_before_any_engine_pulls(registry, fake_engine):
    """Layers in ocicrypt's media types (skopeo's --encryption-key writes tar+gzip+encrypted): no
    engine behind the Docker API decrypts them, old or new, so snap run says so in one line and the
    engine is asked for nothing but its version."""
    ref = f"{registry.host}/skopeo-encrypted:v1"
    registry.push_image("skopeo-encrypted", "v1", [os.urandom(512)], diff_ids=["sha256:" + "ab" * 32],
                        layer_media_type=LAYER_GZIP + "+encrypted")
    for version in (DEBIAN_DOCKER_20, DOCKER_CE_24, PODMAN_4):
        fake_engine.seen.clear()
        fake_engine.answer = engine_api(version)
        r = snap("run", ref, "--", "/bin/true")
        assert_one_line_error(r, 8, f"{ref!r} has encrypted layers", "snap restore REF --root DIR --decryption-key",
                              "skopeo copy --decryption-key")
        assert all(call.endswith(("/version", "/_ping")) for call in engine_calls(fake_engine)), fake_engine.seen


def test_an_old_engines_invalid_tar_header_names_both_causes(registry, fake_engine):
    """snap cannot read the image itself (here: not in its registry; on a box, a registry only the
    engine's host reaches), so the engine pulls the ref as given. Docker 20.10 says 'invalid tar
    header' of zstd layers and of encrypted ones alike: the one line names both, and each way out."""
    ref = f"{registry.host}/engine-only:v1"
    said = "failed to register layer: Error processing tar file(exit status 1): archive/tar: invalid tar header"
    fake_engine.answer = engine_api(DEBIAN_DOCKER_20, said)
    r = snap("run", ref)
    assert_one_line_error(r, 8, f"Docker 20.10.24+dfsg1 failed to unpack {ref}", "invalid tar header",
                          "zstd, which Docker 20.10.24+dfsg1 cannot read (needs 23.0 or later)",
                          "encrypted, which no Docker engine decrypts", "upgrade Docker", "--compression gzip",
                          "--decryption-key FILE", "skopeo copy")
    assert f"pulling {ref}\n" in r.stderr  # the ref as given: snap read no manifest to pin
    fake_engine.answer = engine_api(DOCKER_CE_24, said)  # a new engine: its own words, not a guess
    assert_one_line_error(snap("run", ref), 10, "archive/tar: invalid tar header")


def test_run_keeps_the_image_entrypoint_cmd_env_and_workdir(registry, base_ref, base_rootfs, engine, tmp_path):
    """Only the command is replaced, and only when given after --."""
    base = registry.manifest("base", "1")
    registry.push_image("appbase", "1", [registry.blob("base", d["digest"]) for d in base["layers"]], config={
        "config": {"Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo default in $(pwd) as $APP_MODE"],
                   "WorkingDir": "/opt/app", "Env": ["PATH=/usr/bin:/bin", "APP_MODE=serve"]}})
    box = make_box(base_rootfs, str(tmp_path / "box"))
    ref = f"{registry.host}/appbox:v1"
    commit_json(ref, f"{registry.host}/appbase:1", box, "--compression", "gzip")

    r = snap("run", ref, check=True)
    assert r.stdout.strip() == "default in /opt/app as serve"
    r = snap("run", "-e", "APP_MODE=debug", ref, "--", "echo override in $(pwd) as $APP_MODE; cat config.yaml",
             check=True)
    assert r.stdout.splitlines() == ["override in /opt/app as debug", "port: 9000"]


def test_run_detached_passes_ports_volumes_env_and_name(registry, base_ref, box, engine, tmp_path):
    ref = f"{registry.host}/dock:detached"
    commit_json(ref, base_ref, box, "--compression", "gzip")
    data = tmp_path / "data"
    data.mkdir()
    (data / "hello.txt").write_text("from the host\n")
    p1, p2 = free_port(), free_port()
    r = snap("run", "-d", "--name", "snap-detached", "-p", f"{p1}:8188", "-p", f"127.0.0.1:{p2}:9000/udp",
             "-v", f"{data}:/data:ro", "-e", "MODE=test", ref, "--", "/bin/sh", "-c", "sleep 300", check=True)
    ct = engine.containers.get(r.stdout.strip())
    try:
        assert ct.name == "snap-detached" and ct.status == "running"  # `run -d` returns once it is started
        host = ct.attrs["HostConfig"]
        assert host["PortBindings"] == {"8188/tcp": [{"HostIp": "", "HostPort": str(p1)}],
                                        "9000/udp": [{"HostIp": "127.0.0.1", "HostPort": str(p2)}]}
        assert host["Binds"] == [f"{data}:/data:ro"]
        assert not host.get("DeviceRequests")  # this host has no GPU
        assert "MODE=test" in ct.attrs["Config"]["Env"]
        res = ct.exec_run(["/bin/sh", "-c", "cat /data/hello.txt; touch /data/x 2>/dev/null || echo read-only"])
        assert res.output.decode().splitlines() == ["from the host", "read-only"]
        # The same name again: one line from snap, not the engine's traceback.
        again = snap("run", "-d", "--name", "snap-detached", ref)
        assert_one_line_error(again, 2, "snap-detached", "already exists")
    finally:
        ct.remove(force=True)


def test_gpus_are_requested_when_the_host_has_them(registry, base_ref, box, engine, tmp_path):
    """A host with NVIDIA GPUs (detected by /dev/nvidia0 or nvidia-smi on PATH; here an nvidia-smi
    script stands in for the driver) gets every GPU requested from the engine. An engine without
    the NVIDIA toolkit refuses, and snap says what to do; --no-gpu runs without them."""
    if "nvidia" in engine.info().get("Runtimes", {}):
        pytest.skip("this engine can give containers GPUs")
    ref = f"{registry.host}/dock:gpu"
    commit_json(ref, base_ref, box, "--compression", "gzip")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA A100'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    before = {c.id for c in engine.containers.list(all=True)}
    r = snap("run", ref, "--", "/bin/sh", "-c", "echo ran", env=env)
    assert_one_line_error(r, 8, "GPU", "--no-gpu")
    assert {c.id for c in engine.containers.list(all=True)} == before  # the refused container is gone
    r = snap("run", "--no-gpu", ref, "--", "/bin/sh", "-c", "echo ran", env=env, check=True)
    assert r.stdout.strip() == "ran"


NVIDIA_HOOK = "nvidia-container-runtime-hook"  # the NVIDIA toolkit's: dockerd offers GPUs when it finds it


@pytest.fixture(scope="session")
def gpu_engine(dockerd, registry, tmp_path_factory):
    """(Dockerd, log of the NVIDIA hook's calls or None) of an engine that can give containers GPUs.
    Where the toolkit is installed, the test dockerd already can. Elsewhere a second dockerd gets
    a stand-in hook on its PATH: the engine then takes GPU requests as with the real toolkit (it
    sets NVIDIA_VISIBLE_DEVICES and calls the hook before the container starts), minus the devices."""
    if shutil.which(NVIDIA_HOOK):
        yield dockerd, None
        return
    workdir = tmp_path_factory.mktemp("gpu-dockerd")
    calls = workdir / "hook-calls"
    hook = workdir / "bin" / NVIDIA_HOOK
    hook.parent.mkdir()
    hook.write_text(f"#!/bin/sh\ncat > /dev/null\necho \"$*\" >> {calls}\n")  # the container's state comes on stdin
    hook.chmod(0o755)
    d = Dockerd(str(workdir), registry.host, path=f"{hook.parent}:{os.environ['PATH']}").start()
    yield d, calls
    d.stop()


def test_gpus_reach_the_engine_that_can_give_them(registry, base_ref, box, gpu_engine, tmp_path):
    """On a host with NVIDIA GPUs `snap run` requests all of them, and an engine with the NVIDIA
    toolkit gives them to the container: the request is in the container's HostConfig, the toolkit's
    hook ran, and the container sees NVIDIA_VISIBLE_DEVICES=all. --no-gpu requests none."""
    engine, calls = gpu_engine
    client = engine.client()
    ref = f"{registry.host}/dock:gpuok"
    commit_json(ref, base_ref, box, "--compression", "gzip")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA A100'\n")  # the host has GPUs
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "DOCKER_HOST": engine.host}
    name = f"snap-gpu-{uuid.uuid4().hex[:8]}"
    r = snap("run", "--name", name, ref, "--", "/bin/sh", "-c", "echo \"gpus=$NVIDIA_VISIBLE_DEVICES\"", env=env,
             check=True)
    try:
        assert r.stdout.strip() == "gpus=all"
        requests_ = client.containers.get(name).attrs["HostConfig"]["DeviceRequests"]
        assert [(d["Count"], d["Capabilities"]) for d in requests_] == [(-1, [["gpu"]])]
        if calls is not None:
            assert calls.read_text().split() == ["prestart"]
        r = snap("run", "--no-gpu", "--name", name + "-none", ref, "--", "/bin/sh", "-c",
                 "echo \"gpus=$NVIDIA_VISIBLE_DEVICES\"", env=env, check=True)
        assert r.stdout.strip() == "gpus="
        assert not client.containers.get(name + "-none").attrs["HostConfig"]["DeviceRequests"]
    finally:
        for c in client.containers.list(all=True, filters={"name": name}):
            c.remove(force=True)


def test_run_without_an_engine_points_to_extract_mode():
    r = snap("run", "127.0.0.1:5000/box:v1", env={"DOCKER_HOST": "unix:///nonexistent.sock"})
    assert_one_line_error(r, 8, "unix:///nonexistent.sock", "snap restore")
    assert r.stderr.count("\n") == 1 and not r.stdout


def test_run_registry_errors_and_credentials(engine, base_rootfs, registry, tmp_path):
    """--username/--password-stdin reach the engine's pull; pull failures get snap's exit codes."""
    r = snap("run", f"{registry.host}/nosuch:v1")
    assert_one_line_error(r, 5, "not found", "nosuch")
    reg = RegistryServer(str(tmp_path / "auth-registry"), auth=("snapuser", "s3cret-Pa55")).start()
    try:
        push_base_image(reg, "private", "1", base_rootfs)
        ref = f"{reg.host}/private:1"
        cmd = ["--", "/bin/sh", "-c", "cat /etc/os-release"]
        assert_one_line_error(snap("run", ref, *cmd), 4, "--username")
        assert_one_line_error(snap("run", "-u", "snapuser", "--password-stdin", ref, *cmd, input="wrong\n"), 4)
        r = snap("run", "-u", "snapuser", "--password-stdin", ref, *cmd, input="s3cret-Pa55\n", check=True)
        assert r.stdout.strip() == "NAME=snap-test-base"
        assert "s3cret" not in r.stdout + r.stderr
    finally:
        reg.stop()


# ---- other OCI tools ----------------------------------------------------------------------------


def test_skopeo_and_umoci_read_the_image_byte_for_byte(registry, base_ref, box, tmp_path):
    """skopeo copies the image to an OCI layout (digests preserved), umoci unpacks it: the rootfs is
    the box, byte for byte. umoci 0.4.7 refuses zstd layers, so this image is gzip; the default
    (zstd) image is checked for what each tool can do with it."""
    need("skopeo")
    need("umoci")
    if os.geteuid() != 0:
        pytest.skip("umoci unpack keeps owners only as root")
    for tag, extra in (("gz", ["--compression", "gzip"]), ("zstd", [])):
        commit_json(f"{registry.host}/oci:{tag}", base_ref, box, *extra)
        src = f"docker://{registry.host}/oci:{tag}"
        m = registry.manifest("oci", tag)
        info = json.loads(subprocess.run(["skopeo", "inspect", "--tls-verify=false", src],
                                         check=True, capture_output=True, text=True).stdout)
        assert info["Layers"] == [d["digest"] for d in m["layers"]]
        layout = tmp_path / f"oci-{tag}"
        subprocess.run(["skopeo", "copy", "-q", "--preserve-digests", "--src-tls-verify=false", src,
                        f"oci:{layout}:{tag}"],
                       check=True, capture_output=True)
        bundle = tmp_path / f"bundle-{tag}"
        r = subprocess.run(["umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle)], capture_output=True,
                           text=True)
        if tag == "zstd" and r.returncode != 0:
            assert "mediatype: " + LAYER_ZSTD in r.stderr.replace("mediaType", "mediatype"), r.stderr
            continue  # an umoci without zstd: nothing else may be wrong
        assert r.returncode == 0, r.stderr
        assert snapshot_of_tree(str(bundle / "rootfs"), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
        # umoci pairs history entries with layers: each snap layer's entry names it.
        stat = json.loads(subprocess.run(["umoci", "stat", "--image", f"{layout}:{tag}", "--json"],
                                         check=True, capture_output=True, text=True).stdout)
        paired = [(h["layer"], h["created_by"]) for h in stat["history"] if h.get("layer")]
        assert [d["digest"] for d, _ in paired] == [d["digest"] for d in m["layers"]]
        for desc, created_by in paired:
            if "dev.snap.layer" in desc.get("annotations", {}):
                assert created_by == f"snap commit: {label(desc)} layer"


def _uncompressed(blob: bytes, media_type: str) -> bytes:
    if media_type == LAYER_GZIP:
        return gzip.decompress(blob)
    assert media_type == LAYER_TAR, media_type
    return blob


def test_manifest_and_config_follow_the_image_spec(registry, base_ref, box, engine):
    """What test_roundtrip does not check yet, on the gzip image an engine pulls: exact manifest
    bytes and digest, descriptor formats, config fields, history pairing, the base annotations
    naming the base's real digest; and Docker's own view of the pulled image agreeing."""
    result = commit_json(f"{registry.host}/spec:v1", base_ref, box, "--compression", "gzip")
    s = registry.session()
    r = s.get(f"{registry.url}/v2/spec/manifests/v1", headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert r.headers["Content-Type"] == "application/vnd.oci.image.manifest.v1+json"
    assert "sha256:" + hashlib.sha256(r.content).hexdigest() == result["manifest_digest"]
    m = r.json()
    assert m["schemaVersion"] == 2 and m["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    digest_re = re.compile(r"^sha256:[a-f0-9]{64}$")
    assert m["config"]["mediaType"] == "application/vnd.oci.image.config.v1+json"
    cfg_bytes = registry.blob("spec", m["config"]["digest"])
    assert len(cfg_bytes) == m["config"]["size"]
    assert "sha256:" + hashlib.sha256(cfg_bytes).hexdigest() == m["config"]["digest"]
    cfg = json.loads(cfg_bytes)
    assert (cfg["architecture"], cfg["os"], cfg["rootfs"]["type"]) == ("amd64", "linux", "layers")
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$", cfg["created"])
    diff_ids = cfg["rootfs"]["diff_ids"]
    assert len(diff_ids) == len(m["layers"])
    for desc, diff_id in zip(m["layers"], diff_ids):
        assert digest_re.match(desc["digest"]) and digest_re.match(diff_id)
        assert isinstance(desc["size"], int) and desc["mediaType"] in (LAYER_TAR, LAYER_GZIP)
        blob = registry.blob("spec", desc["digest"])
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == desc["digest"] and len(blob) == desc["size"]
        assert "sha256:" + hashlib.sha256(_uncompressed(blob, desc["mediaType"])).hexdigest() == diff_id
    # History: tools pair the non-empty entries with the layers, one to one.
    real = [h for h in cfg["history"] if not h.get("empty_layer")]
    assert len(real) == len(m["layers"])
    for desc, h in zip(m["layers"], real):
        if "dev.snap.layer" in desc.get("annotations", {}):
            assert h["created_by"] == f"snap commit: {label(desc)} layer"
    base_manifest = s.get(f"{registry.url}/v2/base/manifests/1",
                          headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).content
    ann = m["annotations"]
    assert ann["org.opencontainers.image.base.name"] == base_ref
    assert ann["org.opencontainers.image.base.digest"] == "sha256:" + hashlib.sha256(base_manifest).hexdigest()
    # skopeo sees the same bytes; Docker computed the same diff_ids while pulling, and the same history.
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{registry.host}/spec:v1"],
                         check=True, capture_output=True).stdout
    assert raw == r.content
    img = engine.images.pull(f"{registry.host}/spec", tag="v1")
    assert img.attrs["RootFS"]["Layers"] == diff_ids
    assert img.id == m["config"]["digest"]
    docker_history = [h["CreatedBy"] for h in reversed(img.history())]
    assert [h for h in docker_history if h.startswith("snap commit")] == \
        [f"snap commit: {label(d)} layer" for d in m["layers"] if "dev.snap.layer" in d.get("annotations", {})]


# ---- snap commit --from-container ----------------------------------------------------------------


CONTAINER_CHANGES = """
set -e
mkdir -p /opt/app/venv/bin /opt/app/custom_nodes/NodeA /root/.ssh /tmp/work
echo 'home = /usr/bin' > /opt/app/venv/pyvenv.cfg
ln -s /usr/bin/python3 /opt/app/venv/bin/python
echo 'class A: pass' > /opt/app/custom_nodes/NodeA/nodes.py
ln /opt/app/custom_nodes/NodeA/nodes.py /opt/app/custom_nodes/NodeA/nodes_link.py
chmod 600 /opt/app/custom_nodes/NodeA/nodes.py
echo 'port: 9000' > /opt/app/config.yaml
chown 1000:1000 /etc/passwd
ln -sfn /usr/lib/libfake.so.1 /usr/lib/libfake.so
chmod 700 /var
rm /opt/app/old_cache.bin
rm -rf /var/lib/app
rm -rf /usr/share/doc/base && mkdir /usr/share/doc/base && echo new > /usr/share/doc/base/NEW
rm /opt/app/main.py && mkdir /opt/app/main.py && echo pkg > /opt/app/main.py/__init__.py
echo secret > /root/.ssh/id_rsa
echo scratch > /tmp/work/scratch
"""


def _export(ct, dest) -> None:
    """The container's whole filesystem as the engine exports it, less the engine's own files: what a
    walk of the container sees."""
    os.makedirs(dest)
    tar = subprocess.Popen(["tar", "-x", "-p", "--numeric-owner", "-C", str(dest)], stdin=subprocess.PIPE)
    for chunk in ct.export():
        tar.stdin.write(chunk)
    tar.stdin.close()
    assert tar.wait() == 0
    for p in ENGINE_FILES:
        if os.path.lexists(dest / p):
            parent = os.lstat((dest / p).parent)
            os.unlink(dest / p)
            os.utime((dest / p).parent, ns=(parent.st_atime_ns, parent.st_mtime_ns))  # as it was


def test_commit_from_container_gives_the_layers_of_a_walk(registry, base_ref, engine, tmp_path):
    """A container started from the base, changed with docker exec (added, modified, deleted,
    retyped and recreated paths, a secret, scratch space): `snap commit --from-container` reads only
    the engine's diff, yet gives the same layers, byte for byte, as a filesystem walk of the
    container's export; restore brings the container's files back; a stopped container gives the
    same image again."""
    engine.images.pull(base_ref)
    name = f"snap-box-{uuid.uuid4().hex[:8]}"
    ct = engine.containers.run(base_ref, ["/bin/sh", "-c", "sleep 600"], name=name, detach=True)
    try:
        ct.put_archive("/", tar_of_files({  # binary files, through the engine's archive API
            "opt/app/models/checkpoints/sd15.safetensors": os.urandom(1_500_000),
            "opt/app/venv/lib/python3.11/site-packages/torch/_C.so": os.urandom(200_000),
        }, mtime=1_650_000_000))
        res = ct.exec_run(["/bin/sh", "-c", CONTAINER_CHANGES])
        assert res.exit_code == 0, res.output

        ref = f"{registry.host}/fromct:v1"
        got = json.loads(snap("commit", ref, "--from-container", name, "--json", check=True).stdout)
        assert got["skipped_secrets"] == ["root/.ssh"]
        export = tmp_path / "export"
        _export(ct, export)
        walked = commit_json(f"{registry.host}/walked:v1", base_ref, str(export))
        assert [(x["name"], x["digest"]) for x in got["layers"]] == [(x["name"], x["digest"]) for x in walked["layers"]]
        assert got["deleted"] == walked["deleted"]
        names = [x["name"] for x in got["layers"]]
        assert names[:3] == ["venv", "custom_nodes", "rest"] and names[-1].startswith("models")  # weights last

        out = tmp_path / "restored"
        snap("restore", ref, "--root", str(out), check=True)
        skip = NOT_CAPTURED + ENGINE_FILES + ("root/.ssh",)
        assert snapshot_of_tree(str(out), skip=skip) == snapshot_of_tree(str(export), skip=skip)
        restored = snapshot_of_tree(str(out), skip=skip)
        assert restored["etc/passwd"][2:4] == (1000, 1000)
        assert restored["usr/lib/libfake.so"][::5] == ("link", "/usr/lib/libfake.so.1")
        assert restored["var"][1] == "0o700"
        assert restored["opt/app/main.py/__init__.py"][0] == "file"
        link = restored["opt/app/custom_nodes/NodeA/nodes_link.py"]
        assert link[5].endswith("linked-with:opt/app/custom_nodes/NodeA/nodes.py")
        assert "usr/share/doc/base/NEW" in restored and "usr/share/doc/base/README" not in restored
        for gone in ("opt/app/old_cache.bin", "var/lib/app", "tmp/work", "root/.ssh"):
            assert not os.path.lexists(out / gone), gone

        ct.stop(timeout=1)
        again = json.loads(snap("commit", f"{registry.host}/fromct:v2", "--from-container", name, "--json",
                                check=True).stdout)
        assert [x["digest"] for x in again["layers"]] == [x["digest"] for x in got["layers"]]

        wrong = snap("commit", f"{registry.host}/fromct:v3", "--from-container", name, "--base",
                     f"{registry.host}/walked:v1")
        assert_one_line_error(wrong, 2, name, "--base")
    finally:
        ct.remove(force=True)
    assert_one_line_error(snap("commit", f"{registry.host}/fromct:v4", "--from-container", name), 5, name)


def test_parent_directories_keep_their_mode_and_owner_in_docker(registry, engine, tmp_path):
    """Docker 20.10 makes a parent directory a layer lacks 0755 root:root, over the one below it: a
    box whose 0700 /home/user (1000:1000) and /root got a new file shows them as in the box."""
    base_ref, rootfs = make_home_base(registry, str(tmp_path), "dock-home-base")
    box = home_box(rootfs, str(tmp_path / "box"))
    ref = f"{registry.host}/dock-home:v1"
    commit_json(ref, base_ref, box, "--compression", "gzip")
    dirs = ("/home", "/home/user", "/home/user/proj", "/root")
    r = snap("run", ref, "--", "/bin/sh", "-c", "stat -c '%a %u:%g %n' " + " ".join(dirs), check=True)
    want = []
    for d in dirs:
        st = os.lstat(os.path.join(box, d.lstrip("/")))
        want.append(f"{st.st_mode & 0o7777:o} {st.st_uid}:{st.st_gid} {d}")
    assert r.stdout.splitlines() == want


def test_hardlinked_weights_are_one_inode_in_docker_and_umoci(registry, base_ref, base_rootfs, engine, tmp_path):
    """A weight with three names and a small file with two: Docker (snap run) and umoci show each
    as one inode, as restore does (tests/test_layers.py)."""
    need("skopeo")
    need("umoci")
    box, profile = hardlink_box(base_rootfs, str(tmp_path / "box"))
    ref = f"{registry.host}/dock-links:v1"
    commit_json(ref, base_ref, box, "--profile", profile, "--compression", "gzip")
    assert_content_written_once(registry, "dock-links", "v1")
    names = [n for group in LINKED for n in group]
    r = snap("run", ref, "--", "/bin/sh", "-c", "stat -c '%i' " + " ".join("/" + n for n in names), check=True)
    inodes = dict(zip(names, r.stdout.split()))
    for group in LINKED:
        assert len({inodes[n] for n in group}) == 1, (group, inodes)
    assert inodes[LINKED[0][0]] != inodes[LINKED[1][0]]

    layout, bundle = tmp_path / "oci", tmp_path / "bundle"
    subprocess.run(["skopeo", "copy", "-q", "--src-tls-verify=false", f"docker://{ref}", f"oci:{layout}:v1"],
                   check=True, capture_output=True)
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:v1", str(bundle)], check=True, capture_output=True)
    for group in LINKED:
        assert len({os.lstat(bundle / "rootfs" / n).st_ino for n in group}) == 1, group
    assert snapshot_of_tree(str(bundle / "rootfs"),
                            skip=NOT_CAPTURED)[LINKED[0][2]][5].startswith(sha256_file(os.path.join(box, LINKED[0][0])))


# ---- the container provider recipe of docs/providers.md (the README's, before docs/) ---------------------

def readme_recipe() -> tuple[str, str]:
    """(Dockerfile, start.sh) of docs/providers.md's container provider recipe: the first indented
    blocks, after its mention of this test, that start with FROM and with #!/bin/sh."""
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "providers.md")) as f:
        lines = f.read().split("\n")
    at = next(i for i, line in enumerate(lines) if "test_container_recipe_from_the_readme" in line)
    at = next(i for i in range(at, 0, -1) if lines[i].startswith("**A container provider**"))
    blocks, i = [], at
    while i < len(lines) and not lines[i].startswith("**A VM**"):
        if lines[i].startswith("    "):
            end = next(j for j in range(i, len(lines)) if lines[j] and not lines[j].startswith("    "))
            blocks.append("\n".join(line[4:] for line in lines[i:end]).strip("\n") + "\n")
            i = end
        i += 1
    dockerfile = next(b for b in blocks if any(x.startswith("FROM ") for x in b.split("\n")))
    script = next(b for b in blocks if b.startswith("#!/bin/sh"))
    return dockerfile, script


def with_own(script: str, box: str, base: str, app: str) -> str:
    """The script with the test's image names and app in place of the recipe's examples; nothing else changes."""
    lines = script.split("\n")
    names = [i for i, line in enumerate(lines) if line.startswith("BOX=")]
    apps = [i for i, line in enumerate(lines) if line.endswith(" & app=$!")]
    assert len(names) == 1 and len(apps) == 1, script
    lines[names[0]] = f"BOX={shlex.quote(box)} BASE={shlex.quote(base)}"
    lines[apps[0]] = f"{app} & app=$!"
    return "\n".join(lines)


def with_own_base(dockerfile: str, base: str) -> str:
    lines = dockerfile.split("\n")
    froms = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(froms) == 1, dockerfile
    lines[froms[0]] = f"FROM {base}"
    return "\n".join(lines)


def python_layer() -> bytes:
    """A layer with this machine's Debian Python 3.11 (interpreter, stdlib, the libraries they load,
    the wheels its ensurepip installs pip from) and a wheelhouse of snap's dependencies at /wheels:
    a provider's base image with a Python, offline (the image's env points pip at /wheels)."""
    files = {"usr/bin/python3.11": "/usr/bin/python3.11", "lib64/ld-linux-x86-64.so.2": "/lib64/ld-linux-x86-64.so.2"}
    lib = "/usr/lib/python3.11"
    for dirpath, dirnames, filenames in os.walk(lib):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "test", "idlelib", "tkinter")
                       and not d.startswith("config-")]
        files.update({os.path.relpath(os.path.join(dirpath, n), "/"): os.path.join(dirpath, n) for n in filenames})
    for w in os.listdir("/usr/share/python-wheels"):
        files[f"usr/share/python-wheels/{w}"] = f"/usr/share/python-wheels/{w}"
    for w in os.listdir(WHEELS):
        if not re.search(r"-cp3\d+-cp3\d+", w) or "-cp311-" in w:  # another Python's build: half the bytes, unused
            files[f"wheels/{w}"] = os.path.join(WHEELS, w)
    # What the manylinux extensions in the wheels load (Rust's, C++'s), beyond what Python's own do.
    needed = {f"/lib/x86_64-linux-gnu/{n}" for n in ("libgcc_s.so.1", "librt.so.1", "libpthread.so.0", "libdl.so.2")}
    for so in ["/usr/bin/python3.11"] + [os.path.join(lib, "lib-dynload", n) for n in os.listdir(lib + "/lib-dynload")]:
        needed.update(re.findall(r"=> (/\S+)", subprocess.run(["ldd", so], capture_output=True, text=True).stdout))
    files.update({f"lib/x86_64-linux-gnu/{os.path.basename(p)}": p for p in needed})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("usr/local/bin", "opt", "workspace"):
            tar.addfile(_dir_info(d))
        for dest, src in sorted(files.items()):
            info = tar.gettarinfo(os.path.realpath(src), arcname=dest)
            info.uname = info.gname = ""
            with open(src, "rb") as f:
                tar.addfile(info, f)
        link = tarfile.TarInfo("usr/bin/python3")
        link.type, link.linkname = tarfile.SYMTYPE, "python3.11"
        tar.addfile(link)
    return buf.getvalue()


def _dir_info(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 1_600_000_000
    return info


def wait_for_line(ct, text: str, count: int = 1, timeout: float = 120) -> str:
    """The container's output once `text` is in it `count` times, read as the engine streams it (an event,
    not a poll). The stream ends when the container stops; the docker client reads it without a timeout,
    so a timer closes it after `timeout` seconds (a hang)."""
    seen, want = b"", text.encode()
    stream, timed_out = ct.logs(stream=True, follow=True), threading.Event()
    timer = threading.Timer(timeout, lambda: (timed_out.set(), stream.close()))
    timer.start()
    try:
        for chunk in stream:
            seen += chunk
            if seen.count(want) >= count:
                return seen.decode(errors="replace")
    except Exception:
        if not timed_out.is_set():  # not closed by the timer: a real error
            raise
    finally:
        timer.cancel()
        stream.close()
    raise AssertionError(f"no {text!r} x{count} before the container stopped or {timeout} s passed in:\n"
                         + seen.decode(errors="replace"))


SITE = "/usr/local/lib/python3.11/dist-packages"  # where a pip install in the box puts a package
RECIPE_USER, RECIPE_PASSWORD = "snapuser", "s3cret-Recipe-Pa55"
RECIPE_APP = ("/bin/sh -c 'echo app up; cat /workspace/ComfyUI/custom_nodes/NodeX/nodes.py 2>/dev/null; "
              "echo $$ > /tmp/app.pid; exec sleep 1000'")


@pytest.fixture(scope="session")
def recipe_base(registry, base_ref) -> str:
    """The provider's base, pushed once per worker: the suite's base image plus a Python; each recipe test
    builds the recipe's image on it."""
    if not (shutil.which("busybox") and os.path.exists("/usr/bin/python3.11")
            and os.path.isdir("/usr/share/python-wheels")):
        pytest.skip("needs busybox and Debian 12's python3.11 (with python3-venv's wheels) for the test base image")
    if not have_wheels("setuptools", "typer", "docker", "oras", "zstandard"):
        pytest.skip("no wheels of snap's dependencies in .ci/wheels (run .ci/setup)")
    base = registry.manifest("base", "1")
    layers = [registry.blob("base", d["digest"]) for d in base["layers"]] + [gzip.compress(python_layer(), 1, mtime=0)]
    registry.push_image("pybase", "1", layers, config={"config": {"Cmd": ["/bin/sh"], "Env": [
        "PATH=/usr/local/bin:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE=1", "PIP_NO_INDEX=1", "PIP_FIND_LINKS=/wheels",
        "PIP_DISABLE_PIP_VERSION_CHECK=1"]}})
    return f"{registry.host}/pybase:1"


class Recipe:
    """The container recipe of docs/providers.md for one test: its image (this very Dockerfile and start.sh,
    with the test's names and app) built in the test dockerd and pushed, a password-protected snapshot
    registry (htpasswd over plain http on loopback) behind a FaultProxy that counts what the boxes
    download, and what the test does to boxes and reads of them."""

    def __init__(self, engine, workdir, registry_host: str):
        self.engine, self.workdir = engine, workdir
        self.image = f"{registry_host}/recipe-box-base"  # the pod's image, and the watcher's --base
        self.snaps = RegistryServer(str(workdir / "snapshots"), auth=(RECIPE_USER, RECIPE_PASSWORD)).start()
        self.proxy = FaultProxy(self.snaps.host).start()
        self.box_ref = f"{self.proxy.host}/box:v2"
        self.env = {"SNAP_USERNAME": RECIPE_USER, "SNAP_PASSWORD": RECIPE_PASSWORD}  # the pod's secret env vars only
        self.outputs: list[str] = []  # each container's output, none of which may hold the password

    def build(self, pybase: str, wheel: str) -> None:
        """Build the image and push it (the watcher's --base): a second test on this dockerd builds from cache."""
        dockerfile, script = readme_recipe()
        assert "pip install" in dockerfile and "COPY start.sh" in dockerfile and "CMD" in dockerfile
        assert "snap restore" in script and "snap watch" in script and "SNAP_" not in script  # credentials: env only
        ctx = self.workdir / "context"
        ctx.mkdir()
        shutil.copy(wheel, ctx)  # the wheel `make dist` builds
        (ctx / "Dockerfile").write_text(with_own_base(dockerfile, pybase))
        (ctx / "start.sh").write_text(with_own(script, self.box_ref, f"{self.image}:1", RECIPE_APP))
        self.engine.images.build(path=str(ctx), tag=f"{self.image}:1", network_mode="none", rm=True)
        for event in self.engine.api.push(self.image, tag="1", stream=True, decode=True):
            assert "error" not in event, event

    def stop(self) -> None:
        self.proxy.stop()
        self.snaps.stop()

    def new_box(self, name: str):
        """A new container of the image with a new, empty volume at /workspace (workdir/name), started."""
        volume = self.workdir / name
        volume.mkdir()
        host = self.engine.api.create_host_config(network_mode="host",
                                                  mounts=[docker.types.Mount("/workspace", str(volume), type="bind")])
        # --stop-timeout 5
        created = self.engine.api.create_container(f"{self.image}:1", environment=self.env, host_config=host,
                                                   stop_timeout=5)
        self.engine.api.start(created["Id"])
        return self.engine.containers.get(created["Id"])

    def change(self, ct, command: str) -> None:
        res = ct.exec_run(["/bin/sh", "-c", command])
        assert res.exit_code == 0, res.output

    def stopped(self, ct) -> str:
        """`docker stop -t 5`: its output, in which the watcher's final snapshot ran and ended with 0."""
        ct.stop(timeout=5)
        out = ct.logs().decode(errors="replace")
        self.outputs.append(out)
        assert "signal SIGTERM: final snapshot" in out and "snap watch ended with exit code 0" in out, out
        return out

    def tree(self, ct, name: str) -> dict:
        """The container's files (as the engine exports them) and its volume's, as snapshot_of_tree sees them."""
        export = self.workdir / f"export-{name}"
        _export(ct, export)
        skip = NOT_CAPTURED + ENGINE_FILES + ("workspace", "root/.cache")  # the volume apart; snap's state dir
        return {"rootfs": snapshot_of_tree(str(export), skip=skip),
                "volume": snapshot_of_tree(str(self.workdir / f"volume-{name}"))}

    def tagged(self) -> str:
        r = self.snaps.session().head(f"{self.snaps.url}/v2/box/manifests/v2",
                                      headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        return r.headers.get("Docker-Content-Digest") if r.status_code == 200 else None

    def snap_layers(self) -> list:
        return [d["digest"] for d in self.snaps.manifest("box", "v2")["layers"]]

    def downloads(self, digest: str) -> int:
        """How many times the boxes downloaded this blob whole."""
        return sum(1 for m, path, code in self.proxy.log if m == "GET" and path.endswith(digest) and code == 200)


@pytest.fixture
def recipe(registry, recipe_base, engine, tmp_path_factory, tmp_path):
    r = Recipe(engine, tmp_path, registry.host)
    try:
        r.build(recipe_base, snap_dist(tmp_path_factory)["wheel"])
        yield r
    finally:
        r.stop()


# The two recipe tests are independent (each builds the image: from the build cache when the other built it
# on this dockerd first). Their own xdist group: with --dist loadgroup they share one worker while another
# runs the rest of this file.
@pytest.mark.xdist_group("recipe")
def test_container_recipe_from_the_readme(recipe):
    """The container recipe of docs/providers.md on a new box every time, as in the field: the Dockerfile puts
    snap and start.sh into the image (nothing on the volume), credentials come from SNAP_USERNAME and
    SNAP_PASSWORD, and the cycle is: first start (no snapshot yet), changes (a pip install, a custom node, a
    weight), `docker stop -t 5`, a new container with a new empty volume (the tree byte for byte, the app
    up), a restart with the volume kept (the weight not downloaded again), the app crashing (the watcher's
    final snapshot all the same, the app's exit code). The registry outage at start: the next test."""
    # 1. The first start: no snapshot yet (restore's 5), the watcher makes the first.
    a = recipe.new_box("volume-a")
    out = wait_for_line(a, " moved to it")
    assert "no snapshot of" in out and "app up" in out and "watching '/'" in out, out
    first = recipe.tagged()
    # 2. Changes: a pip install (package and .dist-info), /etc, a weight, a custom node; then the
    # reclaim: the final snapshot (--every 5m: none before it) carries them.
    recipe.change(a, f"mkdir -p {SITE}/tinypkg {SITE}/tinypkg-1.0.dist-info "
                     f"&& echo 'VERSION = 1' > {SITE}/tinypkg/__init__.py "
                     f"&& printf 'Name: tinypkg\nVersion: 1.0\n' > {SITE}/tinypkg-1.0.dist-info/METADATA "
                     f"&& echo pip > {SITE}/tinypkg-1.0.dist-info/INSTALLER && echo 'gpu = 1' > /etc/box.conf")
    a.put_archive("/workspace", tar_of_files({"ComfyUI/models/checkpoints/w.safetensors": os.urandom(4 << 20)},
                                             dirs=("ComfyUI", "ComfyUI/models", "ComfyUI/models/checkpoints")))
    recipe.change(a, "mkdir -p /workspace/ComfyUI/custom_nodes/NodeX "
                     "&& echo 'class X: pass' > /workspace/ComfyUI/custom_nodes/NodeX/nodes.py")
    out = recipe.stopped(a)  # docker stop -t 5
    good, good_layers = recipe.tagged(), recipe.snap_layers()
    assert good != first and "final snapshot v2-" in out, out
    before = recipe.tree(a, "a")
    assert "usr/local/lib/python3.11/dist-packages/tinypkg-1.0.dist-info/METADATA" in before["rootfs"]
    assert "ComfyUI/custom_nodes/NodeX/nodes.py" in before["volume"]
    a.remove()

    # 3. A new box: a new container with a new, empty volume.
    b = recipe.new_box("volume-b")
    wait_for_line(b, "class X: pass")  # what the app prints after "app up": the restored node
    wait_for_line(b, f"restored {recipe.box_ref}@sha256:")  # snap's, in either order with the app's
    out = b.logs().decode(errors="replace")
    assert "app up" in out, out
    assert recipe.tree(b, "b") == before
    weight = next(d["digest"] for d in recipe.snaps.manifest("box", "v2")["layers"]
                  if d.get("annotations", {}).get("dev.snap.layer", "").startswith("models"))
    assert recipe.downloads(weight) == 1

    # 4. The same container restarted, its volume kept: the weight is not downloaded again.
    b.stop(timeout=5)
    assert recipe.snap_layers() == good_layers, b.logs().decode()  # nothing changed since the restore
    # The first start's watcher may not have said it watches before the stop (a loaded machine): this
    # start's is the next one.
    watchers = b.logs().count(b"watching '/'")
    b.start()
    wait_for_line(b, "app up", 2)
    wait_for_line(b, f"restored {recipe.box_ref}@sha256:", 2)  # snap's, in either order with the app's
    recipe.outputs.append(b.logs().decode(errors="replace"))
    assert recipe.downloads(weight) == 1, f"the weight was downloaded again: {recipe.downloads(weight)} downloads"
    # The app crashes (killed): the watcher's final snapshot still runs, and the container ends
    # with the app's code (before, PID 1 exited and the watcher was killed without it).
    wait_for_line(b, "watching '/'", watchers + 1)  # this start's watcher has its signal handlers
    recipe.change(b, "kill $(cat /tmp/app.pid)")
    assert b.wait(timeout=120)["StatusCode"] == 143
    out = b.logs().decode(errors="replace").split("the app ended with exit code 143")
    assert len(out) == 2 and "final snapshot" in out[1] and "snap watch ended with exit code 0" in out[1], out
    b.remove()
    assert all(RECIPE_PASSWORD not in o for o in recipe.outputs)


@pytest.mark.xdist_group("recipe")
def test_container_recipe_from_the_readme_through_a_registry_outage(recipe):
    """The recipe's registry outage at start (the last step of docs/providers.md's cycle, on a box of its own):
    restore's 3, asked again, then the watcher all the same (and the app). Once the registry answers, the
    box, which is not the last one, saves its work to a diverged tag of its own, which holds every file once
    `docker stop -t 5` is over; the tag stays on the good snapshot."""
    first = recipe.new_box("volume-first")  # the first start: its watcher makes the good snapshot
    wait_for_line(first, " moved to it")
    good, good_layers = recipe.tagged(), recipe.snap_layers()
    assert good
    first.remove(force=True)

    recipe.snaps.stop()
    c = recipe.new_box("volume-c")
    wait_for_line(c, "app up")
    # start.sh's lines are its stderr, the app's its stdout: the engine may log the two in either order
    wait_for_line(c, "diverged tag of its own")
    out = c.logs().decode(errors="replace")
    assert out.count("registry unreachable: restoring again") == 3, out
    assert "exit code 3" in out and "not reachable" in out and "TLS" not in out, out
    recipe.snaps.start()
    out = wait_for_line(c, "v2 not moved")  # its first snapshot: to the diverged tag
    [diverged] = diverged_tags(recipe.snaps, "box")
    assert f"box:{diverged}" in out, out
    recipe.change(c, f"mkdir -p {SITE}/outage-1.0.dist-info && echo 'V = 2' > {SITE}/outage.py "
                     f"&& printf 'Name: outage\nVersion: 1.0\n' > {SITE}/outage-1.0.dist-info/METADATA "
                     "&& mkdir -p /workspace/ComfyUI/output && echo made > /workspace/ComfyUI/output/img-1.png")
    recipe.stopped(c)  # docker stop -t 5
    assert recipe.tagged() == good and recipe.snap_layers() == good_layers
    assert diverged_tags(recipe.snaps, "box") == [diverged]
    work = recipe.tree(c, "c")
    got = recipe.workdir / "diverged"
    snap("restore", f"{recipe.snaps.host}/box:{diverged}", "--root", str(got), "--only-snapshot", env=recipe.env,
         check=True)
    for path in (f"{SITE[1:]}/outage.py", f"{SITE[1:]}/outage-1.0.dist-info/METADATA"):
        assert snapshot_of_tree(str(got))[path] == work["rootfs"][path], path
    assert snapshot_of_tree(str(got / "workspace")) == work["volume"]  # every file of the volume
    c.remove()
    assert all(RECIPE_PASSWORD not in o for o in recipe.outputs)
