"""The stat cache: layer fingerprints (from stat data only) -> the layer blob they produced.

A second commit whose big layers did not change reads no model bytes: each planned layer's
fingerprint (path, size, mtime, inode, ctime, mode, owner of every entry) is looked up here, and a
hit whose blob the registry still has is reused as it is. The cache is per (box root, base image):
a cache from another root or base is never consulted."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from .state import replace_file, sub

VERSION = 1


class StatCache:
    def __init__(self, root: str, base_digest: str):
        self.key = {"version": VERSION, "root": os.path.realpath(root), "base": base_digest}
        name = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:32]
        self.path = os.path.join(sub("stat-cache"), name + ".json")
        self.old: dict[str, dict] = {}
        self.new: dict[str, dict] = {}
        try:
            with open(self.path) as f:
                doc = json.load(f)
            if doc.get("key") == self.key:
                self.old = doc.get("layers", {})
        except (OSError, ValueError):
            pass  # no cache, or a damaged one: everything is built

    def lookup(self, fingerprint: str) -> Optional[dict]:
        return self.old.get(fingerprint)

    def record(self, fingerprint: str, blob: dict) -> None:
        self.new[fingerprint] = blob

    def save(self) -> None:
        """Keep what this commit used: layers that are gone from the box fall out of the cache."""
        replace_file(self.path, lambda f: json.dump({"key": self.key, "layers": self.new}, f))
