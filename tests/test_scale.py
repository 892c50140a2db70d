"""A new box at scale: blobs mounted from repositories known to hold them instead of uploaded
again, one snap process per state dir, leftovers of killed runs swept, cached blobs checked."""

import fcntl
import gzip
import hashlib
import io
import json
import os
import signal
import subprocess
import time

import pytest

from snapshotter import CommitOptions, commit_box
from snapshotter.commit import push as push_module
from snapshotter.index.indexer import apply_layer_to_index
from snapshotter.index.store import load_index
from snapshotter.state import sub

from support.images import snap_layer_files
from support.run import SNAP, snap
from support.tars import member, tar_bytes
from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree

MiB = 1024 * 1024
STAGING_PREFIX = ".snap-staging-"  # a restore's downloads, at the top of its root


@pytest.fixture
def weight_box(box, monkeypatch):
    write_tree(box, {"opt/app/models/checkpoints/big.safetensors": os.urandom(70 * MiB)})  # a layer of its own
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)  # the box's files are trusted to the stat cache
    return box


def test_a_weight_already_in_the_registry_is_mounted_not_uploaded(registry, proxy, base_ref, weight_box):
    first = commit_box(f"{proxy.host}/mount-a:v1", base_ref, CommitOptions(root=weight_box))
    assert proxy.upload_bytes() > 70 * MiB
    sent_before = proxy.upload_bytes()

    second = commit_box(f"{proxy.host}/mount-b:v1", base_ref, CommitOptions(root=weight_box))
    manifest = registry.manifest("mount-b", "v1")
    # Only the new config went up: every layer, the weight and the base's included, was mounted.
    assert proxy.upload_bytes() - sent_before == manifest["config"]["size"]
    assert {layer.status for layer in second.layers} == {"mounted from mount-a (unchanged, not read)"}
    assert [layer.digest for layer in second.layers] == [layer.digest for layer in first.layers]
    for d in manifest["layers"]:
        assert registry.has_blob("mount-b", d["digest"])
    mounts = [path for method, path, status in proxy.log if method == "POST" and "mount=" in path and status == 201]
    headers = {d["annotations"]["dev.snap.headers"] for d in manifest["layers"]
               if "dev.snap.headers" in d.get("annotations", {})}
    # and the base's config, the base index, its empty config, and the snap layers' headers blobs
    assert headers and len(mounts) == len(manifest["layers"]) + 3 + len(headers)


def test_blobs_of_a_restore_are_mounted_by_the_next_commit_elsewhere(registry, proxy, base_ref, weight_box, tmp_path):
    commit_box(f"{registry.host}/mount-src:v1", base_ref, CommitOptions(root=weight_box))
    state = tmp_path / "new-machine-state"  # a new machine: only the restore taught it anything
    env = {"SNAP_STATE_DIR": str(state)}
    out = tmp_path / "out"
    snap("restore", f"{proxy.host}/mount-src:v1", "--root", str(out), env=env, check=True)
    sent_before = proxy.upload_bytes()
    r = snap("commit", f"{proxy.host}/mount-dst:v1", "--base", base_ref, "--root", str(out), "--json", env=env,
             check=True)
    layers = json.loads(r.stdout)["layers"]
    assert all(layer["status"].startswith("mounted from mount-src") for layer in layers), layers
    # Sent: the new config, and the base's (the restore saw only the snapshot's own config).
    configs = registry.manifest("mount-dst", "v1")["config"]["size"] + registry.manifest("base", "1")["config"]["size"]
    assert proxy.upload_bytes() - sent_before == configs


