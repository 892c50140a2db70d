"""A restore onto a root that already holds some of the image downloads only the layers that differ
(skip.py): a pod restart, whose /workspace volume kept the weights while the container disk and
snap's state dir are gone, downloads no weight byte."""

import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import tarfile

import pytest

from snapshotter.restore.journal import Journal
from snapshotter.restore.restore import RestoreOptions, restore_image

from support.images import CAP_NET_BIND, part_ann, xattr_snapshot
from support.run import snap
from support.tars import member, tar_bytes
from support.trees import NOT_CAPTURED, flip_byte, make_box, snapshot_of_tree, write_tree

MiB = 1 << 20
# The default profile's models layer with small thresholds: weights of a few MiB get layers of
# their own, a file over --max-layer-size is cut into part layers, the rest is bundled.
PROFILE = """
name: skiptest
layers:
  - name: venv
    venv: true
    compression: zstd
  - name: custom_nodes
    paths: ["**/custom_nodes/**"]
    compression: zstd
  - name: models
    paths: ["**/models/**"]
    compression: none
    file_layer_min: 512KiB
    bundle_max: 256KiB
  - name: rest
    compression: zstd
exclude: [/proc, /sys, /dev, /tmp, /run]
"""
VOLUME = "workspace"
A = "workspace/models/checkpoints/a.safetensors"  # a single-file layer
B = "workspace/models/checkpoints/b.safetensors"  # cut into part layers (with a hardlink)
SMALL = [f"workspace/models/loras/l{i}.pt" for i in range(12)]  # bundles


