"""`snap verify REF --root DIR`: a restored tree verifies; each kind of change to it is reported."""

import json
import os
import shutil
import struct
import subprocess

import pytest

from support.run import snap
from support.images import CAP_NET_BIND, xattr_snapshot
from support.trees import flip_byte, make_box


@pytest.fixture(scope="module")
def restored_once(registry, base_ref, base_rootfs, tmp_path_factory):
    """A box committed, then restored into a fresh directory, once for this module."""
    d = tmp_path_factory.mktemp("verify")
    env = {"SNAP_STATE_DIR": str(d / "state"), "SNAP_QUIET": "1", "DOCKER_CONFIG": str(d / "docker-config")}
    ref = f"{registry.host}/verify:v1"
    box = make_box(base_rootfs, str(d / "box"))
    snap("commit", ref, "--base", base_ref, "--root", box, env=env, check=True)
    snap("restore", ref, "--root", str(d / "restored"), env=env, check=True)
    return ref, d / "restored"


@pytest.fixture
def restored(restored_once, tmp_path):
    """(ref, a copy of the restored tree this test may change)."""
    ref, out = restored_once
    subprocess.run(["cp", "-a", str(out), str(tmp_path / "restored")], check=True)
    return ref, tmp_path / "restored"


def verify(ref, root, *args):
    r = snap("verify", ref, "--root", str(root), *args)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def verify_json(ref, root, *args):
    r = verify(ref, root, "--json", *args)
    return r.returncode, json.loads(r.stdout)


def test_restored_tree_verifies(restored):
    ref, out = restored
    r = verify(ref, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "matches" in r.stdout
    code, doc = verify_json(ref, out, "--only-snapshot")
    assert code == 0 and doc["ok"] and doc["checked"] > 5


def _modify_content_same_size(out):
    p = out / "opt/app/config.yaml"
    st = os.stat(p)
    p.write_text("port: 9001\n")  # same length
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back


CHANGES = {
    "content": (_modify_content_same_size, "/opt/app/config.yaml", "content"),
    "size": (lambda out: (out / "etc/app.conf").write_text("threads = 16\n"), "/etc/app.conf", "content"),
    "chmod": (lambda out: os.chmod(out / "opt/app/main.py", 0o600), "/opt/app/main.py", "mode"),
    "chown": (lambda out: os.chown(out / "etc/os-release", 1234, 5678), "/etc/os-release", "owner"),
    "symlink": (lambda out: (os.unlink(out / "usr/lib/libfake.so"),
                             os.symlink("elsewhere.so", out / "usr/lib/libfake.so")),
                "/usr/lib/libfake.so", "symlink"),
    "deleted file": (lambda out: os.unlink(out / "opt/app/models/vae/vae.pt"), "/opt/app/models/vae/vae.pt", "missing"),
    "deleted tree": (lambda out: subprocess.run(["rm", "-rf", str(out / "opt/app/custom_nodes")], check=True),
                     "/opt/app/custom_nodes", "missing"),
    "type": (lambda out: (os.unlink(out / "var/lib/app/state.db"), os.mkdir(out / "var/lib/app/state.db")),
             "/var/lib/app/state.db", "type"),
    "whited out file is back": (lambda out: (out / "opt/app/old_cache.bin").write_bytes(b"stale"),
                                "/opt/app/old_cache.bin", "extra"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_change_is_reported(restored, change):
    ref, case = restored
    modify, path, kind = CHANGES[change]
    modify(case)
    r = verify(ref, case)
    assert r.returncode == 9, r.stdout + r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith(path + ":")], r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("snap: error:")]
    assert len(errors) == 1 and "1 path(s)" in errors[0], r.stderr  # exactly this one difference
    code, doc = verify_json(ref, case)
    assert code == 9 and [(d["path"], d["kind"]) for d in doc["differences"]] == [(path, kind)]


def test_extra_files_are_reported_only_when_strict(restored):
    ref, out = restored
    (out / "opt/app/new_dir").mkdir()
    (out / "opt/app/new_dir/a.txt").write_text("not in the image\n")
    (out / "tmp/scratch").write_text("excluded by the profile: never reported\n")
    (out / "root/.ssh").mkdir(parents=True)  # a secret: commit leaves it out on purpose
    assert verify(ref, out).returncode == 0
    code, doc = verify_json(ref, out, "--strict")
    assert code == 9
    assert [(d["path"], d["kind"]) for d in doc["differences"]] == [("/opt/app/new_dir", "extra")]
    r = verify(ref, out, "--strict", "--only-snapshot")
    assert r.returncode == 2 and "drop --only-snapshot" in r.stderr


def test_many_changes_one_line_each(restored):
    ref, out = restored
    for modify, _, _ in CHANGES.values():
        modify(out)
    r = verify(ref, out)
    assert r.returncode == 9
    reported = [line.split(":", 1)[0] for line in r.stdout.splitlines()]
    assert reported == sorted(path for _, path, _ in CHANGES.values())


def test_files_joined_from_part_layers_are_verified(registry, base_ref, box, tmp_path):
    """A file cut into part layers at commit is compared as the whole file restore joins back."""
    with open(os.path.join(box, "opt/app/models/huge.safetensors"), "wb") as f:
        f.write(os.urandom(2 * 1024 * 1024 + 77))
    ref = f"{registry.host}/verify-parts:v1"
    snap("commit", ref, "--base", base_ref, "--root", box, "--max-layer-size", "1MiB", check=True)
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)
    assert verify(ref, out).returncode == 0
    assert verify(ref, out, "--only-snapshot").returncode == 0
    flip_byte(out / "opt/app/models/huge.safetensors", 1024 * 1024 + 5)  # in the second part
    code, doc = verify_json(ref, out)
    assert code == 9
    assert [(d["path"], d["kind"]) for d in doc["differences"]] == [("/opt/app/models/huge.safetensors", "content")]


