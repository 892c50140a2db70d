"""What a snapshot keeps of a hub-cache blob instead of its bytes: a Reference (which file of which
repository at which commit, on which origin, with its sha256 and size, and the blob file's own mode,
owner and mtime), and a RefName (a branch or tag the cache's refs/ maps to a commit). The list is
serialised in one versioned JSON form (References.to_json), made to travel as a blob of its own
media type tied to the snapshot's manifest (docs/weights-from-origin.md). Everything read back is
checked as strictly as a layer: a hostile document names no path out of its cache and no odd hash."""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from snapshotter import jsontext
from snapshotter.digests import sha256_digest
from snapshotter.errors import IntegrityError

MEDIA_TYPE = "application/vnd.boxsnap.origin.references.v1+json"
SCHEMA_VERSION = 1
DEFAULT_ENDPOINT = "https://huggingface.co"
# The hub's folder prefix and URL prefix of each repository type (huggingface_hub's repo_folder_name, hf_hub_url).
FOLDER_PREFIX = {"model": "models", "dataset": "datasets", "space": "spaces"}
URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")  # a git commit (or a git blob: the hub's name for a small file)
# Bounds of what a file can have (a hostile document's huge numbers would overflow chown or utime):
# uid_t's 32 bits less (uid_t)-1, which means "unchanged"; a signed 64-bit size and time in ns.
MAX_ID = (1 << 32) - 1
MAX_SIZE = MAX_MTIME_NS = (1 << 63) - 1
# The hub's own rule for a repository id (validate_repo_id): NAME or ORG/NAME, no '--' nor '..' in it.
REPO_ID = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


def repo_folder(cache: str, repo_type: str, repo_id: str) -> str:
    """A repository's folder in a hub cache: models--ORG--NAME (huggingface_hub's repo_folder_name)."""
    return posixpath.join(cache, f"{FOLDER_PREFIX[repo_type]}--{repo_id.replace('/', '--')}")


def plain_relative(path: str) -> bool:
    """Whether `path` is a plain relative path: no '..', '.', empty or absolute part, no NUL."""
    parts = path.split("/")
    return bool(path) and "\0" not in path and all(p not in ("", ".", "..") for p in parts)


@dataclass(frozen=True)
class Reference:
    """One file of a hub cache, held by the origin: the blob `cache`/REPO/blobs/`sha256`, named by
    the symlink `cache`/REPO/snapshots/`revision`/`path`. `cache` is the hub cache folder, relative
    to the root (root/.cache/huggingface/hub)."""

    cache: str
    repo_type: str  # model, dataset or space
    repo_id: str  # ORG/NAME (or NAME)
    revision: str  # the commit hash the snapshots folder names: what the origin resolves for ever
    path: str  # the file's path in the repository
    sha256: str  # hex: the blob's name and its content's hash
    size: int
    endpoint: str  # where the box got it (what HF_ENDPOINT said); informative: a restore asks its own
    mode: int = 0o644  # the blob file's permission bits, owner and mtime, so the restored one is the box's
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0

    @property
    def repo_folder(self) -> str:
        return repo_folder(self.cache, self.repo_type, self.repo_id)

    @property
    def blob_path(self) -> str:
        return posixpath.join(self.repo_folder, "blobs", self.sha256)

    @property
    def link_path(self) -> str:
        return posixpath.join(self.repo_folder, "snapshots", self.revision, self.path)

    @property
    def link_target(self) -> str:
        """The symlink's text as the hub writes it: relative, from the link's folder to the blob."""
        return posixpath.relpath(self.blob_path, posixpath.dirname(self.link_path))

    @property
    def url_path(self) -> str:
        """The repository's part of a resolve URL: ORG/NAME, datasets/ORG/NAME, spaces/ORG/NAME."""
        return URL_PREFIX[self.repo_type] + self.repo_id

    def check(self) -> None:
        """IntegrityError unless every field has the form the hub gives it (an untrusted document)."""
        bad = _bad_reference_field(self)
        if bad:
            raise IntegrityError(f"origin reference {self.path[:200]!r} of {self.repo_id[:200]!r}: {bad}",
                                 "the snapshot's list of weights from the origin is corrupt or hostile")


