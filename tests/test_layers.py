"""What a layer carries and how it is read back: configs valid by the OCI schema, layers read by
their bytes rather than their label, parent directories in every layer, hardlinked weights."""

import json
import os
import stat
import subprocess
import tarfile

from snapshotter.index.entry import DIR, FILE, Entry
from snapshotter.layer.parents import add_parent_dirs
from snapshotter.layer.plan import LayerPlan

from support.images import layer_tar, layers_by_name, push
from support.run import assert_one_line_error, commit_json, snap
from support.schema import oci_validator
from support.tars import tar_of_files
from support.trees import (
    BIG,
    LINKED,
    NOT_CAPTURED,
    MiB,
    assert_content_written_once,
    hardlink_box,
    home_box,
    make_box,
    make_home_base,
    profile_excluding_nothing,
    snapshot_of_tree,
    write_tree,
)


def test_manifest_and_config_validate_against_the_image_spec_schema(registry, base_ref, base_rootfs, tmp_path):
    """A base config as Docker writes it (nulls in config and container_config) gives a snapshot
    config and manifest that the image-spec v1.1 schemas accept; the exposed port survives."""
    base = registry.manifest("base", "1")
    nulls = {"User": "", "Env": None, "Entrypoint": None, "Cmd": ["/bin/sh"], "WorkingDir": "", "Labels": None,
             "Volumes": None, "OnBuild": None, "ExposedPorts": {"8188/tcp": {}}, "StopSignal": None}
    registry.push_image("nullbase", "1", [registry.blob("base", d["digest"]) for d in base["layers"]],
                        config={"config": nulls, "container_config": dict(nulls, Image=""), "author": None,
                                "variant": None})
    box = make_box(base_rootfs, str(tmp_path / "box"))
    commit_json(f"{registry.host}/nullbox:v1", f"{registry.host}/nullbase:1", box)

    manifest = registry.manifest("nullbox", "v1")
    config = json.loads(registry.blob("nullbox", manifest["config"]["digest"]))
    # The check itself: the base's own config is refused by the schema.
    base_config = json.loads(registry.blob("nullbase", registry.manifest("nullbase", "1")["config"]["digest"]))
    assert list(oci_validator("config-schema.json").iter_errors(base_config))
    oci_validator("image-manifest-schema.json").validate(manifest)
    oci_validator("config-schema.json").validate(config)
    assert config["config"]["ExposedPorts"] == {"8188/tcp": {}} and config["config"]["Cmd"] == ["/bin/sh"]
    assert "Env" not in config["config"] and "author" not in config


# ---- layers read by their bytes ---------------------------------------------------------------

DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def put_manifest(registry, repo: str, tag: str, manifest: dict) -> None:
    r = registry.session().put(f"{registry.url}/v2/{repo}/manifests/{tag}", data=json.dumps(manifest).encode(),
                               headers={"Content-Type": manifest["mediaType"]})
    r.raise_for_status()


def as_docker_pushes_it(manifest: dict) -> dict:
    """The manifest `docker push` writes for an image it pulled: Docker's schema 2, every layer
    labelled gzip (snap's plain-tar weights included), no annotations."""
    return {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": manifest["config"]["digest"], "size": manifest["config"]["size"]},
            "layers": [{"mediaType": DOCKER_GZIP, "digest": d["digest"], "size": d["size"]}
                       for d in manifest["layers"]]}


