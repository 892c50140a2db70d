"""The rules of a layer tar that generation and reading (extraction, indexing, verifying) share, kept
apart from both (as umoci keeps its utils apart from extract and generate): entry order, whiteout
names, xattr records, a header's bytes, and what of a header identifies a layer's bytes."""

from __future__ import annotations

import hashlib
import tarfile
from typing import Optional

from snapshotter.errors import IntegrityError

WHITEOUT_PREFIX = ".wh."
OPAQUE = ".wh..wh..opq"
XATTR_PAX = "SCHILY.xattr."
SKIP_XATTRS = ("trusted.", "security.selinux")  # privileged, or labels of the host they were made on
CAPABILITY = "security.capability"  # a file capability: setuid by another name
MAX_SYMLINK_HOPS = 40  # resolving a path through the image's symlinks (as the kernel's limit)


def check_name(name: str) -> str:
    """Root-relative path of a member name; refuses names that try to leave the root."""
    if name.startswith("/"):
        raise IntegrityError(f"layer entry {name!r} has an absolute path: refusing a hostile layer")
    rel, parts = name, name.split("/")
    if "" in parts or "." in parts or ".." in parts:
        parts = [p for p in parts if p not in ("", ".")]
        if ".." in parts:
            raise IntegrityError(f"layer entry {name!r} escapes the root with '..': refusing a hostile layer")
        rel = "/".join(parts)
    if "\0" in rel:
        raise IntegrityError(f"layer entry {name!r} has a NUL byte: refusing a hostile layer")
    return rel


def layer_order(item: tuple[str, bool]) -> tuple[str, int, str]:
    """Sort key of (path, is_whiteout): by parent directory, whiteouts before their siblings."""
    path, is_whiteout = item
    parent, _, base = path.rpartition("/")
    return (parent, 0 if is_whiteout else 1, base)


def whiteout_name(path: str) -> str:
    """The member name of the whiteout that deletes `path`."""
    parent, _, base = path.rpartition("/")
    return f"{parent}/{WHITEOUT_PREFIX}{base}" if parent else f"{WHITEOUT_PREFIX}{base}"


def whiteout_target(base: str) -> str:
    """The name a whiteout entry `.wh.NAME` deletes (not the opaque marker). Refuses names that
    could reach anything but a sibling."""
    name = base[len(WHITEOUT_PREFIX):]
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise IntegrityError(f"whiteout {base!r} names no valid path: refusing a hostile layer")
    return name


def member_xattrs(m) -> Optional[dict[str, str]]:
    """The extended attributes a member carries (PAX SCHILY.xattr records) that snap keeps."""
    out = {k[len(XATTR_PAX):]: v for k, v in (m.pax_headers or {}).items()
           if k.startswith(XATTR_PAX) and not k[len(XATTR_PAX):].startswith(SKIP_XATTRS)}
    return out or None


def applied_xattrs(xattrs: Optional[dict[str, str]], keep_privileges: bool) -> dict[str, str]:
    """The extended attributes applying a path that carries `xattrs` (member_xattrs, Entry.xattrs:
    SKIP_XATTRS left out) leaves on it: a file capability only where privileges are kept
    (--allow-setuid as root; layer/fileops.set_attrs strips it otherwise, from a path of any kind)."""
    out = dict(xattrs or {})
    if not keep_privileges:
        out.pop(CAPABILITY, None)
    return out


def member_mtime_ns(m) -> Optional[int]:
    """A member's exact mtime in ns where its header holds one finer than whole seconds (a PAX
    mtime with a fraction, parsed from its text as Go's archive/tar does: a float would be off by
    a few hundred ns), else None. reader.py has checked the text."""
    text = (m.pax_headers or {}).get("mtime", "")
    whole, _, frac = text.partition(".")
    if not frac.strip("0"):
        return None
    ns = int(whole.lstrip("-") or 0) * 1_000_000_000 + int(frac[:9].ljust(9, "0"))
    return -ns if whole.startswith("-") else ns


def header_bytes(ti: tarfile.TarInfo) -> bytes:
    """A member's header as tarfile's PAX writer makes it (a PAX record block where one is needed,
    then the ustar block), the same bytes on every Python: where a PAX mtime record holds the
    nanoseconds, the ustar mtime field holds the whole seconds, as Python 3.11+ write it. 3.10s
    older than CPython's bpo-45863 write 0 there, and a layer's digest must not depend on the
    Python that wrote it."""
    buf = ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    if "mtime" not in ti.pax_headers or not 0 <= ti.mtime < 8 ** 11:
        return buf  # out of the field's range every Python writes 0
    block = bytearray(buf[-tarfile.BLOCKSIZE:])
    whole = tarfile.itn(int(ti.mtime), 12, tarfile.PAX_FORMAT)
    if block[136:148] == whole:
        return buf
    block[136:148] = whole
    block[148:156] = b" " * 8  # the checksum counts its own field as spaces
    block[148:155] = b"%06o\0" % sum(block)
    return buf[:-tarfile.BLOCKSIZE] + bytes(block)


def pax_mtime(ns: int) -> str:
    """A PAX mtime record's text for an mtime in ns (member_mtime_ns reads it back exactly)."""
    sign, ns = ("-", -ns) if ns < 0 else ("", ns)
    return f"{sign}{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def header_key(ti) -> tuple:
    """What of a tar header decides the layer's bytes (with the content): compared when the stat
    cache is seeded from a restore. `ti`: a tarfile.TarInfo written, or one read (reader.py)."""
    xattrs = member_xattrs(ti) if ti.pax_headers else None  # most members have no PAX records: 5x faster
    return (ti.name.rstrip("/"), ti.type, ti.mode & 0o7777, ti.uid, ti.gid, ti.size, int(ti.mtime), ti.linkname,
            ti.devmajor, ti.devminor, tuple(sorted(xattrs.items())) if xattrs else ())


class HeadersDigest:
    """One digest for a layer's tar headers (header_key of each, in order), computed as they pass:
    the same as sha256(repr(list of keys)), without keeping the list (a layer may hold millions)."""

    def __init__(self):
        self._sha = hashlib.sha256(b"[")
        self._first = True

    def add(self, key: tuple) -> None:
        self._sha.update((repr(key) if self._first else ", " + repr(key)).encode())
        self._first = False

    def hexdigest(self) -> str:
        h = self._sha.copy()
        h.update(b"]")
        return h.hexdigest()


def headers_digest(keys) -> str:
    """HeadersDigest of a list of header keys."""
    d = HeadersDigest()
    for k in keys:
        d.add(k)
    return d.hexdigest()
