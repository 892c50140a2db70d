"""Which weights of a restore have landed, for `snap restore --then` and `snap restore --wait PATH`.

Commit puts the weights layers last (layer/plan.py), so a restore knows the point after which only
weights remain: there it starts the app (`--then CMD`). As it goes, it keeps a small progress file
per restore root in the state dir, written first thing ("starting"): its pid, the weight files named
by their layers (a single-file layer's file, a file cut into parts) and whether each has landed, and
whether the restore is done.
`--wait PATH`, in another process, polls that file (it takes no lock: the restore holds it).
A file inside a bundle or a non-weight layer is not named in advance: it counts as landed when the
restore is done. A weight appears at its path by a rename, never half-written (layer/extract.py); the
layers before the app's start, which nothing reads yet, write their new files in place."""

from __future__ import annotations

import math
import os
import subprocess
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from snapshotter import jsontext
from snapshotter.errors import NotFound, UsageError, WaitTimeout
from snapshotter.oci.image import SNAP_CONTENT, SNAP_LAYER, Layer
from snapshotter.state import RootFiles, open_own, state_dir, sub, versioned, write_versioned

VERSION = 1
PROGRESS_DIR = "restore-progress"
POLL_SECONDS = 0.1


def progress_path(files: RootFiles, directory: Optional[str] = None) -> str:
    """The progress file of a restore into a root (`files`), in `directory` (default: made in the state dir)."""
    return files.file_in(directory or sub(PROGRESS_DIR))


def weight_file(layer: Layer, weights: set[str]) -> Optional[str]:
    """The root-relative file a weights layer brings whole ("" for a bundle); None for another layer."""
    ann = layer.annotations
    if ann.get(SNAP_LAYER) not in weights:
        return None
    part_of = layer.part_file
    if isinstance(part_of, str):
        return part_of.lstrip("/")
    content = ann.get(SNAP_CONTENT)
    one_file = isinstance(content, str) and not content.startswith(("bundle ", "directories"))
    return content.lstrip("/") if one_file else ""


def app_ready_after(layers: list[Layer], weights: set[str]) -> int:
    """How many of `layers` (in order) must be applied before the app can start: all
    up to the last one that is not a weights layer. A file of a non-weight layer cut into parts is
    joined at the end, so then the app starts at the end."""
    last = 0
    for n, layer in enumerate(layers):
        if weight_file(layer, weights) is None:
            if layer.part_file is not None:
                return len(layers) + 1  # after the joins
            last = n + 1
    return last


class Progress:
    """The progress file of a restore into a root (`files`). Written "starting" first thing, before
    the image is resolved: a file an earlier run left (stopped, or done with another image) must not
    answer `--wait` meanwhile. `running` names the weights of `layers` (in order) once they are known."""

    def __init__(self, files: RootFiles):
        self.path = progress_path(files)
        self.files: dict[str, bool] = {}
        self.state = "starting"
        self._write()

    @contextmanager
    def stopped_on_failure(self) -> Iterator[None]:
        """What the block raises marks the restore stopped (a `--wait` gives up at once)."""
        try:
            yield
        except BaseException:
            self.finish(ok=False)
            raise

    def running(self, layers: list[Layer], weights: set[str]) -> None:
        self.files = {rel: False for rel in (weight_file(d, weights) for d in layers) if rel}
        self.state = "running"
        self._write()

    def landed(self, layer: Layer, weights: set[str]) -> None:
        rel = weight_file(layer, weights)
        if rel and rel in self.files and layer.part_file is None:
            self.files[rel] = True
            self._write()

    def finish(self, ok: bool) -> None:
        self.state = "done" if ok else "stopped"
        if ok:
            self.files = dict.fromkeys(self.files, True)
        self._write()

    def _write(self) -> None:
        try:
            write_versioned(self.path, VERSION, {"pid": os.getpid(), "state": self.state, "files": self.files})
        except OSError:
            pass  # only `--wait` reads it; the restore itself goes on


def start_then(command: str) -> subprocess.Popen:
    """Start the app: `command` by the shell, in the background, with snap's stdout and stderr.
    It keeps running when the restore ends, whatever its exit code."""
    return subprocess.Popen(command, shell=True)


def _alive(pid: object) -> bool:
    if type(pid) is not int or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_landed(path: str, root: str, timeout: Optional[float],
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once the restore into `root` has landed `path` (a path on this machine, under root);
    raise with one line on a timeout, or when no restore is running or the image lacks the file."""
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):  # nan never timed out
        raise UsageError(f"--timeout {timeout:g} is not a number of seconds from 0", "e.g. --timeout 600")
    real_root = os.path.realpath(root)
    full = os.path.abspath(path)
    rel = os.path.relpath(full, real_root)
    if rel == ".." or rel.startswith("../") or rel == ".":
        raise UsageError(f"{path!r} is not a file under the restore root {root!r}", "pass --root")
    deadline = None if timeout is None else clock() + timeout
    progress = progress_path(RootFiles(real_root), os.path.join(state_dir(), PROGRESS_DIR))  # read only: nothing made
    while True:
        try:
            with open_own(progress) as f:
                doc = jsontext.loads(f.read())
        except FileNotFoundError:
            doc = None
        except (OSError, ValueError):
            doc = {}  # being replaced: read again
        if doc is None:
            if os.path.lexists(full):
                return
            raise UsageError(f"no restore into {root!r} is running, and {path!r} is not there",
                             "start `snap restore REF --root ROOT` first")
        if versioned(doc, VERSION):
            files = doc.get("files") if isinstance(doc.get("files"), dict) else {}
            if files.get(rel) is True:
                return
            if doc.get("state") == "done":
                if os.path.lexists(full):
                    return
                raise NotFound(f"{path!r} is not in the image restored into {root!r}", "check the path")
            if doc.get("state") not in ("starting", "running") or not _alive(doc.get("pid")):
                raise UsageError(f"the restore into {root!r} stopped before {path!r} landed",
                                 "run the restore again: it resumes, then wait again")
        if deadline is not None and clock() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {path!r} to land", "wait longer (--timeout)")
        sleep(POLL_SECONDS)
