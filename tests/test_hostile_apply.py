"""Valid-but-unusual layers restore correctly, and the policies hold on every path that writes:
FIFOs are devices, a joined file is never setuid unless allowed, a file larger than the disk stops
the restore before the disk fills, xattrs larger than Linux allows are a bad image. verify refuses
what restore refuses. The journal grows by a line per layer. A layer that fails its diff_id never
shows its last file."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile

import pytest

from support.images import GZIP, MARK, PART, TAR, part_image, push, repo_for
from support.run import snap_with_peak
from support.tars import gzip_bytes, member, raw_header, tar_bytes


def fifo(name: str) -> tuple[tarfile.TarInfo, bytes]:
    ti, data = member(name)
    ti.type = tarfile.FIFOTYPE
    return ti, data


# ---- valid tars that are unusual ---------------------------------------------------------------------

def test_a_directory_entry_after_its_contents(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("a/b/c", data=b"c\n"), member("a/b/", "dir", mode=0o750),
                                       member("a/", "dir", mode=0o711)))
    jail.ok(jail.restore(ref))
    assert (jail.root / "a/b/c").read_bytes() == b"c\n"
    assert stat.S_IMODE(os.lstat(jail.root / "a/b").st_mode) == 0o750
    assert stat.S_IMODE(os.lstat(jail.root / "a").st_mode) == 0o711


def test_a_symlink_over_an_implied_directory(registry, jail, request):
    """As containerd does: the later entry replaces the directory the earlier one implied."""
    ref = push(registry, request,
               tar_bytes(member("x/a/b", data=b"b\n"), member("x/a", "symlink", linkname="elsewhere")))
    jail.ok(jail.restore(ref))
    assert os.readlink(jail.root / "x/a") == "elsewhere"


def test_the_same_uncompressed_layer_listed_twice(registry, jail, request):
    big = os.urandom(3 << 20)  # big enough to be kept split (staging.py) and renamed into place
    weights = tar_bytes(member("w/", "dir"), member("w/model.bin", data=big))
    gone = tar_bytes(member("w/.wh.model.bin"))
    ref = push(registry, request, weights, gone, weights)
    jail.ok(jail.restore(ref))
    assert (jail.root / "w/model.bin").read_bytes() == big


# ---- policies ------------------------------------------------------------------------------------------

def test_fifos_are_devices(registry, jail, request, tmp_path):
    ref = push(registry, request, tar_bytes(member("p/", "dir"), fifo("p/pipe"), member("p/f", data=b"f\n")))
    jail.ok(jail.restore(ref))
    assert not os.path.lexists(jail.root / "p/pipe") and (jail.root / "p/f").exists()
    r, _ = snap_with_peak("verify", ref, "--root", str(jail.root))
    assert r.returncode == 0, r.stdout + r.stderr  # verify expects what restore wrote
    other = tmp_path / "other"
    r, _ = snap_with_peak("restore", ref, "--root", str(other), "--allow-devices")
    assert r.returncode == 0, r.stderr
    assert stat.S_ISFIFO(os.lstat(other / "p/pipe").st_mode)


def test_a_part_hardlinked_to_a_setuid_file_already_there_is_refused(registry, jail, request):
    """A hardlink only names a file the image wrote (test_hostile_links.py): never a setuid file of
    the box, whose bits the join would otherwise have to strip."""
    (jail.root / "bin").mkdir(parents=True)
    (jail.root / "bin/su").write_bytes(b"first part\n")
    os.chmod(jail.root / "bin/su", 0o4755)
    ref = part_image(registry, request, member(PART.format(1, 2), "hardlink", linkname="bin/su"))
    assert "the image did not write" in jail.refused(jail.restore(ref))
    assert not (jail.root / "m/big").exists() and not (jail.root / PART.format(1, 2)).exists()
    st = os.lstat(jail.root / "bin/su")
    assert stat.S_IMODE(st.st_mode) == 0o4755 and st.st_nlink == 1  # what was there stays, with no other name


def test_a_file_larger_than_the_disk_stops_before_writing(registry, jail, request):
    jail.root.mkdir()
    st = os.statvfs(jail.root)
    declared = st.f_bavail * st.f_frsize + (1 << 30)  # more than is free: a bomb would fill the disk
    size_field = b"\x80" + declared.to_bytes(11, "big")  # base-256, as GNU tar writes sizes over 8 GiB
    tar = raw_header(b"bomb", size_field=size_field) + os.urandom(1 << 20)  # (the rest never comes)
    ref = push(registry, request, tar)
    r = jail.restore(ref)
    assert r.returncode == 7, r.stderr
    assert "disk full" in r.stderr and "stopping before writing it" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert os.listdir(jail.root) == []


def test_an_xattr_larger_than_linux_allows_is_a_bad_image(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("f", data=b"f", pax={"SCHILY.xattr.user.big": "x" * 70_000})))
    assert "extended attribute" in jail.refused(jail.restore(ref))


# ---- verify is as strict as restore ------------------------------------------------------------------

@pytest.mark.parametrize("case", ["absolute", "dotdot", "hardlink-out", "whiteout-dotdot", "symlink-loop",
                                  "hardlink-missing"])
def test_verify_refuses_what_restore_refuses(registry, jail, request, tmp_path, case):
    layers = {
        "absolute": [tar_bytes(member(f"{jail.outside}/{MARK}", data=b"x"))],
        "dotdot": [tar_bytes(member(f"a/../../{MARK}", data=b"x"))],
        "hardlink-out": [tar_bytes(member("hl", "hardlink", linkname="../outside/secret"))],
        "whiteout-dotdot": [tar_bytes(member("a/", "dir")), tar_bytes(member("a/.wh..."))],
        "symlink-loop": [tar_bytes(member("a", "symlink", linkname="b"), member("b", "symlink", linkname="a"),
                               member("a/x", data=b"x"))],
        "hardlink-missing": [tar_bytes(member("hl", "hardlink", linkname="nowhere"))],
    }[case]
    ref = push(registry, request, *layers)
    jail.refused(jail.restore(ref))
    jail.root.mkdir(exist_ok=True)
    r, _ = snap_with_peak("verify", ref, "--root", str(jail.root))
    jail.refused(r)


def test_verify_never_looks_outside_the_root(registry, jail, request, tmp_path):
    """A '..' path a later layer deletes again: refused, not probed (nor reported) outside the root."""
    ref = push(registry, request, tar_bytes(member("a/", "dir"), member("a/../../outside/keep", data=b"sentinel\n")),
               tar_bytes(member("a/../../outside/.wh.keep")))
    jail.root.mkdir()
    r, _ = snap_with_peak("verify", ref, "--root", str(jail.root))
    assert "outside" not in r.stdout
    jail.refused(r)


def test_a_name_with_a_newline_cannot_forge_a_line_of_the_verify_report(registry, jail, request, tmp_path):
    """A name like any other (issue 33: restore writes it, so verify compares it): its difference is
    one quoted line, never a line of its own for what follows the newline."""
    ref = push(registry, request,
               tar_bytes(member("d/", "dir"), member("d/x\n/etc/passwd: content differs", data=b"x")))
    jail.root.mkdir()
    (jail.root / "d").mkdir()
    r, _ = snap_with_peak("verify", ref, "--root", str(jail.root))
    assert r.returncode == 9, r.stderr
    assert r.stdout.splitlines() == ["'/d/x\\n/etc/passwd: content differs': missing (expected a file)"]
    assert not any(line.startswith("/etc/passwd") for line in r.stdout.splitlines() + r.stderr.splitlines())


# ---- the journal ---------------------------------------------------------------------------------------

def test_the_journal_grows_by_one_line_per_layer(registry, jail, request, tmp_path, state_dir):
    layers = [tar_bytes(member(f"f{i}", data=b"%d" % i)) for i in range(3)]
    repo = repo_for(request)
    diff_ids = ["sha256:" + hashlib.sha256(b).hexdigest() for b in layers]
    diff_ids[2] = "sha256:" + "0" * 64  # the third layer fails its check: the journal stays
    registry.push_image(repo, "v1", layers, layer_media_type="application/vnd.oci.image.layer.v1.tar",
                        diff_ids=diff_ids)
    r = jail.restore(f"{registry.host}/{repo}:v1")
    assert r.returncode == 6, r.stderr
    (journal,) = list((state_dir / "restore-journal").iterdir())
    lines = journal.read_text().splitlines()
    assert json.loads(lines[0])["layers"] and [json.loads(line) for line in lines[1:]] == [
        {"applied": 1, "wrote": ["f0"], "shapes": [1]},  # what a later layer's hardlink may name, and its size
        {"applied": 2, "wrote": ["f1"], "shapes": [1]}]  # (a resumed run checks the file is still there: resume.py)


# ---- the diff_id check ---------------------------------------------------------------------------------

@pytest.mark.parametrize("compressed", [False, True], ids=["tar", "gzip"])
def test_a_layer_that_fails_its_diff_id_never_shows_its_last_file(registry, jail, request, compressed):
    """The diff_id is known at the end of the stream only: the entries before the last one are on
    disk by then (the layer is not recorded as applied), but a last regular file is renamed into
    place only after the check, and here its temp is removed instead."""
    tar = tar_bytes(member("app/", "dir"), member("app/first", data=b"first\n"), member("app/last", data=b"last\n"))
    repo = repo_for(request)
    registry.push_image(repo, "v1", [gzip_bytes(tar) if compressed else tar],
                        layer_media_type=GZIP if compressed else TAR,
                        diff_ids=["sha256:" + "0" * 64])
    line = jail.refused(jail.restore(f"{registry.host}/{repo}:v1"))
    assert "does not match its diff_id" in line, line
    assert (jail.root / "app/first").read_bytes() == b"first\n"  # the layer was applied up to its end
    assert os.listdir(jail.root / "app") == ["first"]  # no app/last, and no temp left for it
