"""Bare VMs: a box with no base image (`--base scratch`), and a restore that never wrecks a live
system (a full image refused onto a root that holds an OS; the profile's excludes never written).
The VM is a tree laid out like an Ubuntu GPU VM: etc/os-release, usr/bin, a user's ComfyUI and
Hugging Face cache in /home/ubuntu, conda in /opt/conda."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from snapshotter.oci.image import SNAP_BASE_LAYERS
from snapshotter.registry.remote import host_platform

from support.images import layers_by_name, push, push_base_image
from support.run import assert_one_line_error, commit_json, snap
from support.schema import oci_validator
from support.tars import member, tar_bytes
from support.trees import snapshot_of_tree, write_tree

UBUNTU = 1000  # the VM's user


def make_vm_root(root: str, hostname: str = "gpu-vm-1") -> str:
    """A tree that looks like a GPU VM: an OS, the machine's own files, and a user's app."""
    write_tree(root, {
        "etc/os-release": 'PRETTY_NAME="Ubuntu 22.04.4 LTS"\nID=ubuntu\nVERSION_ID="22.04"\n',
        "etc/passwd": "root:x:0:0:root:/root:/bin/bash\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n",
        "etc/hostname": f"{hostname}\n",
        "etc/hosts": f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n",
        "etc/resolv.conf": "nameserver 127.0.0.53\n",
        "usr/bin/python3": b"\x7fELF" + hashlib.sha256(hostname.encode()).digest() * 100,
        "usr/lib/x86_64-linux-gnu/libc.so.6": b"libc of " + hostname.encode() * 500,
        "bin": "->usr/bin",
        "var/log/syslog": "boot\n",
        "tmp/.X0-lock": "1234\n",
    })
    return root


def add_user_app(root: str) -> dict[str, bytes]:
    """The user's work on the VM: ComfyUI with a custom node and a model, the HF cache, conda."""
    files = {
        "home/ubuntu/ComfyUI/main.py": b"print('comfy')\n",
        "home/ubuntu/ComfyUI/custom_nodes/NodeA/__init__.py": b"NODE_CLASS_MAPPINGS = {}\n",
        "home/ubuntu/ComfyUI/models/checkpoints/sd15.safetensors": os.urandom(1_500_000),
        "home/ubuntu/.cache/huggingface/hub/models--org--tiny/blobs/" + "a" * 64: os.urandom(200_000),
        "home/ubuntu/.cache/huggingface/hub/models--org--tiny/refs/main": b"0123abcd\n",
        "opt/conda/bin/python3.11": b"#!conda python\n" * 50,
        "opt/conda/lib/python3.11/site-packages/torch/__init__.py": b"import math\n" * 300,
    }
    write_tree(root, files)
    write_tree(root, {"home/ubuntu/.cache/huggingface/hub/models--org--tiny/snapshots/0123abcd/model.bin":
                      "->../../blobs/" + "a" * 64,
                      "home/ubuntu/.ssh/id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----\n",
                      "home/ubuntu/ComfyUI/.env": "HF_TOKEN=hf_secret\n",
                      "home/ubuntu/notes.txt": "not included\n"})
    for dirpath, dirs, names in os.walk(os.path.join(root, "home/ubuntu")):
        for n in [dirpath] + [os.path.join(dirpath, x) for x in dirs + names]:
            os.chown(n, UBUNTU, UBUNTU, follow_symlinks=False)
    return files


def strict_tree(root: str) -> dict[str, tuple]:
    """Every path (the root too) with what any write would change: inode, type and mode, owner,
    size, mtime and ctime in ns, content or link target."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for p in [dirpath] + [os.path.join(dirpath, n) for n in dirs + names]:
            st = os.lstat(p)
            if os.path.islink(p):
                extra = os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    extra = hashlib.sha256(f.read()).hexdigest()
            else:
                extra = ""
            out[os.path.relpath(p, root)] = (st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size,
                                             st.st_mtime_ns, st.st_ctime_ns, extra)
    return out


@pytest.fixture(autouse=True)
def only_loopback(monkeypatch):
    """Were `scratch` ever read as Docker Hub's image again, its requests end at a closed local port."""
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost,::1")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost,::1")


@pytest.fixture
def vm_root(tmp_path):
    return make_vm_root(str(tmp_path / "vm"))


INCLUDES = ("/home/ubuntu/ComfyUI", "/home/ubuntu/.cache/huggingface", "/opt/conda")
# What the machine owns, and what a snapshot leaves out (secrets): never in the image.
NOT_CAPTURED = ("tmp", "etc/hostname", "etc/hosts", "etc/resolv.conf", "home/ubuntu/.ssh", "home/ubuntu/ComfyUI/.env")


def under(rel: str, tops) -> bool:
    return any(rel == t or rel.startswith(t + "/") for t in tops)


def parents(tops) -> set[str]:
    return {"/".join(t.split("/")[:i]) for t in tops for i in range(1, t.count("/") + 1)}