def test_layers_are_read_by_their_bytes_not_their_label(registry, base_ref, box, tmp_path):
    """After docker pull + docker push, snap's plain-tar weight layers are labelled gzip; elsewhere
    gzip bytes may come labelled zstd. Restore, verify and commit (reading it as a base) read each
    layer by its magic bytes, say in one line which label is wrong, and restore the box byte for byte."""
    commit_json(f"{registry.host}/relabel:src", base_ref, box, "--compression", "gzip")
    m = registry.manifest("relabel", "src")
    put_manifest(registry, "relabel", "pushed", as_docker_pushes_it(m))
    zstd_label = dict(m,
                      layers=[dict(d, mediaType=LAYER_ZSTD) if d.get("annotations", {}).get("dev.snap.layer") == "venv"
                                 else d for d in m["layers"]])
    put_manifest(registry, "relabel", "zstd-label", zstd_label)
    expected = snapshot_of_tree(box, skip=NOT_CAPTURED)

    plain = sum(d["mediaType"] == "application/vnd.oci.image.layer.v1.tar" for d in m["layers"])
    assert plain == 2  # the weights and the models' directories
    for tag, wrong, count in (("pushed", f"labelled {DOCKER_GZIP} but its bytes are a plain tar", plain),
                              ("zstd-label", f"labelled {LAYER_ZSTD} but its bytes are gzip", 1)):
        ref = f"{registry.host}/relabel:{tag}"
        out = tmp_path / f"restored-{tag}"
        r = snap("restore", ref, "--root", str(out), check=True)
        assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == expected
        lines = [line for line in r.stderr.splitlines() if "labelled" in line]
        assert len(lines) == count and all(line.startswith("warning: ") and wrong in line for line in lines), r.stderr
        for d, _, files in os.walk(out):  # times verify does not compare: no layer is found whole, each is read
            for name in files:
                os.utime(os.path.join(d, name), (1_650_000_123, 1_650_000_123), follow_symlinks=False)
        r = snap("verify", ref, "--root", str(out), check=True)
        assert wrong in r.stderr
        # The relabelled image as the base of a commit: its index is read by the bytes too (on
        # another machine: the restore here indexed the base it applied).
        r = snap("commit", f"{registry.host}/relabel:on-{tag}", "--base", ref, "--root", str(out), check=True,
                 env={"SNAP_STATE_DIR": str(tmp_path / f"state-{tag}")})
        assert wrong in r.stderr


# ---- parent directories --------------------------------------------------------------------------


def assert_layers_carry_their_parents(registry, repo: str, tag: str, box: str) -> dict[str, list[tarfile.TarInfo]]:
    """Every snap layer of the image holds each parent directory of each of its paths, with the
    box's mode and owner; the topmost layer holding a directory has its mtime too. Returns each
    layer's members by label."""
    layers = {}
    topmost: dict[str, tarfile.TarInfo] = {}
    for label, desc in layers_by_name(registry.manifest(repo, tag)).items():
        with layer_tar(registry, repo, desc) as t:
            members = t.getmembers()
        layers[label] = members
        names = {m.name.rstrip("/"): m for m in members}
        for m in members:
            parent = m.name.rstrip("/").rpartition("/")[0]
            while parent:
                assert parent in names and names[parent].isdir(), f"{label}: /{m.name} without its parent /{parent}"
                st = os.lstat(os.path.join(box, parent))
                got = names[parent]
                assert (got.mode, got.uid, got.gid) == (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid), (label, parent)
                xattrs = {k: v for k, v in got.pax_headers.items() if k.startswith("SCHILY.xattr.")}
                want = {"SCHILY.xattr." + n:
                        os.getxattr(os.path.join(box, parent), n).decode("utf-8", "surrogateescape")
                        for n in os.listxattr(os.path.join(box, parent)) if n.startswith("user.")}
                assert xattrs == want, (label, parent)
                parent = parent.rpartition("/")[0]
        topmost.update((name, m) for name, m in names.items() if m.isdir())
    for name, m in topmost.items():
        assert m.mtime == int(os.lstat(os.path.join(box, name)).st_mtime), name
    return layers


