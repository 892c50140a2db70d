"""Images: a resolved image (`Image`) and which of its layers a restore applies, and assembling a
snapshot image (base layers + snapshot layers, as an OCI manifest and config).

Serialisation is canonical (sorted keys, no spaces) so the digest we compute is the digest the
registry stores: we push these exact bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, NamedTuple, Optional

from snapshotter import jsontext
from snapshotter.digests import DIGEST, sha256_digest
from snapshotter.errors import IntegrityError, UsageError, printable

from .mediatypes import OCI_CONFIG, OCI_MANIFEST, compression_of, oci_media_type

if TYPE_CHECKING:  # imported for the annotation only
    from .reference import Reference

SNAP_LAYER = "dev.snap.layer"  # layer annotation: which profile layer this is
SNAP_CONTENT = "dev.snap.content"  # layer annotation: the one file it holds, or "bundle N"
SNAP_PART = "dev.snap.part"  # layer annotation: "i/n" for a part of a file cut at the layer size cap
SNAP_PART_FILE = "dev.snap.part-file"  # layer annotation: the file the parts join back into
# The last part's annotation: the file's other names (JSON list), linked at the join.
SNAP_PART_LINKS = "dev.snap.part-links"
SNAP_HEADERS = "dev.snap.headers"  # layer annotation: the digest of that layer's headers blob
SNAP_SKELETON = "dev.snap.skeleton"  # manifest annotation of older snapshots: one blob of every layer's headers
SNAP_BASE_LAYERS = "dev.snap.base-layers"  # manifest annotation: how many leading layers are the base's
SNAP_PROFILE = "dev.snap.profile"
SNAP_MAX_LAYER = "dev.snap.max-layer-size"  # manifest annotation: the cap files were cut at
SNAP_SECRETS = "dev.snap.left-out.secrets"  # manifest annotation: JSON list of the secret paths left out
SNAP_SECRETS_COUNT = "dev.snap.left-out.secrets-count"  # how many there were (more than listed if cut)
SECRETS_ANNOTATION_MAX = 32 * 1024  # bytes of JSON at most: registries cap a whole manifest at 4 MiB
BASE_NAME = "org.opencontainers.image.base.name"
BASE_DIGEST = "org.opencontainers.image.base.digest"
CREATED = "org.opencontainers.image.created"


class Layer(NamedTuple):
    """One layer of an image: its descriptor (the manifest's JSON, exact), its place among the
    image's layers and its diff_id (the config's). What snap's annotations say of it is read here."""

    index: int
    descriptor: dict
    diff_id: str

    @property
    def digest(self) -> str:
        return self.descriptor["digest"]

    @property
    def size(self) -> int:
        return self.descriptor["size"]

    @property
    def media_type(self) -> str:
        return self.descriptor["mediaType"]

    @property
    def annotations(self) -> dict[str, str]:
        return annotations_of(self.descriptor, "a layer")

    @property
    def snap_label(self) -> str:
        """How commit named it ('venv', 'models (bundle 2)'); '' for a layer snap did not make."""
        return snap_label(self.descriptor)

    @property
    def label(self) -> str:
        """Its name fit for a message: snap's label, else 'base layer N'."""
        return layer_label(self.descriptor, self.index)

    @property
    def headers(self) -> Optional[str]:
        """The digest of its headers blob (dev.snap.headers), if it names a well-formed one."""
        digest = self.annotations.get(SNAP_HEADERS)
        return digest if isinstance(digest, str) and DIGEST.fullmatch(digest) else None

    @property
    def part_file(self) -> Optional[str]:
        """The file this part layer joins back into (dev.snap.part-file); None for a whole layer."""
        return self.annotations.get(SNAP_PART_FILE)


@dataclass
class Image:
    """A resolved single-platform image: its manifest (exact bytes) and config."""

    ref: Reference
    manifest_bytes: bytes
    manifest_digest: str
    config_bytes: bytes

    def __post_init__(self) -> None:
        """Every annotation snap may read is checked once, here: a malformed one is refused (exit 6),
        never met later as an internal error."""
        doc = self.manifest
        if isinstance(doc, dict):
            manifest_annotations(doc, f"image {self.ref}")

    @property
    def manifest(self) -> dict:
        return jsontext.loads(self.manifest_bytes)

    @property
    def config(self) -> dict:
        return jsontext.loads(self.config_bytes)

    @property
    def layers(self) -> list[dict]:
        """The manifest's layer descriptors, as JSON (select_layers gives them as checked Layers)."""
        return self.manifest["layers"]

    @property
    def annotations(self) -> dict[str, str]:
        """The manifest's annotations ({} when it has none), checked at __post_init__."""
        return annotations_of(self.manifest, f"image {self.ref}")

    @property
    def config_digest(self) -> str:
        return self.manifest["config"]["digest"]

    def annotated_digest(self, key: str) -> Optional[str]:
        """A digest the manifest's annotation `key` names, if it is a well-formed one."""
        digest = self.annotations.get(key)
        return digest if isinstance(digest, str) and DIGEST.fullmatch(digest) else None


