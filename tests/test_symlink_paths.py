"""A path through symlinks lands in the same place for the box's scan (resolve_in_box), an image's
index (resolve_parent) and the extractor writing on disk (_resolve_dir), as a container sees it:
an absolute target starts at the root, `..` stops at the root; a loop is refused by each."""

from __future__ import annotations

import os

import pytest

from snapshotter.box.scan import resolve_in_box
from snapshotter.errors import IntegrityError
from snapshotter.index.entry import DIR, SYMLINK, Entry
from snapshotter.index.indexer import resolve_parent
from snapshotter.layer.extract import Extractor

LINKS = {"lib": "usr/lib", "abs": "/usr/lib", "up": "../../usr/lib", "chain": "abs", "dots": "./usr/./lib/",
         "usr/lib/self": "../lib", "loop1": "loop2", "loop2": "loop1"}
DIRS = ["usr", "usr/lib", "usr/lib/py"]


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    for d in DIRS:
        (root / d).mkdir(parents=True)
    for path, target in LINKS.items():
        os.symlink(target, root / path)
    entries = {d: Entry(d, DIR, 0o755) for d in DIRS}
    entries.update({path: Entry(path, SYMLINK, 0o777, linkname=target) for path, target in LINKS.items()})
    return str(root), entries


@pytest.mark.parametrize("path", ["lib/py", "abs/py", "up/py", "chain/py", "dots/py", "usr/lib/self/self/py",
                                  "lib/../lib/py", "usr/lib/py"])
def test_the_scan_the_index_and_the_extractor_resolve_alike(tree, path):
    root, entries = tree
    assert resolve_in_box(entries, path) == "usr/lib/py"
    assert resolve_parent(entries, {}, path + "/f") == "usr/lib/py/f"
    assert Extractor(root)._resolve_dir(path, create=False) == os.path.join(root, "usr/lib/py")


def test_a_loop_is_refused_by_each(tree):
    root, entries = tree
    assert resolve_in_box(entries, "loop1/x") is None
    with pytest.raises(IntegrityError, match="too many symlinks"):
        resolve_parent(entries, {}, "loop1/x/f")
    with pytest.raises(IntegrityError, match="too many symlinks"):
        Extractor(root)._resolve_dir("loop1/x", create=False)


def test_a_layers_entry_stands_over_the_index_below_it(tree):
    _, entries = tree
    assert resolve_parent(entries, {"lib": Entry("lib", DIR, 0o755)}, "lib/f") == "lib/f"