def test_every_layer_carries_its_parent_directories(registry, base_ref, base_rootfs, tmp_path):
    """A file added under /home/user/proj (0700 1000:1000 /home/user, both as in the base) and
    under /root: its layer holds home/, home/user/ and home/user/proj/ with the box's attributes,
    and a restore of the snapshot's layers alone, into an empty directory, gives them back."""
    base_ref, rootfs = make_home_base(registry, str(tmp_path), "homebase")
    box = home_box(rootfs, str(tmp_path / "box"))
    commit_json(f"{registry.host}/homebox:v1", base_ref, box)
    layers = assert_layers_carry_their_parents(registry, "homebox", "v1", box)
    rest = {m.name.rstrip("/"): m for m in layers["rest"]}
    assert {"home", "home/user", "home/user/proj", "home/user/proj/new.txt", "root", "root/notes.txt"} <= set(rest)
    assert (rest["home/user"].mode, rest["home/user"].uid, rest["home/user"].gid) == (0o700, 1000, 1000)
    assert "home/user/.profile" not in rest  # parents only, not their other contents
    assert rest["home"].pax_headers["SCHILY.xattr.user.snap.parent"] == "kept in every layer under it"
    # The usual box too: venv, custom nodes, weights and their directories' layer, each with its parents.
    box2 = make_box(base_rootfs, str(tmp_path / "box2"))
    # A box of the other base: against homebase it deletes /home, which a commit refuses unforced.
    commit_json(f"{registry.host}/homebox:v2", base_ref, box2, "--force")
    assert len(assert_layers_carry_their_parents(registry, "homebox", "v2", box2)) == 5

    out = tmp_path / "snapshot-only"
    snap("restore", f"{registry.host}/homebox:v1", "--root", str(out), "--only-snapshot", check=True)
    for rel in ("home", "home/user", "home/user/proj", "root"):
        want, got = os.lstat(os.path.join(box, rel)), os.lstat(out / rel)
        assert (got.st_mode, got.st_uid, got.st_gid, int(got.st_mtime)) == \
            (want.st_mode, want.st_uid, want.st_gid, int(want.st_mtime)), rel


# ---- hardlinked weights ------------------------------------------------------------------------------

def same_inode(root: str, names) -> bool:
    return len({os.lstat(os.path.join(root, n)).st_ino for n in names}) == 1


def tree_without_link_order(root: str) -> dict:
    """snapshot_of_tree, without which name of an inode a walk met first (compared by same_inode)."""
    return {k: v[:5] + (v[5].split(" linked-with:")[0],) + v[6:]
            for k, v in snapshot_of_tree(root, skip=NOT_CAPTURED).items()}


def test_hardlinked_weights_get_their_own_layer_and_stay_one_inode(registry, base_ref, base_rootfs, tmp_path):
    box, profile = hardlink_box(base_rootfs, str(tmp_path / "box"))
    commit_json(f"{registry.host}/links:v1", base_ref, box, "--profile", profile)
    layers = assert_content_written_once(registry, "links", "v1")
    single = {m.name: m for m in layers[f"models ({BIG})"]}
    assert single[BIG].isreg() and single[BIG].size == 3 * MiB + 5
    assert all(single[n].islnk() and single[n].linkname == BIG for n in LINKED[0][1:])
    assert sum(1 for label in layers if label.startswith("models (bundle")) > 2  # c000's link travels with it

    out = tmp_path / "restored"
    snap("restore", f"{registry.host}/links:v1", "--root", str(out), check=True)
    assert tree_without_link_order(str(out)) == tree_without_link_order(box)
    assert all(same_inode(str(out), names) for names in LINKED)


def test_a_hardlinked_file_cut_into_parts_is_linked_again_after_the_join(registry, base_ref, base_rootfs, tmp_path):
    """Over --max-layer-size the first name is cut into part layers; its other names are listed on
    the last part, and restore links them to the joined file. verify sees them too."""
    box, profile = hardlink_box(base_rootfs, str(tmp_path / "box"))
    ref = f"{registry.host}/links:parts"
    commit_json(ref, base_ref, box, "--profile", profile, "--max-layer-size", "1MiB")
    layers = assert_content_written_once(registry, "links", "parts")
    parts = [label for label in layers if label.startswith("models (part ") and label.endswith(f" of {BIG})")]
    assert parts == [f"models (part {i}/4 of {BIG})" for i in range(1, 5)]
    last = layers_by_name(registry.manifest("links", "parts"))[parts[-1]]
    assert json.loads(last["annotations"]["dev.snap.part-links"]) == list(LINKED[0][1:])
    assert not any(m.name in LINKED[0] for label in layers for m in layers[label])  # only the parts carry it

    out = tmp_path / "restored"
    snap("restore", ref, "--root", str(out), check=True)
    assert tree_without_link_order(str(out)) == tree_without_link_order(box)
    assert all(same_inode(str(out), names) for names in LINKED)
    snap("verify", ref, "--root", str(out), check=True)
    os.unlink(out / LINKED[0][2])
    r = snap("verify", ref, "--root", str(out))
    assert r.returncode == 9 and f"/{LINKED[0][2]}: missing" in r.stdout


