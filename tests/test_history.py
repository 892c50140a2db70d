"""`snap log` and `snap status` against the real test registry."""

import json
import os
import subprocess

from support.images import push_base_image
from support.registry import RegistryServer, digest_of, diverged_tags
from support.run import snap
from support.trees import write_tree

MiB = 1024 * 1024
MODEL = "opt/app/models/checkpoints/added.safetensors"


def test_log_lists_snapshots_newest_first_with_their_new_layers(registry, base_ref, box):
    repo = f"{registry.host}/base"  # the base image's own repository: its tag "1" is no snapshot
    snap("commit", f"{repo}:snap-a", "--base", base_ref, "--root", box, check=True)
    write_tree(box, {MODEL: os.urandom(2 * MiB)})
    snap("commit", f"{repo}:snap-b", "--base", base_ref, "--root", box, check=True)
    snap("commit", f"{repo}:snap-b-copy", "--base", base_ref, "--root", box, check=True)

    r = snap("log", f"{repo}:snap-b", "--json", check=True)
    snaps = json.loads(r.stdout)
    assert [s["tags"] for s in snaps][-1] == ["snap-a"]
    assert all("1" not in s["tags"] for s in snaps)
    newest, older = snaps[0], snaps[-2]
    assert newest["created"] >= older["created"] >= snaps[-1]["created"]
    b = registry.manifest("base", "snap-b")
    with_model = next(s for s in snaps if "snap-b" in s["tags"])
    assert with_model["digest"] == "sha256:" + __import__("hashlib").sha256(
        registry.session().get(f"{registry.url}/v2/base/manifests/snap-b",
                               headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).content).hexdigest()
    assert with_model["size"] == sum(d["size"] for d in b["layers"]) + b["config"]["size"]
    assert with_model["base"] == base_ref
    # The first snapshot's layers are all new; the second adds the model (and what its directory changed).
    a = registry.manifest("base", "snap-a")
    assert {layer["digest"] for layer in snaps[-1]["new"]} == {d["digest"] for d in a["layers"][2:]}
    model = [layer for layer in snaps[-2]["new"] if layer["label"] == "models" or MODEL in layer["label"]]
    assert model and all(layer["digest"] not in {d["digest"] for d in a["layers"]} for layer in snaps[-2]["new"])

    text = snap("log", f"{repo}:snap-b", check=True).stdout.splitlines()
    assert text[0].split("  ")[0] in (", ".join(newest["tags"]),)
    assert any(line.startswith("    new: ") for line in text)
    # By digest (any, even one not there): the repository's snapshots, as by a tag of it (whose own
    # tag comes last among a snapshot's tags).
    def same(listed):
        return sorted(({**s, "tags": sorted(s["tags"])} for s in listed), key=lambda s: s["digest"])
    for digest in (with_model["digest"], "sha256:" + "0" * 64):
        assert same(json.loads(snap("log", f"{repo}@{digest}", "--json", check=True).stdout)) == same(snaps)


def test_log_of_a_repository_without_snapshots_is_one_line(registry, base_rootfs):
    push_base_image(registry, "only-a-base", "1", base_rootfs)
    r = snap("log", f"{registry.host}/only-a-base:1")
    assert r.returncode == 5 and r.stderr.count("\n") == 1 and "no snapshots" in r.stderr


def test_status_says_what_a_commit_would_send_and_pushes_nothing(registry, base_ref, box, tmp_path):
    write_tree(box, {MODEL: os.urandom(2 * MiB)})
    before = registry.session().get(f"{registry.url}/v2/_catalog").json()
    r = snap("status", "--base", base_ref, "--root", box, "--json", check=True)
    st = json.loads(r.stdout)
    assert all(layer["changed"] for layer in st["layers"]) and st["deleted"] == 1
    assert st["to_send"] >= 2 * MiB + 2_000_000  # the new model and the box's checkpoint, before compression
    assert registry.session().get(f"{registry.url}/v2/_catalog").json() == before

    # A restored box: every layer is known (from the restore), nothing to send until a file changes.
    snap("commit", f"{registry.host}/status:v1", "--base", base_ref, "--root", box, check=True)
    out = str(tmp_path / "restored")
    snap("restore", f"{registry.host}/status:v1", "--root", out, check=True)
    r = snap("status", "--base", base_ref, "--root", out, "--json", check=True)
    assert not any(layer["changed"] for layer in json.loads(r.stdout)["layers"]), r.stdout
    write_tree(out, {"opt/app/custom_nodes/NodeA/nodes.py": "class A: changed = True\n"})
    r = snap("status", "--root", box, check=True)  # --base from the last commit of that root
    assert f"against base {base_ref}," in r.stdout
    r = snap("status", "--base", base_ref, "--root", out, check=True)
    lines = r.stdout.splitlines()
    assert any(line.startswith("custom_nodes: changed, would send") for line in lines), r.stdout
    assert any(line.startswith("venv: unchanged, skipped") for line in lines), r.stdout
    assert lines[-1].startswith("1 of ")