def test_a_file_joined_from_part_layers_keeps_its_xattrs(registry, tmp_path):
    """A file cut into part layers is joined with the xattrs commit took from it: verify finds it as
    the image has it, and a restart's restore finds its parts in the root (not downloaded)."""
    big, url = "m/big.bin", b"https://example.com/big.bin"
    ref = xattr_snapshot(registry, tmp_path, "verify-parts-xattrs",
                         lambda box: os.setxattr(box / big, "user.xdg.origin.url", url),
                         {big: os.urandom(2 * 1024 * 1024 + 77)}, "--max-layer-size", "1MiB")
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)
    assert os.getxattr(out / big, "user.xdg.origin.url") == url
    assert verify(ref, out).returncode == 0
    r = snap("restore", ref, "--root", str(out), "--json", env={"SNAP_STATE_DIR": str(tmp_path / "restart")},
             check=True)
    assert not [name for name in json.loads(r.stdout)["applied"] if "part" in name], r.stdout


def test_tampered_blob_fails_verify_with_integrity_error(registry, tmp_path):
    import hashlib

    from support.tars import member, tar_bytes
    blob = tar_bytes(member("a.txt", data=b"a" * 1000))
    registry.push_image("verify-tampered", "v1", [blob], layer_media_type="application/vnd.oci.image.layer.v1.tar")
    hexd = hashlib.sha256(blob).hexdigest()
    with open(os.path.join(registry.storage, "docker/registry/v2/blobs/sha256", hexd[:2], hexd, "data"), "r+b") as f:
        f.seek(600)
        f.write(b"b")  # inside a.txt's content: the tar still parses
    (tmp_path / "root").mkdir()
    r = verify(f"{registry.host}/verify-tampered:v1", tmp_path / "root")
    assert r.returncode == 6, r.stderr
    assert "does not match its digest" in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="owners, setuid bits and device nodes need root")
def test_setuid_and_devices_follow_what_restore_writes_by_default(registry, tmp_path):
    from support.tars import member, tar_bytes
    registry.push_image("verify-priv", "v1", [tar_bytes(
        member("bin/", "dir"), member("bin/su", data=b"#!/bin/sh\n", mode=0o4755),
        member("bin/plain", data=b"#!/bin/sh\n", mode=0o755), member("devs/", "dir"),
        member("devs/null", "char", mode=0o666, dev=(1, 3)))],
        layer_media_type="application/vnd.oci.image.layer.v1.tar")
    ref = f"{registry.host}/verify-priv:v1"
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)  # setuid stripped, device skipped
    assert verify(ref, out).returncode == 0
    code, doc = verify_json(ref, out, "--allow-setuid", "--allow-devices")
    assert code == 9
    assert [(d["path"], d["kind"]) for d in doc["differences"]] == [("/bin/su", "mode"), ("/devs/null", "missing")]
    os.chmod(out / "bin/plain", 0o4755)  # a setuid bit the image never had is always reported
    code, doc = verify_json(ref, out)
    assert code == 9 and [(d["path"], d["kind"]) for d in doc["differences"]] == [("/bin/plain", "mode")]


