"""Same-second edits (issue 23, item 7): a tar header holds whole seconds, so a box file edited
within its base file's second, at the same size, matches the base by metadata; its content must
tell, and only such files may be read."""

import os
import tarfile

import pytest

from snapshotter import CommitOptions, commit_box
from snapshotter.box import diff as box_diff
from snapshotter.tar.rules import header_bytes, pax_mtime

from support.images import snap_layer_files
from support.run import snap
from support.tars import gzip_bytes, member, tar_bytes

T = 1_700_000_000  # the base's whole second
NS = 1_000_000_000
UNTOUCHED = os.urandom(100_000)

# path -> (content in the base, its PAX mtime or None for the whole second T)
BASE = {
    "data/edited.txt": (b"version 1\n", None),
    "data/touched.txt": (b"the same\n", None),
    "data/untouched.bin": (UNTOUCHED, None),
    "data/pax-untouched.txt": (b"pax same\n", f"{T}.1"),
    "data/pax-edited.txt": (b"pax v1\n", f"{T}.1"),
}
# path -> (content in the box, mtime in ns): what a runtime extracting the base, then the user, left
BOX = {
    "data/edited.txt": (b"version 2\n", T * NS + 900_000_000),  # an edit at T+0.9, same size
    "data/touched.txt": (b"the same\n", T * NS + 900_000_000),  # touched, same content
    "data/untouched.bin": (UNTOUCHED, T * NS),
    "data/pax-untouched.txt": (b"pax same\n", T * NS + 100_000_000),  # as Docker sets a PAX mtime
    "data/pax-edited.txt": (b"pax v2\n", T * NS + 900_000_000),
}
CAPTURED = {"data/edited.txt", "data/pax-edited.txt"}
READ = {"data/edited.txt", "data/touched.txt", "data/pax-edited.txt"}  # in their base file's second, not at its time


@pytest.fixture(scope="module")
def racy_base(registry):
    members = [member("data/", "dir", mtime=T)]
    members += [member(p, data=data, mtime=T, pax={"mtime": pax} if pax else None) for p, (data, pax) in BASE.items()]
    registry.push_image("racy-base", "1", [gzip_bytes(tar_bytes(*members))])
    return f"{registry.host}/racy-base:1"


def make_box(root):
    os.makedirs(os.path.join(root, "data"))
    for rel, (data, ns) in BOX.items():
        path = os.path.join(root, rel)
        with open(path, "wb") as f:
            f.write(data)
        os.utime(path, ns=(ns, ns))
    os.utime(os.path.join(root, "data"), (T, T))


def test_a_same_size_edit_within_the_base_files_second_is_captured_and_only_such_files_are_read(
        registry, racy_base, tmp_path, monkeypatch):
    box = str(tmp_path / "box")
    make_box(box)
    read = []
    real = box_diff.scanned_digest
    monkeypatch.setattr(box_diff, "scanned_digest", lambda files, e: read.append(e.path) or real(files, e))
    commit_box(f"{registry.host}/racy-edit:v1", racy_base, CommitOptions(root=box))
    assert set(read) == READ  # the untouched files, at their base time to the ns, are never read
    in_layers = {p for p in snap_layer_files(registry, "racy-edit", "v1") if p in BOX}
    assert in_layers == CAPTURED  # the touched file with its old content is no change
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/racy-edit:v1", "--root", str(out), check=True)
    for rel, (data, _) in BOX.items():
        assert (out / rel).read_bytes() == data


def test_a_restore_sets_a_pax_mtime_to_the_nanosecond(racy_base, tmp_path):
    """As Docker does: the next commit's diff then sees the base's untouched files at their time."""
    out = tmp_path / "out"
    snap("restore", racy_base, "--root", str(out), check=True)
    assert os.lstat(out / "data/pax-untouched.txt").st_mtime_ns == T * NS + 100_000_000
    assert os.lstat(out / "data/untouched.bin").st_mtime_ns == T * NS


def test_a_captured_same_second_edit_survives_a_restore_and_the_next_commit(registry, racy_base, tmp_path):
    """Its layer carries its mtime to the ns: restored at a whole second, it would match the base
    by metadata again, and the next snapshot of the restored box would lose the edit."""
    box = str(tmp_path / "box")
    make_box(box)
    snap("commit", f"{registry.host}/racy-chain:v1", "--base", racy_base, "--root", box, check=True)
    second = tmp_path / "second-box"
    snap("restore", f"{registry.host}/racy-chain:v1", "--root", str(second), check=True)
    assert os.lstat(second / "data/edited.txt").st_mtime_ns == BOX["data/edited.txt"][1]
    snap("commit", f"{registry.host}/racy-chain:v2", "--base", racy_base, "--root", str(second), check=True)
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/racy-chain:v2", "--root", str(out), check=True)
    for rel, (data, _) in BOX.items():
        assert (out / rel).read_bytes() == data


def test_a_pax_mtime_header_is_the_same_bytes_under_a_tarfile_that_writes_0_seconds(monkeypatch):
    """With a PAX mtime record the ustar mtime field holds the whole seconds, as Python 3.11+ write
    it, also under a 3.10 tarfile from before CPython's bpo-45863 that writes 0 there (emulated: the
    Pythons here all have the fix; test_install compares whole layers across those it has)."""
    ti = tarfile.TarInfo("data/edited.txt")
    ti.mtime, ti.size, ti.pax_headers = T, 10, {"mtime": pax_mtime(T * NS + 900_000_000)}
    this_python = ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    assert tarfile.nti(this_python[-512 + 136:-512 + 148]) == T
    create_pax_header = tarfile.TarInfo.create_pax_header

    def as_before_the_fix(self, info, encoding):  # a number field with a PAX record was zeroed
        return create_pax_header(self, {**info, "mtime": 0} if "mtime" in self.pax_headers else info, encoding)

    monkeypatch.setattr(tarfile.TarInfo, "create_pax_header", as_before_the_fix)
    assert ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") != this_python  # the emulation differs
    assert header_bytes(ti) == this_python
