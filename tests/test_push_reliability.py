"""Commit-side safety: interrupted pushes, a registry that restarts, unreadable files, secrets."""

import json
import os
import signal
import subprocess
import threading

import pytest
import zstandard

from snapshotter.profile import load_profile

from support.faults import FaultProxy
from support.images import push_base_image, snap_layer_files
from support.registry import RegistryServer, digest_of
from support.run import SNAP, snap
from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree

MiB = 1024 * 1024
STALL_AT = 20 * MiB  # bytes of the big blob's upload after which the tests act


def write_big(path, size):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for _ in range(size // (4 * MiB)):
            f.write(os.urandom(4 * MiB))


def start_commit(host, box, tag, base_ref):
    """A commit that retries at once (no backoff waits): these tests stop the registry, and say
    by events when it is back (the proxy's `back`), not by how long the commit waits."""
    return subprocess.Popen([*SNAP, "commit", f"{host}/{tag}", "--base", base_ref,
                             "--root", box, "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SNAP_RETRY_SCALE": "0"})


def stalled_mid_upload(proxy, proc):
    """Wait (on the proxy's event) until the big blob's upload has sent STALL_AT bytes and the link
    stopped there: the test acts mid-upload, at the same point every run."""
    if not proxy.stalled.wait(120):
        proc.kill()
        pytest.fail(f"the upload never reached {STALL_AT} bytes: {proc.communicate()}")


def blob_upload_finished(method, path, status):
    return method == "PUT" and "/blobs/uploads/" in path and "digest=" in path and status == 201


@pytest.fixture
def own_registry(tmp_path, base_rootfs):
    """A registry of this test's own, since the tests stop and restart it."""
    reg = RegistryServer(str(tmp_path / "registry")).start()
    push_base_image(reg, "base", "1", base_rootfs)
    yield reg
    reg.stop()


@pytest.fixture
def stalling_proxy(own_registry):
    """A FaultProxy in front of own_registry whose link stops STALL_AT bytes into an upload's PATCH
    (`stalled` set) until the test sets `release`."""
    proxy = FaultProxy(own_registry.host).start()
    proxy.stall_uploads_after = STALL_AT
    yield proxy
    proxy.release.set()
    if proxy.back:
        proxy.back.set()
    proxy.stop()


@pytest.fixture
def big_box(box):
    """A box with a weight just big enough for a layer of its own (the default profile's
    file_layer_min), whose upload stalls at STALL_AT."""
    size = max(rule.file_layer_min or 0 for rule in load_profile().layers)
    assert size > STALL_AT
    write_big(os.path.join(box, "opt/app/models/checkpoints/big.safetensors"), size)
    return box


def test_killed_push_leaves_no_tag_and_the_next_commit_finishes(own_registry, stalling_proxy, big_box, tmp_path):
    reg, proxy = own_registry, stalling_proxy
    base_ref = f"{proxy.host}/base:1"
    proc = start_commit(proxy.host, big_box, "box:v1", base_ref)
    stalled_mid_upload(proxy, proc)
    # The small layers go up beside the stalled big one: kill once one of them is in.
    assert proxy.wait_for(blob_upload_finished), "no small layer was uploaded beside the big one"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proxy.stall_uploads_after = None  # the next commit goes through
    proxy.release.set()
    # The tag moves last: after a kill there is no half-made image under it.
    r = reg.session().get(f"{reg.url}/v2/box/manifests/v1")
    assert r.status_code == 404

    r = snap("commit", f"{proxy.host}/box:v1", "--base", base_ref, "--root", big_box, "--json", check=True)
    statuses = {layer["name"]: layer["status"] for layer in json.loads(r.stdout)["layers"]}
    big = "models (opt/app/models/checkpoints/big.safetensors)"
    assert statuses[big] == "uploaded"  # the interrupted blob is sent again
    # Small layers finished before the kill: found in the registry, not sent again.
    assert any(s.startswith("exists") for name, s in statuses.items() if name != big), statuses
    out = tmp_path / "out"
    snap("restore", f"{reg.host}/box:v1", "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(big_box, skip=NOT_CAPTURED)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_commit_stopped_once_the_tag_moved_leaves_the_box_its_tag(own_registry, box, sig):
    """Stopped after the registry moved the tag and before snap heard so: the tag names this box's
    snapshot, and the next commit, and a watcher, go on moving it (not refused as another box's)."""
    reg = own_registry
    proxy = FaultProxy(reg.host).start()
    try:
        base_ref, ref = f"{reg.host}/base:1", f"{proxy.host}/stopped:v1"
        snap("commit", ref, "--base", base_ref, "--root", box, check=True)
        first = digest_of(reg, "stopped", "v1")
        write_tree(box, {"opt/app/custom_nodes/NodeA/nodes.py": "class A: changed = True\n"})
        proxy.hold_answer = lambda method, path: method == "PUT" and path.endswith("/manifests/v1")
        proc = subprocess.Popen([*SNAP, "commit", ref, "--base", base_ref, "--root", box],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proxy.holding.wait(120), proc.communicate()
            proc.send_signal(sig)
            proc.communicate(timeout=60)
        finally:
            proc.kill()
            proxy.unhold.set()
        moved = digest_of(reg, "stopped", "v1")
        assert moved != first  # the registry moved the tag; snap was stopped before it heard
        r = snap("commit", f"{reg.host}/stopped:v1", "--base", base_ref, "--root", box)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[-1] == f"nothing changed: {reg.host}/stopped:v1 is current", r.stdout
        assert digest_of(reg, "stopped", "v1") == moved
    finally:
        proxy.stop()


def test_registry_restarted_mid_upload(own_registry, stalling_proxy, big_box, tmp_path):
    reg, proxy = own_registry, stalling_proxy
    proxy.back = threading.Event()  # retries after the first refused one wait for the restart
    proc = start_commit(proxy.host, big_box, "box:v2", f"{proxy.host}/base:1")
    stalled_mid_upload(proxy, proc)
    reg.stop()
    proxy.release.set()  # the upload breaks on the stopped registry
    # Back only once the commit has found it down (a request refused), so it must wait for it.
    assert proxy.wait_for(lambda method, path, status: status == proxy.REFUSED), "the commit never retried"
    reg.start()  # same port, same storage
    proxy.back.set()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    snap("restore", f"{reg.host}/box:v2", "--root", str(tmp_path / "out"), check=True)
    assert snapshot_of_tree(str(tmp_path / "out"), skip=NOT_CAPTURED) == snapshot_of_tree(big_box, skip=NOT_CAPTURED)


def test_registry_down_during_commit_is_a_clear_error(own_registry, stalling_proxy, big_box):
    reg, proxy = own_registry, stalling_proxy
    proc = start_commit(proxy.host, big_box, "box:v3", f"{proxy.host}/base:1")
    stalled_mid_upload(proxy, proc)
    reg.stop()
    proxy.release.set()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("snap: error:")


def test_a_file_snap_may_not_read_is_left_out_and_named_and_the_rest_committed(registry, base_ref, box):
    write_tree(box, {"opt/app/private/data.bin": b"x" * 100, "opt/app/private/dir/inside.txt": b"y",
                     "opt/app/\x1b[31mred.bin": b"z", "opt/app/readable.txt": b"kept"})
    for rel in ("opt/app/private/data.bin", "opt/app/\x1b[31mred.bin"):
        os.chmod(os.path.join(box, rel), 0)
    os.chmod(os.path.join(box, "opt/app/private/dir"), 0)
    # Root reads everything: drop the capabilities that let it ignore permissions.
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search",
           *SNAP, "commit", f"{registry.host}/unreadable:v1", "--base", base_ref, "--root", box]
    if os.geteuid() != 0:
        pytest.skip("needs root to drop root's capabilities")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "may not read" in ln)
    assert "'/opt/app/private/data.bin'" in line and "'/opt/app/private/dir'" in line
    assert "\x1b" not in r.stderr and "'/opt/app/\\x1b[31mred.bin'" in line  # named, escaped
    files = snap_layer_files(registry, "unreadable", "v1")
    assert "opt/app/readable.txt" in files
    # The directory itself is seen (its entry comes from its parent's listing); what it holds is not.
    assert not {"opt/app/private/data.bin", "opt/app/private/dir/inside.txt", "opt/app/\x1b[31mred.bin"} & files.keys()


def _all_layer_bytes(registry, repo, tag):
    m = registry.manifest(repo, tag)
    out = []
    for d in m["layers"][2:]:
        blob = registry.blob(repo, d["digest"])
        if d["mediaType"].endswith("zstd"):
            blob = zstandard.ZstdDecompressor().stream_reader(blob).read()
        out.append(blob)
    return out, registry.blob(repo, m["config"]["digest"])


def test_secrets_are_left_out_and_listed(registry, base_ref, box):
    write_tree(box, {
        "root/.docker/config.json": '{"auths": {"r.example.com": {"auth": "c2VjcmV0LXRva2Vu"}}}',
        "root/.ssh/id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----\nSSH-KEY-MATERIAL\n",
        "root/.aws/credentials": "[default]\naws_secret_access_key = AWS-SECRET-KEY\n",
        "root/.netrc": "machine x login u password NETRC-PASSWORD\n",
        "opt/app/certs/server.pem": "-----BEGIN PRIVATE KEY-----\nPEM-MATERIAL\n",
        "home/ml/.cache/huggingface/token": "hf_HUGGINGFACE-TOKEN\n",
        "etc/ssh/ssh_host_ed25519_key": "-----BEGIN OPENSSH PRIVATE KEY-----\nHOST-KEY-MATERIAL\n",
        "root/.bash_history": "export HF_TOKEN=HISTORY-TOKEN\n",
        "opt/app/keep.txt": "kept\n",
    })
    r = snap("commit", f"{registry.host}/secrets:v1", "--base", base_ref, "--root", box, check=True)
    for p in ("/root/.docker", "/root/.ssh", "/root/.aws", "/root/.netrc", "/opt/app/certs/server.pem",
              "/home/ml/.cache/huggingface/token", "/etc/ssh/ssh_host_ed25519_key", "/root/.bash_history"):
        assert f"  {p!r}" in r.stderr, r.stderr
    layers, config = _all_layer_bytes(registry, "secrets", "v1")
    everything = b"".join(layers) + config
    for needle in (b"c2VjcmV0LXRva2Vu", b"SSH-KEY-MATERIAL", b"AWS-SECRET-KEY", b"NETRC-PASSWORD", b"PEM-MATERIAL",
                   b"HUGGINGFACE-TOKEN", b"HOST-KEY-MATERIAL", b"HISTORY-TOKEN"):
        assert needle not in everything
    assert b"kept\n" in everything  # the comparison can see layer contents at all

    # A profile can opt in.
    prof = os.path.join(box, "..", "with-secrets.yaml")
    with open(prof, "w") as f:
        f.write("extends: default\ninclude_secrets: true\n")
    snap("commit", f"{registry.host}/secrets:v2", "--base", base_ref, "--root", box, "--profile", prof, check=True)
    layers, _ = _all_layer_bytes(registry, "secrets", "v2")
    assert any(b"SSH-KEY-MATERIAL" in layer for layer in layers)


def test_password_never_printed_nor_stored(tmp_path, base_rootfs, box):
    user, password = "alice", "Very-Secret-Password-42"
    reg = RegistryServer(str(tmp_path / "authreg"), auth=(user, password)).start()
    try:
        push_base_image(reg, "base", "1", base_rootfs)
        r = snap("commit", f"{reg.host}/box:v1", "--base", f"{reg.host}/base:1", "--root", box, "-u", user,
                 "--password-stdin", input=password, check=True)
        assert password not in r.stdout + r.stderr
        layers, config = _all_layer_bytes(reg, "box", "v1")
        manifest = json.dumps(reg.manifest("box", "v1")).encode()
        for blob in layers + [config, manifest]:
            assert password.encode() not in blob
        state = os.environ["SNAP_STATE_DIR"]
        for dirpath, _, files in os.walk(state):
            for name in files:
                with open(os.path.join(dirpath, name), "rb") as f:
                    assert password.encode() not in f.read()
    finally:
        reg.stop()


# ---- a blob the tag's snapshot lists, lost by the registry ------------------------------------------

def _lose_blob(registry, repo: str, digest: str) -> str:
    """Delete a blob's data from the registry's storage, as damage or a hand would: the registry
    answers 404 for it, though the tag's manifest lists it."""
    hexd = digest.split(":", 1)[1]
    os.unlink(os.path.join(registry.storage, "docker/registry/v2/blobs/sha256", hexd[:2], hexd, "data"))
    assert not registry.has_blob(repo, digest)
    return digest


def _lose_layer(registry, repo: str, tag: str, layer: str) -> str:
    """_lose_blob of the snapshot's `layer` (its dev.snap.layer name)."""
    return _lose_blob(registry, repo, next(d["digest"] for d in registry.manifest(repo, tag)["layers"]
                                           if d.get("annotations", {}).get("dev.snap.layer") == layer))


def test_a_layer_blob_the_registry_lost_is_sent_again_by_the_next_commit(registry, base_ref, box, tmp_path):
    ref = f"{registry.host}/lostblob:v1"
    snap("commit", ref, "--base", base_ref, "--root", box, check=True)
    lost = _lose_layer(registry, "lostblob", "v1", "models")
    write_tree(box, {"opt/app/custom_nodes/NodeA/nodes.py": "class A: changed = True\n"})
    # The manifest PUT is refused (MANIFEST_BLOB_UNKNOWN): the commit looks again, sends the lost blob.
    r = snap("commit", ref, "--base", base_ref, "--root", box)
    assert r.returncode == 0, r.stderr
    assert registry.has_blob("lostblob", lost)
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_a_rehash_commit_of_an_unchanged_box_sends_a_lost_blob_again(registry, base_ref, box):
    ref = f"{registry.host}/lostrehash:v1"
    snap("commit", ref, "--base", base_ref, "--root", box, check=True)
    lost = [_lose_layer(registry, "lostrehash", "v1", "models"),
            _lose_blob(registry, "lostrehash", registry.manifest("lostrehash", "v1")["config"]["digest"])]
    # --rehash trusts no cache, the tag's manifest included: every blob is looked up, the lost ones sent.
    r = snap("commit", ref, "--base", base_ref, "--root", box, "--rehash", check=True)
    assert r.stdout.splitlines()[-1] == f"nothing changed: {ref} is current", r.stdout
    assert all(registry.has_blob("lostrehash", digest) for digest in lost)


def test_a_lost_base_layer_the_box_cannot_send_again_is_one_line_exit_10(own_registry, box):
    reg = own_registry
    ref = f"{reg.host}/base:snap"  # the base's own repository: its layers are not copied in, nor held here
    snap("commit", ref, "--base", f"{reg.host}/base:1", "--root", box, check=True)
    digest = _lose_blob(reg, "base", reg.manifest("base", "1")["layers"][0]["digest"])
    write_tree(box, {"opt/app/custom_nodes/NodeA/nodes.py": "class A: changed = True\n"})
    r = snap("commit", ref, "--base", f"{reg.host}/base:1", "--root", box)
    assert r.returncode == 10, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("snap: error:")]
    assert f"layer 1 of the base image {reg.host}/base:1 ({digest}) is missing" in line, r.stderr
    assert "Traceback" not in r.stderr
