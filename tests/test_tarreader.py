"""The tar reader (snapshotter/tar/reader.py) against Python's tarfile: the same members, the same
content, for every kind of valid tar snap, Docker, skopeo or GNU tar write."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile

import pytest

from snapshotter.tar.reader import TarReader, data_chunks, iter_members

from support.tars import tar_bytes

FIELDS = ("name", "type", "mode", "uid", "gid", "size", "mtime", "linkname", "uname", "gname", "devmajor",
          "devminor", "pax_headers", "offset_data")


def _members(fmt: int) -> list[tuple[tarfile.TarInfo, bytes]]:
    out = []

    def add(name, kind=tarfile.REGTYPE, data=b"", **kw):
        ti = tarfile.TarInfo(name)
        ti.type = kind
        ti.size = len(data) if kind == tarfile.REGTYPE else 0
        ti.mode = kw.pop("mode", 0o644)
        ti.mtime = kw.pop("mtime", 1_600_000_000)
        for k, v in kw.items():
            setattr(ti, k, v)
        out.append((ti, data))

    add("dir/", tarfile.DIRTYPE, mode=0o755)
    add("dir/empty")
    add("dir/block", data=b"x" * 512)
    add("dir/odd", data=bytes(range(256)) * 5 + b"tail")
    add("dir/" + "d" * 120 + "/" + "f" * 90, data=b"prefix")
    add("dir/hard", tarfile.LNKTYPE, linkname="dir/odd")
    add("dir/fifo", tarfile.FIFOTYPE)
    add("dir/chr", tarfile.CHRTYPE, devmajor=1, devminor=3)
    add("dir/suid", data=b"s", mode=0o4755, uid=1000, gid=1000, uname="u", gname="g")
    add("dir/caf\u00e9-\u65e5\u672c", data=b"utf8")
    add("dir/old", data=b"old", mtime=0)
    if fmt != tarfile.USTAR_FORMAT:
        add("dir/" + "long-name-" * 30, data=b"long")
        add("dir/link", tarfile.SYMTYPE, linkname="../" + "t" * 150)
        add("dir/bad-\udcff-bytes", data=b"surrogate")
        add("dir/big-uid", uid=3_000_000_000, gid=70_000_000)
    if fmt == tarfile.PAX_FORMAT:
        add("dir/xattrs", data=b"x",
            pax_headers={"SCHILY.xattr.user.k": "v", "SCHILY.xattr.security.capability": "\x01\x00"})
        add("dir/frac", data=b"f", mtime=1_600_000_000.5)
    return out


def _tar(fmt: int, **options) -> bytes:
    return tar_bytes(*_members(fmt), format=fmt, encoding="utf-8", errors="surrogateescape", **options)


def _expected(blob: bytes) -> list[tuple]:
    out = []
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        for m in tar:
            data = tar.extractfile(m).read() if m.isreg() else b""
            out.append((tuple(getattr(m, f) for f in FIELDS), data))
    return out


def _read(blob: bytes) -> list[tuple]:
    out = []
    for reader, m in iter_members(io.BytesIO(blob)):
        data = b"".join(data_chunks(reader)) if m.isreg() else b""
        out.append((tuple(getattr(m, f) for f in FIELDS), data))
    return out


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
def test_same_members_as_tarfile(fmt):
    blob = _tar(fmt)
    assert _read(blob) == _expected(blob)


def test_global_pax_headers_apply_to_later_members():
    blob = _tar(tarfile.PAX_FORMAT, pax_headers={"comment": "all"})
    assert _read(blob) == _expected(blob)


@pytest.mark.skipif(not shutil.which("tar"), reason="GNU tar not installed")
@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])
def test_same_members_as_tarfile_for_gnu_tar(tmp_path, fmt):
    tree = tmp_path / "tree"
    (tree / "sub" / ("n" * 80)).mkdir(parents=True)
    (tree / "sub" / ("n" * 80) / ("m" * 90)).write_bytes(b"deep\n" * 300)
    (tree / "file").write_bytes(os.urandom(5000))
    os.symlink("file", tree / "sym")
    os.link(tree / "file", tree / "hard")
    blob = subprocess.run(["tar", "-c", f"--format={fmt}", "-C", str(tree), "."], check=True,
                          capture_output=True).stdout
    assert _read(blob) == _expected(blob)


def test_members_are_not_kept():
    blob = _tar(tarfile.PAX_FORMAT)
    reader = TarReader(io.BytesIO(blob))
    assert sum(1 for _ in reader) == len(_members(tarfile.PAX_FORMAT))
    assert not hasattr(reader, "members")