def test_part_names_are_built_and_parsed_in_one_place():
    """plan (which names the parts), restore (which joins them) and verify (which hashes them
    together) share one builder and one parser: names past 9999 parts parse too, others do not."""
    from snapshotter.layer.plan import MAX_PARTS, parse_part_annotation, parse_part_name, part_name
    for path, i, n in [("opt/m.bin", 1, 3), ("a b/c", 7, 7), ("m/x", 10000, 12345), ("x", MAX_PARTS, MAX_PARTS)]:
        assert parse_part_name(part_name(path, i, n)) == (path, i, n)
    assert part_name("m/x", 2, 3) == "m/x.snap-part-0002-of-0003"
    for name in ["m/x", "m/x.snap-part-0002-of-0003.txt", "m/x.snap-part-2-of-3", "m/x.snap-part-00002-of-00003",
                 "m/x.snap-part-0004-of-0003", "m/x.snap-part-0000-of-0003", ".snap-part-0001-of-0001",
                 part_name("m/x", 1, MAX_PARTS + 1), "m/x.snap-part-\u0661\u0662\u0663\u0664-of-1234"]:
        assert parse_part_name(name) is None, name
    assert parse_part_annotation("2/3") == (2, 3)
    for bad in ["", "1", "0/1", "2/1", "1/2\n", " 1/2", "1/-2", f"1/{MAX_PARTS + 1}", None, 12]:
        assert parse_part_annotation(bad) is None, bad


def test_parallel_hashing_finds_what_one_job_finds(restored):
    """Content is hashed several files at once: the same differences, in the same order, as with one
    job (two changed contents, an unreadable-as-different size, a mode)."""
    ref, out = restored
    for change in ("content", "size", "chmod", "deleted file"):
        CHANGES[change][0](out)
    (out / "opt/app/main.py").write_text("print('tampered')\n")
    one = verify_json(ref, out, "--jobs", "1")
    many = verify_json(ref, out, "--jobs", "8")
    assert one[0] == many[0] == 9
    assert one[1]["differences"] == many[1]["differences"]
    paths = [d["path"] for d in many[1]["differences"] if d["kind"] == "content"]
    assert paths == ["/etc/app.conf", "/opt/app/config.yaml", "/opt/app/main.py"], many[1]["differences"]
    bad = verify(ref, out, "--jobs", "0")
    assert bad.returncode != 0 and "--jobs" in bad.stderr and "Traceback" not in bad.stderr


def test_a_split_hardlink_is_reported(restored):
    """Two names the image gives one file, made two files of the same bytes: the second name is
    reported, whether its layer is read from the registry or checked in the directory."""
    ref, out = restored
    first, link = out / "opt/app/custom_nodes/NodeA/nodes.py", out / "opt/app/custom_nodes/NodeA/nodes_link.py"
    assert os.stat(first).st_ino == os.stat(link).st_ino
    os.unlink(link)
    shutil.copy2(first, link)
    for args in ((), ("--read-layers",)):
        code, doc = verify_json(ref, out, *args)
        assert code == 9 and [(d["path"], d["kind"]) for d in doc["differences"]] == [
            ("/opt/app/custom_nodes/NodeA/nodes_link.py", "hardlink")], doc
    r = verify(ref, out)
    assert r.stdout.splitlines()[0] == ("/opt/app/custom_nodes/NodeA/nodes_link.py: not a hardlink to "
                                        "'/opt/app/custom_nodes/NodeA/nodes.py', as in the image"), r.stdout


def test_files_the_image_keeps_apart_made_one_inode_are_reported(registry, tmp_path):
    """Two files of the image with the same bytes made one inode (`ln -f x y`: an edit of one would
    change both): the second is reported, whether the layer is first checked in the directory
    (held.py, which refuses it then: its link counts differ) or read at once (--read-layers); a third
    name the image links to the first is not."""
    ref = xattr_snapshot(registry, tmp_path, "verify-joined-files",
                         lambda box: os.link(box / "opt/x.cfg", box / "opt/z.cfg"),
                         {"opt/x.cfg": "same\n", "opt/y.cfg": "same\n"})
    out = tmp_path / "out"
    snap("restore", ref, "--root", str(out), check=True)
    code, doc = verify_json(ref, out)
    assert code == 0 and doc["layers_held"] == 1, doc  # held.py checks the layer in the directory, unread
    os.unlink(out / "opt/y.cfg")
    os.link(out / "opt/x.cfg", out / "opt/y.cfg")
    for args in ((), ("--read-layers",)):
        code, doc = verify_json(ref, out, *args)
        assert code == 9 and [(d["path"], d["kind"]) for d in doc["differences"]] == [("/opt/y.cfg", "hardlink")], doc
    r = verify(ref, out)
    assert r.stdout.splitlines()[0] == "/opt/y.cfg: a hardlink to '/opt/x.cfg', not in the image", r.stdout