def canonical(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def descriptor(media_type: str, digest: str, size: int, annotations: Optional[dict] = None) -> dict:
    d = {"mediaType": media_type, "digest": digest, "size": size}
    if annotations:
        d["annotations"] = annotations
    return d


def snapshot_config(base_config: dict, layers: list[tuple[str, str]], created: str) -> bytes:
    """The base config with one diff_id and one history entry per snapshot layer.
    `layers` is [(layer name, diff_id)]."""
    cfg = oci_clean(base_config)  # a new document: the base's is not touched
    rootfs = cfg.setdefault("rootfs", {"type": "layers", "diff_ids": []})
    rootfs["type"] = "layers"
    base_diff_ids = rootfs.setdefault("diff_ids", [])
    history = cfg.setdefault("history", [])
    # Tools pair non-empty history entries with layers: pad a base that lacks them.
    real = sum(1 for h in history if not h.get("empty_layer"))
    history.extend({"created_by": "(base image layer)"} for _ in range(len(base_diff_ids) - real))
    for name, diff_id in layers:
        base_diff_ids.append(diff_id)
        history.append({"created": created, "created_by": f"snap commit: {name} layer",
                        "comment": f"snap layer {name}"})
    cfg["created"] = created
    cfg.setdefault("architecture", "amd64")
    cfg.setdefault("os", "linux")
    return canonical(cfg)


# Maps of name -> object in an image config: a null member stands for an empty object there.
_OBJECT_MAPS = ("ExposedPorts", "Volumes")


def oci_clean(doc):
    """`doc` without its nulls, as the OCI image-spec's schema wants a config: Docker's configs carry
    `"Env": null`, `"Entrypoint": null` and the like, which mean the same as a missing member.
    Inside ExposedPorts and Volumes a null member becomes {} (the port or volume stays)."""
    if isinstance(doc, list):
        return [oci_clean(v) for v in doc if v is not None]
    if not isinstance(doc, dict):
        return doc
    out = {}
    for k, v in doc.items():
        if k in _OBJECT_MAPS and isinstance(v, dict):
            out[k] = {name: oci_clean(obj) if obj is not None else {} for name, obj in v.items()}
        elif v is not None:
            out[k] = oci_clean(v)
    return out


def scratch_config(os_: str, architecture: str) -> dict:
    """The config of no base image (`--base scratch`): the platform it runs on and a default PATH."""
    return {"architecture": architecture, "os": os_,
            "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": []}, "history": []}


def snapshot_manifest(base: Optional[Image], base_name: Optional[str], config: bytes, layers: list[dict], profile: str,
                      created: str, extra_annotations: Optional[dict] = None) -> bytes:
    """An OCI image manifest: the base's layers (media types in their OCI names; same bytes),
    then the snapshot layer descriptors. No base (scratch): the snapshot layers alone."""
    base_layers = []
    for d in (base.layers if base else []):
        nd = {"mediaType": oci_media_type(d["mediaType"]), "digest": d["digest"], "size": d["size"]}
        if d.get("annotations"):
            nd["annotations"] = d["annotations"]
        base_layers.append(nd)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": descriptor(OCI_CONFIG, sha256_digest(config), len(config)),
        "layers": base_layers + layers,
        "annotations": {
            **({BASE_NAME: base_name, BASE_DIGEST: base.manifest_digest} if base else {}),
            SNAP_BASE_LAYERS: str(len(base_layers)),
            SNAP_PROFILE: profile,
            CREATED: created,
            **(extra_annotations or {}),
        },
    }
    return canonical(manifest)


@dataclass
class NewImage:
    """A snapshot image as commit builds it: the base's layers, then snap's own, appended one by one
    (`append`); its config and manifest (the exact bytes pushed) are made from them, and the image
    is written to a registry by registry/remote.py's Remote.write_image."""

    base: Optional[Image]  # None: scratch
    base_name: Optional[str]
    base_config: dict
    profile: str
    created: str = field(default_factory=now_rfc3339)
    annotations: dict[str, str] = field(default_factory=dict)  # the manifest's, beside snap's own
    layers: list[Layer] = field(default_factory=list)  # snap's own, in order
    labels: list[str] = field(default_factory=list)  # each one's name in the config's history

    def append(self, descriptor: dict, diff_id: str, label: str) -> Layer:
        """Add a layer on top; returns it, placed after the base's layers and those before it."""
        layer = Layer(len(self.base.layers if self.base else []) + len(self.layers), descriptor, diff_id)
        self.layers.append(layer)
        self.labels.append(label)
        return layer

    def config_bytes(self) -> bytes:
        return snapshot_config(self.base_config, list(zip(self.labels, (layer.diff_id for layer in self.layers))),
                               self.created)

    def manifest_bytes(self, config: bytes) -> bytes:
        return snapshot_manifest(self.base, self.base_name, config, [layer.descriptor for layer in self.layers],
                                 self.profile, self.created, self.annotations)


