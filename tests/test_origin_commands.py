"""Weights from the origin through the commands (docs/weights-from-origin.md): `snap commit
--weights-from-origin` of a box whose hub cache the real huggingface_hub client made (against
tests/support/hub.py, a loopback hub and CDN) pushes none of the weights' bytes nor the token file,
and `snap restore` fetches them back from the origin into the box's hub cache, byte for byte; a
failure of the origin is one line and loses nothing else, and a rerun (after kill -9 too) fetches
only what is missing; `--upload-origin` makes the snapshot self-contained."""

import dataclasses
import glob
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import threading

import pytest
import zstandard

from snapshotter.commit import push as push_module
from snapshotter.commit import sender as sender_module
from snapshotter.errors import SnapError
from snapshotter.commit.model import CommitOptions
from snapshotter.profile import load_profile
from snapshotter.watch.watcher import Watcher, WatchOptions

from support.engine import Dockerd, engine_api
from support.faults import HostileServer
from support.ocicrypt import make_keys
from support.registry import digest_of
from support.hub import HubServer, Repo, hub_download, sha256_hex
from support.run import SNAP, TIMEOUT, assert_one_line_error, free_port, snap
from support.trees import NOT_CAPTURED, SMALL_WEIGHTS, make_box, snapshot_of_tree
from support.watch import FakeClock

pytest.importorskip("huggingface_hub")

C_MODEL, C_DATA, C_GATED = (f"{i:x}" * 40 for i in (10, 11, 13))
TOKEN = "hf_gated_commands_token"
BIG = 2 * (1 << 20) + 77  # over fetch's 1 MiB chunk: a paused fetch leaves a part to resume
WEIGHTS = random.Random(1).randbytes(BIG)
REPOS = {
    ("model", "acme/tiny"): Repo(C_MODEL, {"config.json": b'{"hidden": 8}\n', "model.safetensors": WEIGHTS,
                                           "sub/extra.bin": random.Random(2).randbytes(5000)}, {"main": C_MODEL}),
    ("dataset", "acme/corpus"): Repo(C_DATA, {"data/train.parquet": random.Random(3).randbytes(20000)}),
    ("model", "acme/gated"): Repo(C_GATED, {"w.bin": random.Random(5).randbytes(4000)}, {"main": C_GATED}, token=TOKEN),
}
DOWNLOADS = [("model", "acme/tiny", "main", f, None) for f in ("config.json", "model.safetensors", "sub/extra.bin")]
DOWNLOADS += [("dataset", "acme/corpus", C_DATA, "data/train.parquet", None), ("model", "acme/gated", "main", "w.bin",
                                                                                 TOKEN)]
HF_HOME = "root/.cache/huggingface"
CACHE = f"{HF_HOME}/hub"
TOKEN_PATH = "opt/hf/token"  # the box's HF_TOKEN_PATH, out of the default secret rules' sight
LFS = {sha256_hex(d) for r in REPOS.values() for d in r.files.values() if len(d) >= 1024}
BIG_SHA = sha256_hex(WEIGHTS)
GATED_SHA = sha256_hex(REPOS[("model", "acme/gated")].files["w.bin"])


@pytest.fixture(scope="module")
def hub():
    with HubServer(REPOS) as server:
        yield server


@pytest.fixture(scope="module")
def origin_box(hub, base_rootfs, tmp_path_factory):
    """A box started from the base, with a hub cache the hub client made and a token file at HF_TOKEN_PATH."""
    root = make_box(base_rootfs, str(tmp_path_factory.mktemp("obox") / "box"))
    os.makedirs(os.path.join(root, CACHE))
    os.makedirs(os.path.join(root, os.path.dirname(TOKEN_PATH)))
    with open(os.path.join(root, TOKEN_PATH), "w") as f:
        f.write(TOKEN)
    hub_download(hub.url, os.path.join(root, HF_HOME), DOWNLOADS)
    for folder, dirs, files in os.walk(os.path.join(root, HF_HOME), topdown=False):  # times a restore cannot fake
        for name in dirs + files + ["."]:
            os.utime(os.path.join(folder, name), (1_600_000_000, 1_600_000_000), follow_symlinks=False)
    return root


def commit_env(hub) -> dict:
    return {"HF_ENDPOINT": hub.url, "HF_TOKEN_PATH": "/" + TOKEN_PATH}


@pytest.fixture(scope="module")
def committed(registry, base_ref, origin_box, hub, tmp_path_factory):
    """The box committed with --weights-from-origin (its own state dir): (ref, commit JSON, state dir)."""
    ref = f"{registry.host}/origin-box:v1"
    state = str(tmp_path_factory.mktemp("ostate"))
    r = snap("commit", ref, "--base", base_ref, "--root", origin_box, "--json", "--weights-from-origin",
             env={**commit_env(hub), "SNAP_STATE_DIR": state}, check=True)
    return ref, json.loads(r.stdout), state


