"""`snap verify`'s hardlink check: the names the image gives one file must be one inode in the
directory, and files the image keeps apart must not be (after `ln -f a b` an edit of one changes
both, whatever their bytes are now). Inodes come from the lstat verify made of each path anyway."""

from __future__ import annotations

import os

from snapshotter.errors import quoted_path


class HardlinkCheck:
    """The inodes of the image's regular files as the directory has them, and how they differ from
    the image's hardlinks."""

    def __init__(self, linked: dict[str, object]):
        self.linked = linked  # path -> a key its file's other names share (the hardlinks the layers make)
        self.inodes: dict[str, tuple[int, int]] = {}  # the image's files found as files, which may share one

    def note(self, rel: str, st: os.stat_result) -> None:
        """A regular file of the image found as one. A file of one name is nobody's hardlink: its
        inode is kept only when the image links it (a split link leaves it one name)."""
        if rel in self.linked or st.st_nlink > 1:
            self.inodes[rel] = (st.st_dev, st.st_ino)

    def differences(self) -> list[tuple[str, str]]:
        """(path, what differs), in path order within each file: each name the image links that is
        not its first name's inode, and each file the image keeps apart that shares an inode with
        an earlier path (the other names the image links to it are not reported again)."""
        out: list[tuple[str, str]] = []
        names: dict[object, list[str]] = {}  # the image's file -> its names found
        files: dict[tuple[int, int], list[str]] = {}  # the directory's inode -> the image's paths on it
        for rel in sorted(self.inodes):
            if rel in self.linked:
                names.setdefault(self.linked[rel], []).append(rel)
            files.setdefault(self.inodes[rel], []).append(rel)
        for first, *others in names.values():
            out.extend((rel, f"not a hardlink to {quoted_path(first)}, as in the image")
                       for rel in others if self.inodes[rel] != self.inodes[first])
        for first, *others in files.values():
            seen = {self.linked.get(first, first)}  # the image's files on this inode, by key (or path)
            for rel in others:
                key = self.linked.get(rel, rel)
                if key not in seen:
                    seen.add(key)
                    out.append((rel, f"a hardlink to {quoted_path(first)}, not in the image"))
        return out
