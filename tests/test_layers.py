"""What a layer carries and how it is read back: configs valid by the OCI schema, layers read by
their bytes rather than their label, parent directories in every layer, hardlinked weights."""

import json
import os
from urllib.parse import urljoin

import jsonschema
import pytest
import referencing
import referencing.jsonschema

from conftest import NOT_CAPTURED, make_box, snap
from support import snapshot_of_tree
from test_roundtrip import commit_json

SCHEMA_DIR = os.path.join(os.path.dirname(__file__), "data", "oci-schema")


def _ids(doc) -> set:
    """Every "id" in a schema: relative $refs resolve against the nearest one."""
    if isinstance(doc, dict):
        found = {doc["id"]} if isinstance(doc.get("id"), str) else set()
        return found.union(*(_ids(v) for v in doc.values()))
    if isinstance(doc, list):
        return set().union(*(_ids(v) for v in doc))
    return set()


def oci_validator(name: str):
    """A validator for one of the image-spec's schemas, its $refs resolved from tests/data only
    (each file is known by its name under every base URI the schemas use: no network)."""
    docs = {}
    for fname in sorted(os.listdir(SCHEMA_DIR)):
        if fname.endswith(".json"):
            with open(os.path.join(SCHEMA_DIR, fname)) as f:
                docs[fname] = json.load(f)
    bases = set().union(*(_ids(d) for d in docs.values()))
    resources = []
    for fname, doc in docs.items():
        resource = referencing.jsonschema.DRAFT4.create_resource(doc)
        resources += [(fname, resource)] + [(urljoin(base, fname), resource) for base in bases]
    registry = referencing.Registry().with_resources(resources)
    return jsonschema.Draft4Validator(docs[name], registry=registry, format_checker=jsonschema.FormatChecker())


def test_manifest_and_config_validate_against_the_image_spec_schema(registry, base_ref, base_rootfs, tmp_path):
    """A base config as Docker writes it (nulls in config and container_config) gives a snapshot
    config and manifest that the image-spec v1.1 schemas accept; the exposed port survives."""
    base = registry.manifest("base", "1")
    nulls = {"User": "", "Env": None, "Entrypoint": None, "Cmd": ["/bin/sh"], "WorkingDir": "", "Labels": None,
             "Volumes": None, "OnBuild": None, "ExposedPorts": {"8188/tcp": {}}, "StopSignal": None}
    registry.push_image("nullbase", "1", [registry.blob("base", d["digest"]) for d in base["layers"]],
                        config={"config": nulls, "container_config": dict(nulls, Image=""), "author": None,
                                "variant": None})
    box = make_box(base_rootfs, str(tmp_path / "box"))
    commit_json(f"{registry.host}/nullbox:v1", f"{registry.host}/nullbase:1", box)

    manifest = registry.manifest("nullbox", "v1")
    config = json.loads(registry.blob("nullbox", manifest["config"]["digest"]))
    # The check itself: the base's own config is refused by the schema.
    base_config = json.loads(registry.blob("nullbase", registry.manifest("nullbase", "1")["config"]["digest"]))
    assert list(oci_validator("config-schema.json").iter_errors(base_config))
    oci_validator("image-manifest-schema.json").validate(manifest)
    oci_validator("config-schema.json").validate(config)
    assert config["config"]["ExposedPorts"] == {"8188/tcp": {}} and config["config"]["Cmd"] == ["/bin/sh"]
    assert "Env" not in config["config"] and "author" not in config


# ---- layers read by their bytes ---------------------------------------------------------------

DOCKER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def put_manifest(registry, repo: str, tag: str, manifest: dict) -> None:
    r = registry.session().put(f"{registry.url}/v2/{repo}/manifests/{tag}", data=json.dumps(manifest).encode(),
                               headers={"Content-Type": manifest["mediaType"]})
    r.raise_for_status()


def as_docker_pushes_it(manifest: dict) -> dict:
    """The manifest `docker push` writes for an image it pulled: Docker's schema 2, every layer
    labelled gzip (snap's plain-tar weights included), no annotations."""
    return {"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       "digest": manifest["config"]["digest"], "size": manifest["config"]["size"]},
            "layers": [{"mediaType": DOCKER_GZIP, "digest": d["digest"], "size": d["size"]} for d in manifest["layers"]]}


def test_layers_are_read_by_their_bytes_not_their_label(registry, base_ref, box, tmp_path):
    """After docker pull + docker push, snap's plain-tar weight layers are labelled gzip; elsewhere
    gzip bytes may come labelled zstd. Restore, verify and commit (reading it as a base) read each
    layer by its magic bytes, say in one line which label is wrong, and restore the box byte for byte."""
    commit_json(f"{registry.host}/relabel:src", base_ref, box, "--compression", "gzip")
    m = registry.manifest("relabel", "src")
    put_manifest(registry, "relabel", "pushed", as_docker_pushes_it(m))
    zstd_label = dict(m, layers=[dict(d, mediaType=LAYER_ZSTD) if d.get("annotations", {}).get("dev.snap.layer") == "venv"
                                 else d for d in m["layers"]])
    put_manifest(registry, "relabel", "zstd-label", zstd_label)
    expected = snapshot_of_tree(box, skip=NOT_CAPTURED)

    plain = sum(d["mediaType"] == "application/vnd.oci.image.layer.v1.tar" for d in m["layers"])
    assert plain == 2  # the weights and the models' directories
    for tag, wrong, count in (("pushed", f"labelled {DOCKER_GZIP} but its bytes are a plain tar", plain),
                              ("zstd-label", f"labelled {LAYER_ZSTD} but its bytes are gzip", 1)):
        ref = f"{registry.host}/relabel:{tag}"
        out = tmp_path / f"restored-{tag}"
        r = snap("restore", ref, "--root", str(out), check=True)
        assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == expected
        lines = [line for line in r.stderr.splitlines() if "labelled" in line]
        assert len(lines) == count and all(line.startswith("warning: ") and wrong in line for line in lines), r.stderr
        r = snap("verify", ref, "--root", str(out), check=True)
        assert wrong in r.stderr
        # The relabelled image as the base of a commit: its index is read by the bytes too.
        r = snap("commit", f"{registry.host}/relabel:on-{tag}", "--base", ref, "--root", str(out), check=True)
        assert wrong in r.stderr