XATTR_CHANGES = {
    "removed": (lambda out: os.removexattr(out / "srv/app/a.txt", "user.tag"), "/srv/app/a.txt", "'user.tag' missing"),
    "changed": (lambda out: os.setxattr(out / "srv/app/a.txt", "user.tag", b"red"), "/srv/app/a.txt",
                "'user.tag' differs"),
    "added": (lambda out: os.setxattr(out / "srv/app/b.txt", "user.evil", b"1"), "/srv/app/b.txt",
              "'user.evil' extra"),
    "added to a directory": (lambda out: os.setxattr(out / "srv/app", "user.evil", b"1"), "/srv/app",
                             "'user.evil' extra"),
    # A POSIX ACL any owner may set (its mask keeps the mode bits; it gives uid 65534 read access).
    "an ACL": (lambda out: _set_acl(out / "srv/app/b.txt"), "/srv/app/b.txt", "'system.posix_acl_access' extra"),
}


def _set_acl(path) -> bool:
    """False where the filesystem takes no POSIX ACLs."""
    try:
        os.setxattr(path, "system.posix_acl_access", POSIX_ACL)
    except OSError:
        return False
    return True


POSIX_ACL = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, uid) for tag, perm, uid in (
    (0x01, 6, 0xFFFFFFFF), (0x02, 4, 65534), (0x04, 4, 0xFFFFFFFF), (0x10, 4, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)))


def test_each_xattr_change_is_reported(registry, tmp_path):
    """An xattr of the image removed or changed, or one it does not have added (to a file or a
    directory), in a restored tree: that path is reported, one line naming the attribute."""
    ref = xattr_snapshot(registry, tmp_path, "verify-xattrs",
                          lambda box: os.setxattr(box / "srv/app/a.txt", "user.tag", b"blue"))
    restored = tmp_path / "restored"
    snap("restore", ref, "--root", str(restored), check=True)
    assert verify(ref, restored).returncode == 0
    for change, (modify, path, what) in XATTR_CHANGES.items():
        out = tmp_path / change.replace(" ", "-")
        subprocess.run(["cp", "-a", str(restored), str(out)], check=True)
        if modify(out) is False:
            continue
        code, doc = verify_json(ref, out, *(("--read-layers",) if change == "removed" else ()))
        assert code == 9 and [(d["path"], d["kind"], d["detail"]) for d in doc["differences"]] == [
            (path, "xattrs", f"extended attribute {what}" + (" (not in the image)" if what.endswith("extra") else ""))
        ], (change, doc)
    r = verify(ref, tmp_path / "added")
    assert r.returncode == 9 and r.stdout.splitlines()[0] == \
        "/srv/app/b.txt: extended attribute 'user.evil' extra (not in the image)", r.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="file capabilities need root")
def test_a_file_capability_follows_what_restore_writes(registry, tmp_path):
    """A capability is compared as setuid bits are: the image's, stripped by a plain restore, is
    required with --allow-setuid and no difference without; one the image never had is reported."""
    def prepare(box):
        os.chmod(box / "srv/app/bin/tool", 0o755)
        os.setxattr(box / "srv/app/bin/tool", "security.capability", CAP_NET_BIND)

    ref = xattr_snapshot(registry, tmp_path, "verify-capability", prepare)
    plain, kept = tmp_path / "plain", tmp_path / "kept"
    snap("restore", ref, "--root", str(plain), check=True)
    snap("restore", ref, "--root", str(kept), "--allow-setuid", check=True)
    assert verify(ref, plain).returncode == 0 and verify(ref, kept).returncode == 0
    assert verify(ref, kept, "--allow-setuid").returncode == 0
    code, doc = verify_json(ref, plain, "--allow-setuid")
    assert code == 9 and [(d["path"], d["detail"]) for d in doc["differences"]] == [
        ("/srv/app/bin/tool", "extended attribute 'security.capability' missing")], doc
    os.setxattr(kept / "srv/app/b.txt", "security.capability", CAP_NET_BIND)
    code, doc = verify_json(ref, kept)
    assert code == 9 and [(d["path"], d["kind"]) for d in doc["differences"]] == [("/srv/app/b.txt", "xattrs")], doc
