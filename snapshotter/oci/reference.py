"""Image references, read as Docker reads them (distribution's reference grammar, normalized).

`ubuntu:22.04` is `docker.io/library/ubuntu:22.04`, `me/box` is `docker.io/me/box:latest`; a first
component with a dot or a port, `localhost`, or capitals names a registry; `index.docker.io` is
`docker.io`, whose API is served by `registry-1.docker.io`. Digests (`name@sha256:...`, also after a
tag: then the digest is what is fetched), lowercase repositories, tags of at most 128 characters and
names of at most 255 follow the same rules as `docker pull`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from snapshotter.errors import UsageError

DOCKER_HUB = "docker.io"
DOCKER_HUB_LEGACY = "index.docker.io"  # the "Docker Index" of old: the same registry
DOCKER_HUB_API = "registry-1.docker.io"
DOCKER_HUB_NAMES = (DOCKER_HUB, DOCKER_HUB_LEGACY, DOCKER_HUB_API)
OFFICIAL_PREFIX = "library/"  # Docker Hub's namespace for one-component names
DEFAULT_TAG = "latest"
NAME_MAX = 255  # domain/path, as distribution counts it
# go-digest's algorithms and the length of their lowercase hex encodings
DIGEST_HEX_LENGTHS = {"sha256": 64, "sha384": 96, "sha512": 128}

# The grammar of distribution/reference (regexp.go), as Python regular expressions.
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_REMOTE_NAME = rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN_NAME = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*"
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_DOMAIN_AND_PORT = rf"(?:{_DOMAIN_NAME}|{_IPV6})(?::(?P<port>[0-9]+))?"
PORT_RANGE = range(1, 65536)  # the grammar takes any digits; a port past these fails only at connect
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

_REFERENCE_RE = re.compile(
    rf"(?P<name>(?:{_DOMAIN_AND_PORT}/)?{_REMOTE_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")
_NAME_RE = re.compile(rf"(?:(?P<domain>{_DOMAIN_AND_PORT})/)?(?P<path>{_REMOTE_NAME})")
_TAG_RE = re.compile(_TAG)
_IDENTIFIER_RE = re.compile(r"[a-f0-9]{64}")  # a bare image ID: not a name


def is_tag(text) -> bool:
    """Is `text` a tag as distribution spells them (what a registry's tag list may hold)?"""
    return isinstance(text, str) and _TAG_RE.fullmatch(text) is not None


def api_host(registry: str) -> str:
    """The host[:port] that serves the /v2/ API of a registry named in a reference."""
    return DOCKER_HUB_API if registry in DOCKER_HUB_NAMES else registry


def parse_registry(text: str) -> str:
    """The registry a `snap login REGISTRY` names: host[:port], as Docker takes it (a scheme and a
    path, as in https://index.docker.io/v1/, are dropped; Docker Hub under any of its names is
    docker.io)."""
    scheme, sep, rest = text.partition("://")
    host = (rest if sep else text).split("/", 1)[0]
    m = re.fullmatch(_DOMAIN_AND_PORT, host)
    if not m or not _port_in_range(m["port"]) or (sep and scheme not in ("http", "https")):
        raise UsageError(f"registry {text!r} is not valid", "write HOST[:PORT], e.g. ghcr.io or 127.0.0.1:5000, "
                         "the port from 1 to 65535")
    return DOCKER_HUB if host in DOCKER_HUB_NAMES else host


def _port_in_range(port: Optional[str]) -> bool:
    return port is None or int(port) in PORT_RANGE


def _split_domain(text: str) -> tuple[str, str]:
    """Registry and the rest, as Docker splits a familiar name (distribution's splitDockerDomain)."""
    first, sep, rest = text.partition("/")
    if not sep:
        domain, remainder = DOCKER_HUB, text
    elif first == DOCKER_HUB_LEGACY:
        domain, remainder = DOCKER_HUB, rest
    elif first == "localhost" or "." in first or ":" in first or first.lower() != first:
        domain, remainder = first, rest
    else:
        domain, remainder = DOCKER_HUB, text
    if domain == DOCKER_HUB and "/" not in remainder:
        remainder = OFFICIAL_PREFIX + remainder
    return domain, remainder


def _invalid(text: str, why: str) -> UsageError:
    return UsageError(f"image reference {text!r} is not valid: {why}",
                      "write [HOST[:PORT]/]NAME[:TAG][@sha256:DIGEST], e.g. ubuntu:22.04 or 127.0.0.1:5000/box:v1")


@dataclass(frozen=True)
class Reference:
    """registry/repository[:tag][@digest], normalized: `registry` is never empty (docker.io by
    default) and Docker Hub's one-component names carry `library/`. With no tag and no digest the
    tag is `latest`."""

    registry: str
    repository: str
    tag: Optional[str] = None
    digest: Optional[str] = None

    @classmethod
    def parse(cls, text: str) -> "Reference":
        if not text:
            raise _invalid(text, "it is empty")
        if _IDENTIFIER_RE.fullmatch(text):
            raise _invalid(text, "a 64-character hex string is an image ID, not a name")
        domain, remainder = _split_domain(text)
        path = remainder.split(":", 1)[0].split("@", 1)[0]
        if path.lower() != path:
            raise _invalid(text, "the repository name must be lowercase")
        m = _REFERENCE_RE.fullmatch(f"{domain}/{remainder}")
        if not m:
            raise _invalid(text, "it does not follow the image name grammar")
        if len(m["name"]) > NAME_MAX:
            raise _invalid(text, f"the name is longer than {NAME_MAX} characters")
        name = _NAME_RE.fullmatch(m["name"])
        if not name or not name["domain"]:  # e.g. "my_host.com/x": read as a path, no valid host in front
            raise _invalid(text, f"{domain!r} is not a valid registry host")
        if not _port_in_range(name["port"]):
            raise _invalid(text, f"the registry's port {name['port']} is not from 1 to 65535")
        digest = m["digest"]
        if digest:
            algorithm, _, hexdigest = digest.partition(":")
            if algorithm not in DIGEST_HEX_LENGTHS:
                raise _invalid(text, f"digest algorithm {algorithm!r} is not one of {', '.join(DIGEST_HEX_LENGTHS)}")
            if not re.fullmatch(rf"[a-f0-9]{{{DIGEST_HEX_LENGTHS[algorithm]}}}", hexdigest):
                raise _invalid(text, f"a {algorithm} digest is {DIGEST_HEX_LENGTHS[algorithm]} lowercase hex digits")
        tag = m["tag"] or (None if digest else DEFAULT_TAG)
        return cls(name["domain"], name["path"], tag, digest)

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    @property
    def api_host(self) -> str:
        return api_host(self.registry)

    @property
    def target(self) -> str:
        """What goes after /manifests/: the digest when pinned, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def with_digest(self, digest: str) -> "Reference":
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        s = self.name
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s