def test_status_of_a_scratch_box_needs_no_registry(tmp_path):
    """With --base scratch there is no base to read: status reads the box alone, and says the tag was
    not looked up when its registry is away (it exited 3 before: the last commit's registry was
    asked before anything else)."""
    box = tmp_path / "box"
    write_tree(str(box), {"opt/app/f.txt": "x\n"})
    reg = RegistryServer(str(tmp_path / "reg")).start()
    try:
        snap("commit", f"{reg.host}/scratch-box:v1", "--base", "scratch", "--root", str(box), check=True)
    finally:
        reg.stop()
    write_tree(str(box), {"opt/app/g.txt": "y\n"})
    r = snap("status", "--base", "scratch", "--root", str(box), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [layer["changed"] for layer in doc["layers"]] == [True] and "not reachable" in doc["tags_error"], doc


def test_status_without_base_before_any_commit_is_one_line(box):
    r = snap("status", "--root", box)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--base is required" in r.stderr


def test_log_and_status_list_the_diverged_tags_beside_the_main_one(registry, base_ref, box, base_rootfs, tmp_path):
    """A box that may not move the tag saved its work to TAG-diverged-<time> (`snap commit --diverge`):
    `snap log TARGET` lists it after the snapshots, and `snap status` on either box says what the tag
    names, whether that box may move it, and the diverged tags, the box's own marked."""
    target = f"{registry.host}/hist-diverged:v2"
    snap("commit", target, "--base", base_ref, "--root", box, check=True)
    bare = tmp_path / "bare"  # a box whose restore failed: the image alone, and its own work
    subprocess.run(["cp", "-a", base_rootfs, str(bare)], check=True)
    write_tree(str(bare), {"opt/app/work.txt": "done on the bare box\n"})
    r = snap("commit", target, "--base", base_ref, "--root", str(bare), "--diverge", check=True)
    [tag] = diverged_tags(registry, "hist-diverged")
    digest = digest_of(registry, "hist-diverged", tag)
    assert f"pushed {registry.host}/hist-diverged:{tag}@{digest}" in r.stdout, r.stdout

    snaps = json.loads(snap("log", target, "--json", check=True).stdout)
    assert [s["diverged"] for s in snaps if s["digest"] == digest] == [[tag]]
    text = snap("log", target, check=True).stdout.splitlines()
    at = next(i for i, line in enumerate(text) if line.startswith("diverged from v2 "))
    assert text[at + 1].startswith(f"    {tag}  ") and text[at + 1].endswith(digest), text

    st = json.loads(snap("status", "--root", str(bare), "--json", check=True).stdout)
    assert (st["tag"], st["tag_digest"], st["movable"]) == (target, digest_of(registry, "hist-diverged", "v2"), False)
    assert [(d["tag"], d["digest"], d["own"]) for d in st["diverged"]] == [(tag, digest, True)]
    lines = snap("status", "--root", str(bare), check=True).stdout.splitlines()
    assert any(line.startswith(f"tag {target}: ") and "neither came from nor made" in line for line in lines), lines
    assert f"diverged: {tag}  " in lines[-1] and lines[-1].endswith("(this box's)"), lines
    st = json.loads(snap("status", "--root", box, "--json", check=True).stdout)
    assert st["movable"] is True and [(d["tag"], d["own"]) for d in st["diverged"]] == [(tag, False)]
