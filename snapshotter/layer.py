"""Generating layers: reproducible tars of box paths (plus whiteouts), compressed and hashed in one pass.

The same content always gives the same bytes, so an unchanged layer keeps its digest and the
registry already has it: entries sorted (whiteouts before their siblings), PAX headers with integer
mtimes and numeric owners only, deterministic compression."""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Optional

from .compress import MEDIA_TYPE, Compressor
from .errors import StorageError
from .fsindex import BLOCK, CHAR, DIR, FIFO, FILE, SYMLINK, Entry
from .tarrules import XATTR_PAX, layer_order, whiteout_name
from .plan import LayerPlan

READ_SIZE = 1 << 20  # per read of a file's content
_TAR_TYPE = {FILE: tarfile.REGTYPE, DIR: tarfile.DIRTYPE, SYMLINK: tarfile.SYMTYPE, CHAR: tarfile.CHRTYPE,
             BLOCK: tarfile.BLKTYPE, FIFO: tarfile.FIFOTYPE}


@dataclass
class LayerBlob:
    """A built layer: the digests that name it, and the blob on disk (None when it was only measured:
    an uncompressed layer is streamed from the box again at upload instead of copied to disk)."""

    name: str
    path: Optional[str]
    digest: str  # sha256 of the blob (compressed bytes)
    diff_id: str  # sha256 of the uncompressed tar
    size: int
    media_type: str
    changed_while_read: list[str] = field(default_factory=list)


def _tarinfo(e: Entry, linkname_for_hardlink: Optional[str]) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(e.path + ("/" if e.kind == DIR else ""))
    ti.mode = e.mode
    ti.uid, ti.gid = e.uid, e.gid
    ti.uname = ti.gname = ""
    ti.mtime = int(e.mtime)
    if e.xattrs:
        ti.pax_headers = {XATTR_PAX + k: v for k, v in sorted(e.xattrs.items())}
    if linkname_for_hardlink is not None:
        ti.type = tarfile.LNKTYPE
        ti.linkname = linkname_for_hardlink
        return ti
    ti.type = _TAR_TYPE[e.kind]
    if e.kind == FILE:
        ti.size = e.size
    elif e.kind == SYMLINK:
        ti.linkname = e.linkname
    elif e.kind in (CHAR, BLOCK):
        ti.devmajor, ti.devminor = os.major(e.rdev), os.minor(e.rdev)
    return ti


def tar_headers(plan: LayerPlan) -> list[tuple[tarfile.TarInfo, Optional[Entry]]]:
    """The tar headers of a plan in layer order, each with its entry (None for a whiteout):
    sorted, whiteouts before their siblings, later paths of a hardlinked inode as links."""
    items = [(e.path, False) for e in plan.entries] + [(w, True) for w in plan.whiteouts]
    by_path = {e.path: e for e in plan.entries}
    first_of_inode: dict[str, str] = {}
    out: list[tuple[tarfile.TarInfo, Optional[Entry]]] = []
    for path, is_whiteout in sorted(items, key=layer_order):
        if is_whiteout:
            ti = tarfile.TarInfo(whiteout_name(path))
            ti.mode, ti.mtime, ti.uname, ti.gname = 0o644, 0, "", ""
            out.append((ti, None))
            continue
        e = by_path[path]
        link_to = first_of_inode.get(e.inode) if e.inode else None
        if e.inode and link_to is None:
            first_of_inode[e.inode] = e.path
        out.append((_tarinfo(e, link_to), e))
    return out