def annotations_of(doc: dict, where: str) -> dict[str, str]:
    """The annotations of a manifest or a descriptor ({} when it has none): a map of strings to
    strings, as the image-spec wants; any other JSON (a number, a list, a nested object) is refused."""
    ann = doc.get("annotations")
    if ann is None:
        return {}
    if not isinstance(ann, dict) or not all(isinstance(v, str) for v in ann.values()):
        raise IntegrityError(f"{where} has malformed annotations (not a map of strings): refusing a hostile image")
    return ann


def manifest_annotations(doc: dict, where: str) -> dict[str, str]:
    """A manifest's annotations, after checking its layers' annotations too (annotations_of)."""
    layers = doc.get("layers")
    for i, d in enumerate(layers if isinstance(layers, list) else []):
        if isinstance(d, dict):
            annotations_of(d, f"layer {i + 1} of {where}")
    return annotations_of(doc, where)


def snapshot_layers_of(doc: dict, where: str) -> int:
    """How many of a manifest's layers snap added (0 for an image snap did not make); refused when
    its annotation says more than it has."""
    ann, n = manifest_annotations(doc, where), len(doc.get("layers") or [])
    if SNAP_BASE_LAYERS not in ann:
        return 0
    base = ann[SNAP_BASE_LAYERS]
    if not (base.isascii() and base.isdigit() and int(base) <= n):
        raise IntegrityError(f"{where} says {SNAP_BASE_LAYERS}={base!r} but has {n} layers: refusing a hostile image")
    return n - int(base)


def snapshot_layer_count(image: Image) -> int:
    """How many of an image's layers snap added (0 for an image snap did not make)."""
    return snapshot_layers_of(image.manifest, f"image {image.ref}")


def select_layers(image: Image, only_snapshot: bool) -> list[Layer]:
    """The layers a restore applies, in order: all of them, or only the snapshot's; refused if the
    image is malformed."""
    layers = image.layers
    diff_ids = image.config.get("rootfs", {}).get("diff_ids", [])
    if len(diff_ids) != len(layers):
        raise IntegrityError(f"image {image.ref} is inconsistent: {len(layers)} layers but {len(diff_ids)} diff_ids")
    for i, d in enumerate(layers):
        if not (isinstance(d, dict) and isinstance(d.get("digest"), str) and DIGEST.fullmatch(d["digest"])
                and type(d.get("size")) is int and d["size"] >= 0 and isinstance(d.get("mediaType"), str)):
            raise IntegrityError(f"image {image.ref} has a malformed descriptor for layer {i + 1}: refusing it")
        compression_of(d["mediaType"])  # an unknown type: refused before anything is read
    start = 0
    if only_snapshot:
        n = snapshot_layer_count(image)
        if n == 0:
            raise UsageError(f"{image.ref} was not made by snap commit",
                             "drop --only-snapshot to restore all its layers")
        start = len(layers) - n
    return [Layer(i, layers[i], diff_ids[i]) for i in range(start, len(layers))]


def snap_label(desc: dict) -> str:
    """How commit named a layer: 'venv', 'models (bundle 2)', ...; '' for a layer snap did not make."""
    ann = annotations_of(desc, "a layer")
    if SNAP_LAYER not in ann:
        return ""
    return f"{ann[SNAP_LAYER]} ({ann[SNAP_CONTENT]})" if SNAP_CONTENT in ann else ann[SNAP_LAYER]


def secrets_annotations(paths: list[str]) -> dict:
    """Manifest annotations recording the secret paths a commit left out (root-relative), cut to
    SECRETS_ANNOTATION_MAX bytes of JSON; the count says how many there were in all."""
    if not paths:
        return {}
    listed = list(paths)
    while len(json.dumps(listed).encode()) > SECRETS_ANNOTATION_MAX:
        listed = listed[:len(listed) * 3 // 4]
    return {SNAP_SECRETS: json.dumps(listed), SNAP_SECRETS_COUNT: str(len(paths))}


def left_out_secrets(manifest: dict) -> tuple[list[str], int]:
    """(the secret paths listed in an image's manifest, how many were left out in all); a malformed
    annotation (not snap's) lists nothing."""
    ann = annotations_of(manifest, "the image")
    try:
        listed = jsontext.loads(ann.get(SNAP_SECRETS, "[]"))
        total = int(ann.get(SNAP_SECRETS_COUNT, len(listed)))
    except (ValueError, TypeError):
        return [], 0
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        return [], 0
    return listed, max(total, len(listed))


def layer_label(desc: dict, i: int) -> str:
    """'venv', 'models (bundle 2)', ... as commit named it, fit for a message; 'base layer N' for
    the base's (`i`: its index in the image)."""
    return printable(snap_label(desc)) or f"base layer {i + 1}"
