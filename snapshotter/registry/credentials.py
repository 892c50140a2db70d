"""Who we are to a registry: the username and password given on the command line, or the ones
Docker's config holds for it (read by the docker SDK, as `docker login` or `snap login` wrote
them); and writing them there, as `docker login` does: inline in config.json, or through the
credential helper the config names for the registry, so that every tool on the box shares them."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from typing import Optional

import oras.utils

from snapshotter.errors import AuthError, storage_error
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


DOCKER_HUB_KEY = "https://index.docker.io/v1/"  # the key Docker keeps Docker Hub's credentials under
_HELPER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a program name on PATH, never a path
_FIX_CONFIG = "check ~/.docker/config.json (or $DOCKER_CONFIG) and its credential helpers"


def docker_config_path() -> str:
    """The config `docker login` writes: $DOCKER_CONFIG/config.json, else ~/.docker/config.json."""
    return os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")


def config_key(registry: str) -> str:
    """The key Docker writes a registry's credentials under: host[:port], Docker Hub's legacy URL."""
    return DOCKER_HUB_KEY if registry in DOCKER_HUB_NAMES else registry


def save_docker_credentials(registry: str, username: str, password: str) -> str:
    """Keep (username, password) for `registry` as `docker login` does: through the credential
    helper the config names for it (credHelpers, else credsStore), the config keeping an empty
    entry, as Docker's; else inline in config.json. Returns where they went (the helper or the file)."""
    key = config_key(registry)
    config = _read_config()
    helper = _helper_for(config, key)
    auths = config["auths"] = config.get("auths") or {}
    if not isinstance(auths, dict):
        raise AuthError(f"Docker's config {docker_config_path()} has an \"auths\" that is not an object", _FIX_CONFIG)
    if helper:
        _run_helper(helper, "store", key, username, password)
        auths[key] = {}  # no secret in the file; an inline one from before is dropped
        where = f"credential helper docker-credential-{helper}"
    else:
        auths[key] = {"auth": base64.b64encode(f"{username}:{password}".encode()).decode()}
        where = docker_config_path()
    _write_config(config)
    return where


def erase_docker_credentials(registry: str) -> bool:
    """Forget `registry`'s credentials: its entries in config.json (under every key snap would read
    them from) and the helper's. False if there were none."""
    key = config_key(registry)
    config = _read_config()
    auths = config.get("auths")
    import docker.auth  # the SDK's own key matching, so that what it read is what goes

    names = {docker.auth.resolve_index_name(n) for n in (
        ["docker.io"] if registry in DOCKER_HUB_NAMES else oras.utils.iter_localhosts(registry))}
    gone = [k for k in auths if docker.auth.resolve_index_name(k) in names] if isinstance(auths, dict) else []
    for k in gone:
        del auths[k]
    helper = _helper_for(config, key)
    erased = bool(helper) and _run_helper(helper, "erase", key)
    if gone:
        _write_config(config)
    return bool(gone) or erased


def _read_config() -> dict:
    """config.json as a dict; {} if there is none. A config that is no JSON object is refused, not replaced."""
    path = docker_config_path()
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise AuthError(f"cannot read Docker's config {path}: {e.strerror or e}", _FIX_CONFIG)
    if not text.strip():
        return {}  # an empty file, as some tools leave: Docker takes it as no config
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise AuthError(f"Docker's config {path} is not a JSON object: not touching it", _FIX_CONFIG)
    return config


def _write_config(config: dict) -> None:
    """config.json written whole or not at all (a temporary file renamed over it), 0600 in a 0700
    directory made if missing; a config that is a symlink is written where it points, as Docker does."""
    path = os.path.realpath(docker_config_path())
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".config.json.", dir=directory)  # 0600
    except OSError as e:
        raise storage_error(e, directory, " (Docker's config)")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(config, f, indent="\t")
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        _keep_owner(path, tmp)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise storage_error(e, directory, " (Docker's config)")


def _keep_owner(path: str, tmp: str) -> None:
    """The new file belongs to whoever owned the old one (root writing a user's config, as with sudo)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        with contextlib.suppress(PermissionError):
            os.chown(tmp, st.st_uid, st.st_gid)


def _helper_for(config: dict, key: str) -> Optional[str]:
    """The credential helper the config names for `key`: credHelpers', else credsStore."""
    helpers = config.get("credHelpers")
    helper = (helpers.get(key) if isinstance(helpers, dict) else None) or config.get("credsStore")
    if helper and not (isinstance(helper, str) and _HELPER_NAME.fullmatch(helper)):  # "": none, as Docker reads it
        raise AuthError(f"Docker's config {docker_config_path()} names a credential helper that is no program name: "
                        f"{str(helper)[:100]!r}", _FIX_CONFIG)
    return helper or None


def _run_helper(helper: str, action: str, key: str, username: str = "", password: str = "") -> bool:
    """`docker-credential-HELPER store|erase` for `key` (the docker SDK runs it: the helper protocol).
    erase: False if the helper held nothing for `key`."""
    import docker.credentials

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a helper missing from PATH: the error below says it
        store = docker.credentials.Store(helper)
    try:
        if action == "store":
            store.store(key, username, password)
            return True
        try:
            store.get(key)
        except docker.credentials.CredentialsNotFound:
            return False
        store.erase(key)
        return True
    except (docker.credentials.StoreError, ValueError, KeyError) as e:  # ValueError, KeyError: an answer that is no JSON
        raise AuthError(f"credential helper docker-credential-{helper} failed to {action} the credentials for "
                        f"{key}: {short_error(e)}", _FIX_CONFIG)
