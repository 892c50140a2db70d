"""A commit's weights from the origin (--weights-from-origin): whether the recognised hub weights
are kept as references or go into the layers, the references pushed, and the counts reported."""

from __future__ import annotations

from typing import Optional

from snapshotter.oci.image import NewImage
from snapshotter.origin import snapshots as origin
from snapshotter.registry.remote import Remote

from .model import CommitOptions, CommitPlan


def weights_in_layers(opts: CommitOptions) -> bool:
    """Whether recognised hub weights go into the layers after all: with --upload-origin, and in an
    encrypted snapshot, whose references would name its files in clear (in_layers_note says so)."""
    return _in_layers(opts)


def in_layers_note(opts: CommitOptions) -> Optional[str]:
    """The line that says --weights-from-origin is not followed (once a command: a watcher plans often)."""
    if opts.weights_from_origin and opts.encryption is not None and not opts.upload_origin:
        return "weights from the origin: kept in the encrypted layers (references would name them in clear)"
    return None


def _in_layers(opts: CommitOptions) -> bool:
    return opts.upload_origin or opts.encryption is not None


def note_origin(cp: CommitPlan, remote: Remote, image: NewImage, opts: CommitOptions) -> Optional[str]:
    """Push the references (annotating the manifest with their blob), or with --upload-origin note
    how many hub files the layers hold instead. Returns the references blob's digest, if pushed."""
    if cp.origin is None or not cp.origin.references:
        return None
    if _in_layers(opts):
        image.annotations[origin.SNAP_ORIGIN_UPLOADED] = str(len(cp.origin.references))
        return None
    digest, note = origin.push_document(remote, cp.origin.document(), cp.sources)
    image.annotations[origin.SNAP_REFERENCES] = note
    return digest


def origin_counts(cp: CommitPlan, opts: CommitOptions) -> dict:
    """CommitResult's counts of hub files: kept as references, or uploaded (--upload-origin)."""
    refs = cp.origin.references if cp.origin is not None else []
    if _in_layers(opts):
        return {"origin_uploaded": len(refs)}
    return {"references": len(refs), "reference_bytes": sum({r.sha256: r.size for r in refs}.values())}
