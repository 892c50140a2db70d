"""The core job, end to end on a real registry: commit a box, restore it, compare byte for byte."""

import json
import os
import subprocess
import tarfile

import zstandard

from snapshotter import CommitOptions, commit_box
from snapshotter.commit import push as push_module

from support.images import layers_by_name
from support.run import commit_json, snap
from support.trees import NOT_CAPTURED, snapshot_of_tree, write_tree

MODELS_META = "models (directories and deletions)"
SNAP_LAYERS = ["venv", "custom_nodes", "rest", "models", MODELS_META]  # weights last: `restore --then`


def test_round_trip_restores_box_byte_for_byte(registry, base_ref, box, tmp_path):
    result = commit_json(f"{registry.host}/box:v1", base_ref, box)
    out = tmp_path / "restored"
    r = snap("restore", f"{registry.host}/box:v1", "--root", str(out), check=True)
    assert "restored" in r.stdout

    expected = snapshot_of_tree(box, skip=NOT_CAPTURED)
    got = snapshot_of_tree(str(out), skip=NOT_CAPTURED)
    assert got == expected
    # The sanity of the comparison itself: it did see the box's new and changed files.
    assert "opt/app/models/checkpoints/sd15.safetensors" in got
    assert got["opt/app/custom_nodes/NodeB/__init__.py"][1] == "0o600"
    link = got["opt/app/custom_nodes/NodeA/nodes_link.py"]
    assert link[5].endswith("linked-with:opt/app/custom_nodes/NodeA/nodes.py")
    assert got["usr/lib/libfake.so"][0] == "link"
    assert not (out / "opt/app/old_cache.bin").exists()  # whiteout applied
    assert not (out / "tmp/scratch.txt").exists()  # excluded
    assert result["deleted"] == 1


def test_image_layout_split_and_media_types(registry, base_ref, box):
    commit_json(f"{registry.host}/layout:v1", base_ref, box)
    m = registry.manifest("layout", "v1")
    base = registry.manifest("base", "1")
    assert m["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    # Base layers first, unchanged, then one layer per non-empty profile layer, in profile order, weights last.
    assert [d["digest"] for d in m["layers"][:2]] == [d["digest"] for d in base["layers"]]
    named = layers_by_name(m)
    assert list(named) == SNAP_LAYERS
    assert named["venv"]["mediaType"].endswith("tar+zstd")
    assert named["models"]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"  # weights: uncompressed
    ann = m["annotations"]
    assert ann["org.opencontainers.image.base.name"] == base_ref
    assert ann["org.opencontainers.image.base.digest"].startswith("sha256:")
    # Every blob is in the registry, and the config's diff_ids are the uncompressed tar digests.
    cfg = json.loads(registry.blob("layout", m["config"]["digest"]))
    assert len(cfg["rootfs"]["diff_ids"]) == len(m["layers"])
    for desc, diff_id in zip(m["layers"], cfg["rootfs"]["diff_ids"]):
        blob = registry.blob("layout", desc["digest"])
        assert len(blob) == desc["size"]
        if desc["mediaType"].endswith("zstd"):
            blob = zstandard.ZstdDecompressor().stream_reader(blob).read()
        elif desc["mediaType"].endswith("gzip"):
            import gzip
            blob = gzip.decompress(blob)
        import hashlib
        assert "sha256:" + hashlib.sha256(blob).hexdigest() == diff_id
    snap_history = [h for h in cfg["history"] if h.get("created_by", "").startswith("snap commit")]
    assert [h["created_by"] for h in snap_history] == [f"snap commit: {n} layer" for n in named]


def _layer_members(registry, repo, desc, dirs=None):
    """The member names of a layer (only its directories with dirs=True, only the rest with False)."""
    import io
    blob = registry.blob(repo, desc["digest"])
    if desc["mediaType"].endswith("zstd"):
        blob = zstandard.ZstdDecompressor().stream_reader(blob).read()
    with tarfile.open(fileobj=io.BytesIO(blob)) as t:
        return [m.name for m in t.getmembers() if dirs is None or m.isdir() == dirs]


def test_each_path_lands_in_its_layer(registry, base_ref, box):
    commit_json(f"{registry.host}/split:v1", base_ref, box)
    members: dict[str, list[str]] = {}  # per profile layer, over all its image layers
    for d in registry.manifest("split", "v1")["layers"][2:]:
        members.setdefault(d["annotations"]["dev.snap.layer"],
                           []).extend(_layer_members(registry, "split", d, dirs=False))
    assert "opt/app/venv/lib/python3.11/site-packages/torch/_C.so" in members["venv"]
    assert "opt/app/custom_nodes/NodeA/nodes.py" in members["custom_nodes"]
    assert "opt/app/models/checkpoints/sd15.safetensors" in members["models"]
    assert "etc/app.conf" in members["rest"]
    assert "opt/app/custom_nodes" in _layer_members(registry, "split",
                                                    layers_by_name(registry.manifest("split", "v1"))["custom_nodes"])
    assert "opt/app/.wh.old_cache.bin" in members["models"]  # *.bin is a weight extension: its whiteout goes there too
    for name, names in members.items():
        others = [n for o, ns in members.items() if o != name for n in ns]
        # directories aside: each layer has its parents
        assert not set(names) & set(others), f"layer {name} shares paths with another layer"
    meta = _layer_members(registry, "split", layers_by_name(registry.manifest("split", "v1"))[MODELS_META])
    assert meta == sorted(meta, key=lambda p: (p.rpartition("/")[0], not p.rpartition("/")[2].startswith(".wh."), p))
    assert meta.index("opt/app/.wh.old_cache.bin") < meta.index("opt/app/models")  # whiteouts before siblings


def test_recommit_keeps_unchanged_layers_and_skips_upload(registry, base_ref, box, monkeypatch):
    """A second commit takes the layers whose files did not change from the stat cache, without
    reading them; only the layer with the changed file is built and uploaded."""
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)  # the box's files count as old: the first commit caches
    first = commit_box(f"{registry.host}/inc:v1", base_ref, CommitOptions(root=box))
    # Change one custom node file only.
    write_tree(box, {"opt/app/custom_nodes/NodeB/__init__.py": "B = 3\n"}, mtime=1_700_000_000)
    r = snap("commit", f"{registry.host}/inc:v2", "--base", base_ref, "--root", box, check=True)
    assert "models: exists, skipped (unchanged, not read)" in r.stdout
    assert "venv: exists, skipped (unchanged, not read)" in r.stdout
    assert "custom_nodes: uploaded" in r.stdout
    a = layers_by_name(registry.manifest("inc", "v1"))
    b = layers_by_name(registry.manifest("inc", "v2"))
    assert a["venv"]["digest"] == b["venv"]["digest"]
    assert a["models"]["digest"] == b["models"]["digest"]
    assert a["custom_nodes"]["digest"] != b["custom_nodes"]["digest"]
    assert {layer.name: layer.status for layer in first.layers}["models"] == "uploaded"