def registry_bytes(registry, repo: str):
    """Every blob the registry holds for `repo`, zstd layers decompressed: what it could give anyone."""
    yield from registry_blobs(registry, repo).values()


def registry_blobs(registry, repo: str) -> dict:
    """registry_bytes by digest."""
    found = {}
    v2 = os.path.join(registry.storage, "docker/registry/v2")
    for folder, _, files in os.walk(os.path.join(v2, "repositories", repo, "_layers")):
        if "link" in files:
            digest = open(os.path.join(folder, "link")).read().partition(":")[2]
            with open(os.path.join(v2, "blobs/sha256", digest[:2], digest, "data"), "rb") as f:
                data = f.read()
            if data[:4] == b"\x28\xb5\x2f\xfd":
                data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
            found[digest] = data
    return found


def assert_holds_no_weights(registry, repo: str) -> None:
    seen = 0
    for data in registry_bytes(registry, repo):
        seen += 1
        assert WEIGHTS[BIG // 2:BIG // 2 + 4096] not in data
        assert TOKEN.encode() not in data
    assert seen > 3  # the comparison saw the repository's blobs


def restore(ref: str, root: str, hub, *args: str, **env) -> subprocess.CompletedProcess:
    return snap("restore", ref, "--root", root, *args, env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, **env})


def cache_tree(root: str) -> dict:
    return {p: v for p, v in snapshot_of_tree(root, skip=NOT_CAPTURED).items() if p.startswith(CACHE)}


def cdn_seen(hub) -> list:
    return [s for s in hub.seen_all if s.server == "cdn"]


def present_blobs(root: str) -> set:
    repos = os.listdir(os.path.join(root, CACHE))
    return {sha for sha in LFS for repo in repos if os.path.exists(blob(root, repo, sha))}


def blob(root: str, repo: str, sha: str) -> str:
    return os.path.join(root, CACHE, repo, "blobs", sha)


def test_commit_pushes_references_not_the_weights_nor_the_token(committed, registry, hub):
    ref, result, _ = committed
    assert result["references"] == len(LFS) and result["reference_bytes"] == sum(
        len(d) for r in REPOS.values() for d in r.files.values() if len(d) >= 1024)
    assert TOKEN_PATH in result["skipped_secrets"]
    manifest = registry.manifest("origin-box", "v1")
    note = json.loads(manifest["annotations"]["dev.snap.origin-references"])
    assert note["files"] == len(LFS)
    assert all(layer["digest"] != note["digest"] for layer in manifest["layers"])  # never a layer to apply
    doc = json.loads(registry.blob("origin-box", note["digest"]))
    assert {r["sha256"] for r in doc["references"]} == LFS
    assert_holds_no_weights(registry, "origin-box")


def test_the_boxs_hub_token_files_are_left_out_without_the_flag_too(registry, base_ref, origin_box, hub):
    ref = f"{registry.host}/origin-plain:v1"
    result = json.loads(snap("commit", ref, "--base", base_ref, "--root", origin_box, "--json",
                             env=commit_env(hub), check=True).stdout)
    assert TOKEN_PATH in result["skipped_secrets"] and not result.get("references")
    assert not any(TOKEN.encode() in data for data in registry_bytes(registry, "origin-plain"))


