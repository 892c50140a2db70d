"""Hostile layers, built by hand and pushed to a real registry, then `snap restore`d into a temp root.

Whatever a layer says, nothing may be created, changed or deleted outside the root: each test
checks a sentinel directory next to the root (and the directories above it) before and after.
A layer that cannot be applied safely is refused with exit code 6."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import tarfile

import pytest

from snapshotter.layer.extract_model import NAMES_KEPT

from support.images import GZIP, MARK, PART, part_ann, part_image, push, push_annotated, repo_for
from support.run import IS_ROOT, assert_one_line_error, snap
from support.tars import gzip_bytes, member, tar_bytes
from support.trees import profile_excluding_nothing

# ---- names that leave the root -----------------------------------------------------------------

@pytest.mark.parametrize("name", [f"../{MARK}", f"a/../../{MARK}", f"./../{MARK}", f"a/b/../../../{MARK}"])
def test_dotdot_names_are_refused(registry, jail, request, name):
    ref = push(registry, request, tar_bytes(member("a/", "dir"), member(name, data=b"escaped\n")))
    line = jail.refused(jail.restore(ref))
    assert "'..'" in line


@pytest.mark.parametrize("gz", [False, True])
def test_absolute_names_are_refused(registry, jail, request, gz):
    ref = push(registry, request, tar_bytes(member(f"{jail.outside}/{MARK}", data=b"escaped\n")), gzip=gz)
    line = jail.refused(jail.restore(ref))
    assert "absolute path" in line
    assert list(jail.root.iterdir()) == []  # the root is made before the layer is read; nothing in it


# ---- symlinks: written as data, never followed out of the root ----------------------------------

def _find(root, name: str) -> list[str]:
    """Where a file called `name` ended up under root (symlinks not followed)."""
    return [os.path.join(d, name) for d, _, files in os.walk(root) if name in files]


# Each escape aims at the sentinel directory, so that an extractor that does follow the link
# damages only the sentinel (and the test sees it), never the machine's own files.
@pytest.mark.parametrize("split", [False, True], ids=["same-layer", "next-layer"])
@pytest.mark.parametrize("target", ["{outside}", "/", "../../..", "../../../../../../../.."])
def test_write_through_an_escaping_symlink_stays_inside(registry, jail, request, split, target, tmp_path_factory):
    target = target.format(outside=jail.outside)
    prefix = jail.through("evil", target, str(jail.outside))
    link = member("evil", "symlink", linkname=target)
    files = [member(f"{prefix}/{MARK}", data=b"inside\n"), member(f"{prefix}/sub/deep", data=b"overwritten\n")]
    layers = [tar_bytes(link), tar_bytes(*files)] if split else [tar_bytes(link, *files)]
    ref = push(registry, request, *layers)
    # The sentinel lies below /tmp: see profile_excluding_nothing.
    jail.ok(jail.restore(ref, "--profile", profile_excluding_nothing(tmp_path_factory.mktemp("profile"))))
    assert os.readlink(jail.root / "evil") == target  # the link itself is data, kept as written
    # Resolved as if the root were '/': the files land inside the root.
    [found] = _find(jail.root, MARK)
    assert open(found, "rb").read() == b"inside\n"
    assert open(os.path.join(os.path.dirname(found), "sub/deep"), "rb").read() == b"overwritten\n"


def test_chain_of_parent_symlinks_stays_inside(registry, jail, request):
    name = jail.base.name
    ref = push(registry, request, tar_bytes(
        member("l1", "symlink", linkname=".."),  # followed by the OS: the test dir, where the sentinel is
        member("l2", "symlink", linkname="l1/.."),  # ... the dir above it
        member("l3", "symlink", linkname="l2"),
        member("d/", "dir"),
        member("d/up", "symlink", linkname="../../.."),
    ), tar_bytes(
        member(f"l1/outside/{MARK}-1", data=b"one\n"),
        member(f"l2/{name}/outside/{MARK}-2", data=b"two\n"),
        member(f"l3/{name}/outside/{MARK}-3", data=b"three\n"),
        member(f"d/up/{name}/outside/{MARK}-4", data=b"four\n"),
    ))
    jail.ok(jail.restore(ref))
    assert (jail.root / f"outside/{MARK}-1").read_bytes() == b"one\n"
    for i, data in ((2, b"two\n"), (3, b"three\n"), (4, b"four\n")):
        assert (jail.root / name / f"outside/{MARK}-{i}").read_bytes() == data


def test_file_replacing_a_symlink_does_not_write_through_it(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("evil", "symlink", linkname=f"{jail.outside}/keep"),
                     member("rel", "symlink", linkname="../outside/keep")),
               tar_bytes(member("evil", data=b"replaced\n"), member("rel", data=b"replaced too\n")))
    jail.ok(jail.restore(ref))
    assert not (jail.root / "evil").is_symlink() and (jail.root / "evil").read_bytes() == b"replaced\n"
    assert (jail.root / "rel").read_bytes() == b"replaced too\n"


def test_directory_replacing_a_symlink_does_not_follow_it(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("evil", "symlink", linkname=str(jail.outside))),
               tar_bytes(member("evil/", "dir", mode=0o700), member("evil/keep", data=b"mine\n")))
    jail.ok(jail.restore(ref))
    assert (jail.root / "evil").is_dir() and not (jail.root / "evil").is_symlink()
    assert stat.S_IMODE(os.lstat(jail.root / "evil").st_mode) == 0o700
    assert (jail.root / "evil/keep").read_bytes() == b"mine\n"


def test_symlink_loop_is_refused(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("a", "symlink", linkname="b"), member("b", "symlink", linkname="a"),
                                       member("a/x", data=b"x")))
    assert "too many symlinks" in jail.refused(jail.restore(ref))


# ---- hardlinks: the target must be inside the root, resolved like any other path ---------------

@pytest.mark.parametrize("linkname", ["../../etc/passwd", "../outside/secret", "/etc/passwd", "{outside}/secret"])
def test_hardlink_out_of_the_root_is_refused(registry, jail, request, linkname):
    linkname = linkname.format(outside=jail.outside)
    ref = push(registry, request, tar_bytes(member("hl", "hardlink", linkname=linkname)))
    jail.refused(jail.restore(ref))
    assert os.stat(jail.outside / "secret").st_nlink == 1
    assert not os.path.lexists(jail.root / "hl")


@pytest.mark.parametrize("via", ["{outside}", "../.."], ids=["absolute", "relative"])
def test_hardlink_through_a_symlink_is_refused(registry, jail, request, via):
    via = via.format(outside=jail.outside)
    target = jail.through("d", via, str(jail.outside / "secret"))
    ref = push(registry, request, tar_bytes(member("d", "symlink", linkname=via)),
               tar_bytes(member("hl", "hardlink", linkname=target)))
    line = jail.refused(jail.restore(ref))
    assert "not in the image" in line
    assert os.stat(jail.outside / "secret").st_nlink == 1


def test_hardlink_to_a_symlink_links_the_symlink_not_its_target(registry, jail, request):
    ref = push(registry, request,
               tar_bytes(member("s", "symlink", linkname=f"{jail.outside}/secret"),
                         member("hl", "hardlink", linkname="s")))
    jail.ok(jail.restore(ref))
    assert os.readlink(jail.root / "hl") == f"{jail.outside}/secret"
    assert os.lstat(jail.root / "hl").st_ino == os.lstat(jail.root / "s").st_ino
    assert os.stat(jail.outside / "secret").st_nlink == 1


def test_refused_hardlink_target_changes_nothing_on_its_way(registry, jail, request):
    """Looking up a hardlink target must not create directories or replace files."""
    ref = push(registry, request, tar_bytes(member("f", data=b"a file\n")),
               tar_bytes(member("hl", "hardlink", linkname="f/x")))
    jail.refused(jail.restore(ref))
    assert (jail.root / "f").read_bytes() == b"a file\n"


# ---- device nodes and privileges -----------------------------------------------------------------

def _devices_layer():
    return tar_bytes(member("dev2/", "dir"), member("dev2/mynull", "char", mode=0o666, dev=(1, 3)),
                 member("dev2/myloop", "block", mode=0o660, dev=(7, 0)))


@pytest.mark.skipif(not IS_ROOT, reason="device nodes need root")
def test_device_nodes_are_skipped_unless_allowed(registry, jail, request, tmp_path):
    ref = push(registry, request,
               tar_bytes(member("dev2/", "dir"), member("dev2/keep/", "dir"), member("dev2/keep/f", data=b"f")),
               _devices_layer(), tar_bytes(member("dev2/keep", "char", dev=(1, 3))))
    r = jail.restore(ref)
    jail.ok(r)
    assert "skipped 3 device node(s)" in r.stderr
    assert sorted(os.listdir(jail.root / "dev2")) == ["keep"]
    assert (jail.root / "dev2/keep/f").read_bytes() == b"f"  # a skipped node leaves the lower tree alone

    other = tmp_path / "root2"
    r = snap("restore", ref, "--root", str(other), "--allow-devices")
    assert r.returncode == 0, r.stderr
    st = os.lstat(other / "dev2/mynull")
    assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3)
    st = os.lstat(other / "dev2/myloop")
    assert stat.S_ISBLK(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (7, 0)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_many_skipped_devices_are_all_counted_but_only_the_first_names_kept(registry, jail, request):
    """The report of skipped devices keeps a bounded sample of names (memory stays flat for a layer of
    millions of device headers), and counts every one."""
    n = NAMES_KEPT + 500
    ref = push(registry, request, tar_bytes(member("d/", "dir"),
                                        *(member(f"d/n{i:05d}", "char", dev=(1, 3)) for i in range(n))))
    r = jail.restore(ref, "--json")
    jail.ok(r)
    assert f"skipped {n} device node(s)" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["skipped_devices_count"] == n
    assert doc["skipped_devices"] == [f"/d/n{i:05d}" for i in range(NAMES_KEPT)]


# A file capability (cap_net_bind_service+ep), as `setcap` writes it: VFS_CAP_REVISION_2 | effective.
CAP = struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0)


def _privileged_layer():
    cap_pax = {"SCHILY.xattr.security.capability": CAP.decode("utf-8", "surrogateescape")}
    return tar_bytes(member("bin/", "dir"), member("bin/su", data=b"#!/bin/sh\n", mode=0o4755),
                 member("bin/wall", data=b"#!/bin/sh\n", mode=0o2755),
                 member("bin/ping", data=b"#!/bin/sh\n", mode=0o755, pax=cap_pax),
                 member("shared/", "dir", mode=0o2775))


@pytest.mark.skipif(not IS_ROOT, reason="setuid bits and capabilities are kept only as root")
def test_setuid_setgid_and_capabilities_are_stripped_unless_allowed(registry, jail, request, tmp_path):
    ref = push(registry, request, _privileged_layer())
    r = jail.restore(ref)
    jail.ok(r)
    assert "stripped setuid/setgid from 3 file(s)" in r.stderr
    mode = lambda p: stat.S_IMODE(os.lstat(p).st_mode)  # noqa: E731
    assert mode(jail.root / "bin/su") == 0o755
    assert mode(jail.root / "bin/wall") == 0o755
    assert mode(jail.root / "shared") == 0o2775  # setgid on a directory only sets group inheritance
    assert "security.capability" not in os.listxattr(jail.root / "bin/ping")

    other = tmp_path / "root2"
    r = snap("restore", ref, "--root", str(other), "--allow-setuid")
    assert r.returncode == 0, r.stderr
    assert mode(other / "bin/su") == 0o4755
    assert mode(other / "bin/wall") == 0o2755
    try:
        assert os.getxattr(other / "bin/ping", "security.capability") == CAP
    except OSError as e:  # a filesystem without xattrs: nothing to check
        pytest.skip(f"no security xattrs here: {e}")


# ---- whiteouts: delete from lower layers, inside the root only -----------------------------------

@pytest.mark.parametrize("name", [".wh...", "a/.wh...", ".wh..", ".wh."])
def test_whiteouts_naming_no_valid_path_are_refused(registry, jail, request, name):
    ref = push(registry, request, tar_bytes(member("a/", "dir"), member("a/x", data=b"x")),
               tar_bytes(member(name)))
    line = jail.refused(jail.restore(ref))
    assert "whiteout" in line
    assert (jail.root / "a/x").exists()


@pytest.mark.parametrize("via", ["{outside}", "../..", "../../.."], ids=["absolute", "relative", "above"])
def test_whiteouts_through_a_symlink_stay_inside(registry, jail, request, via):
    via = via.format(outside=jail.outside)
    prefix = jail.through("evil", via, str(jail.outside))
    ref = push(registry, request, tar_bytes(member("evil", "symlink", linkname=via)),
               tar_bytes(member(f"{prefix}/.wh.keep"), member(f"{prefix}/.wh.sub"),
                     member(f"{prefix}/sub/.wh..wh..opq")))
    jail.ok(jail.restore(ref))


def test_opaque_whiteout_through_a_symlink_stays_inside(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("evil", "symlink", linkname=str(jail.outside))),
               tar_bytes(member("evil/.wh..wh..opq")))
    jail.ok(jail.restore(ref))


def test_whiteout_of_a_symlink_removes_the_link_only(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("evil", "symlink", linkname=str(jail.outside)),
                                             member("evil2", "symlink", linkname="../outside")),
               tar_bytes(member(".wh.evil"), member(".wh.evil2"), member(".wh..wh..opq")))
    jail.ok(jail.restore(ref))
    assert not os.path.lexists(jail.root / "evil") and not os.path.lexists(jail.root / "evil2")


def test_whiteout_never_deletes_from_its_own_layer_even_through_a_symlink(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("low", data=b"lower\n")), tar_bytes(
        member("real/", "dir"), member("alias", "symlink", linkname="real"),
        member("real/f", data=b"mine\n"), member("alias/.wh.f"), member("alias/.wh..wh..opq"),
        member(".wh.low"),
    ))
    jail.ok(jail.restore(ref))
    assert (jail.root / "real/f").read_bytes() == b"mine\n"
    assert not (jail.root / "low").exists()


# ---- tampered blobs -------------------------------------------------------------------------------

def _tamper(registry, digest: str) -> None:
    hexd = digest.split(":", 1)[1]
    path = os.path.join(registry.storage, "docker/registry/v2/blobs/sha256", hexd[:2], hexd, "data")
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
        f.seek(0)
        f.write(data)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("which", [0, 1], ids=["first-layer", "second-layer"])
def test_tampered_blob_is_rejected_before_any_of_it_is_written(registry, jail, request, gz, which):
    # Blobs are shared across the registry's repositories: each case tampers with blobs of its own.
    passwd = b"root:x:0:0::/root:/bin/sh\n" * 100 + request.node.name.encode()
    ref = push(registry, request, tar_bytes(member("etc/", "dir"), member("etc/passwd", data=passwd)),
               tar_bytes(member("opt/", "dir"), member("opt/app.py", data=b"print('hi')\n" * 100),
                     member("opt/model.bin", data=os.urandom(3 << 20))), gzip=gz)  # big: split at download
    m = registry.manifest(ref.split("/", 1)[1].rsplit(":", 1)[0], "v1")
    _tamper(registry, m["layers"][which]["digest"])
    r = jail.restore(ref)
    line = jail.refused(r)
    assert "does not match its digest" in line
    # A layer is applied only once its blob is checked: nothing of the tampered one is written.
    # The layers before it are (verified, they were applied while the rest downloaded).
    if which == 0:
        assert list(jail.root.iterdir()) == []  # the root is made, nothing written in it
    else:
        assert sorted(os.listdir(jail.root)) == ["etc"]
        assert (jail.root / "etc/passwd").read_bytes() == passwd
        assert "stopped with 1 of 2 layer(s) applied" in r.stderr
    assert not list(jail.root.glob(".snap-staging-*/*.part"))  # downloads go to a staging dir in the root


@pytest.mark.parametrize("kind", ["truncated-gzip", "garbage-gzip", "bad-gzip-crc", "garbage-zstd", "not-a-tar"])
def test_corrupt_layer_data_is_an_integrity_error(registry, jail, request, kind):
    """The blob matches its digest (it was pushed so), but its bytes do not unpack."""
    data = tar_bytes(member("a/", "dir"), member("a/f", data=os.urandom(100_000)))
    blob, media = {
        "truncated-gzip": (gzip_bytes(data)[:-5000], GZIP),
        "garbage-gzip": (gzip_bytes(data)[:100] + b"\0" * 5000, GZIP),
        "bad-gzip-crc": (gzip_bytes(data)[:-8] + b"\0" * 8, GZIP),
        "garbage-zstd": (b"\x28\xb5\x2f\xfd" + os.urandom(5000), "application/vnd.oci.image.layer.v1.tar+zstd"),
        "not-a-tar": (gzip_bytes(os.urandom(5000)), GZIP),
    }[kind]
    repo = repo_for(request)
    registry.push_image(repo, "v1", [blob], layer_media_type=media,
                        diff_ids=["sha256:" + hashlib.sha256(data).hexdigest()])
    jail.refused(jail.restore(f"{registry.host}/{repo}:v1"))


# ---- part layers: a file cut at the layer size cap, joined back by restore --------------------------

def _nothing_leaked(jail) -> None:
    for d, _, files in os.walk(jail.root):
        for n in files:
            p = os.path.join(d, n)
            if stat.S_ISREG(os.lstat(p).st_mode):  # never open a FIFO: it would block
                with open(p, "rb") as f:
                    assert b"do not link me" not in f.read(), f"{p} holds the host file's content"


@pytest.mark.parametrize("kind", ["symlink-absolute", "symlink-relative", "directory", "fifo"])
def test_a_part_that_is_not_a_regular_file_is_refused(registry, jail, request, kind):
    """A "part" that is a symlink to a host file must not get that file copied into the root."""
    name = PART.format(1, 2)
    first = {
        "symlink-absolute": member(name, "symlink", linkname=str(jail.outside / "secret")),
        "symlink-relative": member(name, "symlink", linkname="../../outside/secret"),
        "directory": member(name + "/", "dir"),
        "fifo": member(name, "file"),
    }[kind]
    if kind == "fifo":
        first[0].type = tarfile.FIFOTYPE
    # FIFOs are created only with --allow-devices
    line = jail.refused(jail.restore(part_image(registry, request, first),
                                     *(["--allow-devices"] if kind == "fifo" else [])))
    assert "part 1/2 of /m/big" in line, line
    _nothing_leaked(jail)
    assert not (jail.root / "m/big").exists()


@pytest.mark.parametrize("ann", ["1", "x/2", "0/2", "3/2", "1/100001", "1/2\n", " 1/2", "\uff11/2", "1/-2", ""])
def test_malformed_part_annotations_are_refused(registry, jail, request, ann):
    r = jail.restore(part_image(registry, request, member(PART.format(1, 2), data=b"first part\n"), anns=(ann, "2/2")))
    line = jail.refused(r)
    assert "malformed part annotation" in line, line
    assert not jail.root.exists()  # refused before anything is written


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside/keep", "m/../../outside/keep", ""])
def test_part_files_outside_the_root_are_refused(registry, jail, request, path):
    ref = push_annotated(registry, repo_for(request), [
        (tar_bytes(member("m/", "dir"), member("m/x.snap-part-0001-of-0001", data=b"part\n")), part_ann(path, "1/1"))])
    jail.refused(jail.restore(ref))


@pytest.mark.parametrize("anns", [("1/2", "2/3"), ("1/2", "1/2"), ("1/3", "2/3")],
                         ids=["counts-differ", "twice", "one-missing"])
def test_inconsistent_part_layers_are_refused(registry, jail, request, anns):
    ref = part_image(registry, request, member(PART.format(1, 2), data=b"first part\n"), anns=anns)
    line = jail.refused(jail.restore(ref))
    assert "/m/big" in line, line


def test_parts_deleted_before_the_join_are_refused(registry, jail, request):
    """Some parts there and some not at join time: an incomplete file, never silently left as parts."""
    ref = part_image(registry, request, member(PART.format(1, 2), data=b"first part\n"),
                      extra=[(tar_bytes(member("m/.wh." + PART.format(2, 2).split("/")[1])), {})])
    line = jail.refused(jail.restore(ref))
    assert "missing" in line and "/m/big" in line, line
    assert not (jail.root / "m/big").exists()


def test_well_formed_parts_are_joined(registry, jail, request):
    ref = part_image(registry, request, member(PART.format(1, 2), data=b"first part\n", mode=0o640))
    jail.ok(jail.restore(ref, "--fsync"))
    assert (jail.root / "m/big").read_bytes() == b"first part\nsecond part\n"
    assert stat.S_IMODE(os.lstat(jail.root / "m/big").st_mode) == 0o640
    assert os.listdir(jail.root / "m") == ["big"]


DEEP = "[" * 100_000  # JSON nested deeper than the parser goes: RecursionError, not ValueError


@pytest.mark.parametrize("where", ["secrets", "part-links"])
def test_an_annotation_nested_deeper_than_the_parser_goes_is_malformed_like_any(registry, request, tmp_path, where):
    """The image's JSON annotations (jsontext.loads): a left-out list that deep lists nothing, as a
    malformed one; part links that deep are refused, exit 6, one line. Never an internal error."""
    tar = tar_bytes(member("opt/app/a.txt", data=b"a\n"))
    layer_ann = {"dev.snap.layer": "rest"}
    if where == "part-links":  # the one part of m/big, whose other names are listed on it
        tar = tar_bytes(member("m", "dir"), member(PART.format(1, 1), data=b"part\n"))
        layer_ann = {**part_ann("m/big", "1/1"), "dev.snap.part-links": DEEP}
    ref = push_annotated(registry, repo_for(request), [(tar, layer_ann)],
                         {"dev.snap.base-layers": "0", **({"dev.snap.left-out.secrets": DEEP} if where == "secrets"
                                                          else {})})
    (tmp_path / "root").mkdir()
    for command in ("restore", "verify"):
        r = snap(command, ref, "--root", str(tmp_path / "root"))
        assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
        if where == "secrets":
            assert r.returncode == 0, r.stderr
        else:
            assert_one_line_error(r, 6, "dev.snap.part-links")