def test_a_second_snap_process_waits_for_the_first(registry, base_ref, box, state_dir):
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first process, mid-run
        held.write("4242\n")
        held.flush()
        proc = subprocess.Popen([*SNAP, "commit", f"{registry.host}/locked:v1",
                                 "--base", base_ref, "--root", box], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            line = proc.stderr.readline()  # returns when it says it waits (or when it ends: then it did not wait)
            assert "waiting for another snap process (pid 4242)" in line, line
            assert proc.poll() is None
            assert not registry.session().get(f"{registry.url}/v2/locked/tags/list").ok  # nothing pushed yet
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert registry.manifest("locked", "v1")


def test_leftovers_of_killed_runs_are_swept_and_cached_blobs_checked(registry, proxy, base_ref, box, state_dir):
    base = registry.manifest("base", "1")
    layer = base["layers"][0]["digest"]
    sub()  # snap's own state dir (marked): what else a user keeps in it stays
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftovers = [state_dir / "layers" / ".building-venv-123-456", state_dir / "blobs" / "0123abcd.part",
                 state_dir / "stat-cache" / f"x.json.tmp.{dead.pid}.1"]
    # A temp file of a process still running (a watcher writing its exit code, without the state
    # lock) is its own: a commit that takes the lock leaves it alone.
    writer = subprocess.Popen(["sleep", "600"])
    live = state_dir / "watch" / f"0123.exit.tmp.{writer.pid}.1"
    live.parent.mkdir(parents=True, exist_ok=True)
    live.write_bytes(b"being written")
    for p in leftovers:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half-made")
    # a killed build's layer, no longer written (one written in the last minute may be a live build's)
    os.utime(leftovers[0], (time.time() - 3600,) * 2)
    (state_dir / "blobs" / "deadbeef.split.part").mkdir()
    keep = state_dir / "keep.json"
    keep.write_text("{}")
    # A blob a killed run left in the cache, damaged: it is checked, found bad, and fetched again.
    cached = state_dir / "blobs" / layer.split(":", 1)[1]
    cached.write_bytes(b"not the layer")
    # The target is another registry (by name) than the base's: base layers are copied through the cache.
    commit_box(f"{proxy.host}/swept:v1", base_ref, CommitOptions(root=box))
    for p in leftovers + [state_dir / "blobs" / "deadbeef.split.part"]:
        assert not p.exists(), p
    assert keep.exists() and live.exists()
    writer.kill()
    writer.wait()
    assert hashlib.sha256(registry.blob("swept", layer)).hexdigest() == layer.split(":", 1)[1]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_during_an_upload_does_not_wait_for_it(registry, proxy, base_ref, weight_box, sig, code):
    """The link stalls in the middle of the weight's upload; Ctrl-C or SIGTERM stops the commit
    there (it would otherwise wait for the upload, here for ever), and the tag never moves."""
    proxy.stall_uploads_after = 8 * MiB
    proc = subprocess.Popen([*SNAP, "commit", f"{proxy.host}/stopped:v1", "--base", base_ref,
                             "--root", weight_box], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proxy.stalled.wait(120), "the upload never got going"
        proc.send_signal(sig)
        try:
            _, err = proc.communicate(timeout=60)  # a generous bound, only to fail instead of hanging
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("the commit waited for the stalled upload")
    finally:
        proxy.release.set()
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1].startswith("snap: " + ("interrupted" if code == 130 else "terminated")), err
    assert "Traceback" not in err
    assert not registry.session().get(f"{registry.url}/v2/stopped/manifests/v1").ok


def base_layer_gets(proxy, base_manifest, since):
    digests = {d["digest"] for d in base_manifest["layers"]}
    return [p for m, p, s in proxy.log[since:] if m == "GET" and "/blobs/" in p and p.rsplit("/", 1)[-1] in digests]


def test_the_base_index_travels_with_the_snapshot(registry, proxy, base_ref, box, tmp_path, monkeypatch):
    base = f"{proxy.host}/base:1"  # read through the proxy: its GETs are counted
    base_manifest = registry.manifest("base", "1")
    first = commit_box(f"{proxy.host}/travel:v1", base, CommitOptions(root=box))
    assert len(base_layer_gets(proxy, base_manifest, 0)) == len(base_manifest["layers"])  # indexed from the layers
    index_digest = registry.manifest("travel", "v1")["annotations"]["dev.snap.base-index"]
    assert registry.has_blob("travel", index_digest)
    artifact = registry.manifest("travel", "snap-index-" + base_manifest_digest(registry).replace(":", "-"))
    assert [d["digest"] for d in artifact["layers"]] == [index_digest]  # a descriptor keeps it from GC

    # A new machine: an empty state dir. The commit fetches the index instead of the base's layers.
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "new-machine"))
    since = len(proxy.log)
    second = commit_box(f"{proxy.host}/travel:v2", base, CommitOptions(root=box))
    assert base_layer_gets(proxy, base_manifest, since) == []
    assert [layer.digest for layer in second.layers] == [layer.digest for layer in first.layers]

    # Another new machine restores the snapshot: the index comes with it, and its commit reads no base layer.
    env = {"SNAP_STATE_DIR": str(tmp_path / "restored-machine")}
    monkeypatch.setenv("SNAP_STATE_DIR", env["SNAP_STATE_DIR"])
    out = tmp_path / "out"
    snap("restore", f"{proxy.host}/travel:v1", "--root", str(out), env=env, check=True)
    since = len(proxy.log)
    commit_box(f"{proxy.host}/elsewhere:v1", base, CommitOptions(root=str(out)))
    assert base_layer_gets(proxy, base_manifest, since) == []


def base_index_of(registry, repo, manifest):
    """The index of an image as a commit builds it (index/indexer.py's apply_layer_to_index over its layers,
    read from the registry)."""
    index = {}
    for d in manifest["layers"]:
        blob = registry.blob(repo, d["digest"])
        apply_layer_to_index(index, io.BytesIO(gzip.decompress(blob) if d["mediaType"].endswith("gzip") else blob))
    return index


