"""The OCI image-spec's JSON schemas, from tests/data alone."""

from __future__ import annotations

import json
import os
from urllib.parse import urljoin

import jsonschema
import referencing
import referencing.jsonschema

SCHEMA_DIR = os.path.join(os.path.dirname(__file__), "..", "data", "oci-schema")


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