def _bad_repository(cache: str, repo_type: str, repo_id: str, revision: str) -> str:
    if repo_type not in FOLDER_PREFIX:
        return f"unknown repository type {repo_type!r}"
    if not REPO_ID.fullmatch(repo_id):
        return f"not a repository id: {repo_id!r}"
    if not plain_relative(cache):
        return "a cache folder that leaves the root"
    if not COMMIT_HASH.fullmatch(revision):
        return "a revision that is not a commit hash"
    return ""


def _bad_reference_field(r: Reference) -> str:
    bad = _bad_repository(r.cache, r.repo_type, r.repo_id, r.revision)
    if bad:
        return bad
    if not plain_relative(r.path):
        return "a path that leaves its repository"
    if not SHA256_HEX.fullmatch(r.sha256):
        return "a hash that is not a sha256"
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in (r.size, r.mode, r.uid, r.gid, r.mtime_ns)):
        return "a size or file attribute that is not a number"
    if r.uid >= MAX_ID or r.gid >= MAX_ID or r.size > MAX_SIZE or r.mtime_ns > MAX_MTIME_NS:
        return "a size, owner or mtime no file can have"
    if r.mode > 0o777 or not r.endpoint.startswith(("https://", "http://")):
        return "a mode with special bits (a hub blob has none), or an odd endpoint"
    return ""


@dataclass(frozen=True)
class RefName:
    """`cache`/REPO/refs/`name` holds `revision`: which commit a branch or tag named when the box had it."""

    cache: str
    repo_type: str
    repo_id: str
    name: str  # main, or refs/pr/1's pr/1
    revision: str

    @property
    def file_path(self) -> str:
        return posixpath.join(repo_folder(self.cache, self.repo_type, self.repo_id), "refs", self.name)

    def check(self) -> None:
        bad = _bad_repository(self.cache, self.repo_type, self.repo_id, self.revision)
        if bad or not plain_relative(self.name):
            raise IntegrityError(f"origin ref {self.name[:200]!r}: {bad or 'a name that leaves refs/'}",
                                 "the snapshot's list of weights from the origin is corrupt or hostile")


@dataclass(frozen=True)
class References:
    """A snapshot's references and refs: the document that travels with its manifest."""

    references: tuple[Reference, ...] = ()
    refs: tuple[RefName, ...] = ()

    def to_json(self) -> bytes:
        """The one serialised form: sorted, compact, so that the same references give the same digest."""
        doc = {"schemaVersion": SCHEMA_VERSION, "mediaType": MEDIA_TYPE,
               "references": sorted((asdict(r) for r in self.references), key=_order),
               "refs": sorted((asdict(r) for r in self.refs), key=_order)}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def descriptor(self) -> dict:
        """The OCI descriptor of the serialised form, for a manifest to name it by digest."""
        data = self.to_json()
        return {"mediaType": MEDIA_TYPE, "digest": sha256_digest(data), "size": len(data)}

    @classmethod
    def from_json(cls, data: bytes) -> "References":
        """Read back what to_json wrote; IntegrityError for anything else (another version, a field
        missing or of the wrong type, a path out of its cache)."""
        try:
            doc = jsontext.loads(data)
        except ValueError:
            doc = None
        version = (doc.get("schemaVersion"), doc.get("mediaType")) if isinstance(doc, dict) else None
        if version != (SCHEMA_VERSION, MEDIA_TYPE):
            raise IntegrityError("the snapshot's list of weights from the origin is not a version-1 list",
                                 "a newer snap wrote it, or it is corrupt")
        refs = tuple(_build(RefName, item) for item in _list(doc, "refs"))
        found = cls(tuple(_build(Reference, item) for item in _list(doc, "references")), refs)
        for item in (*found.references, *found.refs):
            item.check()
        return found


def _order(item: dict) -> tuple:
    return tuple(str(item[k]) for k in sorted(item))


def _list(doc: dict, key: str) -> list:
    items = doc.get(key)
    if not isinstance(items, list):
        raise IntegrityError(f"the snapshot's list of weights from the origin has no {key!r} list")
    return items


def _build(kind: type, item: Any):
    names = {f.name: f.type for f in fields(kind)}
    if not isinstance(item, dict) or set(item) != set(names):
        raise IntegrityError(f"an entry of the snapshot's list of weights from the origin is not a {kind.__name__}")
    for name, value in item.items():
        wanted = int if names[name] == "int" else str
        if not isinstance(value, wanted) or isinstance(value, bool):
            raise IntegrityError(f"an entry of the snapshot's list of weights from the origin has a bad {name!r}")
    return kind(**item)
