"""Hooks run in packer processes (layer/packers.py): a commit's CommitHooks.after_read travels to each
packer with its layer, pickled: these are classes, and a packer imports this module (PYTHONPATH must name
tests/, see packer_env)."""

from __future__ import annotations

import os


def packer_env() -> dict:
    """The environment under which packers can load the hooks below."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {"PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}


class NoteReader:
    """Notes the pid of each process that reads a box file (one line each) in `log`."""

    def __init__(self, log: str):
        self.log = log

    def __call__(self, path: str, attempt: int) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


class RewriteOnRead(NoteReader):
    """Also rewrites `paths` (of `root`) in place after every read: they never hold still."""

    def __init__(self, log: str, root: str, paths: set[str]):
        super().__init__(log)
        self.root, self.paths = root, paths

    def __call__(self, path: str, attempt: int) -> None:
        super().__call__(path, attempt)
        if path in self.paths:
            with open(os.path.join(self.root, path), "r+b") as f:
                f.write(os.urandom(64))


class BlockOnRead:
    """In a packer (not in the process `maker`): writes its pid to the FIFO `ready`, then blocks
    for good (opening the FIFO `never` for reading, which no one writes)."""

    def __init__(self, ready: str, never: str):
        self.ready, self.never, self.maker = ready, never, os.getpid()

    def __call__(self, path: str, attempt: int) -> None:
        if os.getpid() == self.maker:
            return
        fd = os.open(self.ready, os.O_WRONLY)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        os.open(self.never, os.O_RDONLY)


