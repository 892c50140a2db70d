"""The restore journal: how far a restore into a root got, so that running it again resumes.

One file per restore root in the state dir: {manifest digest, the digests of this run's layer
list, a digest of the options that decide what a layer writes (`rules_digest`)}, then how many of
them are applied (always a prefix), with the files each layer wrote (a layer's hardlink may only
name those: layer/extract.py), what each of them is (a file's size, a symlink, ...) and what its
whiteouts hid, and the files joined from part layers (with their size), a line each.
Resuming needs the same manifest and the same list: an interrupted `--only-snapshot` run says
nothing about a full one; the same options: layers applied under another --profile or without
--allow-setuid must not stay beside layers applied now; and a root that still holds what the
applied layers wrote (resume.py), else the restore goes back to the first layer whose files are
not all there (`rewind`). A journal of another format version, another image, or other options,
means starting over."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from snapshotter import jsontext
from snapshotter.errors import quoted_path, storage_error
from snapshotter.layer import inplace
from snapshotter.layer.extract_model import ExtractOptions
from snapshotter.state import RootFiles, open_own, remove_if_there, replace_file, sub, versioned

# A header line, then one line per event (6 did not say which options wrote the layers; 5 gave no joined
# file's size or hardlink's target; 4 did not say what the files are; 3 did not list them).
VERSION = 7


@dataclass
class Applied:
    """What applying one layer left, as the journal says: the files it wrote and what each is
    (Extractor.layer_shapes), the paths its whiteouts hid (an opaque directory's end in /)."""

    wrote: list[str] = field(default_factory=list)
    shapes: list[int] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)  # its hardlinks (of `wrote`) -> their targets


