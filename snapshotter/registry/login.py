"""`snap login` and `snap logout`, as `docker login` does them without Docker: credentials are
checked against the registry before they are kept (its /v2/ asked with them, through its token
service for a token registry: the transport's own round trip), then written to Docker's config or
its credential helper (credentials.py), where snap, docker, oras and crane all find them."""

from __future__ import annotations

import dataclasses

from snapshotter.oci.reference import parse_registry

from .auth import CredentialsRefused
from .credentials import Credentials, check_docker_config, erase_docker_credentials, save_docker_credentials
from .transport import Transport, TransportOptions


def login(registry: str, username: str, password: str, options: TransportOptions) -> str:
    """Check (username, password) with `registry`, then keep them. Returns where they went.
    Nothing is written if the registry refuses them or cannot be reached."""
    registry = parse_registry(registry)
    check_docker_config()  # a config that would be refused is said before the registry is asked
    options = dataclasses.replace(options, credentials=Credentials(username, password), credentials_registry=None)
    transport = Transport(registry, "", options)
    try:
        transport.request("GET", f"{transport.scheme}://{transport.host}/v2/")
    except CredentialsRefused:
        raise CredentialsRefused(f"registry {registry} refused the login of {username!r}",
                                 "check the username and the password or token; nothing was saved") from None
    return save_docker_credentials(registry, username, password)


def logout(registry: str) -> bool:
    """Forget `registry`'s credentials; False if none were kept."""
    return erase_docker_credentials(parse_registry(registry))
