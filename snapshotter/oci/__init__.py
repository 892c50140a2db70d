"""The OCI image model: references, media types, snap's annotation keys, manifests and configs.
No I/O."""
