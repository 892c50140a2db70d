"""The base image's blobs in the target repository before a snapshot names them."""

from __future__ import annotations

import os

from snapshotter import progress
from snapshotter.digests import file_digest
from snapshotter.oci.image import Image
from snapshotter.registry.blobsources import BlobSources, in_registry
from snapshotter.registry.remote import Remote
from snapshotter.state import sub


def ensure_base_layers(target: Remote, source: Remote, base: Image, sources: BlobSources, sink: progress.Sink) -> None:
    """Make the base's blobs available in the target repository: nothing to do in the same repo,
    a cross-repository mount on the same registry (from the base's repository or another known to
    hold the blob), else a copy through the local disk."""
    if target is source:
        return
    missing = [d for d in base.layers + [base.manifest["config"]] if not target.blob_exists(d["digest"])]
    if not missing:
        return
    same_registry = target.ref.api_host == source.ref.api_host
    if same_registry:
        sources.note(source.ref.api_host, source.ref.repository, [d["digest"] for d in missing])
    tmp_dir = sub("blobs")
    with progress.bar("copying base layers", sum(d["size"] for d in missing), sink=sink) as b:
        for d in missing:
            if in_registry(target, d["digest"], sources):
                b.update(d["size"])
                continue
            path = os.path.join(tmp_dir, d["digest"].split(":", 1)[1])
            if not (os.path.exists(path) and file_digest(path) == d["digest"]):  # a killed run's: checked first
                source.download_blob(d["digest"], path, size=d["size"])
            target.upload_blob(path, d["digest"], d["size"], progress.safe_update(b), what="base layers")
            os.unlink(path)  # only a stop on the way to the other registry
