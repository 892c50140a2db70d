"""`snap login` and `snap logout`, as `docker login` does them without Docker: credentials are
checked against the registry before they are kept (its /v2/ asked with them, through its token
service for a token registry: the transport's own round trip), then written to Docker's config or
its credential helper (credentials.py), where snap, docker, oras and crane all find them."""

from __future__ import annotations

import dataclasses
import getpass
import sys
from typing import Optional

from snapshotter.errors import UsageError
from snapshotter.oci.reference import parse_registry

from .auth import CredentialsRefused
from .credentials import (Credentials, check_docker_config, checked_utf8, env_credentials, erase_docker_credentials,
                          password_from_stdin, save_docker_credentials, take_secret_env)
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


def login_credentials(username: Optional[str], password_stdin: bool) -> tuple[str, str]:
    """Who logs in: --username with --password-stdin, else SNAP_USERNAME and SNAP_PASSWORD, else
    asked for on the terminal (the password not echoed)."""
    secrets = take_secret_env()
    if password_stdin:
        password = password_from_stdin(username)
    elif username is None and (secrets.get("SNAP_USERNAME") or secrets.get("SNAP_PASSWORD")):
        username, password = env_credentials(secrets)
    else:
        password = (secrets.get("SNAP_PASSWORD") or None) if username is not None else None
        if password is None:
            if sys.stdin is None or not sys.stdin.isatty():  # None: snap started with stdin closed
                raise UsageError("no password given and no terminal to ask for it",
                                 "pipe it to --password-stdin with --username, or set SNAP_USERNAME and SNAP_PASSWORD")
            if username is None:
                username = input("Username: ")
            password = getpass.getpass("Password: ")
    if not username or not password:
        raise UsageError("the username and the password must not be empty")
    return checked_utf8(username, password)


def logout(registry: str) -> bool:
    """Forget `registry`'s credentials; False if none were kept."""
    return erase_docker_credentials(parse_registry(registry))