# ---- a VM with no base image ------------------------------------------------------------------------

def test_scratch_commit_of_a_vm_restores_exactly_its_paths_on_another_vm(registry, vm_root, tmp_path):
    add_user_app(vm_root)
    ref = f"{registry.host}/vmbox:v1"
    doc = commit_json(ref, "scratch", vm_root, *[a for p in INCLUDES for a in ("--include", p)])
    assert doc["base_layers"] == 0
    assert doc["skipped_secrets"] == ["home/ubuntu/ComfyUI/.env"]

    # A valid OCI image of its own: no base layer, the host's platform, one diff_id and history entry per layer.
    manifest = registry.manifest("vmbox", "v1")
    config = json.loads(registry.blob("vmbox", manifest["config"]["digest"]))
    oci_validator("image-manifest-schema.json").validate(manifest)
    oci_validator("config-schema.json").validate(config)
    assert manifest["annotations"][SNAP_BASE_LAYERS] == "0"
    assert "org.opencontainers.image.base.name" not in manifest["annotations"]
    assert (config["os"], config["architecture"]) == host_platform()
    assert len(config["rootfs"]["diff_ids"]) == len(manifest["layers"]) == len(config["history"])
    assert {"venv", "custom_nodes", "models", "rest"} <= {n.split(" ")[0] for n in layers_by_name(manifest)}

    # Another VM: its OS stays, the included paths (and their parents) arrive byte for byte.
    other = make_vm_root(str(tmp_path / "vm2"), hostname="gpu-vm-2")
    before = strict_tree(other)
    snap("restore", ref, "--root", other, check=True)  # no base layers: not refused on a live system
    after = strict_tree(other)
    tops = [p.strip("/") for p in INCLUDES]
    written = {rel for rel in after if under(rel, tops)} | parents(tops) | {"."}  # the root gets new children
    assert {rel: v for rel, v in after.items() if rel not in written} == {
        rel: v for rel, v in before.items() if rel not in written}
    assert after["."][5] == before["."][5]  # its mtime put back
    want = {rel: v for rel, v in snapshot_of_tree(vm_root).items() if rel in written and rel not in NOT_CAPTURED}
    assert {rel: v for rel, v in snapshot_of_tree(other).items() if rel in written} == want
    assert not os.path.exists(os.path.join(other, "home/ubuntu/notes.txt"))  # not included


def test_scratch_without_include_takes_the_whole_root_and_says_how_much(registry, vm_root, tmp_path):
    add_user_app(vm_root)
    ref = f"{registry.host}/vmwhole:v1"
    r = snap("commit", ref, "--base", "scratch", "--root", vm_root, check=True)
    line = next(x for x in r.stderr.splitlines() if "without --include" in x)
    files = sum(1 for rel, v in snapshot_of_tree(vm_root, skip=NOT_CAPTURED).items() if v[0] == "file")
    assert f"{files} files" in line, line
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)
    assert snapshot_of_tree(str(out)) == snapshot_of_tree(vm_root, skip=NOT_CAPTURED)


def test_profile_include_key(registry, vm_root, tmp_path):
    add_user_app(vm_root)
    prof = tmp_path / "vm.yaml"
    prof.write_text("name: vm\nextends: default\ninclude: [/home/ubuntu/ComfyUI]\n")
    ref = f"{registry.host}/vmprof:v1"
    commit_json(ref, "scratch", vm_root, "--profile", str(prof), "--include", "/opt/conda")
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)
    got = set(snapshot_of_tree(str(out)))
    assert got == {rel for rel in snapshot_of_tree(vm_root, skip=NOT_CAPTURED)
                   if under(rel, ("home/ubuntu/ComfyUI", "opt/conda"))} | parents(["home/ubuntu/ComfyUI", "opt/conda"])


@pytest.mark.parametrize("args,words", [
    (("--include", "/home/ubuntu/ComfyUI"), ("needs --base scratch",)),
    (("--base", "scratch", "--include", "/home/ubuntu/nothing"), ("does not exist",)),
    (("--base", "scratch", "--include", "/bin/python3"), ("symlink", "'/bin'")),
    (("--base", "scratch", "--include", "/tmp/.X0-lock"), ("left out by the profile",)),
    (("--base", "scratch", "--include", "/home/../etc"), ("not a path inside the root",)),
])
def test_bad_include(registry, base_ref, vm_root, args, words):
    add_user_app(vm_root)
    if "--base" not in args:
        args = ("--base", base_ref) + args
    r = snap("commit", f"{registry.host}/vmbad:v1", "--root", vm_root, *args)
    assert_one_line_error(r, 2, *words)
    assert "vmbad" not in registry.session().get(f"{registry.url}/v2/_catalog").json()["repositories"]


# ---- a full image onto a live system --------------------------------------------------------------

def test_full_image_onto_a_live_system_is_refused_and_writes_nothing(base_ref, vm_root):
    before = strict_tree(vm_root)
    r = snap("restore", base_ref, "--root", vm_root)
    assert_one_line_error(r, 2, "operating system", "--only-snapshot", "snap run", "--force", repr(vm_root))
    assert strict_tree(vm_root) == before


