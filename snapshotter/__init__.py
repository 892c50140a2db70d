"""snap: capture a running box as an OCI image in any registry and restore it anywhere.

The library behind the `snap` command; each verb is a function (named apart from its module, so
that `snapshotter.commit` and `snapshotter.restore` stay the modules):
    from snapshotter import commit_box, restore_image
    commit_box("registry.example.com/me/box:v2", base="registry.example.com/me/base:1")
    restore_image("registry.example.com/me/box:v2", "/")
"""

from .commit import CommitOptions, commit_box
from .errors import SnapError
from .restore import RestoreOptions, restore_image

__all__ = ["commit_box", "CommitOptions", "restore_image", "RestoreOptions", "SnapError"]
