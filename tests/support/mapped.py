"""A real process that keeps a box file mapped shared and writable and writes through the map on
demand (a database keeping its file mapped): the kernel moves the file's times at the first write
to a clean page only, the writes after it change no stat data."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator

import pytest

TIMEOUT = 60

# Maps the file (its descriptor closed: the map alone holds it) and writes each word it is given at
# the file's start, through the map, answering "wrote"; "!ro" and "!rw" switch the map read-only and
# back (mprotect); an empty line ends it.
_WRITER = ("import ctypes, mmap, sys\n"
           "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
           "libc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
           "at = ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
           "for line in sys.stdin:\n"
           "    word = line.strip()\n"
           "    if not word:\n"
           "        break\n"
           "    if word in ('!ro', '!rw'):\n"
           "        assert libc.mprotect(at, len(m), 1 if word == '!ro' else 3) == 0\n"
           "    else:\n"
           "        m[:len(word)] = word.encode()\n"
           "    print('wrote', flush=True)\n")


class MappedWriter:
    def __init__(self, path: str):
        self.proc = subprocess.Popen([sys.executable, "-c", _WRITER, path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def write(self, word: str) -> None:
        """Write `word` through the map; returns once it is written."""
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "wrote\n"

    def exit(self) -> None:
        self.proc.communicate("\n", timeout=TIMEOUT)


_HOLDS = {"open for append": "f = open(sys.argv[1], 'ab')",
          "mapped to be read": "f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)"}


@contextmanager
def held(path: str, how: str) -> Iterator[int]:
    """A real process holding `path` as `how` says (a key of _HOLDS) until the block ends; its pid."""
    proc = subprocess.Popen([sys.executable, "-c", f"import mmap, sys; {_HOLDS[how]}; print('held', flush=True); "
                             "sys.stdin.readline()", path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        yield proc.pid
    finally:
        proc.communicate("\n", timeout=TIMEOUT)


@contextmanager
def mapped_name(path: str, elsewhere: str, via: str) -> Iterator[str]:
    """The name a writer maps the box file `path` through: `path` itself ("box"), a hard link at
    `elsewhere` ("hardlink": outside the box, on its filesystem), or `path` seen through a bind mount of
    its directory at `elsewhere` ("bind": root only, skipped where mount is refused, unmounted after).
    /proc shows the mapping by that name: only the file's identity says it is the box's."""
    if via == "box":
        yield path
        return
    if via == "hardlink":
        os.link(path, elsewhere)
        yield elsewhere
        return
    os.makedirs(elsewhere)
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    mounted = subprocess.run(["mount", "--bind", os.path.dirname(path), elsewhere], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"mount --bind refused: {mounted.stderr.strip()}")
    try:
        yield os.path.join(elsewhere, os.path.basename(path))
    finally:
        subprocess.run(["umount", "--lazy", elsewhere], check=True, timeout=TIMEOUT)


def stat_data(path: str) -> tuple:
    """What the stat cache and the walk memo compare of a file."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