def test_a_populated_usr_is_a_live_system_too(base_ref, tmp_path):
    root = tmp_path / "root"
    write_tree(str(root), {"usr/bin/python3": "python\n"})
    before = strict_tree(str(root))
    assert_one_line_error(snap("restore", base_ref, "--root", str(root)), 2, "usr/")
    assert strict_tree(str(root)) == before


def test_empty_root_and_force_are_not_refused(base_ref, base_rootfs, tmp_path, vm_root):
    empty = tmp_path / "empty"
    empty.mkdir()
    snap("restore", base_ref, "--root", str(empty), check=True)
    assert (empty / "etc/os-release").read_text() == "NAME=snap-test-base\n"
    snap("restore", base_ref, "--root", vm_root, "--force", check=True)
    assert open(os.path.join(vm_root, "etc/os-release")).read() == "NAME=snap-test-base\n"


def test_only_snapshot_onto_a_live_system_is_not_refused(registry, base_ref, box, vm_root):
    snap("commit", f"{registry.host}/vmonly:v1", "--base", base_ref, "--root", box, check=True)
    snap("restore", f"{registry.host}/vmonly:v1", "--root", vm_root, "--only-snapshot", check=True)
    assert open(os.path.join(vm_root, "etc/app.conf")).read() == "threads = 8\n"
    assert open(os.path.join(vm_root, "etc/os-release")).read().startswith('PRETTY_NAME="Ubuntu')


def test_a_restore_this_run_started_is_resumed_not_refused(registry, base_rootfs, tmp_path):
    """The first run applied base layer 1 (/bin, /etc: the root now has an os-release) and stopped
    on layer 2, gone from the registry; its journal says this restore started here, so the next
    run goes on once the blob is back."""
    root = tmp_path / "root"
    root.mkdir()
    push_base_image(registry, "halfbase", "v1", base_rootfs)
    second = registry.manifest("halfbase", "v1")["layers"][1]["digest"]
    blob = registry.blob("halfbase", second)
    registry.session().delete(f"{registry.url}/v2/halfbase/blobs/{second}").raise_for_status()
    first = snap("restore", f"{registry.host}/halfbase:v1", "--root", str(root))
    assert_one_line_error(first, 5, "missing")
    assert (root / "etc/os-release").exists()
    registry.push_blob("halfbase", blob)
    r = snap("restore", f"{registry.host}/halfbase:v1", "--root", str(root), "--json", check=True)
    assert json.loads(r.stdout)["resumed"] == 1


# ---- the machine's own files ----------------------------------------------------------------------

def test_excluded_paths_are_never_written_whatever_the_image_holds(registry, request, vm_root, tmp_path):
    """An image carrying /etc/hostname, /etc/hosts, /etc/resolv.conf, /tmp and /proc contents, and
    whiteouts of /etc/hosts and of all of /etc's lower entries: none of it touches those paths."""
    image = push(registry, request,
                 tar_bytes(member("etc", "dir"), member("etc/hostname", data=b"image-host\n"),
                       member("etc/hosts", data=b"10.0.0.1 image\n"),
                       member("etc/resolv.conf", data=b"nameserver 10.0.0.1\n"),
                       member("etc/app.conf", data=b"threads = 8\n"), member("tmp", "dir", mode=0o1777),
                       member("tmp/junk", data=b"junk\n"), member("proc", "dir", mode=0o555),
                       member("proc/cpuinfo", data=b"fake\n")),
                 tar_bytes(member("etc", "dir"), member("etc/.wh.hosts"), member("etc/.wh.resolv.conf")),
                 tar_bytes(member("etc", "dir"), member("etc/.wh..wh..opq"), member("etc/app2.conf", data=b"x\n")))
    own = ("etc/hostname", "etc/hosts", "etc/resolv.conf", "tmp", "tmp/.X0-lock")
    before = strict_tree(vm_root)
    snap("restore", image, "--root", vm_root, "--force", check=True)
    after = strict_tree(vm_root)
    assert {p: after.get(p) for p in own} == {p: before[p] for p in own}
    assert open(os.path.join(vm_root, "etc/app2.conf")).read() == "x\n"
    assert not os.path.exists(os.path.join(vm_root, "etc/app.conf"))  # the opaque whiteout did hide it
    assert not os.path.exists(os.path.join(vm_root, "etc/os-release"))  # (and the VM's own: it was forced)
    assert not os.path.exists(os.path.join(vm_root, "tmp/junk"))
    # Into an empty directory: the mount points are made, empty; the machine's files are not written.
    out = tmp_path / "out"
    snap("restore", image, "--root", str(out), check=True)
    assert sorted(os.listdir(out / "etc")) == ["app2.conf"]
    assert os.listdir(out / "tmp") == [] and os.listdir(out / "proc") == []
    assert oct((out / "tmp").stat().st_mode & 0o7777) == "0o1777"
