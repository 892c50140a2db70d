"""Who we are to a registry: the username and password given on the command line, or the ones
Docker's config holds for it (read by the docker SDK, as `docker login` wrote them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import oras.utils

from snapshotter.errors import AuthError
from snapshotter.oci.reference import DOCKER_HUB_NAMES

from .answers import short_error


@dataclass
class Credentials:
    username: Optional[str] = None
    password: Optional[str] = None


_SDK_CONFIGS = ("~/.docker/config.json", "~/.dockercfg")  # where the docker SDK looks without $DOCKER_CONFIG


def docker_credentials(registry: str) -> Optional[tuple[str, str]]:
    """(username, password) for `registry` from Docker's config, read by the docker SDK: inline
    auths, credsStore and credHelpers (the helper programs run), Docker Hub under any of its keys.
    A loopback registry's are also found under its other name (localhost or 127.0.0.1). None if
    there are none."""
    # The SDK falls back to ~/.docker when $DOCKER_CONFIG holds no config.json; Docker does not.
    env_dir = os.environ.get("DOCKER_CONFIG")
    path = os.path.join(env_dir, "config.json") if env_dir else None
    if path and not os.path.exists(path):
        return None
    if not path and not any(os.path.exists(os.path.expanduser(p)) for p in _SDK_CONFIGS):
        return None  # no config where the SDK looks: no credentials, and no SDK to load
    import docker.auth  # only here: the SDK costs a restore's start ~0.1 s, and most machines have no config
    import docker.errors

    names = ["docker.io"] if registry in DOCKER_HUB_NAMES else list(oras.utils.iter_localhosts(registry))
    try:
        config = docker.auth.load_config(path)
        for name in names:
            found = docker.auth.resolve_authconfig(config, name) or {}
            username = found.get("username", found.get("Username"))
            if username is not None:
                return username, found.get("password", found.get("Password")) or ""
    except (docker.errors.DockerException, OSError, ValueError) as e:
        raise AuthError(f"cannot read registry credentials for {registry} from Docker's config: {short_error(e)}",
                        "check ~/.docker/config.json (or $DOCKER_CONFIG) and its credential helpers")
    return None
