"""Files cut into part layers: which ones an image holds, and joining them back at restore.

`snap commit` cuts a file over the registry's layer size cap into part layers (layer/plan.py names the
parts and their annotations). A restore checks the parts' annotations before anything is written,
applies the parts as files named FILE.snap-part-K-of-N, then joins them here into FILE."""

from __future__ import annotations

import errno
import os
import shutil
import stat

from snapshotter import jsontext
from snapshotter.box.scan import read_xattrs
from snapshotter.errors import IntegrityError, printable, quoted_path, storage_error
from snapshotter.layer.extract import Extractor
from snapshotter.layer.fileops import set_xattr
from snapshotter.layer.roottree import TMP_PREFIX
from snapshotter.layer.plan import parse_part_annotation, part_name
from snapshotter.oci.image import SNAP_PART, SNAP_PART_FILE, SNAP_PART_LINKS, layer_label
from snapshotter.tar.rules import applied_xattrs, check_name

from .journal import Journal


def part_files(layers: list[tuple[int, dict, str]]) -> dict[str, int]:
    """{file: number of parts} for the files commit cut into part layers, from the layers'
    annotations. Refused unless every file has each of its parts 1..n exactly once, all saying n."""
    seen: dict[str, tuple[int, set[int]]] = {}
    for i, desc, _ in layers:
        ann = desc.get("annotations") or {}
        if not isinstance(ann, dict) or (SNAP_PART_FILE not in ann and SNAP_PART not in ann):
            continue
        label = layer_label(desc, i)
        part = parse_part_annotation(ann.get(SNAP_PART))
        rel = ann.get(SNAP_PART_FILE)
        if part is None or not isinstance(rel, str):
            raise IntegrityError(f"layer {label} has a malformed part annotation "
                                 f"({SNAP_PART}={ann.get(SNAP_PART)!r}, {SNAP_PART_FILE}={rel!r}): "
                                 "refusing a hostile image")
        rel = check_name(rel)
        if not rel:
            raise IntegrityError(f"layer {label} is a part of the root directory: refusing a hostile image")
        k, n = part
        count, have = seen.setdefault(rel, (n, set()))
        if n != count:
            raise IntegrityError(f"the part layers of /{printable(rel)} disagree on its number of parts "
                                 f"({count} and {n}): refusing a hostile image")
        if k in have:
            raise IntegrityError(f"part {k}/{n} of /{printable(rel)} is in the image twice: refusing a hostile image")
        have.add(k)
    for rel, (n, have) in seen.items():
        if len(have) != n:
            raise IntegrityError(f"/{printable(rel)} is cut into {n} parts, but the layers restored hold only "
                                 f"{len(have)} of them: "
                                 "refusing an incomplete image")
    return {rel: n for rel, (n, _) in seen.items()}


def part_links(layers: list[tuple[int, dict, str]]) -> dict[str, list[str]]:
    """{file: its other names} for the files cut into part layers that had hardlinks (listed on
    the last part): restore links them to the joined file. Names are checked like tar names."""
    out: dict[str, list[str]] = {}
    for i, desc, _ in layers:
        ann = desc.get("annotations") or {}
        if not isinstance(ann, dict) or SNAP_PART_LINKS not in ann:
            continue
        rel = ann.get(SNAP_PART_FILE)
        try:
            names = jsontext.loads(ann[SNAP_PART_LINKS]) if isinstance(ann[SNAP_PART_LINKS], str) else None
        except ValueError:
            names = None
        if not isinstance(rel, str) or not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise IntegrityError(f"layer {layer_label(desc, i)} has a malformed {SNAP_PART_LINKS} annotation: "
                                 "refusing a hostile image")
        rel, names = check_name(rel), [check_name(n) for n in names]
        if "" in names or rel in names:
            raise IntegrityError(f"layer {layer_label(desc, i)} links the root or /{printable(rel)} to itself: "
                                 "refusing a hostile image")
        out[rel] = names
    return out


def join_parts(extractor: Extractor, files: dict[str, int], links: dict[str, list[str]], fsync: bool,
               journal: Journal) -> None:
    """Join files that commit cut into part layers (over the registry's layer size cap) back into
    their original path. Each part was verified with its layer. Parts are opened without following
    symlinks, relative to their directory, and must be regular files: a hostile image cannot make
    a "part" of a host file. A file whose parts are all gone was joined by an earlier run; one with
    only some of them is refused. The file's other names (`links`) are then hardlinked to it, as
    a layer's hardlink is made (scoped to the root), only once this restore (this run, or an
    earlier one: the journal) joined it: never to a file already there. Neither the file nor a
    name replaces a directory or a link to one: commit never cuts such a thing, a hostile image's
    annotations can name /usr/lib (refused, as restore/deletion_guard.py does before anything is
    written onto a live root)."""
    try:
        for rel, count in files.items():
            try:
                if _join_file(extractor, rel, count, fsync, journal) and rel in links:
                    extractor.note_written(rel)
                for name in links.get(rel, ()):
                    if extractor.dir_at(name) is not None:
                        refuse_join_over_dir(rel, name)
                    extractor.add_hardlink(name, rel)
            except OSError as e:
                raise storage_error(e, repr(extractor.root), f" while joining the parts of {quoted_path(rel)}") from e
    finally:
        extractor.put_back_dir_times()