def write_tar(out: BinaryIO, root: str, plan: LayerPlan, on_bytes: Optional[Callable[[int], None]] = None) -> list[str]:
    """Write the plan as a tar stream to `out`. Returns the paths that changed while being read.

    The bytes are those of tarfile's PAX writer (each header is TarInfo.tobuf, then the content
    padded to 512, then two zero blocks and zeros up to a 10 KiB record), but contents go from the
    file to `out` in 1 MiB reads instead of tarfile's 16 KiB copies re-cut into 10 KiB records:
    at tens of GB that copying is most of the CPU."""
    changed: list[str] = []
    written = 0

    def put(data: bytes) -> None:
        nonlocal written
        out.write(data)
        written += len(data)

    for ti, e in tar_headers(plan):
        if e is None or ti.type != tarfile.REGTYPE:
            put(ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            continue
        source, offset = plan.slices.get(e.path, (e.path, 0))
        try:
            f = open(os.path.join(root, source), "rb", buffering=0)
        except FileNotFoundError:
            f = None  # deleted while we committed: keep the archive well-formed, report it
            changed.append(e.path)
        except PermissionError:
            raise StorageError(f"cannot read /{e.path} in the box", "run snap as root, or exclude the path in the profile")
        put(ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
        left = e.size
        try:
            if f is not None:
                f.seek(offset)
            while left:
                data = f.read(min(left, READ_SIZE)) if f is not None else b""
                if not data:  # the file shrank while we read it: zeros keep the promised size
                    if f is not None:
                        changed.append(e.path)
                        f.close()
                        f = None
                    data = bytes(min(left, READ_SIZE))
                put(data)
                left -= len(data)
                if on_bytes:
                    on_bytes(len(data))
            if f is not None and not plan.slices and f.read(1):
                changed.append(e.path)  # it grew: we took the size the scan saw
        finally:
            if f is not None:
                f.close()
        if e.size % tarfile.BLOCKSIZE:
            put(bytes(tarfile.BLOCKSIZE - e.size % tarfile.BLOCKSIZE))
    put(bytes(2 * tarfile.BLOCKSIZE))
    if written % tarfile.RECORDSIZE:
        put(bytes(tarfile.RECORDSIZE - written % tarfile.RECORDSIZE))
    return changed


def _emit(out: Optional[BinaryIO], root: str, plan: LayerPlan, zstd_level: int,
          on_bytes: Optional[Callable[[int], None]], hashing: bool = True) -> LayerBlob:
    """Tar -> compress -> hash in one pass, writing the blob to `out` (or nowhere)."""
    comp = Compressor(out, plan.compression, zstd_level, hashing)
    changed = write_tar(comp, root, plan, on_bytes)
    comp.finish()
    if not hashing:
        return LayerBlob(plan.name, None, "", "", comp.blob.size, MEDIA_TYPE[plan.compression], changed)
    return LayerBlob(plan.name, None, comp.blob.digest, comp.tar.digest, comp.blob.size,
                     MEDIA_TYPE[plan.compression], changed)


def measure_layer(root: str, plan: LayerPlan, zstd_level: int = 3,
                  on_bytes: Optional[Callable[[int], None]] = None) -> LayerBlob:
    """Digests and size of a layer without keeping its bytes (stream it again with write_layer)."""
    return _emit(None, root, plan, zstd_level, on_bytes)


def write_layer(out: BinaryIO, root: str, plan: LayerPlan, zstd_level: int = 3,
                on_bytes: Optional[Callable[[int], None]] = None) -> LayerBlob:
    """Write the layer blob's bytes to `out`: the upload stream of a measured layer, not hashed
    again (the registry checks the bytes against the digest measured before)."""
    return _emit(out, root, plan, zstd_level, on_bytes, hashing=False)


def build_layer(root: str, plan: LayerPlan, out_dir: str, zstd_level: int = 3,
                on_bytes: Optional[Callable[[int], None]] = None) -> LayerBlob:
    """Build one layer blob into `out_dir` (temp name, renamed to its digest when complete)."""
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f".building-{plan.name}-{os.getpid()}-{id(plan)}")
    try:
        with open(tmp, "wb") as f:
            blob = _emit(f, root, plan, zstd_level, on_bytes)
        blob.path = os.path.join(out_dir, blob.digest.split(":", 1)[1])
        os.replace(tmp, blob.path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise StorageError(f"cannot write layer {plan.name} to {out_dir}: {e.strerror}",
                           "free disk space or set SNAP_STATE_DIR to a larger disk")
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return blob