def test_part_links_from_a_hostile_image_stay_in_the_root(registry, base_ref, base_rootfs, tmp_path):
    """The other names of a cut file come from a manifest annotation: a name that leaves the root,
    a malformed list, or a name under a symlink to outside the root never writes outside it."""
    box, profile = hardlink_box(base_rootfs, str(tmp_path / "box"))
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(str(outside), os.path.join(box, "opt/app/escape"))  # absolute: resolved inside the root at restore
    commit_json(f"{registry.host}/evil-links:src", base_ref, box, "--profile", profile, "--max-layer-size", "1MiB")
    m = registry.manifest("evil-links", "src")
    last = next(d for d in m["layers"] if d.get("annotations", {}).get("dev.snap.part-links"))

    def with_links(value: str) -> dict:
        return dict(m, layers=[dict(d, annotations=dict(d["annotations"], **{"dev.snap.part-links": value}))
                               if d is last else d for d in m["layers"]])

    for tag, value in (("dotdot", json.dumps(["../../evil"])), ("absolute", json.dumps(["/evil"])),
                       ("malformed", "[not json"), ("not-a-list", json.dumps({"a": 1})), ("itself", json.dumps([BIG]))):
        put_manifest(registry, "evil-links", tag, with_links(value))
        out = tmp_path / f"out-{tag}"
        assert_one_line_error(snap("restore", f"{registry.host}/evil-links:{tag}", "--root", str(out)), 6, "refusing")
        assert not out.exists()  # refused before anything is written
    assert not (tmp_path / "evil").exists()

    put_manifest(registry, "evil-links", "symlink", with_links(json.dumps(["opt/app/escape/evil.bin"])))
    out = tmp_path / "out-symlink"
    # `outside` lies below /tmp: see profile_excluding_nothing.
    snap("restore", f"{registry.host}/evil-links:symlink", "--root", str(out), "--profile",
         profile_excluding_nothing(tmp_path), check=True)
    assert not os.listdir(outside)
    assert same_inode(str(out), [BIG, str(outside).lstrip("/") + "/evil.bin"])  # the link landed inside the root


ROOT_WEIGHTS_PROFILE = """
extends: default
layers:
  - name: models
    extensions: [.safetensors]
    compression: none
    file_layer_min: 1MiB
    bundle_max: 64KiB
"""


def test_a_weight_layer_keeps_its_digest_when_its_base_directory_first_changes(registry, base_ref, base_rootfs,
                                                                               tmp_path):
    """A weight in a directory of the base whose mtime the box kept (a model rewritten in place):
    the directory is unchanged, the weight's layer carries it. Then a file is added beside it: the
    directory changes, the topmost layer carrying it moves to the last one, and the weight's layer
    keeps its digest (it is not uploaded again); the restored directory has the box's mtime."""
    box = str(tmp_path / "box")
    subprocess.run(["cp", "-a", base_rootfs, box], check=True)
    write_tree(box, {"opt/app/big.safetensors": os.urandom(2 * MiB)}, mtime=1_650_000_000)
    os.utime(os.path.join(box, "opt/app"), (1_600_000_000, 1_600_000_000))  # as in the base
    profile = str(tmp_path / "profile.yaml")
    with open(profile, "w") as f:
        f.write(ROOT_WEIGHTS_PROFILE)
    weight = "models (opt/app/big.safetensors)"

    def layers(tag):
        got = commit_json(f"{registry.host}/basedir:{tag}", base_ref, box, "--profile", profile)
        return {x["name"]: x for x in got["layers"]}

    v1 = layers("v1")
    write_tree(box, {"opt/app/notes.txt": "beside the weight\n"})
    os.utime(os.path.join(box, "opt/app"), (1_700_000_000, 1_700_000_000))
    v2 = layers("v2")
    assert v2[weight]["digest"] == v1[weight]["digest"] and v2[weight]["status"].startswith("exists")
    assert_layers_carry_their_parents(registry, "basedir", "v2", box)
    out = tmp_path / "restored"
    snap("restore", f"{registry.host}/basedir:v2", "--root", str(out), check=True)
    assert os.lstat(out / "opt/app").st_mtime == 1_700_000_000


