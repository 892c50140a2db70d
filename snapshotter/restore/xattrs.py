"""Which extended attributes a restored path holds against those its image sets: one rule for the
restore's skip check (skip.py) and `snap verify` (verify.py)."""

from __future__ import annotations

from typing import Optional

from snapshotter.box.scan import read_xattrs
from snapshotter.tar.rules import applied_xattrs

# Names a filesystem or the kernel sets by itself on every file the extractor makes (NFSv4's ACL, IMA
# and EVM's hashes): one of those more than the image sets is what applying the layer leaves too. A
# POSIX ACL is not among them: any file's owner may set one (an ACL whose mask keeps the mode bits
# gives another uid access), and a layer applied would drop it.
_FILESYSTEMS_OWN = ("system.nfs4_acl", "system.nfs4_dacl", "system.nfs4_sacl", "security.ima", "security.evm")


def xattrs_differ(path: str, want: dict[str, str], exact: bool) -> str:
    """How the extended attributes of `path` (never followed) differ from `want`, those applying its
    member leaves (applied_xattrs): one missing or of another value, or with `exact` one more (the
    extractor makes a file or symlink new, so it holds those alone; a directory there keeps its own),
    but for one a filesystem adds by itself (_FILESYSTEMS_OWN). Names snap never carries (SKIP_XATTRS,
    as box/scan.read_xattrs reads them) do not count. "" if none."""
    unreadable: list[bool] = []
    have = read_xattrs(path, lambda: unreadable.append(True)) or {}
    if unreadable:
        return "extended attributes unreadable"
    for name in sorted(want):
        if have.get(name) != want[name]:
            return f"extended attribute {name!r} {'missing' if name not in have else 'differs'}"
    extra = sorted(n for n in have.keys() - want.keys() if n not in _FILESYSTEMS_OWN) if exact else []
    return f"extended attribute {extra[0]!r} extra (not in the image)" if extra else ""


def image_xattrs_differ(path: str, xattrs: Optional[dict[str, str]], allow_setuid: bool) -> str:
    """`snap verify`: how the xattrs of `path` differ from the image's `xattrs` (Entry.xattrs), all of
    them: a directory's extra ones too. Its file capability, as its setuid bits: required with
    --allow-setuid; without, stripped or kept alike (a restore with --allow-setuid left it)."""
    differ = xattrs_differ(path, applied_xattrs(xattrs, allow_setuid), exact=True)
    kept = applied_xattrs(xattrs, True)
    if differ and not allow_setuid and kept != applied_xattrs(xattrs, False) and not xattrs_differ(path, kept, True):
        return ""
    return differ
