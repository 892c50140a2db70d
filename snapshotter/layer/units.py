"""Natural units of a box's tree: what one `pip install` or one custom node adds, upgrades or
removes together. Bundles are cut only between units (layer/bundling.py), so a change to one package
changes only the bundles that hold its files.

  - A path an installed distribution's RECORD lists (box/records.py) is that distribution's
    (`yaml/` with `PyYAML-*.dist-info`). The name rules below hold for the rest:
  - In a site-packages or dist-packages directory, a unit is a distribution's top-level name with
    its `<name>-<version>.dist-info` (or .egg-info, .data), `<name>.libs`, `<name>.py`, `<name>.pth`,
    its extension module `<name>.cpython-*.so` and its `__pycache__/<name>.*.pyc`, compared by the
    name normalized (lowercase, `-` and `.` as `_`). A namespace directory (no `__init__.py`: `nvidia/`,
    `google/`) holds a unit per subdirectory (`nvidia/cublas`, keyed `nvidia_cublas`).
  - Under `custom_nodes/`, a unit is one node: `custom_nodes/<node>/` and all below it.
  - Elsewhere a unit is a file's directory, or its ancestor four levels deep for a deeper one
    (`usr/share/doc/<pkg>`, `opt/conda/pkgs/<pkg>`, `root/ComfyUI/comfy/ldm`).
"""

from __future__ import annotations

import re
from typing import Optional, Protocol

PACKAGE_DIRS = ("site-packages", "dist-packages")
NODES_DIR = "custom_nodes"
DEPTH = 4  # elsewhere: a unit is at most this many directories deep
_META_SUFFIX = re.compile(r"-[^/]*\.(dist-info|egg-info|data)$", re.IGNORECASE)  # "<name>-<version>.dist-info"
_NORMALIZE = re.compile(r"[-.]+")


def normalize(name: str) -> str:
    """A distribution's or module's name as pip compares them (PEP 503, with `_` as the separator)."""
    return _NORMALIZE.sub("_", name).lower()


def top_name(first: str, is_dir: bool) -> str:
    """The unit name of a site-packages entry's first component: "numpy-1.26.4.dist-info" and
    "numpy.libs" and "numpy" all give "numpy"; "six.py" and "_cffi_backend.cpython-311-x86_64-linux-gnu.so"
    their module's name."""
    m = _META_SUFFIX.search(first)
    if m:
        return normalize(first[:m.start()])
    if first.endswith((".dist-info", ".egg-info")):
        return normalize(first.rpartition(".")[0])
    if first.endswith(".libs") and is_dir:
        return normalize(first[:-len(".libs")])
    if not is_dir or first.endswith(".egg-link"):
        return normalize(first.partition(".")[0])
    return normalize(first)


class Owners(Protocol):
    def owner_of(self, path: str) -> Optional[str]:
        """The dist-info directory of the installed distribution that owns `path` (box/records.py)."""


def units_of(paths: list[str], owners: Optional[Owners] = None) -> list[str]:
    """The unit key of each of `paths` (root-relative, all of one layer): its distribution's as
    `owners` (the box's RECORDs) says, else by the rules above. The key is made of the tree alone
    (paths, RECORDs), so the same tree gives the same keys wherever it lies."""
    present = set(paths)
    by_dir: dict[str, str] = {}  # a directory's files share its unit, but for a few (_unit says)
    keys = []
    of_owner: dict[str, str] = {}  # a dist-info directory: its unit key (the name rule's for it)
    for p in paths:
        owner = owners.owner_of(p) if owners is not None else None
        if owner is not None:
            if owner not in of_owner:
                of_owner[owner] = _unit(owner + "/RECORD", present)[0]
            keys.append(of_owner[owner])
            continue
        parent = p.rpartition("/")[0]
        key = by_dir.get(parent)
        if key is None:
            key, of_dir = _unit(p, present)
            if of_dir:
                by_dir[parent] = key
        keys.append(key)
    return keys


def _unit(path: str, present: set[str]) -> tuple[str, bool]:
    """A path's unit key, and whether every file in its directory has that key."""
    parts = path.split("/")
    for i, part in enumerate(parts[:-1]):
        if part in PACKAGE_DIRS:
            return _package_unit("/".join(parts[:i + 1]), parts[i + 1:], present)
        if part == NODES_DIR:
            return "/".join(parts[:i + 2]), i + 2 < len(parts)
    return "/".join(parts[:-1][:DEPTH]), True


def _package_unit(where: str, rest: list[str], present: set[str]) -> tuple[str, bool]:
    first, is_dir = rest[0], len(rest) > 1
    if first == "__pycache__" and len(rest) == 2:  # a top-level module's byte code: "six.cpython-311.pyc"
        return f"{where}\0{normalize(rest[1].partition('.')[0])}", False
    name = top_name(first, is_dir)
    if len(rest) > 2 and name == normalize(first) and f"{where}/{first}/__init__.py" not in present:
        # A namespace directory holds several distributions: a unit per subdirectory.
        return f"{where}\0{name}_{normalize(rest[1])}", True
    return f"{where}\0{name}", is_dir