def assert_same_index(built, old):
    assert built is not None and sorted(built) == sorted(old)
    for rel, e in old.items():
        assert built[rel] == e, rel


def test_a_full_restore_indexes_the_base_it_applies(registry, proxy, base_ref, box, tmp_path, monkeypatch, state_dir):
    """A snapshot that carries no base index (an older snap's, or one whose index push failed): the
    full restore indexes the base layers as it applies them, and the first commit on that machine
    reads none of them again."""
    base = f"{proxy.host}/base:1"
    base_manifest = registry.manifest("base", "1")
    base_digest = base_manifest_digest(registry)
    first = commit_box(f"{registry.host}/bare:v1", base_ref, CommitOptions(root=box))
    manifest = registry.manifest("bare", "v1")
    del manifest["annotations"]["dev.snap.base-index"]
    registry.session().put(f"{registry.url}/v2/bare/manifests/v2", data=json.dumps(manifest).encode(),
                           headers={"Content-Type": manifest["mediaType"]}).raise_for_status()

    env = {"SNAP_STATE_DIR": str(tmp_path / "restored-machine")}
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/bare:v2", "--root", str(out), env=env, check=True)
    cache = tmp_path / "restored-machine/base-index" / (base_digest.split(":")[1] + ".built.jsonl.gz")
    built = load_index(str(cache))
    # Entry by entry what the commit built from the registry (the cache of the first commit).
    old = load_index(str(state_dir / "base-index" / cache.name))
    assert old == base_index_of(registry, "base", base_manifest)
    assert_same_index(built, old)

    monkeypatch.setenv("SNAP_STATE_DIR", env["SNAP_STATE_DIR"])
    since = len(proxy.log)
    second = commit_box(f"{proxy.host}/after:v1", base, CommitOptions(root=str(out)))
    assert base_layer_gets(proxy, base_manifest, since) == []
    assert [layer.digest for layer in second.layers] == [layer.digest for layer in first.layers]


def test_a_full_restore_of_a_plain_image_indexes_it(registry, proxy, tmp_path, monkeypatch):
    """A plain (not snap's) image restored whole is its own base: its index, built as its layers are
    applied (uncompressed layers here, whose big files are renamed into place, not copied), is what
    a commit builds from the registry: whiteouts, opaque directories, a file over a lower tree, a
    path below a symlink, hardlinks across layers, paths the restore never writes (/tmp, /etc/hostname)."""
    big = os.urandom(3 * MiB)  # over staging.STAGE_MIN: a content file of its own, taken
    layers = [
        tar_bytes(member("etc/", "dir"), member("etc/hostname", data=b"base-host\n"),
                  member("tmp/", "dir", mode=0o1777),
                  member("tmp/scratch", data=b"x" * 100), member("real/", "dir"), member("real/a", data=b"a"),
                  member("link", "symlink", linkname="real"), member("gone/", "dir"), member("gone/f", data=b"f"),
                  member("opaque/", "dir"), member("opaque/old", data=b"old"), member("tree/", "dir"),
                  member("tree/deep/", "dir"), member("tree/deep/x", data=b"x"), member("data/", "dir"),
                  member("data/big.bin", data=big), member("data/small", data=b"s" * 5000, mode=0o600)),
        tar_bytes(member(".wh.gone"), member("opaque/.wh..wh..opq"), member("opaque/new", data=b"new"),
                  member("tree", data=b"now a file"), member("link/b", data=b"through the link"),
                  member("data/big.link", "hardlink", linkname="data/big.bin"),
                  member("data/big2.bin", data=big[::-1]), member("tmp/later", data=b"later")),
    ]
    registry.push_image("plain", "1", layers, layer_media_type="application/vnd.oci.image.layer.v1.tar")
    image_digest = base_manifest_digest(registry, "plain")
    env = {"SNAP_STATE_DIR": str(tmp_path / "restored-machine")}
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/plain:1", "--root", str(out), env=env, check=True)
    assert (out / "real/b").read_bytes() == b"through the link" and not (out / "tmp/scratch").exists()
    built = load_index(str(tmp_path / "restored-machine/base-index" / (image_digest.split(":")[1] + ".built.jsonl.gz")))
    old = base_index_of(registry, "plain", registry.manifest("plain", "1"))
    assert_same_index(built, old)
    assert built["data/big.link"].digest == built["data/big.bin"].digest == "sha256:" + hashlib.sha256(big).hexdigest()
    assert built["tmp/scratch"].digest == "sha256:" + hashlib.sha256(b"x" * 100).hexdigest()  # indexed, not written
    assert "gone/f" not in built and "opaque/old" not in built and "tree/deep/x" not in built

    monkeypatch.setenv("SNAP_STATE_DIR", env["SNAP_STATE_DIR"])
    manifest = registry.manifest("plain", "1")
    since = len(proxy.log)
    commit_box(f"{proxy.host}/plain-box:v1", f"{proxy.host}/plain:1", CommitOptions(root=str(out)))
    assert base_layer_gets(proxy, manifest, since) == []


