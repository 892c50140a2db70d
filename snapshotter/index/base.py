"""The base image's file index travels with the snapshot, so that a new machine (an empty state
dir) commits without reading the base's layers: a 6 GB base would cost minutes of a 5 s notice.

The index (the cache file store.py writes, gzip'd JSON lines with their format
version) is pushed as a blob into the snapshot's repository and kept referenced by a layer-less
artifact manifest of its own, tagged `snap-index-sha256-<base manifest hex>`. Not the referrers
API: distribution 2.8 (Debian's registry) has none; not an annotation only: a registry's garbage
collection deletes a blob no manifest lists as a descriptor. The snapshot's manifest also names
the blob (annotation dev.snap.base-index), which a restore fetches by digest.

An index is trusted as far as its source. Its header's diff_ids are the base's whoever made it, so
they prove nothing: one built on this machine from the base's layers serves every commit; one
fetched from a repository (a restored snapshot's, or its artifact tag's) serves only commits into
that repository, since whoever may push an index there may replace its snapshots anyway. One
from elsewhere (a hostile snapshot restored here) would make a commit leave out, as the base's,
files the forger listed; and its push would spread it to the commit's own repository."""

from __future__ import annotations

import gzip
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from snapshotter import jsontext
from snapshotter.digests import file_digest, sha256_digest
from snapshotter.errors import IntegrityError, NotFound, RegistryError
from snapshotter.oci.image import canonical, descriptor
from snapshotter.oci.mediatypes import BASE_INDEX, BASE_INDEX_ARTIFACT, OCI_EMPTY, OCI_MANIFEST
from snapshotter.registry.blobsources import BlobSources, in_registry
from snapshotter.registry.remote import Remote
from snapshotter.state import open_own, remove_if_there, sub

from .entry import Entry
from .store import load_index

SNAP_BASE_INDEX = "dev.snap.base-index"  # manifest annotation: the digest of the base's index blob
MAX_INDEX_SIZE = 256 * 1024 * 1024  # a 200k-file base compresses to ~10 MB: anything far bigger is refused
_EMPTY_CONFIG = b"{}"
EMPTY_CONFIG_DIGEST = sha256_digest(_EMPTY_CONFIG)


def cache_path(base_manifest_digest: str, source: Optional[str] = None) -> str:
    """Where the state dir keeps the index of a base, by its manifest digest: the one built here
    from the base's layers (`source` None), or the one fetched from the repository `source` (a
    Reference's name: registry/repository), kept apart by the hash of that name."""
    hexdigest = base_manifest_digest.split(":", 1)[1]
    kind = "built" if source is None else "from-" + hashlib.sha256(source.encode()).hexdigest()[:32]
    return os.path.join(sub("base-index"), f"{hexdigest}.{kind}.jsonl.gz")


def _legacy_path(base_manifest_digest: str) -> str:
    """An older snap's name for the cache: built here or fetched from any repository, no telling which."""
    return os.path.join(sub("base-index"), base_manifest_digest.split(":", 1)[1] + ".jsonl.gz")


def _usable_paths(base_manifest_digest: str, repository: Optional[str]) -> list[str]:
    """The caches a commit into `repository` (a Reference's name; None: no push) may use, best first."""
    return [cache_path(base_manifest_digest)] + ([cache_path(base_manifest_digest, repository)] if repository else [])


def load_cached(base_manifest_digest: str, diff_ids: list[str],
                repository: Optional[str]) -> Optional[dict[str, Entry]]:
    """The base's index this state dir holds that a commit into `repository` may use (the trust rule
    above); None if none. A cache of another format or of other layers is removed (push() must not
    send it), and so is an older snap's, whose source is unknown: a commit into the repository the
    index came from fetches it again, others read the base once."""
    remove_if_there(_legacy_path(base_manifest_digest))
    for path in _usable_paths(base_manifest_digest, repository):
        index = load_index(path, diff_ids)
        if index is not None:
            return index
        remove_if_there(path)
    return None


def keep_carried(remote: Remote, base_manifest_digest: str, digest: str, log: Callable[[str], None]) -> None:
    """Keep the index a restored snapshot carries (the blob `digest` in `remote`'s repository) as that
    repository's. Where the state dir holds the index built here (a full restore builds it), the
    carried one is kept only if it is the very same, and then in the built one's place: a commit
    into another repository pushes those bytes, which its registry mounts instead of an upload."""
    built, carried = cache_path(base_manifest_digest), cache_path(base_manifest_digest, remote.ref.name)
    have_built = os.path.exists(built)
    if not have_built and os.path.exists(carried):
        return
    if have_built and _digest_of(built) == digest:
        return  # the snapshot carries the very index built here (one this state dir pushed): nothing to fetch
    if fetch(remote, base_manifest_digest, log, digest) is None or not have_built:
        return
    if _same_content(built, carried):
        os.replace(carried, built)
    else:
        remove_if_there(carried)  # the built one serves every commit; one that differs from it serves none


