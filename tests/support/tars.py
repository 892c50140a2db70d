"""Tars built by hand: one builder, (TarInfo, content) pairs in; the conveniences below feed it; and
headers tarfile will not write."""

from __future__ import annotations

import gzip
import io
import os
import tarfile


def tar_bytes(*members: tuple[tarfile.TarInfo, bytes], format: int = tarfile.PAX_FORMAT, **options) -> bytes:
    """An uncompressed tar of the members, in order (content is written for regular files only).
    `options` go to tarfile.open (pax_headers, encoding, errors)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=format, **options) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def member(name: str, kind: str = "file", data: bytes = b"", mode: int | None = None, linkname: str = "",
           dev: tuple[int, int] = (0, 0), pax: dict | None = None,
           mtime: int = 1_600_000_000) -> tuple[tarfile.TarInfo, bytes]:
    """One tar member, as tar_bytes takes it: kind is file, dir, symlink, hardlink, char or block."""
    ti = tarfile.TarInfo(name)
    ti.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
               "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE}[kind]
    ti.mode = mode if mode is not None else (0o755 if kind == "dir" else 0o644)
    ti.mtime = mtime
    ti.linkname = linkname
    ti.devmajor, ti.devminor = dev
    ti.size = len(data) if kind == "file" else 0
    if pax:
        ti.pax_headers = pax
    return ti, data


def tar_of_files(files: dict[str, bytes], dirs: tuple[str, ...] = (), mode: int = 0o644,
                 mtime: int = 1_600_000_000) -> bytes:
    """A tar of the directories `dirs` (first), then of the files (path -> content), all of one mode."""
    return tar_bytes(*[member(d + "/", "dir", mtime=mtime) for d in dirs],
                     *[member(name, data=data, mode=mode, mtime=mtime) for name, data in files.items()])


def tar_of_dir(root: str) -> bytes:
    """An uncompressed tar of a directory tree, as an image layer holds it (numeric owners)."""
    members = []
    with tarfile.open(fileobj=io.BytesIO(), mode="w") as stat_reader:  # gettarinfo also finds hardlinks
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                ti = stat_reader.gettarinfo(full, arcname=os.path.relpath(full, root))
                ti.uname = ti.gname = ""
                data = b""
                if ti.isreg():
                    with open(full, "rb") as f:
                        data = f.read()
                members.append((ti, data))
    return tar_bytes(*members)


def gzip_bytes(b: bytes) -> bytes:
    return gzip.compress(b, mtime=0)



def raw_header(name: bytes, kind: bytes = b"0", size: int = 0, size_field: bytes | None = None,
               extra: dict[int, bytes] | None = None) -> bytes:
    """A ustar header block with a correct checksum; `extra` overwrites bytes at given offsets."""
    buf = bytearray(512)
    buf[0:len(name)] = name
    buf[100:108] = b"0000644\0"
    buf[108:116] = b"0000000\0"
    buf[116:124] = b"0000000\0"
    buf[124:136] = size_field if size_field is not None else b"%011o\0" % size
    buf[136:148] = b"%011o\0" % 1_600_000_000
    buf[156:157] = kind
    buf[257:265] = b"ustar\x0000"
    for at, data in (extra or {}).items():
        buf[at:at + len(data)] = data
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)