def test_an_encrypted_snapshot_keeps_the_hub_weights_in_its_encrypted_layers(registry, base_ref, origin_box, hub,
                                                                            tmp_path, state_dir):
    """References would name the repositories and files in clear beside encrypted layers: with
    --encrypt-to the weights go into the encrypted layers (said in one line), no references blob is
    pushed, the token file stays out, and a restore with the key needs no origin."""
    make_keys(tmp_path)
    ref = f"{registry.host}/origin-enc:v1"
    r = snap("commit", ref, "--base", base_ref, "--root", origin_box, "--json", "--weights-from-origin",
             "--encrypt-to", str(tmp_path / "rsa.pub"), env=commit_env(hub), check=True)
    assert "kept in the encrypted layers" in r.stderr
    assert json.loads(r.stdout)["origin_uploaded"] == len(LFS)
    assert "dev.snap.origin-references" not in json.dumps(registry.manifest("origin-enc", "v1"))
    for data in registry_bytes(registry, "origin-enc"):
        assert b"acme/tiny" not in data and b"model.safetensors" not in data and TOKEN.encode() not in data
        assert WEIGHTS[BIG // 2:BIG // 2 + 4096] not in data
    out = str(tmp_path / "restored")
    r = restore(ref, out, hub, "--decryption-key", str(tmp_path / "rsa.pem"), HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 0, r.stderr
    assert cache_tree(out) == cache_tree(origin_box)
    assert not os.path.lexists(os.path.join(out, TOKEN_PATH))


def test_restore_fetches_the_weights_into_the_boxs_hub_cache(committed, origin_box, hub, tmp_path):
    ref = committed[0]
    out = str(tmp_path / "restored")
    r = restore(ref, out, hub)
    assert r.returncode == 0, r.stderr
    assert f"weights from the origin: {len(LFS)} file(s) fetched" in r.stdout
    assert cache_tree(out) == cache_tree(origin_box)
    assert not os.path.lexists(os.path.join(out, TOKEN_PATH))
    cdn = [s for s in cdn_seen(hub) if s.method == "GET"]
    assert all("authorization" not in s.headers for s in cdn)  # the token goes to the hub, never its CDN
    # verify checks the fetched weights as the image's files: none is extra, and one overwritten is found.
    strict = snap("verify", ref, "--root", out, "--strict")
    assert strict.returncode == 0, strict.stdout + strict.stderr
    weights = blob(out, "models--acme--tiny", BIG_SHA)
    with open(weights, "r+b") as f:
        f.write(b"\0" * 16)
    r = snap("verify", ref, "--root", out)
    assert r.returncode == 9 and f"{weights[len(out):]}: content differs" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("fault, code, words", [
    ("unreachable", 3, ["cannot reach the origin for '", f"{len(LFS) - 1} more failed"]),
    ("corrupt", 6, ["model.safetensors", "does not hash"]),
    ("missing", 5, ["model.safetensors", "HTTP 404"]),
    ("no token", 4, ["w.bin", "HTTP 401"]),
])
def test_an_origin_failure_is_one_line_and_loses_nothing_else(committed, origin_box, hub, tmp_path, fault, code,
                                                               words):
    ref = committed[0]
    out = str(tmp_path / "restored")
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"} if fault == "unreachable" else {}
    env.update({"HF_TOKEN": ""} if fault == "no token" else {})
    if fault == "corrupt":
        hub.cdn.corrupt.add(BIG_SHA)
    if fault == "missing":
        hub.redirect_to[BIG_SHA] = f"{hub.cdn.url}/blobs/{'0' * 64}"
    try:
        r = restore(ref, out, hub, **env)
    finally:
        hub.cdn.corrupt.clear()
        hub.redirect_to.clear()
    assert_one_line_error(r, code, *words)
    assert repr(env.get("HF_ENDPOINT", hub.url)) in r.stderr  # the origin named
    assert os.path.exists(os.path.join(out, "opt/app/models/checkpoints/sd15.safetensors"))  # the layers are in
    assert os.path.islink(os.path.join(out, CACHE, "models--acme--tiny/snapshots", C_MODEL, "model.safetensors"))
    failed = blob(out, "models--acme--tiny", BIG_SHA) if fault != "no token" else blob(out, "models--acme--gated",
                                                                                        GATED_SHA)
    assert not os.path.exists(failed)  # never a partial or wrong blob at its path
    missing = LFS - present_blobs(out)
    assert missing == (LFS if fault == "unreachable" else {GATED_SHA if fault == "no token" else BIG_SHA})
    before = len(cdn_seen(hub))
    again = restore(ref, out, hub)
    assert again.returncode == 0, again.stderr
    assert cache_tree(out) == cache_tree(origin_box)
    assert {s.path.split("?")[0].rpartition("/")[2] for s in cdn_seen(hub)[before:] if s.method == "GET"} == missing


def test_kill_9_mid_fetch_then_rerun_resumes_only_what_is_missing(committed, origin_box, hub, tmp_path):
    ref = committed[0]
    out = str(tmp_path / "restored")
    hub.cdn.reached.clear()
    hub.cdn.release.clear()
    hub.cdn.pause[BIG_SHA] = (1 << 20) + 5
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN}
    proc = subprocess.Popen([*SNAP, "restore", ref, "--root", out], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert hub.cdn.reached.wait(TIMEOUT)
        part = blob(out, "models--acme--tiny", BIG_SHA) + ".snap-part"
        # The CDN sent its first piece; the kill waits until the part holds it (a condition, not a time).
        for _ in range(TIMEOUT * 100):
            if os.path.exists(part) and os.path.getsize(part) >= 1 << 20:
                break
            hub.cdn.release.wait(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(TIMEOUT)
    finally:
        del hub.cdn.pause[BIG_SHA]
        hub.cdn.release.set()
    assert not os.path.exists(blob(out, "models--acme--tiny", BIG_SHA))
    had = os.path.getsize(part)
    present = present_blobs(out)
    before = len(cdn_seen(hub))
    r = restore(ref, out, hub)
    assert r.returncode == 0, r.stderr
    assert cache_tree(out) == cache_tree(origin_box)
    asked = [s for s in cdn_seen(hub)[before:] if s.method == "GET"]
    assert not {s.path.split("?")[0].rpartition("/")[2] for s in asked} & present
    big = [s for s in asked if BIG_SHA in s.path]
    assert had >= 1 << 20 and len(big) == 1 and big[0].headers.get("range") == f"bytes={had}-"


def test_the_origins_fetch_threads_yield_to_the_apps_unpacking_then_run_below_the_app(committed, hub, tmp_path,
                                                                                      monkeypatch):
    """An in-process restore: a blob from the origin is held mid-way by the CDN while the app's layers
    apply. Once the app is in, the thread fetching it runs at WEIGHTS_NICE: lowered as a weight's
    download (priority.py), then raised back with the registry's."""
    from snapshotter.restore.priority import UNPACKING_NICE, WEIGHTS_NICE
    from snapshotter.restore.restore import RestoreOptions, restore_image
    if os.getpriority(os.PRIO_PROCESS, 0) >= WEIGHTS_NICE:
        pytest.skip("the suite itself runs at a nice value of WEIGHTS_NICE or more")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.cdn.reached.clear()
    hub.cdn.release.clear()
    hub.cdn.pause[BIG_SHA] = (1 << 20) + 5
    app_in = threading.Event()
    done: list = []
    out = str(tmp_path / "restored")
    worker = threading.Thread(target=lambda: done.append(
        restore_image(committed[0], out, RestoreOptions(on_app_ready=app_in.set))))
    worker.start()
    try:
        assert hub.cdn.reached.wait(TIMEOUT) and app_in.wait(TIMEOUT), "the restore got nowhere"
        fetching = [t.native_id for t in threading.enumerate() if t.name.startswith("origin-fetch_")]
        assert fetching
        nices = {os.getpriority(os.PRIO_PROCESS, tid) for tid in fetching}
    finally:
        del hub.cdn.pause[BIG_SHA]
        hub.cdn.release.set()
        worker.join(TIMEOUT)
    assert done, "the restore failed"
    # The thread held mid-blob is at WEIGHTS_NICE; a pool thread that took no blob keeps its own.
    assert max(nices) == WEIGHTS_NICE and UNPACKING_NICE not in nices, nices


def test_upload_origin_makes_the_snapshot_self_contained(registry, base_ref, origin_box, hub, tmp_path, state_dir):
    ref = f"{registry.host}/origin-up:v1"
    env = commit_env(hub)
    first = json.loads(snap("commit", ref, "--base", base_ref, "--root", origin_box, "--json",
                            env={**env, "SNAP_WEIGHTS_FROM_ORIGIN": "1"}, check=True).stdout)
    assert first["references"] == len(LFS)
    up = json.loads(snap("commit", ref, "--base", base_ref, "--root", origin_box, "--json", "--upload-origin",
                         env=env, check=True).stdout)
    assert up["origin_uploaded"] == len(LFS) and up["references"] == 0
    manifest = registry.manifest("origin-up", "v1")
    assert "dev.snap.origin-references" not in manifest["annotations"]
    assert any(WEIGHTS[BIG // 2:BIG // 2 + 4096] in data for data in registry_bytes(registry, "origin-up"))
    out = str(tmp_path / "restored")
    r = restore(ref, out, hub, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")  # no origin at all
    assert r.returncode == 0, r.stderr
    assert "come from the registry's copy" in r.stderr
    assert cache_tree(out) == cache_tree(origin_box)
    assert not os.path.lexists(os.path.join(out, TOKEN_PATH))


def test_a_hub_cache_the_profile_excludes_is_neither_referenced_nor_restored(committed, registry, base_ref,
                                                                             origin_box, hub, tmp_path):
    profile = tmp_path / "no-tiny.yaml"
    profile.write_text(f"extends: default\nexclude: [/{CACHE}/models--acme--tiny]\n")
    ref = f"{registry.host}/origin-excluded:v1"
    result = json.loads(snap("commit", ref, "--base", base_ref, "--root", origin_box, "--json", "--profile",
                             str(profile), "--weights-from-origin", env=commit_env(hub), check=True).stdout)
    tiny = {sha256_hex(d) for d in REPOS[("model", "acme/tiny")].files.values() if len(d) >= 1024}
    assert result["references"] == len(LFS - tiny)
    assert_holds_no_weights(registry, "origin-excluded")
    out = str(tmp_path / "restored")  # the snapshot that references it, restored with the profile: not fetched
    r = restore(committed[0], out, hub, "--profile", str(profile))
    assert r.returncode == 0, r.stderr
    assert not [p for p in cache_tree(out) if p.startswith(f"{CACHE}/models--acme--tiny/")]
    assert present_blobs(out) == LFS - tiny


def test_then_does_not_wait_for_the_weights_and_their_folder_keeps_its_times(committed, origin_box, hub, tmp_path):
    """`--then`'s app starts while a weight is held back at the CDN; the blob lands after the layers
    set its folder's times, which stay the box's."""
    ref = committed[0]
    out, fifo = str(tmp_path / "restored"), str(tmp_path / "ready")
    os.mkfifo(fifo)
    hub.cdn.reached.clear()
    hub.cdn.release.clear()
    hub.cdn.pause[BIG_SHA] = 1 << 20
    proc = subprocess.Popen([*SNAP, "restore", ref, "--root", out, "--then", f"echo started > {fifo}"],
                            env={**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        fd = os.open(fifo, os.O_RDWR)  # never blocks: a restore that fails before the app cannot hang the test
        try:
            assert select.select([fd], [], [], TIMEOUT)[0], "the app was not started"
            assert os.read(fd, 100) == b"started\n"  # the app runs
        finally:
            os.close(fd)
        assert hub.cdn.reached.wait(TIMEOUT)
        assert not os.path.exists(blob(out, "models--acme--tiny", BIG_SHA))  # and the weight is not in yet
    finally:
        del hub.cdn.pause[BIG_SHA]
        hub.cdn.release.set()
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr
    assert cache_tree(out) == cache_tree(origin_box)


@pytest.fixture
def watched_box(origin_box, hub, tmp_path, monkeypatch) -> CommitOptions:
    """A copy of the box to watch with --weights-from-origin (the box's hub settings in the environment)."""
    box = str(tmp_path / "box")
    shutil.copytree(origin_box, box, symlinks=True)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN_PATH", "/" + TOKEN_PATH)
    return CommitOptions(root=box, profile=load_profile(), weights_from_origin=True)


def test_watch_keeps_the_weights_as_references_then_uploads_them(registry, base_ref, watched_box):
    commit = watched_box
    clock = FakeClock()
    w = Watcher(f"{registry.host}/origin-watch:v2", base_ref, WatchOptions(commit=commit, log=[].append,
                                                                            clock=clock, every=60))
    w.tick()
    note = json.loads(registry.manifest("origin-watch", "v2")["annotations"]["dev.snap.origin-references"])
    assert note["files"] == len(LFS)
    assert_holds_no_weights(registry, "origin-watch")
    clock.advance(600)
    w.tick()  # nothing else pending: the weights are sent in the background
    w.origin.thread.join(TIMEOUT)
    clock.advance(600)
    w.tick()  # once they are in, the next snapshot holds them: self-contained
    manifest = registry.manifest("origin-watch", "v2")
    assert "dev.snap.origin-references" not in manifest["annotations"]
    assert manifest["annotations"]["dev.snap.origin-uploaded"] == str(len(LFS)) and w.snapshots == 2
    assert any(WEIGHTS[BIG // 2:BIG // 2 + 4096] in data for data in registry_bytes(registry, "origin-watch"))
    clock.advance(600)
    w.tick()  # nothing changed since: no snapshot (the token file left out is no change either)
    assert w.snapshots == 2
    assert w.changes.committed_scan is w.changes.commit_scan  # a final snapshot can tell nothing changed unscanned
    # A watcher started again on the unchanged box never turns the self-contained tag back into references.
    said: list = []
    again = Watcher(f"{registry.host}/origin-watch:v2", base_ref, WatchOptions(commit=commit, log=said.append,
                                                                                clock=clock, every=60))
    again.tick()
    annotations = registry.manifest("origin-watch", "v2")["annotations"]  # a snapshot may be pushed, self-contained
    assert "dev.snap.origin-references" not in annotations, said
    assert annotations["dev.snap.origin-uploaded"] == str(len(LFS)), said


def test_watch_sends_the_weights_behind_the_changes_then_holds_them(registry, base_ref, watched_box, monkeypatch):
    commit, box = watched_box, watched_box.root
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)  # a real box's weights are older than the window
    weights = f"/blobs/{BIG_SHA}"
    reading, release, reads = threading.Event(), threading.Event(), []

    def after_read(path: str, attempt: int) -> None:  # holds the send of the big weight until the test says
        if path.endswith(weights):
            reads.append(path)
            reading.set()
            release.wait(20)  # today's watcher sends them inside its tick: this bound ends its wait

    clock, said = FakeClock(), []
    w = Watcher(f"{registry.host}/origin-behind:v1", base_ref, WatchOptions(commit=commit, log=said.append, clock=clock,
                                                                             every=60, after_read=after_read))
    try:
        w.tick()  # the first snapshot: references
        clock.advance(600)
        w.tick()  # nothing pending: the weights go in the background, held mid-read
        assert reading.wait(TIMEOUT)
        with open(os.path.join(box, "root/notes.txt"), "w") as f:
            f.write("a change made while the weights are being sent\n")
        clock.advance(600)
        w.tick()  # the change's snapshot, at once: it does not wait for the weights
        assert not release.is_set() and w.snapshots == 2, said
        annotations = registry.manifest("origin-behind", "v1")["annotations"]
        assert "dev.snap.origin-references" in annotations and "dev.snap.origin-uploaded" not in annotations
    finally:
        release.set()
    w.origin.thread.join(TIMEOUT)
    before, read_behind = registry_blobs(registry, "origin-behind"), len(reads)
    assert any(WEIGHTS[BIG // 2:BIG // 2 + 4096] in data for data in before.values())  # sent ahead
    clock.advance(600)
    w.tick()  # every weight in: the tag moves to a snapshot that holds them
    manifest = registry.manifest("origin-behind", "v1")
    assert "dev.snap.origin-references" not in manifest["annotations"], said
    assert manifest["annotations"]["dev.snap.origin-uploaded"] == str(len(LFS)) and w.snapshots == 3
    new = [data for digest, data in registry_blobs(registry, "origin-behind").items() if digest not in before]
    assert not any(WEIGHTS[BIG // 2:BIG // 2 + 4096] in data for data in new)  # that snapshot sent no weight bytes
    assert len(reads) == read_behind, said  # not even read: the snapshot found its layer in the stat cache


@pytest.fixture
def engine(registry, tmp_path_factory, monkeypatch):
    if os.geteuid() != 0 or not shutil.which("dockerd"):
        pytest.skip("snap run needs a dockerd of the test's own, which needs root")
    d = Dockerd(str(tmp_path_factory.mktemp("odockerd")), registry.host).start()
    monkeypatch.setenv("DOCKER_HOST", d.host)
    yield d
    d.stop()


def test_run_bind_mounts_the_weights_read_only_at_their_paths(registry, base_ref, origin_box, hub, engine):
    ref = f"{registry.host}/origin-run:gz"  # gzip: the test's Docker may predate zstd
    snap("commit", ref, "--base", base_ref, "--root", origin_box, "--weights-from-origin", "--compression", "gzip",
         env=commit_env(hub), check=True)
    link = f"/{CACHE}/models--acme--tiny/snapshots/{C_MODEL}/model.safetensors"
    script = f"sha256sum {link}; echo x >> {link} || echo read-only"
    r = snap("run", ref, "--", "/bin/sh", "-c", script, env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
    assert r.returncode == 0, r.stderr
    assert f"{BIG_SHA}  {link}" in r.stdout and "read-only" in r.stdout
    assert "bind-mounted read-only" in r.stderr
    # the engine pulls the snapshot whose weights are mounted, by digest (a watcher may move the tag)
    assert f"pulling {registry.host}/origin-run@{digest_of(registry, 'origin-run', 'gz')}" in r.stderr


def test_run_refuses_to_bind_the_weights_for_an_engine_on_another_machine(registry, base_ref, origin_box, hub,
                                                                          monkeypatch):
    """An engine whose host is another machine (docker info's Name: DOCKER_HOST over TCP or SSH, or
    the host of a container snap runs in) would bind that machine's paths: empty folders where the
    weights belong. Refused in one line before a weight is fetched or anything pulled; the same
    engine saying it is this machine gets the weights fetched and is asked to pull."""
    ref = f"{registry.host}/origin-elsewhere:gz"
    snap("commit", ref, "--base", base_ref, "--root", origin_box, "--weights-from-origin", "--compression", "gzip",
         env=commit_env(hub), check=True)
    engine = HostileServer().start()
    monkeypatch.setenv("DOCKER_HOST", f"tcp://{engine.host}")
    version = {"Version": "27.3.1", "ApiVersion": "1.47", "Os": "linux", "Arch": "amd64"}
    try:
        engine.answer = engine_api(version, info={"Name": "gpu-box-elsewhere"})
        hub.seen_all.clear()
        r = snap("run", ref, "--", "/bin/true", env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
        assert_one_line_error(r, 8, "'gpu-box-elsewhere'", repr(socket.gethostname()), "bind-mounted",
                              "snap restore", "--upload-origin")
        assert not hub.seen_all, hub.seen_all  # nothing fetched
        assert not [p for m, p, _ in engine.seen if "images/create" in p or "containers" in p], engine.seen

        engine.answer = engine_api(version, info={"Name": socket.gethostname()})
        r = snap("run", ref, "--", "/bin/true", env={"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})
        assert r.returncode == 10 and "this engine pulls nothing" in r.stderr, r.stderr
        assert "bind-mounted read-only" in r.stderr and hub.seen_all
    finally:
        engine.stop()


def test_log_and_status_say_which_snapshots_depend_on_the_origin(committed, origin_box, base_ref, hub):
    ref, _, state = committed
    log = json.loads(snap("log", ref, "--json", check=True).stdout)
    assert [(s["origin_files"], s["tags"]) for s in log] == [(len(LFS), ["v1"])]
    assert f"depends on the origin: {len(LFS)} hub file(s)" in snap("log", ref, check=True).stdout
    r = snap("status", "--base", base_ref, "--root", origin_box, check=True,
             env={**commit_env(hub), "SNAP_STATE_DIR": state, "SNAP_WEIGHTS_FROM_ORIGIN": "1"})
    assert f"tag {ref}: depends on the origin for {len(LFS)} hub file(s)" in r.stdout
    assert f"a commit keeps {len(LFS)} hub file(s) as references" in r.stdout


@pytest.mark.parametrize("where, code, words", [
    ("endpoint", 2, ["HF_ENDPOINT", "169.254.169.254"]),
    ("redirect", 10, ["model.safetensors", "169.254.169.254", "link-local"]),
])
def test_the_origin_is_checked_as_a_registry_is(committed, hub, tmp_path, where, code, words):
    """A link-local (cloud metadata) endpoint is refused before any layer is applied; a redirect there
    is refused before it is connected to. Only HF_TOKEN goes to the origin, and only to the hub itself."""
    ref = committed[0]
    out = str(tmp_path / "restored")
    env = {"HF_ENDPOINT": "http://169.254.169.254"} if where == "endpoint" else {}
    hub.redirect_to.update({BIG_SHA: "http://169.254.169.254/latest/meta-data/"} if where == "redirect" else {})
    before = len(hub.seen_all)
    try:
        r = restore(ref, out, hub, **env)
    finally:
        hub.redirect_to.clear()
    assert_one_line_error(r, code, *words)
    assert (os.listdir(out) if os.path.isdir(out) else []) == [] if where == "endpoint" else os.path.isdir(
        os.path.join(out, "opt/app"))
    assert {s.headers.get("authorization") for s in hub.seen_all[before:]} <= {None, f"Bearer {TOKEN}"}
    assert all("authorization" not in s.headers for s in hub.seen_all[before:] if s.server == "cdn")


def _tick_until_the_weights_are_in(w, clock):
    """After a failed send: the failure told (a backoff), then a send that works, then the snapshot
    holding them."""
    for _ in range(4):
        clock.advance(3600)
        try:
            w.tick()
        except SnapError:
            pass
        if w.origin.thread is not None:
            w.origin.thread.join(TIMEOUT)


def test_a_failed_send_of_the_weights_is_tried_again_and_they_go_up(registry, proxy, base_ref, watched_box,
                                                                    monkeypatch):
    """The registry refuses the weights' uploads while the first send runs: the error is told at the
    next tick, and a later idle tick sends them (a failed send stops only itself, not every retry);
    then the tag moves to a snapshot that holds them."""
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)  # a real box's weights are older than the window
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    refusing = threading.Event()
    proxy.answer = lambda method, path: (403, {}) if refusing.is_set() and "/blobs/uploads" in path else None
    clock, said = FakeClock(), []
    w = Watcher(f"{proxy.host}/origin-retry:v1", base_ref, WatchOptions(commit=watched_box, log=said.append,
                                                                         clock=clock, every=60))
    w.tick()  # the snapshot with references
    refusing.set()
    clock.advance(600)
    w.tick()  # nothing pending: the send starts, and fails
    w.origin.thread.join(TIMEOUT)
    assert not w.origin.sent and w.origin.error is not None
    refusing.clear()
    _tick_until_the_weights_are_in(w, clock)
    manifest = registry.manifest("origin-retry", "v1")
    assert manifest["annotations"].get("dev.snap.origin-uploaded") == str(len(LFS)), said[-6:]
    assert "dev.snap.origin-references" not in manifest["annotations"]


DEFAULT_PROFILE = open(os.path.join(os.path.dirname(__file__), "..", "layers", "default.yaml")).read()


def profiled(watched_box: CommitOptions, path, text: str) -> CommitOptions:
    """watched_box with the layer profile `text` (written at `path`)."""
    path.write_text(text)
    return dataclasses.replace(watched_box, profile=load_profile(str(path)))


@pytest.mark.parametrize("sweeper", ["this process", "another process"])
def test_a_sweep_leaves_the_layer_the_background_send_is_building(registry, base_ref, watched_box, tmp_path,
                                                                   state_dir, monkeypatch, sweeper):
    """A profile whose weights layer is compressed: the send builds it in the state dir's layers/,
    without the state lock. A commit meanwhile, the watcher's own or another snap process's, takes
    the lock and sweeps what killed runs left half-made: the layer being built is a live process's
    and stays, and the send goes through."""
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)  # a real box's weights are older than the window
    commit = profiled(watched_box, tmp_path / "zstd-weights.yaml", DEFAULT_PROFILE.replace("compression: none",
                                                                                           "compression: zstd"))
    reading, release = threading.Event(), threading.Event()

    def after_read(path: str, attempt: int) -> None:  # holds the weights' layer half-built
        if path.endswith(f"/blobs/{BIG_SHA}") and not reading.is_set():
            reading.set()
            release.wait(TIMEOUT)

    clock, said = FakeClock(), []
    w = Watcher(f"{registry.host}/origin-sweep:v1", base_ref, WatchOptions(commit=commit, log=said.append, clock=clock,
                                                                            every=60, after_read=after_read))
    try:
        w.tick()  # the snapshot with references
        clock.advance(600)
        w.tick()  # nothing pending: the send starts, held mid-build
        assert reading.wait(TIMEOUT), said
        building = glob.glob(os.path.join(state_dir, "layers", ".building-*"))
        assert building, said
        if sweeper == "this process":
            with open(os.path.join(commit.root, "root/notes.txt"), "w") as f:
                f.write("a change made while the weights are being sent\n")
            clock.advance(600)
            w.tick()  # the change's snapshot: it takes the state lock, and sweeps
            assert w.snapshots == 2, said
        else:  # a `snap commit` that takes the lock (and sweeps) before it refuses its target
            r = snap("commit", f"{registry.host}/x@sha256:{'0' * 64}", "--base", base_ref, "--root", commit.root)
            assert r.returncode == 2 and "needs a tag" in r.stderr, r.stderr
        assert [p for p in building if os.path.exists(p)] == building
    finally:
        release.set()
    w.origin.thread.join(TIMEOUT)
    assert w.origin.error is None and w.origin.sent, said


def test_a_failed_send_keeps_the_stat_cache_rows_of_the_layers_that_went_up(registry, proxy, base_ref, watched_box,
                                                                            tmp_path, monkeypatch):
    """Two layers of weights (the big one a layer of its own, the small ones a bundle), sent one after
    the other: the registry refuses the second's upload. The retry reads only the refused layer's
    weights: the one that went up is found through the stat cache, its blob in the registry."""
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)
    monkeypatch.setattr(sender_module, "UPLOADS", 1)  # the first layer is in before the second is refused
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    commit = profiled(watched_box, tmp_path / "small-weights.yaml", SMALL_WEIGHTS)
    refusing, uploads, reads = threading.Event(), [], []

    def after_read(path: str, attempt: int) -> None:  # only the send reads a weight: the refusals start
        if path.rpartition("/")[2] in LFS:
            reads.append(path)
            refusing.set()

    def answer(method: str, path: str):
        if refusing.is_set() and method == "POST" and "/blobs/uploads/" in path and "mount=" not in path:
            uploads.append(path)
            return (403, {}) if len(uploads) > 1 else None
        return None

    proxy.answer = answer
    clock, said = FakeClock(), []
    w = Watcher(f"{proxy.host}/origin-keep:v1", base_ref, WatchOptions(commit=commit, log=said.append, clock=clock,
                                                                        every=60, after_read=after_read))
    for _ in range(4):  # the snapshot with references, the big file sent ahead (a weight here), then the send
        w.tick()
        clock.advance(600)
        if w.origin.thread is not None:
            break
    w.origin.thread.join(TIMEOUT)  # one layer went up, the other was refused
    assert w.origin.error is not None and len(uploads) >= 2, said
    first, reads[:] = set(reads), []
    proxy.answer = lambda method, path: None
    _tick_until_the_weights_are_in(w, clock)
    assert registry.manifest("origin-keep", "v1")["annotations"].get("dev.snap.origin-uploaded") == str(len(LFS))
    assert reads and set(reads) < first, (sorted(first), sorted(set(reads)))  # the layer that went up: not read