def test_a_snapshot_past_the_engines_layer_limit_is_warned_of_naming_docker_and_podman(registry, request, tmp_path):
    """Docker refuses images of more than about 125 layers, podman fails to start them from 126 to 133;
    snap restore has no limit. A base of 125 layers and two snap layers on it: 127."""
    base = push(registry, request, *(tar_of_files({f"l/{i:03d}": b"x"}, dirs=("l",)) for i in range(125)))
    box = str(tmp_path / "box")
    snap("restore", base, "--root", box, check=True)
    write_tree(box, {"opt/new.txt": "new\n", "opt/app/custom_nodes/N/nodes.py": "n = 1\n"})
    r = snap("commit", f"{registry.host}/many-layers:v1", "--base", base, "--root", box, check=True)
    warning = [line for line in r.stderr.splitlines() if "Docker cannot run" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: the image has 127 layers"), r.stderr
    assert all(word in warning[0] for word in ("Docker", "125", "podman", "126 and 133", "snap restore")), warning
    # A commit that pushes twice (the registry lost the layer it reuses): the image is warned of once.
    (rest,) = [d for d in registry.manifest("many-layers", "v1")["layers"]
               if d.get("annotations", {}).get("dev.snap.layer") == "rest"]
    hexd = rest["digest"].split(":", 1)[1]
    os.unlink(os.path.join(registry.storage, "docker/registry/v2/blobs/sha256", hexd[:2], hexd, "data"))
    write_tree(box, {"opt/app/custom_nodes/N/nodes.py": "n = 2\n"})
    r = snap("commit", f"{registry.host}/many-layers:v1", "--base", base, "--root", box, check=True)
    assert "looking each blob up and sending the lost ones again" in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if "Docker cannot run" in line] == warning, r.stderr


def test_a_new_directory_below_its_topmost_layer_carries_the_newest_mtime_of_that_layers_paths_under_it():
    """A directory the base lacks, in a layer below the topmost that carries it: its copy there has
    the newest mtime of that layer's own paths under it (deeper ones too), not the box's."""
    d = lambda path, mtime: Entry(path, DIR, 0o755, mtime=mtime)  # noqa: E731
    f = lambda path, mtime: Entry(path, FILE, 0o644, size=1, mtime=mtime)  # noqa: E731
    box = {e.path: e for e in [d("opt", 50), d("opt/new", 900), d("opt/new/a", 800), d("opt/new/b", 700),
                               f("opt/new/a/x.py", 30), f("opt/new/a/deep/y.py", 40), f("opt/new/b/z.py", 20)]}
    box["opt/new/a/deep"] = d("opt/new/a/deep", 600)
    lower = LayerPlan("venv", "zstd", [box["opt/new/a/deep/y.py"], box["opt/new/a/x.py"], box["opt/new/b/z.py"]])
    top = LayerPlan("rest", "zstd", [box["opt/new"], box["opt/new/a"], box["opt/new/a/deep"], box["opt/new/b"]])
    changed = {p: e for p, e in box.items() if p != "opt"}
    add_parent_dirs([lower, top], box, changed, {"opt": d("opt", 50)})
    mtimes = {e.path: e.mtime for e in lower.entries if e.kind == DIR}
    assert mtimes == {"opt": 50, "opt/new": 40, "opt/new/a": 40, "opt/new/a/deep": 40, "opt/new/b": 20}
    assert [e.path for e in lower.entries] == sorted(e.path for e in lower.entries)


def test_a_parent_copy_is_its_directory_but_for_mtime_stamp_inode_and_digest():
    """parent_copy() names every field of an Entry (for speed): a field added to Entry and not named
    there would be dropped from every parent directory a layer carries."""
    import dataclasses

    from snapshotter.layer.parents import parent_copy

    values = {f.name: f"x-{f.name}" for f in dataclasses.fields(Entry)}
    e = Entry(**values)
    assert parent_copy(e, 7) == dataclasses.replace(e, mtime=7, stamp="", inode=None, digest=None)
