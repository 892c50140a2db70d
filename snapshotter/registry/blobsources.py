"""Which repositories of a registry are known to hold a blob, learnt from the pushes and restores
of this state dir: a commit mounts a blob from one of them (`POST ...?mount=&from=`) instead of
uploading it again, so a model already in the registry is never sent twice."""

from __future__ import annotations

import os
from typing import Iterable

from snapshotter.state import read_versioned, sub, write_versioned

from .remote import Remote

VERSION = 1
FILE_NAME = "blob-sources.json"
MAX_REPOSITORIES = 4  # per blob: the ones it was seen in last
MAX_BLOBS = 50_000  # per registry: the oldest are forgotten first


class BlobSources:
    """{registry API host: {digest: [repository, ...]}}, in the state dir (versioned: a file of
    another version is ignored and rebuilt)."""

    def __init__(self) -> None:
        self.path = os.path.join(sub(), FILE_NAME)
        self.known: dict[str, dict[str, list[str]]] = {}
        doc = read_versioned(self.path, VERSION)  # None: none yet, or damaged: nothing is known
        if doc is not None and isinstance(doc.get("registries"), dict):
            self.known = {host: {d: [r for r in repos if isinstance(r, str)]
                                 for d, repos in blobs.items() if isinstance(repos, list)}
                          for host, blobs in doc["registries"].items() if isinstance(blobs, dict)}

    def repositories(self, registry: str, digest: str) -> list[str]:
        """The repositories of `registry` (its API host) last seen holding `digest`, newest first."""
        return list(reversed(self.known.get(registry, {}).get(digest, [])))

    def note(self, registry: str, repository: str, digests: Iterable[str]) -> None:
        blobs = self.known.setdefault(registry, {})
        for digest in digests:
            repos = [r for r in blobs.pop(digest, []) if r != repository] + [repository]
            blobs[digest] = repos[-MAX_REPOSITORIES:]  # re-inserted: the dict keeps the newest last
        for digest in list(blobs)[:max(0, len(blobs) - MAX_BLOBS)]:
            del blobs[digest]

    def save(self) -> None:
        write_versioned(self.path, VERSION, {"registries": self.known})


def in_registry(remote: Remote, digest: str, sources: BlobSources) -> str:
    """"exists, skipped" if the target repository holds the blob; "mounted from REPO" if another
    repository of the registry known to hold it (blobsources.py) lends it; "" if it must be sent."""
    if remote.blob_exists(digest):
        return "exists, skipped"
    for repository in sources.repositories(remote.ref.api_host, digest):
        if repository != remote.ref.repository and remote.mount_blob(digest, repository):
            return f"mounted from {repository}"
    return ""
