"""snap: capture a running box as an OCI image in any registry and restore it anywhere.

The library behind the `snap` command; each verb is a function, named apart from its package
(`snapshotter.commit`, `snapshotter.restore`), which exports it too:
    from snapshotter import commit_box, restore_image
    commit_box("registry.example.com/me/box:v2", base="registry.example.com/me/base:1")
    restore_image("registry.example.com/me/box:v2", "/")
"""

import importlib

from .version import __version__

# Loaded when first asked for (PEP 562): `snap restore` then imports no commit code, `snap --help` neither.
_EXPORTS = {"commit_box": "commit", "CommitOptions": "commit", "restore_image": "restore",
            "RestoreOptions": "restore", "SnapError": "errors"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if not name.startswith("_"):  # a subpackage, e.g. `snapshotter.restore` after a bare `import snapshotter`
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise  # the module exists but lacks one of its own imports
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