def test_only_snapshot_onto_an_existing_base(registry, base_ref, base_rootfs, box, tmp_path):
    commit_json(f"{registry.host}/only:v1", base_ref, box)
    target = tmp_path / "vm"
    subprocess.run(["cp", "-a", base_rootfs, str(target)], check=True)
    r = snap("restore", f"{registry.host}/only:v1", "--root", str(target), "--only-snapshot", "--json", check=True)
    applied = json.loads(r.stdout)["applied"]
    assert applied == SNAP_LAYERS
    assert snapshot_of_tree(str(target), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_type_changes_and_deleted_trees(registry, base_ref, base_rootfs, tmp_path):
    """A base file that became a directory, a base directory that became a file, a deleted tree."""
    box = tmp_path / "box"
    subprocess.run(["cp", "-a", base_rootfs, str(box)], check=True)
    os.unlink(box / "opt/app/main.py")
    write_tree(str(box), {"opt/app/main.py/__init__.py": "now a package\n",
                          "opt/app/models/x.bin": b"w" * 1000})
    subprocess.run(["rm", "-rf", str(box / "var/lib/app")], check=True)
    subprocess.run(["rm", "-rf", str(box / "usr/share/doc")], check=True)
    (box / "usr/share/doc").write_text("a file where a directory was\n")
    commit_json(f"{registry.host}/types:v1", base_ref, str(box))
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/types:v1", "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(str(box), skip=NOT_CAPTURED)


def test_unchanged_box_gives_base_layers_only(registry, base_ref, base_rootfs, tmp_path):
    box = tmp_path / "same"
    subprocess.run(["cp", "-a", base_rootfs, str(box)], check=True)
    r = snap("commit", f"{registry.host}/same:v1", "--base", base_ref, "--root", str(box), check=True)
    assert "no changes" in r.stdout
    assert registry.manifest("same", "v1")["layers"] == registry.manifest("base", "1")["layers"]


def test_rehash_finds_content_changed_behind_same_size_and_mtime(registry, base_ref, base_rootfs, tmp_path):
    """--rehash compares the contents of files whose metadata matches the base: a base file
    rewritten at the same size with its mtime put back is captured, and no file that is the same."""
    box = tmp_path / "box"
    subprocess.run(["cp", "-a", base_rootfs, str(box)], check=True)
    write_tree(str(box), {"opt/app/config.yaml": "port: 9999\n"})  # same size, same mtime as the base's
    hashed = commit_json(f"{registry.host}/rehash:v1", base_ref, str(box), "--rehash")
    assert [layer["name"] for layer in hashed["layers"]] == ["rest"]
    rest = layers_by_name(registry.manifest("rehash", "v1"))["rest"]
    assert _layer_members(registry, "rehash", rest) == ["opt", "opt/app", "opt/app/config.yaml"]  # and its parents
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/rehash:v1", "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(str(box), skip=NOT_CAPTURED)
    assert (out / "opt/app/config.yaml").read_text() == "port: 9999\n"


def test_extended_attributes_round_trip(registry, base_ref, box, tmp_path):
    """xattrs of changed files travel in PAX records (binary values too) and are written back."""
    path = os.path.join(box, "opt/app/custom_nodes/NodeB/__init__.py")
    os.setxattr(path, "user.snap.origin", b"\xff\x00binary-value")
    os.setxattr(os.path.join(box, "opt/app/models"), "user.snap.dir", b"on a directory")
    commit_json(f"{registry.host}/xattrs:v1", base_ref, box)
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/xattrs:v1", "--root", str(out), check=True)
    got = snapshot_of_tree(str(out), skip=NOT_CAPTURED)
    assert got == snapshot_of_tree(box, skip=NOT_CAPTURED)
    assert os.getxattr(out / "opt/app/custom_nodes/NodeB/__init__.py", "user.snap.origin") == b"\xff\x00binary-value"
