"""What a hub cache looks like around its referenced blobs: the snapshots/COMMIT/PATH symlinks
(relative, as huggingface_hub writes them) and the refs/NAME files (a commit hash, no newline).

Who owns what: the layers keep the symlinks and refs files (they are small, and the layers restore
them with their own mode, owner and times, with everything else the cache holds: .locks, .no_exist,
git-hashed blobs, CACHEDIR.TAG); the references own only the sha256 blobs. So a restore lands the
layers, then fetches the blobs, and the symlinks that dangled until then resolve. cache_layout says
what the references alone imply, and complete_layout makes any of it that is missing (a symlink or
ref the layers do not have) without touching what is there: a cache rebuilt from the references alone
is the hub's, and one restored from layers and references is the box's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from snapshotter.box.openat import DIR_FLAGS, open_beneath, open_root
from snapshotter.errors import IntegrityError, storage_error
from snapshotter.origin.references import References


@dataclass
class Layout:
    """Root-relative paths: each blob (sha256), each symlink (its relative target), each ref file (its text)."""

    blobs: dict[str, str] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)


def cache_layout(doc: References) -> Layout:
    layout = Layout()
    for r in doc.references:
        layout.blobs[r.blob_path] = r.sha256
        layout.links[r.link_path] = r.link_target
    for ref in doc.refs:
        layout.refs[ref.file_path] = ref.revision
    return layout


def complete_layout(root: str, doc: References) -> list[str]:
    """Make the symlinks and refs files the references imply where nothing is at their path (folders
    made 0o755 as the hub makes them); what is there is the layers' and stays. Returns the paths made."""
    layout = cache_layout(doc)
    made = []
    root_fd = open_root(root)
    try:
        for path, target in sorted(layout.links.items()):
            if _make(root_fd, path, lambda name, fd, t=target: os.symlink(t, name, dir_fd=fd)):
                made.append(path)
        for path, revision in sorted(layout.refs.items()):
            if _make(root_fd, path, lambda name, fd, text=revision: _write_ref(fd, name, text)):
                made.append(path)
    finally:
        os.close(root_fd)
    return made


def _write_ref(dir_fd: int, name: str, text: str) -> None:
    """A refs file as the hub writes it, put in place whole (a temporary file renamed)."""
    tmp = f".{name}.snap-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def open_folder(root_fd: int, rel: str) -> int:
    """The handle of the folder `rel` below the root, each folder on the way made (0o755, as the hub
    makes them) where missing and none followed if it is a symlink (IntegrityError)."""
    fd = os.dup(root_fd)
    try:
        for part in rel.split("/") if rel else ():
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                fd, old = open_beneath(fd, part, DIR_FLAGS), fd
            except OSError as e:
                raise IntegrityError(f"cannot land in {rel!r}: {e.strerror} at {part!r}",
                                     "a symlink or a file stands where the hub cache's folders go") from None
            os.close(old)
    except OSError as e:
        os.close(fd)
        raise storage_error(e, repr(rel)) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make(root_fd: int, path: str, create) -> bool:
    """create(name, folder_fd) for the last part of `path` if nothing is there (folders made as
    open_folder makes them; none through a symlink). Whether it made it."""
    folder, _, name = path.rpartition("/")
    try:
        fd = open_folder(root_fd, folder)
    except IntegrityError:
        return False  # a symlink (or file) the layers put where a folder goes: the box's, it stays
    try:
        os.lstat(name, dir_fd=fd)
        return False
    except FileNotFoundError:
        try:
            create(name, fd)
        except OSError as e:
            raise storage_error(e, repr(path)) from None
        return True
    finally:
        os.close(fd)
