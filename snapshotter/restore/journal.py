"""The restore journal: how far a restore into a root got, so that running it again resumes.

One file per restore root in the state dir: {manifest digest, the digests of this run's layer
list}, then how many of them are applied (always a prefix), with the files each layer wrote (a
layer's hardlink may only name those: layer/extract.py), and the files joined from part layers,
a line each. Resuming
needs the same manifest and the same list: an interrupted `--only-snapshot` run says nothing about
a full one. A journal of another format version, or another image, means starting over."""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from snapshotter.errors import storage_error
from snapshotter.state import open_own, replace_file, root_key, versioned

VERSION = 4  # a header line, then one line per event (3 did not list the files written)


class Journal:
    """The journal of a restore of `manifest_digest` (its `layers`, by digest) into `root`, kept in
    `directory`. `load` reads what an earlier run left; `applied` and `joined` say how far it got.

    One JSON line with the manifest and the list, then one line per event ({"applied": n,
    "wrote": [path, ...]} or {"joined": path}) appended as it happens: linear in the layers (a whole rewrite after each of
    5,000 layers was quadratic). A torn last line (a kill while appending) is ignored."""

    def __init__(self, directory: str, root: str, manifest_digest: str, layers: list[str], fsync: bool):
        self.path = os.path.join(directory, root_key(root) + ".json")  # JSON lines
        self.root, self.manifest, self.layers, self.fsync = root, manifest_digest, layers, fsync
        self.applied = 0
        self.joined: list[str] = []
        self.written: set[str] = set()  # files the applied layers wrote, relative to the root
        self._started = False  # the file holds this run's first line

    def _read(self) -> tuple[bool, object, list[bytes]]:
        """(whether there is a journal, its first line (None if unreadable), its event lines if
        it is this restore's: same image, same layers; else [])."""
        try:
            with open_own(self.path, "rb") as f:
                lines = f.read().split(b"\n")
        except FileNotFoundError:
            return False, None, []
        except OSError:
            return True, None, []
        head = _json_line(lines[0])
        ours = (versioned(head, VERSION) is not None and head.get("manifest") == self.manifest
                and head.get("layers") == self.layers)
        return True, head, [b"{}", *lines[1:]] if ours else []

    def started_here(self) -> bool:
        """This restore (same image, same layers) ran into this root before and did not finish."""
        return bool(self._read()[2])

    def load(self, log: Callable[[str], None]) -> None:
        exists, head, events = self._read()
        if not exists:
            return
        if not events:
            why = ("was interrupted with another image or layer selection" if isinstance(head, dict)
                   else f"left an unreadable journal ({self.path})")
            log(f"an earlier restore into {self.root} {why}: starting over, applying all {len(self.layers)} layer(s)")
            self._start()  # at once: the tree is about to change under what the old journal says
            return
        self._started = True
        for line in events:
            event = _json_line(line)
            if not isinstance(event, dict):
                continue  # a torn last line
            n, rel = event.get("applied"), event.get("joined")
            if type(n) is int and 0 <= n <= len(self.layers):
                self.applied = max(self.applied, n)
                wrote = event.get("wrote")
                if isinstance(wrote, list):
                    self.written.update(p for p in wrote if isinstance(p, str))
            elif isinstance(rel, str):
                self.joined.append(rel)

    def record_applied(self, count: int, wrote: Sequence[str] = ()) -> None:
        """The first `count` layers of the list are applied, the last of them writing `wrote`."""
        self.applied = count
        self._append({"applied": count, "wrote": list(wrote)} if wrote else {"applied": count})

    def record_joined(self, rel: str) -> None:
        """/rel is whole again (its part layers joined): said before its parts are removed."""
        self.joined.append(rel)
        self._append({"joined": rel})

    def _start(self) -> None:
        head = {"version": VERSION, "manifest": self.manifest, "layers": self.layers}
        self._write(lambda: replace_file(self.path, lambda f: f.write(json.dumps(head) + "\n"), durable=self.fsync))
        self._started = True

    def _append(self, event: dict) -> None:
        """With --fsync everything written so far is made durable first (os.sync: the tree may span
        filesystems), then the journal's new line."""
        if not self._started:
            self._start()

        def append() -> None:
            if self.fsync:
                os.sync()  # file data, and the directories of every rename, before the journal says so
            with open_own(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())

        self._write(append)

    def _write(self, write: Callable[[], None]) -> None:
        try:
            write()
        except OSError as e:
            raise storage_error(e, f"snap's state dir {os.path.dirname(self.path)!r}", " while writing the restore journal",
                                "free space or point SNAP_STATE_DIR at a bigger disk, and run the restore again: "
                                "it resumes") from e

    def remove(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, f"snap's state dir {os.path.dirname(self.path)!r}",
                                " while removing the restore journal") from e


def _json_line(line: bytes):
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None
