"""snap: capture a running box as an OCI image in any registry and restore it anywhere.

The library behind the `snap` command; each verb is a function:
    from snapshotter import commit, restore
    commit("registry.example.com/me/box:v2", base="registry.example.com/me/base:1")
    restore("registry.example.com/me/box:v2", "/")
"""

from .commit import CommitOptions, commit
from .errors import SnapError
from .restore import RestoreOptions, restore

__all__ = ["commit", "CommitOptions", "restore", "RestoreOptions", "SnapError"]