def refuse_join_over_dir(rel: str, name: str) -> None:
    """A file joined from part layers (/rel), or one of its names, lands on a directory or a link to one."""
    what = "the file joined" if name == rel else f"a name of the file /{printable(rel)} joined"
    raise IntegrityError(f"{what} from part layers would replace the directory (or link to one) {quoted_path(name)}: "
                         "refusing a hostile image")


def _join_file(extractor: Extractor, rel: str, count: int, fsync: bool, journal: Journal) -> bool:
    """Join /rel's parts; whether /rel is the file this restore joined (now, or in an earlier run)."""
    try:
        pdir = extractor.parent_dir(rel)
    except FileNotFoundError:
        return False  # no directory, so no parts: nothing to join
    base = rel.rpartition("/")[2]
    names = [part_name(base, k, count) for k in range(1, count + 1)]
    dfd = os.open(pdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        present = [_lexists_at(name, dfd) for name in names]
        if rel in journal.joined:  # joined and recorded; a killed run may have left some parts
            for name, there in zip(names, present):
                if there:
                    extractor.will_change(pdir)
                    os.unlink(name, dir_fd=dfd)
            return True
        if not any(present):
            return False  # no parts (joined by an earlier run, which the journal says: above)
        if not all(present):
            first = present.index(False) + 1
            raise IntegrityError(f"/{printable(rel)} is cut into {count} part layers, but {present.count(False)} of "
                                 f"its parts (part {first} first) are missing from the restored tree: refusing to "
                                 "join an incomplete file", "restore again into an empty directory")
        if extractor.dir_at(rel) is not None:
            refuse_join_over_dir(rel, rel)
        extractor.will_change(pdir)
        size = _write_joined(extractor, rel, names, dfd, fsync)
        journal.record_joined(rel, size)  # before the parts go: a run killed removing them knows the file is whole
        for name in names:
            os.unlink(name, dir_fd=dfd)
        return True
    finally:
        os.close(dfd)


def _write_joined(extractor: Extractor, rel: str, names: list[str], dfd: int, fsync: bool) -> int:
    """Write the parts `names` (in directory dfd) end to end as /rel, with the first part's owner,
    mode, xattrs and times: in a temp file renamed into place. Returns its size (for the journal)."""
    count, base = len(names), rel.rpartition("/")[2]
    tmp = f"{TMP_PREFIX}join-{os.getpid()}"
    out_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        with os.fdopen(out_fd, "wb") as out:
            first_st = None
            for k, name in enumerate(names, 1):
                fd, st = _open_part(name, dfd, rel, k, count)
                first_st = first_st or st
                with os.fdopen(fd, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            size = out.tell()
            if fsync:
                os.fsync(out.fileno())
            if extractor.opts.same_owner:
                os.fchown(out.fileno(), first_st.st_uid, first_st.st_gid)
            mode = stat.S_IMODE(first_st.st_mode)
            keep = extractor.opts.allow_setuid and os.geteuid() == 0
            if mode & (stat.S_ISUID | stat.S_ISGID) and not keep:
                # The first part may be a hardlink to any setuid file already in the tree.
                mode &= ~(stat.S_ISUID | stat.S_ISGID)
                extractor.stats.stripped("/" + rel)
            os.fchmod(out.fileno(), mode)  # after chown: chown clears setuid bits and capabilities
            # Its member's xattrs, as the extractor left them on the first part (the part's name
            # in the directory's handle, the name not followed: as the scan reads a path's).
            for name, value in applied_xattrs(read_xattrs(f"/proc/self/fd/{dfd}/{names[0]}"), keep).items():
                set_xattr(out.fileno(), name, value, {})
            os.utime(out.fileno(), ns=(first_st.st_atime_ns, first_st.st_mtime_ns))
        os.rename(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
        return size
    finally:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass


def _lexists_at(name: str, dfd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False


def _open_part(name: str, dfd: int, rel: str, k: int, count: int) -> tuple[int, os.stat_result]:
    """A read-only fd on part k of /rel: a regular file in directory `dfd`, never through a symlink."""
    st = os.lstat(name, dir_fd=dfd)
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else \
            "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise IntegrityError(f"part {k}/{count} of /{printable(rel)} is {kind}: refusing a hostile image")
    try:
        # O_NONBLOCK: had the path been swapped for a FIFO since the lstat, open would not hang on it.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise IntegrityError(f"part {k}/{count} of /{printable(rel)} is a symlink: refusing a hostile image")
        raise
    fst = os.fstat(fd)
    if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise IntegrityError(f"part {k}/{count} of /{printable(rel)} changed while being joined: refusing it")
    return fd, fst
