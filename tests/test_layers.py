"""What a layer carries and how it is read back: configs valid by the OCI schema, layers read by
their bytes rather than their label, parent directories in every layer, hardlinked weights."""

import json
import os
from urllib.parse import urljoin

import jsonschema
import pytest
import referencing
import referencing.jsonschema

from conftest import make_box, snap
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
