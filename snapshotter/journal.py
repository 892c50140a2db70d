"""The restore journal: how far a restore into a root got, so that running it again resumes.

One file per restore root in the state dir: {manifest digest, the digests of this run's layer
list, how many of them are applied (always a prefix), files joined from part layers}. Resuming
needs the same manifest and the same list: an interrupted `--only-snapshot` run says nothing about
a full one. A journal of another format version, or another image, means starting over."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable

from .extract import storage_error
from .state import replace_file

VERSION = 2


class Journal:
    """The journal of a restore of `manifest_digest` (its `layers`, by digest) into `root`, kept in
    `directory`. `load` reads what an earlier run left; `applied` and `joined` say how far it got."""

    def __init__(self, directory: str, root: str, manifest_digest: str, layers: list[str], fsync: bool):
        key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:32]
        self.path = os.path.join(directory, key + ".json")
        self.root, self.manifest, self.layers, self.fsync = root, manifest_digest, layers, fsync
        self.applied = 0
        self.joined: list[str] = []

    def _read(self) -> tuple[bool, object, bool]:
        """(whether there is a journal, what it holds (None if unreadable), whether it is this
        restore's: same image, same layers)."""
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return False, None, False
        except (OSError, ValueError):
            return True, None, False
        applied = doc.get("applied") if isinstance(doc, dict) else None
        return True, doc, (isinstance(doc, dict) and doc.get("version") == VERSION and doc.get("manifest") == self.manifest
                           and doc.get("layers") == self.layers and type(applied) is int and 0 <= applied <= len(self.layers))

    def started_here(self) -> bool:
        """This restore (same image, same layers) ran into this root before and did not finish."""
        return self._read()[2]

    def load(self, log: Callable[[str], None]) -> None:
        exists, doc, ours = self._read()
        if not exists:
            return
        if not ours:
            why = ("was interrupted with another image or layer selection" if isinstance(doc, dict)
                   else f"left an unreadable journal ({self.path})")
            log(f"an earlier restore into {self.root} {why}: starting over, applying all {len(self.layers)} layer(s)")
            self.write()  # at once: the tree is about to change under what the old journal says
            return
        self.applied = doc["applied"]
        self.joined = [j for j in doc.get("joined", []) if isinstance(j, str)]

    def record_applied(self, count: int) -> None:
        """The first `count` layers of the list are applied."""
        self.applied = count
        self.write()

    def record_joined(self, rel: str) -> None:
        """/rel is whole again (its part layers joined): said before its parts are removed."""
        self.joined.append(rel)
        self.write()

    def write(self) -> None:
        """Replace the journal atomically. With --fsync everything written so far is made durable
        first (os.sync: the tree may span filesystems), then the journal and its directory."""
        doc = {"version": VERSION, "manifest": self.manifest, "layers": self.layers,
               "applied": self.applied, "joined": self.joined}
        d = os.path.dirname(self.path)
        try:
            if self.fsync:
                os.sync()  # file data, and the directories of every rename, before the journal says so
            replace_file(self.path, lambda f: json.dump(doc, f), durable=self.fsync)
        except OSError as e:
            raise storage_error(e, f"snap's state dir {d}", " while writing the restore journal",
                                "free space or point SNAP_STATE_DIR at a bigger disk, and run the restore again: "
                                "it resumes") from e

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, f"snap's state dir {os.path.dirname(self.path)}",
                                " while removing the restore journal") from e