def _box(base_rootfs, dest):
    box = make_box(base_rootfs, dest)
    shutil.rmtree(os.path.join(box, "opt/app/models"))  # all weights on the volume
    write_tree(box, {A: os.urandom(900_000), B: os.urandom(5 * MiB // 2),
                     "workspace/models/configs/x.yaml": "steps: 20\n",
                     "workspace/notes.txt": "a file of the rest layer on the volume\n",
                     **{p: os.urandom(40_000) for p in SMALL}})
    write_tree(box, {"workspace/models/current": "->checkpoints/a.safetensors"})
    os.link(os.path.join(box, B), os.path.join(box, "workspace/models/b_link.safetensors"))
    os.link(os.path.join(box, SMALL[0]), os.path.join(box, "workspace/models/loras/l0_link.pt"))
    os.utime(os.path.join(box, "workspace/notes.txt"), (1_650_000_000, 1_650_000_000))
    for d in ("workspace/models/loras", "workspace/models/checkpoints", "workspace/models", VOLUME):
        os.utime(os.path.join(box, d), (1_700_000_000, 1_700_000_000))  # newer than any file under it
    return box


@pytest.fixture
def committed(registry, base_ref, base_rootfs, tmp_path):
    """A box committed (weights in single-file, part and bundle layers), restored into an empty root."""
    profile = tmp_path / "skiptest.yaml"
    profile.write_text(PROFILE)
    box = _box(base_rootfs, str(tmp_path / "box"))
    ref = f"{registry.host}/skip:v1"
    # --force: each test's new box replaces the tag the one before pushed (the tag moves only forward)
    snap("commit", ref, "--base", base_ref, "--root", box, "--profile", str(profile), "--max-layer-size", "1MiB",
         "--force", check=True)
    root = tmp_path / "pod"
    snap("restore", ref, "--root", str(root), check=True)
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    return box, root


def _pod_restart(base_rootfs, root):
    """The container disk is gone (all but the volume), the provider lays the base again."""
    for name in os.listdir(root):
        if name != VOLUME:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
    subprocess.run(["cp", "-a", f"{base_rootfs}/.", str(root)], check=True)


def _restore(proxy, root, state_dir, *extra):
    """`snap restore --only-snapshot` through the proxy with this state dir; (its JSON, blob digests GET)."""
    start = len(proxy.log)
    r = snap("restore", f"{proxy.host}/skip:v1", "--root", str(root), "--only-snapshot", "--json", *extra,
             env={"SNAP_STATE_DIR": str(state_dir)}, check=True)
    got = {path.rsplit("/", 1)[1] for method, path, status in proxy.log[start:]
           if method == "GET" and "/blobs/sha256:" in path}
    return json.loads(r.stdout), got, r.stderr


def _weight_layers(registry):
    """{digest: tar member names} of the models layers (weights, bundles, parts)."""
    out = {}
    for d in registry.manifest("skip", "v1")["layers"]:
        ann = d.get("annotations", {})
        if ann.get("dev.snap.layer") == "models" and ann.get("dev.snap.content") != "directories and deletions":
            with tarfile.open(fileobj=io.BytesIO(registry.blob("skip", d["digest"]))) as t:
                out[d["digest"]] = {m.name for m in t.getmembers()}
    return out


def _verify(proxy, root, state_dir):
    r = snap("verify", f"{proxy.host}/skip:v1", "--root", str(root), "--only-snapshot",
             env={"SNAP_STATE_DIR": str(state_dir)})
    assert r.returncode == 0, r.stdout + r.stderr


def test_pod_restart_downloads_no_weight(committed, registry, proxy, base_rootfs, tmp_path):
    box, root = committed
    weights = _weight_layers(registry)
    assert any(".snap-part-" in n for names in weights.values() for n in names)  # the part layers are there
    assert len(weights) >= 5
    _pod_restart(base_rootfs, str(root))
    doc, got, stderr = _restore(proxy, root, tmp_path / "fresh-state")
    assert not got & set(weights), "a weight layer was downloaded"
    # The container disk's layers are applied; the weights' last layer (directories) is in place too.
    assert doc["applied"] == ["venv", "custom_nodes", "rest"]
    assert doc["skipped_layers"] == len(weights) + 1 and doc["hashed_bytes"] >= 3 * MiB
    weight_layers = [d for d in registry.manifest("skip", "v1")["layers"] if d["digest"] in weights]
    assert doc["skipped_bytes"] >= sum(d["size"] for d in weight_layers)
    assert f"skipped {len(weights) + 1} layer(s)" in stderr and "not downloaded" in stderr
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    _verify(proxy, root, tmp_path / "fresh-state")


def test_a_changed_or_missing_file_downloads_exactly_its_layer(committed, registry, proxy, base_rootfs, tmp_path):
    box, root = committed
    weights = _weight_layers(registry)
    _pod_restart(base_rootfs, str(root))
    st = os.stat(root / A)
    with open(root / A, "r+b") as f:  # other bytes, same size and mtime
        f.write(os.urandom(4096))
    os.utime(root / A, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.unlink(root / SMALL[5])
    doc, got, _ = _restore(proxy, root, tmp_path / "fresh-state")
    changed = {d for d, names in weights.items() if A in names or SMALL[5] in names}
    assert len(changed) == 2
    assert got & set(weights) == changed
    assert doc["skipped_layers"] == len(weights) - 2
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    _verify(proxy, root, tmp_path / "fresh-state")


def test_with_the_restore_record_nothing_is_hashed(committed, registry, proxy, base_rootfs, tmp_path, state_dir):
    box, root = committed
    doc, got, _ = _restore(proxy, root, state_dir)  # the state dir of the first restore: its record
    assert doc["applied"] == [] and doc["skipped_layers"] == len(registry.manifest("skip", "v1")["layers"]) - 2
    assert doc["hashed_bytes"] == 0
    assert not got - set(_headers(registry).values()) - {registry.manifest("skip", "v1")["config"]["digest"]}
    # A file changed since that restore (its ctime is newer) is hashed again, and its layer downloaded.
    flip_byte(root / SMALL[3])
    os.utime(root / SMALL[3], (1_600_000_000, 1_600_000_000))
    doc, got, _ = _restore(proxy, root, state_dir)
    assert 0 < doc["hashed_bytes"] < 1 * MiB  # that file's layer only
    assert len(doc["applied"]) == 2 and doc["applied"][0].startswith("models (bundle ")
    assert doc["applied"][1] == "models (directories and deletions)"  # its directory's mtime: see the next test
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def _restore_at(proxy, root, state_dir, offset_s: str) -> dict:
    """_restore with the wall clock set `offset_s` seconds ahead (SNAP_CLOCK_OFFSET, box/clock.py)."""
    r = snap("restore", f"{proxy.host}/skip:v1", "--root", str(root), "--only-snapshot", "--json",
             env={"SNAP_STATE_DIR": str(state_dir), "SNAP_CLOCK_OFFSET": offset_s}, check=True)
    return json.loads(r.stdout)


def test_a_restore_record_ending_in_the_future_is_not_trusted(committed, registry, proxy, base_rootfs, tmp_path,
                                                              state_dir):
    """The clock stepped back after a restore: its record's end lies ahead, and a file changed
    meanwhile can have a ctime before it. The layers are hashed (not trusted), and a file changed
    with the clock set back is found and restored."""
    box, root = committed
    assert _restore_at(proxy, root, state_dir, "3600")["hashed_bytes"] == 0  # the record now ends an hour ahead
    flip_byte(root / SMALL[3])  # changed after the step back: its ctime is before the record's end
    os.utime(root / SMALL[3], (1_600_000_000, 1_600_000_000))
    doc = _restore_at(proxy, root, state_dir, "0")
    assert doc["hashed_bytes"] >= 3 * MiB  # every weight layer hashed
    assert len(doc["applied"]) == 2 and doc["applied"][0].startswith("models (bundle ")
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


@pytest.mark.parametrize("field, value", [("boot_id", "another-boot"), ("offset_ns", 10**18),
                                          ("restored_at_ns", 2 * 10**18)])
def test_a_restore_record_the_clock_cannot_vouch_for_is_not_trusted(committed, registry, proxy, base_rootfs,
                                                                    tmp_path, state_dir, field, value):
    """A record written in another boot, or before a step back of the wall clock (its offset from
    the boot clock was larger then), or whose end lies ahead, says nothing about ctimes since: the
    layers are hashed."""
    _, root = committed
    record = next((state_dir / "restored").glob("*.json"))
    doc = json.loads(record.read_text())
    (doc if field == "restored_at_ns" else doc["ended"])[field] = value
    record.write_text(json.dumps(doc))
    assert _restore_at(proxy, root, state_dir, "0")["hashed_bytes"] >= 3 * MiB


def test_a_layer_after_an_applied_one_that_writes_its_paths_is_applied(committed, registry, proxy, base_rootfs,
                                                                       tmp_path):
    """A changed weight's layer (applied) carries its directory with an older mtime than the box's;
    the weights' last layer, which decides that mtime, finds it right on disk but must be applied
    after it all the same, or the directory keeps the weight layer's mtime."""
    box, root = committed
    _pod_restart(base_rootfs, str(root))
    with open(root / A, "r+b") as f:
        f.write(os.urandom(4096))
    doc, _, err = _restore(proxy, root, tmp_path / "fresh-state")
    assert "checked again" not in err  # the applied layer is what its skeleton said
    assert "models (directories and deletions)" in doc["applied"]
    assert doc["skipped_layers"] == len(_weight_layers(registry)) - 1  # all but the changed weight's
    assert os.stat(root / "workspace/models/checkpoints").st_mtime == 1_700_000_000
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def _headers(registry) -> dict[str, str]:
    """{diff_id: digest of its headers blob} of the snapshot's layers (dev.snap.headers)."""
    manifest = registry.manifest("skip", "v1")
    diff_ids = json.loads(registry.blob("skip", manifest["config"]["digest"]))["rootfs"]["diff_ids"]
    return {diff_id: d["annotations"]["dev.snap.headers"] for d, diff_id in zip(manifest["layers"], diff_ids)
            if "dev.snap.headers" in d.get("annotations", {})}


def _repoint_headers(registry, tag, blobs: dict[str, bytes] | None = None, one_blob: bytes | None = None):
    """The snapshot pushed again as `tag`: each layer naming the headers blob `blobs` has for its
    diff_id; or, with `one_blob`, none, and the manifest naming it as an older snapshot's skeleton."""
    manifest = registry.manifest("skip", "v1")
    diff_ids = json.loads(registry.blob("skip", manifest["config"]["digest"]))["rootfs"]["diff_ids"]
    for d, diff_id in zip(manifest["layers"], diff_ids):
        ann = d.get("annotations", {})
        ann.pop("dev.snap.headers", None)
        if blobs is not None and diff_id in blobs:
            ann["dev.snap.headers"] = registry.push_blob("skip", blobs[diff_id])
    if one_blob is not None:
        manifest["annotations"]["dev.snap.skeleton"] = registry.push_blob("skip", one_blob)
    r = registry.session().put(f"{registry.url}/v2/skip/manifests/{tag}", data=json.dumps(manifest),
                               headers={"Content-Type": manifest["mediaType"]})
    r.raise_for_status()


def test_a_malformed_or_lying_skeleton_is_never_trusted(committed, registry, proxy, base_rootfs, tmp_path):
    box, root = committed
    weights = _weight_layers(registry)
    _pod_restart(base_rootfs, str(root))
    _repoint_headers(registry, "garbage", {diff_id: b"not a skeleton" for diff_id in _headers(registry)})
    r = snap("restore", f"{registry.host}/skip:garbage", "--root", str(root), "--only-snapshot", "--json",
             env={"SNAP_STATE_DIR": str(tmp_path / "s1")}, check=True)
    assert json.loads(r.stdout)["skipped_layers"] == 0 and "are not usable" in r.stderr
    # The skeletons of two weights swapped: each layer's own headers say what is on disk, but not its bytes.
    pieces = {diff_id: gzip.decompress(registry.blob("skip", d)) for diff_id, d in _headers(registry).items()}
    manifest = registry.manifest("skip", "v1")
    config = json.loads(registry.blob("skip", manifest["config"]["digest"]))
    diff_ids = dict(zip((d["digest"] for d in manifest["layers"]), config["rootfs"]["diff_ids"]))
    a, b = [diff_ids[d] for d, names in weights.items() if A in names or SMALL[0] in names]
    pieces[a], pieces[b] = pieces[b].replace(b.encode(), a.encode()), pieces[a].replace(a.encode(), b.encode())
    _repoint_headers(registry, "lying", {diff_id: gzip.compress(p) for diff_id, p in pieces.items()})
    _pod_restart(base_rootfs, str(root))
    start = len(proxy.log)
    r = snap("restore", f"{proxy.host}/skip:lying", "--root", str(root), "--only-snapshot", "--json",
             env={"SNAP_STATE_DIR": str(tmp_path / "s2")}, check=True)
    got = {path.rsplit("/", 1)[1] for method, path, _ in proxy.log[start:] if method == "GET" and "/blobs/" in path}
    assert got & set(weights) == {d for d, names in weights.items() if A in names or SMALL[0] in names}
    assert json.loads(r.stdout)["skipped_layers"] >= len(weights) - 2  # the other weights
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_a_skeleton_of_more_entries_than_the_cap_is_not_parsed_on(committed, registry, proxy, base_rootfs, tmp_path):
    """A skeleton listing more members than SNAP_MAX_ENTRIES (what is kept per member would grow
    with them) is not used: the layers are downloaded, where the same cap holds."""
    import struct

    from snapshotter.snapshot import skeleton

    box, root = committed
    diff_id = json.loads(registry.blob("skip",
                                       registry.manifest("skip", "v1")["config"]["digest"]))["rootfs"]["diff_ids"][-1]
    header = tarfile.TarInfo("x").tobuf(tarfile.PAX_FORMAT)
    piece = skeleton.MAGIC + (struct.pack(">I", len(header)) + header + struct.pack(">Q", 0)) * 3000
    _repoint_headers(registry, "many", {diff_id: gzip.compress(piece + struct.pack(">I", 0) + diff_id.encode())})
    _pod_restart(base_rootfs, str(root))
    r = snap("restore", f"{registry.host}/skip:many", "--root", str(root), "--only-snapshot", "--json",
             env={"SNAP_STATE_DIR": str(tmp_path / "s1"), "SNAP_MAX_ENTRIES": "1000"}, check=True)
    assert json.loads(r.stdout)["skipped_layers"] == 0
    assert "more than 1000 entries" in r.stderr and "are not usable" in r.stderr
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_an_older_snapshot_with_one_skeleton_blob_still_skips_what_the_root_holds(committed, registry, proxy,
                                                                                  base_rootfs, tmp_path):
    """Snapshots made before each layer had a headers blob of its own name one blob of them all
    (dev.snap.skeleton): a restore reads it as before."""
    box, root = committed
    weights = _weight_layers(registry)
    _repoint_headers(registry, "one-blob",
                     one_blob=b"".join(registry.blob("skip", d) for d in _headers(registry).values()))
    _pod_restart(base_rootfs, str(root))
    start = len(proxy.log)
    r = snap("restore", f"{proxy.host}/skip:one-blob", "--root", str(root), "--only-snapshot", "--json",
             env={"SNAP_STATE_DIR": str(tmp_path / "fresh")}, check=True)
    got = {path.rsplit("/", 1)[1] for method, path, _ in proxy.log[start:] if method == "GET" and "/blobs/" in path}
    assert not got & set(weights) and json.loads(r.stdout)["skipped_layers"] >= len(weights)
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def _verify_json(proxy, root, tag="v1") -> tuple[int, dict, set[str]]:
    """`snap verify --only-snapshot --json` of skip:TAG through the proxy, with a fresh state dir:
    (exit code, its JSON, blob digests GET)."""
    start = len(proxy.log)
    r = snap("verify", f"{proxy.host}/skip:{tag}", "--root", str(root), "--only-snapshot", "--json")
    assert "Traceback" not in r.stderr, r.stderr
    got = {path.rsplit("/", 1)[1] for method, path, _ in proxy.log[start:] if method == "GET" and "/blobs/" in path}
    return r.returncode, json.loads(r.stdout), got


def _part_layers(registry) -> set[str]:
    return {d["digest"] for d in registry.manifest("skip", "v1")["layers"]
            if "dev.snap.part-file" in d.get("annotations", {})}


def test_verify_checks_the_layers_the_root_holds_without_downloading_them(committed, registry, proxy):
    """A verify reads a snapshot layer whose files the root holds from the root alone (its headers
    blob and the root's bytes hash to its diff_id): no layer blob but the part layers' is downloaded,
    and the verdict and paths compared are those of a verify that reads every layer."""
    _, root = committed
    layers = {d["digest"] for d in registry.manifest("skip", "v1")["layers"]
              if "dev.snap.layer" in d.get("annotations", {})}  # the snapshot's (--only-snapshot)
    parts = _part_layers(registry)
    assert len(parts) >= 2
    code, doc, got = _verify_json(proxy, root)
    assert code == 0 and doc["ok"], doc
    assert got & layers == parts
    assert doc["layers_held"] == len(layers) - len(parts) and doc["layers_read"] == len(parts)
    _repoint_headers(registry, "no-headers")  # the same snapshot, no layer naming a headers blob
    code, read_all, got = _verify_json(proxy, root, "no-headers")
    assert code == 0 and got & layers == layers and read_all["layers_held"] == 0
    assert read_all["checked"] == doc["checked"]


def test_verify_finds_a_changed_byte_whose_file_kept_its_stat_data(committed, registry, proxy):
    """Bit rot: a weight's byte changed, its mtime put back (the stat pass cannot see it). Its layer
    fails the hash and is read from the registry; the one difference reported is that file's. A file
    whose mtime alone moved is no difference (verify compares no times): its layer is read too."""
    _, root = committed
    weights = _weight_layers(registry)
    st = os.stat(root / A)
    flip_byte(root / A, 1000)
    os.utime(root / A, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(root / SMALL[3], (1_650_000_123, 1_650_000_123))
    code, doc, got = _verify_json(proxy, root)
    assert code == 9 and [(d["path"], d["kind"]) for d in doc["differences"]] == [("/" + A, "content")]
    expected = {d for d, names in weights.items() if A in names or SMALL[3] in names}
    assert got & set(weights) == expected | _part_layers(registry)


def test_verify_never_trusts_a_lying_skeleton(committed, registry, proxy):
    """Two weights' headers blobs swapped (each naming the other's diff_id): neither layer is held, both
    are read from the registry, and the intact root still verifies; with a byte changed in one of them,
    that file is reported."""
    _, root = committed
    weights = _weight_layers(registry)
    pieces = {diff_id: gzip.decompress(registry.blob("skip", d)) for diff_id, d in _headers(registry).items()}
    manifest = registry.manifest("skip", "v1")
    config = json.loads(registry.blob("skip", manifest["config"]["digest"]))
    diff_ids = dict(zip((d["digest"] for d in manifest["layers"]), config["rootfs"]["diff_ids"]))
    swapped = {d for d, names in weights.items() if A in names or SMALL[0] in names}
    a, b = [diff_ids[d] for d in swapped]
    pieces[a], pieces[b] = pieces[b].replace(b.encode(), a.encode()), pieces[a].replace(a.encode(), b.encode())
    _repoint_headers(registry, "lying", {diff_id: gzip.compress(p) for diff_id, p in pieces.items()})
    code, doc, got = _verify_json(proxy, root, "lying")
    assert code == 0 and got & set(weights) == swapped | _part_layers(registry), doc
    flip_byte(root / SMALL[0], 7)
    code, doc, _ = _verify_json(proxy, root, "lying")
    assert code == 9
    assert sorted(d["path"] for d in doc["differences"]) == ["/" + SMALL[0], "/workspace/models/loras/l0_link.pt"]


def _skeleton(tar: bytes, diff_id: str) -> bytes:
    """The headers blob (skeleton piece) snap pushes for a layer whose tar is `tar`, naming `diff_id`."""
    from snapshotter.snapshot.skeleton import PieceWriter

    piece = PieceWriter()
    piece.start()
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():
            piece.add(tar[m.offset:m.offset_data], m.size if m.isreg() else 0)
    return piece.finish(diff_id)


def _hand_made(registry, repo: str, layers: list[tuple[bytes, bytes | None]], annotations: list | None = None,
               cut: int | None = None) -> str:
    """A snapshot of snap's own layers from (tar, the tar its headers blob describes or None for
    itself): each layer's headers blob names the layer's diff_id. `annotations`: each layer's own
    (else those of a rest layer); `cut`: the size files were cut into part layers at."""
    diff_ids = ["sha256:" + hashlib.sha256(tar).hexdigest() for tar, _ in layers]
    heads = [registry.push_blob(repo, _skeleton(said or tar, d)) for (tar, said), d in zip(layers, diff_ids)]
    annotations = annotations or [{"dev.snap.layer": "rest"}] * len(layers)
    registry.push_image(repo, "v1", [gzip.compress(tar, mtime=0) for tar, _ in layers], diff_ids=diff_ids,
                        layer_annotations=[{"dev.snap.headers": h, **a} for h, a in zip(heads, annotations)],
                        manifest_annotations={"dev.snap.base-layers": "0",
                                              **({"dev.snap.max-layer-size": str(cut)} if cut else {})})
    return f"{registry.host}/{repo}:v1"


def _restore_again(ref, root, state_dir) -> tuple[dict, str]:
    r = snap("restore", ref, "--root", str(root), "--json", env={"SNAP_STATE_DIR": str(state_dir)}, check=True)
    return json.loads(r.stdout), r.stderr


def test_a_layer_misdescribed_by_its_skeleton_does_not_decide_what_is_skipped_above_it(registry, tmp_path):
    """Layer 1's headers blob says it writes e/g; it writes d/f. Layer 2 writes d/f, which the root
    holds: skipped on layer 1's word, layer 1 applied would leave its d/f in place of layer 2's. Once
    layer 1 is applied and its headers are seen not to be what it said, layer 2 is checked again."""
    said = tar_bytes(member("e", "dir"), member("e/g", data=b"whatever\n"))
    ref = _hand_made(registry, "misdescribed", [
        (tar_bytes(member("d", "dir"), member("d/f", data=b"EVIL\n")), said),
        (tar_bytes(member("d", "dir"), member("d/f", data=b"GOOD\n")), None)])
    root = tmp_path / "root"
    snap("restore", ref, "--root", str(root), env={"SNAP_STATE_DIR": str(tmp_path / "s0")}, check=True)
    assert (root / "d/f").read_bytes() == b"GOOD\n"
    for state in ("s1", "s2"):  # a fresh state dir (a pod restart), then the same one again
        doc, err = _restore_again(ref, root, tmp_path / state)
        assert (root / "d/f").read_bytes() == b"GOOD\n", err
        assert "is not what its skeleton said: the layers above it are checked again" in err
        assert doc["skipped_layers"] == 0 and len(doc["applied"]) == 2
        assert "skipped" not in err, err  # layer 2, first planned as skipped, was applied: no line says otherwise


def test_a_path_an_applied_layer_deletes_then_makes_again_is_not_skipped_below(registry, tmp_path):
    """Layer 1 deletes d (a whiteout) and makes it again, empty; layer 2 puts d/f in it. Restored
    again, layer 1 is applied (d is there, its whiteout says absent): layer 2 must be too."""
    ref = _hand_made(registry, "deleted", [
        (tar_bytes(member(".wh.d"), member("d", "dir")), None),
        (tar_bytes(member("d", "dir"), member("d/f", data=b"precious\n")), None)])
    root = tmp_path / "root"
    snap("restore", ref, "--root", str(root), env={"SNAP_STATE_DIR": str(tmp_path / "s0")}, check=True)
    doc, err = _restore_again(ref, root, tmp_path / "s1")
    assert (root / "d/f").read_bytes() == b"precious\n", err
    assert doc["skipped_layers"] == 0


def test_a_restore_killed_between_recording_two_skipped_parts_of_a_file_resumes(registry, tmp_path, monkeypatch):
    """The root holds m/big, so both its part layers are skipped; a run killed once the journal lists
    the first part as done but not the second: the rerun skips both again (applying the second alone
    would leave one part of the file to join, and every later run refused it)."""
    part = "m/big.snap-part-{:04d}-of-0002"
    ref = _hand_made(registry, "skippedparts", [
        (tar_bytes(member("m", "dir")), None),
        (tar_bytes(member(part.format(1), data=b"first.\n")), None),
        (tar_bytes(member(part.format(2), data=b"second\n")), None),
        (tar_bytes(member("c.txt", data=b"c\n")), None),
    ], [{"dev.snap.layer": "rest"}, part_ann("m/big", "1/2"), part_ann("m/big", "2/2"), {"dev.snap.layer": "rest"}],
        cut=7)
    root = tmp_path / "root"
    snap("restore", ref, "--root", str(root), env={"SNAP_STATE_DIR": str(tmp_path / "s0")}, check=True)
    assert (root / "m/big").read_bytes() == b"first.\nsecond\n"
    record = Journal.record_applied

    def killed_before_the_second_part(self, count, *args, **kwargs):
        if count == 3:
            raise KeyboardInterrupt()
        return record(self, count, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(Journal, "record_applied", killed_before_the_second_part)
        with pytest.raises(KeyboardInterrupt):
            restore_image(ref, str(root), RestoreOptions(seed_stat_cache=False))
    r = snap("restore", ref, "--root", str(root), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["skipped_layers"] == 3, r.stdout  # both parts, and the layer after them
    assert "only some of the part layers of /m/big" in r.stderr, r.stderr
    assert sorted(os.listdir(root / "m")) == ["big"] and (root / "m/big").read_bytes() == b"first.\nsecond\n"


TOOL = "srv/app/bin/tool"


def _skipped(ref, root, tmp_path, *extra) -> tuple[int, int]:
    """Restore REF into `root` as after a pod restart (a fresh state dir): (layers skipped, applied)."""
    state = tmp_path / f"state-{len(list(tmp_path.glob('state-*')))}"
    r = snap("restore", ref, "--root", str(root), "--json", *extra, env={"SNAP_STATE_DIR": str(state)}, check=True)
    doc = json.loads(r.stdout)
    return doc["skipped_layers"], len(doc["applied"])


def test_a_file_with_an_xattr_its_layer_does_not_set_is_applied_again(registry, tmp_path):
    """A file's layer sets its xattrs on a file it makes new: one with another xattr (user.evil) is
    not what applying the layer leaves, and its layer is applied (the file then holds the layer's
    alone). A directory keeps the xattrs it has when a layer is applied over it: one more there does
    not fail the layer."""
    ref = xattr_snapshot(registry, tmp_path, "skip-xattr",
                          lambda box: os.setxattr(box / "srv/app/a.txt", "user.tag", b"blue"))
    root = tmp_path / "root"
    _skipped(ref, root, tmp_path)
    held, applied = _skipped(ref, root, tmp_path)
    assert held >= 1 and applied == 0
    os.setxattr(root / "srv/app", "user.dir", b"the volume's own")
    assert _skipped(ref, root, tmp_path) == (held, 0)
    os.setxattr(root / "srv/app/a.txt", "user.evil", b"1")
    assert _skipped(ref, root, tmp_path)[1] >= 1
    assert sorted(os.listxattr(root / "srv/app/a.txt")) == ["user.tag"]
    assert _skipped(ref, root, tmp_path) == (held, 0)
    # A POSIX ACL any owner may set, whose mask keeps the mode bits (0644) and gives uid 65534 read
    # access: a layer applied drops it, so the layer is applied.
    acl = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in (
        (0x01, 6, 0xFFFFFFFF), (0x02, 4, 65534), (0x04, 4, 0xFFFFFFFF), (0x10, 4, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)))
    try:
        os.setxattr(root / "srv/app/a.txt", "system.posix_acl_access", acl)
    except OSError:
        pytest.skip("this filesystem takes no POSIX ACLs")
    assert _skipped(ref, root, tmp_path)[1] >= 1
    assert sorted(os.listxattr(root / "srv/app/a.txt")) == ["user.tag"]


@pytest.mark.skipif(os.geteuid() != 0, reason="file capabilities need root")
def test_a_capability_kept_by_allow_setuid_is_applied_again_without_it(registry, tmp_path):
    """A file committed with a capability, restored with --allow-setuid, then restored without it:
    its layer is applied again (as a setuid bit's is), and the file is left as a fresh restore
    leaves it: no capability."""
    def prepare(box):
        os.chmod(box / TOOL, 0o755)
        os.setxattr(box / TOOL, "security.capability", CAP_NET_BIND)

    ref = xattr_snapshot(registry, tmp_path, "skip-capability", prepare)
    root, fresh = tmp_path / "root", tmp_path / "fresh"
    _skipped(ref, root, tmp_path, "--allow-setuid")
    assert "security.capability" in os.listxattr(root / TOOL)
    held, applied = _skipped(ref, root, tmp_path, "--allow-setuid")
    assert held >= 1 and applied == 0
    assert _skipped(ref, root, tmp_path)[1] >= 1
    _skipped(ref, fresh, tmp_path)
    assert "security.capability" not in os.listxattr(root / TOOL)
    assert snapshot_of_tree(str(root)) == snapshot_of_tree(str(fresh))
