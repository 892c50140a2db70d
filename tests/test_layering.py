"""The package's floors: each imports only the floors below it, and no module imports itself back
through others (go-containerregistry's depcheck, for a Python tree). Read from the source with ast,
so function-level imports count as much as the ones at the top of a module."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "snapshotter")

# Bottom first. A unit is a subpackage (snapshotter/box/) or a top-level module (snapshotter/state.py);
# units on one floor do not import each other.
FLOORS = [
    {"errors", "version", "jsontext"},  # jsontext: JSON from outside and from state files, every failure a ValueError
    {"settings"},  # the SNAP_* settings: one parser for each kind of value
    {"digests", "jobs", "progress", "state", "workers"},
    {"oci"},  # the image model: no I/O
    {"tar", "crypt"},  # crypt: ocicrypt's layer encryption, over the image model
    {"registry"},
    {"engine", "index"},
    {"profile"},  # layer profiles: which path goes to which layer (configuration, read by the box and up)
    {"box"},
    {"layer", "origin"},  # origin: weights fetched from Hugging Face, over the registry's destination checks
    {"snapshot"},  # what commit and restore share of a root's snapshots
    {"commit", "restore"},
    {"watch"},
    {"cli"},
    {"__main__", "__init__"},
]
FLOOR_OF = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def imports_of(path: str, name: str, modules: set[str]) -> set[str]:
    """The snapshotter modules a file imports, absolute: `from snapshotter.box import scan` names
    the module snapshotter.box.scan; `from snapshotter.box.scan import Scan` names it too."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)
    return found & modules


def the_files() -> dict[str, str]:
    """module name -> its file."""
    files = {}
    for folder, _, names in os.walk(PACKAGE):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(folder, n)
                files[module_name(path)] = path
    return files


def the_graph() -> dict[str, set[str]]:
    files = the_files()
    return {name: imports_of(path, name, set(files)) - {name} for name, path in files.items()}


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_floor():
    assert {unit(m) for m in the_graph()} - FLOOR_OF.keys() == set()


def test_each_floor_imports_only_the_floors_below_it():
    wrong = []
    for module, imported in the_graph().items():
        here = unit(module)
        for target in imported:
            there = unit(target)
            if there != here and FLOOR_OF[there] >= FLOOR_OF[here]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycle():
    graph = the_graph()
    done, path = set(), []

    def visit(m):
        if m in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for t in sorted(graph[m]):
            if t != m.rpartition(".")[0]:  # a module's own package __init__ is loaded first, not imported back
                visit(t)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_the_readme_layout_is_the_tree():
    """The Layout block of docs/development.md (moved there from the README) names every module and
    package, and nothing that is gone."""
    page = open(os.path.join(os.path.dirname(PACKAGE), "docs", "development.md"), encoding="utf-8").read()
    block = page.split("## Layout", 1)[1].split("```", 2)[1]
    named, folder = set(), ""
    for line in block.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.endswith("/") and line.startswith("  ") and not line.startswith("    "):
            folder = name
            named.add(folder)
        elif name.endswith(".py"):
            named.add((folder if line.startswith("    ") else "") + name)
    on_disk = set()
    for path in the_files().values():
        rel = os.path.relpath(path, PACKAGE)
        if os.path.basename(rel) in ("__init__.py", "__main__.py"):
            if os.path.dirname(rel):
                on_disk.add(os.path.dirname(rel) + "/")
            continue
        on_disk.add(rel)
    assert named == on_disk