def test_an_image_that_names_a_base_it_does_not_hold_leaves_no_index_for_that_base(registry, proxy, base_ref, box,
                                                                                  tmp_path, monkeypatch):
    """A hostile (or broken) snapshot names base:1 but ships other base layers: its full restore
    indexes what it applied, and the next commit on base:1 must not diff against that index (it
    would leave out every file the wrong index claims unchanged): it reads base:1's own layers."""
    registry.push_image("otherbase", "1",
                        [tar_bytes(member("etc/", "dir"), member("etc/os-release", data=b"ID=other\n"))],
                        layer_media_type="application/vnd.oci.image.layer.v1.tar")
    commit_box(f"{registry.host}/liar:v1", f"{registry.host}/otherbase:1", CommitOptions(root=box))
    manifest = registry.manifest("liar", "v1")
    del manifest["annotations"]["dev.snap.base-index"]
    manifest["annotations"]["org.opencontainers.image.base.digest"] = base_manifest_digest(registry)  # base:1's
    registry.session().put(f"{registry.url}/v2/liar/manifests/v2", data=json.dumps(manifest).encode(),
                           headers={"Content-Type": manifest["mediaType"]}).raise_for_status()
    env = {"SNAP_STATE_DIR": str(tmp_path / "restored-machine")}
    snap("restore", f"{registry.host}/liar:v2", "--root", str(tmp_path / "out"), env=env, check=True)

    monkeypatch.setenv("SNAP_STATE_DIR", env["SNAP_STATE_DIR"])
    base_manifest = registry.manifest("base", "1")
    since = len(proxy.log)
    result = commit_box(f"{proxy.host}/honest:v1", f"{proxy.host}/base:1", CommitOptions(root=box))
    assert base_layer_gets(proxy, base_manifest, since) != []  # the claimed index was not trusted
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "clean-machine"))
    expected = commit_box(f"{registry.host}/fresh:v1", base_ref, CommitOptions(root=box))
    assert [layer.digest for layer in result.layers] == [layer.digest for layer in expected.layers]


def base_manifest_digest(registry, repo="base", tag="1"):
    r = registry.session().get(f"{registry.url}/v2/{repo}/manifests/{tag}",
                               headers={"Accept": "application/vnd.oci.image.manifest.v1+json, "
                                                  "application/vnd.docker.distribution.manifest.v2+json"})
    return "sha256:" + hashlib.sha256(r.content).hexdigest()


@pytest.fixture
def small_tmpfs(tmp_path, tmpfs):
    """A 64 MiB tmpfs (root only, 0700: it is a state dir), unmounted afterwards."""
    d = tmpfs(tmp_path / "small-tmpfs", "64m")
    d.chmod(0o700)
    return d
    subprocess.run(["umount", "-l", str(d)], check=True)


def test_a_restore_stages_nothing_on_the_state_disk(registry, base_ref, box, tmp_path, small_tmpfs):
    """A weight bigger than the state dir's whole disk: downloaded beside its destination, on the
    target's disk, and renamed into place; the root keeps no staging dir, and a commit of a root
    where one was left behind does not capture it."""
    weight = os.urandom(100 * MiB)
    write_tree(box, {"opt/app/models/checkpoints/huge.safetensors": weight})
    commit_box(f"{registry.host}/huge:v1", base_ref, CommitOptions(root=box))
    out = tmp_path / "out"  # on the test's disk, not the tmpfs
    env = {"SNAP_STATE_DIR": str(small_tmpfs)}
    r = snap("restore", f"{registry.host}/huge:v1", "--root", str(out), env=env)
    assert r.returncode == 0, r.stderr
    assert (out / "opt/app/models/checkpoints/huge.safetensors").read_bytes() == weight
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    assert not [n for n in os.listdir(out) if n.startswith(STAGING_PREFIX)]
    # journals and small blobs only
    assert sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(small_tmpfs) for f in fs) < 4 * MiB

    left = out / (STAGING_PREFIX + "0123456789abcdef")  # as a stopped restore leaves it
    write_tree(str(left), {"0123.part": b"half a blob"})
    snap("commit", f"{registry.host}/huge:v2", "--base", base_ref, "--root", str(out), env=env, check=True)
    assert not [n for n in snap_layer_files(registry, "huge", "v2") if STAGING_PREFIX in n]