def _digest_of(path: str) -> Optional[str]:
    try:
        with open_own(path, "rb") as f:
            return file_digest(f)
    except OSError:
        return None


def _same_content(a: str, b: str) -> bool:
    """Whether two cached indexes hold the same lines, header and entries in order (read by chunks,
    up to the first difference: the carried one may be a gzip bomb)."""
    try:
        with open_own(a, "rb") as ra, gzip.open(ra) as fa, open_own(b, "rb") as rb, gzip.open(rb) as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except (OSError, EOFError):
        return False


def artifact_tag(base_manifest_digest: str) -> str:
    return "snap-index-" + base_manifest_digest.replace(":", "-")


def push(remote: Remote, base_manifest_digest: str, sources: BlobSources) -> Optional[str]:
    """Push the cached index of the base into `remote`'s repository, with its artifact manifest: the
    one a commit there may use (load_cached), never one fetched from another repository, which would
    spread. Returns the index blob's digest (for the snapshot's annotation); None if there is none."""
    for path in _usable_paths(base_manifest_digest, remote.ref.name):
        try:
            with open_own(path, "rb") as f:
                data = f.read(MAX_INDEX_SIZE + 1)
            break
        except FileNotFoundError:
            continue
        except OSError:
            return None
    else:
        return None
    if len(data) > MAX_INDEX_SIZE:
        return None
    digest = sha256_digest(data)
    push_artifact(remote, [(data, digest)], BASE_INDEX, BASE_INDEX_ARTIFACT, artifact_tag(base_manifest_digest),
                  {"org.opencontainers.image.base.digest": base_manifest_digest}, sources, "base index")
    return digest


def push_artifact(remote: Remote, blobs: list[tuple[bytes, str]], media_type: str, artifact_type: str, tag: str,
                  annotations: dict, sources: BlobSources, what: str, jobs: int = 1) -> None:
    """Push small blobs ([(data, digest)]) that snapshots name by annotation (counted as `what`;
    `jobs` at once: each a round trip or two), with an artifact manifest tagged `tag` that lists
    them: a registry's garbage collection deletes a blob no manifest lists."""
    empty = EMPTY_CONFIG_DIGEST
    unique = list({d: (data, d) for data, d in blobs}.values())
    manifest = canonical({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": artifact_type,
        "config": descriptor(OCI_EMPTY, empty, len(_EMPTY_CONFIG)),
        "layers": [descriptor(media_type, d, len(data)) for data, d in unique],
        **({"annotations": annotations} if annotations else {}),
    })
    if remote.manifest_digest(tag) == sha256_digest(manifest):
        return  # the tag names this very artifact, and the registry keeps the blobs a manifest lists

    def put(item: tuple[bytes, str]) -> None:
        data, d = item
        if not in_registry(remote, d, sources):
            remote.upload_from(lambda out: out.write(data), d, len(data), what=what)

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(put, unique + [(_EMPTY_CONFIG, empty)]))
    remote.put_manifest(manifest, OCI_MANIFEST, tag)


def fetch(remote: Remote, base_manifest_digest: str, log: Callable[[str], None],
          digest: Optional[str] = None, diff_ids: Optional[list[str]] = None) -> Optional[dict[str, Entry]]:
    """The base's index from `remote`'s repository into the state dir, as that repository's
    (cache_path): the blob `digest` (a snapshot's annotation), else the one the artifact tag names.
    Digest-checked and size-capped; None if the repository has none, or one of another format
    version or, given the base's `diff_ids`, of other layers: the caller reads the base."""
    try:
        if digest is None:
            body, _, _ = remote.get_manifest(artifact_tag(base_manifest_digest))
            doc = jsontext.loads(body)
            layer = doc["layers"][0]
            if doc.get("artifactType") != BASE_INDEX_ARTIFACT or layer.get("mediaType") != BASE_INDEX:
                return None
            digest, size = layer["digest"], layer["size"]
            if type(size) is not int or size > MAX_INDEX_SIZE or not isinstance(digest, str):
                return None
        path = cache_path(base_manifest_digest, remote.ref.name)
        remote.download_blob(digest, path, _capped(MAX_INDEX_SIZE, digest))
    except NotFound:
        return None  # no snapshot of this base pushed there yet
    except (RegistryError, IntegrityError, ValueError, KeyError, IndexError, TypeError, OSError) as e:
        log(f"warning: the base index in {remote.ref.name} is not usable ({e}): reading the base's layers")
        return None
    index = load_index(path, diff_ids)
    if index is None:
        os.unlink(path)  # another version's, or of other layers than the base's: rebuilt from the layers
    return index


def _capped(limit: int, digest: str) -> Callable[[int], None]:
    """A download progress callback that stops a blob growing past `limit` bytes."""
    got = 0

    def count(n: int) -> None:
        nonlocal got
        got += n
        if got > limit:
            raise IntegrityError(f"blob {digest} is longer than the {limit} bytes a base index may have")

    return count
