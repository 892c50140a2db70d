"""Every media type snap reads or writes, in one place: manifests, indexes, configs and layers."""

from snapshotter.errors import IntegrityError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
DOCKER_LAYER_GZIP = "application/vnd.docker.image.rootfs.diff.tar.gzip"
DOCKER_LAYER_TAR = "application/vnd.docker.image.rootfs.diff.tar"
DOCKER_LAYER_ZSTD = "application/vnd.docker.image.rootfs.diff.tar.zstd"  # containerd and BuildKit write it
# Foreign (non-distributable) variants carry the same bytes.
NONDISTRIBUTABLE_TAR = "application/vnd.oci.image.layer.nondistributable.v1.tar"

# ocicrypt's encrypted layers (crypt/layer.py): a plain OCI layer type with this suffix.
ENCRYPTED_SUFFIX = "+encrypted"

# The layer media type snap writes for each --compression.
MEDIA_TYPE = {"none": LAYER_TAR, "gzip": LAYER_GZIP, "zstd": LAYER_ZSTD}

# The base image's file index (index/store.py's gzip'd JSON lines), pushed with a snapshot,
# and the artifact manifest that keeps it referenced (index/base.py).
BASE_INDEX = "application/vnd.dev.snap.base-index.v1.jsonl+gzip"
BASE_INDEX_ARTIFACT = "application/vnd.dev.snap.base-index.v1"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
# The headers of a snapshot's layers without their contents (snapshot/skeleton.py), and the artifact
# manifest that keeps that blob referenced.
SKELETON = "application/vnd.dev.snap.skeleton.v1+gzip"
SKELETON_ARTIFACT = "application/vnd.dev.snap.skeleton.v1"


def compression_of(media_type: str) -> str:
    """'none' | 'gzip' | 'zstd' for a layer media type; any other type is refused (a layer snap does
    not know how to read is never sniffed and applied)."""
    if media_type in (LAYER_TAR, DOCKER_LAYER_TAR, NONDISTRIBUTABLE_TAR):
        return "none"
    if media_type in (LAYER_GZIP, DOCKER_LAYER_GZIP, NONDISTRIBUTABLE_TAR + "+gzip"):
        return "gzip"
    if media_type in (LAYER_ZSTD, DOCKER_LAYER_ZSTD, NONDISTRIBUTABLE_TAR + "+zstd"):
        return "zstd"
    raise IntegrityError(f"unsupported layer media type {media_type!r}: refusing the layer")  # repr: escaped


def oci_media_type(media_type: str) -> str:
    """The OCI name for a layer media type (Docker's gzip layer is the same bytes as OCI's)."""
    return MEDIA_TYPE[compression_of(media_type)]