class Journal:
    """The journal of a restore of `manifest_digest` (its `layers`, by digest) into a root (`files`),
    kept in `directory`, under options whose rules_digest is `rules`. `load` reads what an earlier run
    left; `applied` and `joined` say how far it got.

    One JSON line with the manifest and the list, then one line per event ({"applied": n,
    "wrote": [path, ...], "shapes": [...], "gone": [...], "links": {path: target}},
    {"joined": path, "size": n} or {"rewound": n}) appended as it happens: linear in the layers (a
    whole rewrite after each of 5,000 layers was quadratic). A torn last line (a kill while appending) is ignored."""

    def __init__(self, directory: str, files: RootFiles, manifest_digest: str, layers: list[str], fsync: bool,
                 rules: str = ""):
        self.path = files.file_in(directory)  # JSON lines
        self.in_place_log = files.file_in(sub("restore-in-place"))  # JSON lines too: layer/inplace.py
        self.root, self.manifest, self.layers, self.fsync = files.root, manifest_digest, layers, fsync
        self.rules = rules
        self.joined: dict[str, int] = {}  # files joined from part layers -> their size
        self.done: dict[int, Applied] = {}  # layer n (from 1) of the list -> what applying it left
        self._started = False  # the file holds this run's first line

    @property
    def applied(self) -> int:
        """How many layers of the list are applied (a prefix)."""
        return max(self.done, default=0)

    @property
    def written(self) -> set[str]:
        """Files the applied layers wrote, relative to the root (hardlinks may name them)."""
        return {rel for done in self.done.values() for rel in done.wrote}

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
        self.sweep(log)  # before anything: a file an earlier run was writing in place when it stopped
        exists, head, events = self._read()
        if not exists:
            return
        why = None
        if not events:
            why = ("was interrupted with another image or layer selection" if isinstance(head, dict)
                   else f"left an unreadable journal ({self.path})")
        elif head.get("rules") != self.rules:  # the layers it applied follow other rules than this run's
            why = "was interrupted with other options (--profile, --allow-setuid, --allow-devices, or another user)"
        if why is not None:
            log(f"an earlier restore into {self.root} {why}: starting over, applying all {len(self.layers)} layer(s)")
            self._start()  # at once: the tree is about to change under what the old journal says
            return
        self._started = True
        for line in events:
            event = _json_line(line)
            if isinstance(event, dict):  # else a torn last line
                self._replay(event)

    def _replay(self, event: dict) -> None:
        n, rel, back, size = event.get("applied"), event.get("joined"), event.get("rewound"), event.get("size")
        if type(n) is int and 0 < n <= len(self.layers):
            wrote, shapes, gone = event.get("wrote", []), event.get("shapes", []), event.get("gone", [])
            links = event.get("links", {})
            if (_strings(wrote) and _strings(gone) and isinstance(shapes, list) and len(shapes) == len(wrote)
                    and all(type(s) is int for s in shapes) and isinstance(links, dict)
                    and _strings(list(links.values()))):
                self.done[n] = Applied(wrote, shapes, gone, links)
            else:  # not as this version writes it: what that layer left is not known
                self._forget_from(n)
        elif isinstance(rel, str) and type(size) is int and size >= 0:
            self.joined[rel] = size
        elif type(back) is int and back >= 0:
            self._forget_from(back + 1)

    def _forget_from(self, n: int) -> None:
        self.done = {k: v for k, v in self.done.items() if k < n}
        self.joined = {}  # files are joined once every layer is applied

    def record_applied(self, count: int, wrote: Sequence[str] = (), shapes: Sequence[int] = (),
                       gone: Sequence[str] = (), links: Optional[dict[str, str]] = None) -> None:
        """The first `count` layers of the list are applied, the last of them writing `wrote` (what
        each is: `shapes`; its hardlinks' targets: `links`) and hiding `gone` with its whiteouts."""
        self.done[count] = Applied(list(wrote), list(shapes), list(gone), dict(links or {}))
        event: dict = {"applied": count}
        if wrote:
            event.update(wrote=list(wrote), shapes=list(shapes))
        if gone:
            event["gone"] = list(gone)
        if links:
            event["links"] = dict(links)
        self._append(event)

    def rewind(self, count: int) -> None:
        """Only the first `count` layers are applied after all (the root lacks what a later one wrote:
        resume.py): the rest, and the joins, are done again."""
        self._forget_from(count + 1)
        self._append({"rewound": count})

    def record_joined(self, rel: str, size: int) -> None:
        """/rel is whole again (its part layers joined, `size` bytes): said before its parts are removed."""
        self.joined[rel] = size
        self._append({"joined": rel, "size": size})

    def _start(self) -> None:
        head = {"version": VERSION, "manifest": self.manifest, "layers": self.layers, "rules": self.rules}
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
            raise storage_error(e, f"snap's state dir {os.path.dirname(self.path)!r}",
                                " while writing the restore journal",
                                "free space there and run the restore again: it resumes (or point SNAP_STATE_DIR "
                                "at a new empty directory on another disk)") from e

    def remove(self) -> None:
        try:
            remove_if_there(self.path)
            remove_if_there(self.in_place_log)
        except OSError as e:
            raise storage_error(e, f"snap's state dir {os.path.dirname(self.path)!r}",
                                " while removing the restore journal") from e

    def sweep(self, log: Callable[[str], None]) -> None:
        """Remove the files a run (this one, failed, or an earlier one, killed) left half-written at
        their paths (layer/inplace.py); one that cannot be removed is said."""
        try:
            removed, failed = inplace.sweep(self.in_place_log)
        except OSError as e:
            removed, failed = [], [f"the list of them, {self.in_place_log!r} ({e.strerror or e})"]
        for path in removed:
            log(f"removed {quoted_path(path)}: a stopped restore left it half-written")
        if failed:
            log(f"snap: warning: could not remove what a stopped restore left half-written: {', '.join(failed)}; "
                "remove it by hand")


def rules_digest(options: ExtractOptions) -> str:
    """A digest of what decides what applying a layer writes: owners, setuid bits and capabilities,
    device nodes, the paths never written (the profile's), and whether this process runs as root
    (which some of them need). Not fsync, nor the run's token."""
    rules = {"root": os.geteuid() == 0, "same_owner": options.same_owner, "allow_setuid": options.allow_setuid,
             "allow_devices": options.allow_devices, "never_write": sorted(options.never_write)}
    return "sha256:" + hashlib.sha256(json.dumps(rules, sort_keys=True).encode()).hexdigest()


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _json_line(line: bytes):
    try:
        return jsontext.loads(line)
    except ValueError:
        return None
