"""Who we are to a registry: the username and password given on the command line, or the ones
Docker's config holds for it (as `docker login` or `snap login` wrote them: inline, or kept by a
credential helper); and writing them there, as `docker login` does: inline in config.json, or
through the credential helper the config names for the registry, so that every tool on the box
shares them. The file itself is docker_config.py's, the helpers credential_helper.py's."""

from __future__ import annotations

import base64
import os
import sys
from dataclasses import dataclass
from typing import Iterator, Optional, TextIO

from snapshotter.errors import UsageError
from snapshotter.oci.reference import DOCKER_HUB_NAMES

from . import credential_helper, docker_config
from .docker_config import config_path, decode_auth, helper_for


@dataclass
class Credentials:
    username: Optional[str] = None
    password: Optional[str] = None


# The credential variables snap reads: taken out of its environment (take_secret_env), so that no
# process it starts (`restore --then`'s app, a credential helper) inherits them.
SECRET_ENV = ("SNAP_USERNAME", "SNAP_PASSWORD")
_secrets: dict[str, str] = {}  # SECRET_ENV's values once taken: os.environ no longer holds them
UTF8_HINT = "give the credentials as UTF-8 text"  # what HTTP Basic sends them as


def take_secret_env() -> dict[str, str]:
    """SECRET_ENV's values, removed from os.environ (and so from every child's environment) the
    first time they are seen."""
    for name in SECRET_ENV:
        if name in os.environ:
            _secrets[name] = os.environ.pop(name)
    return dict(_secrets)


def given_credentials(username: Optional[str], password_stdin: bool, stdin: Optional[TextIO] = None) -> Credentials:
    """The credentials a command was given: --username with --password-stdin (or SNAP_PASSWORD),
    else SNAP_USERNAME with SNAP_PASSWORD; none (Docker's config is read per registry) otherwise."""
    secrets = take_secret_env()
    if password_stdin:
        return Credentials(*checked_utf8(username, password_from_stdin(username, stdin)))
    if username is not None:
        password = secrets.get("SNAP_PASSWORD")
        if password is None:
            raise UsageError("--username needs a password", "pipe it to --password-stdin, or set SNAP_PASSWORD")
        return Credentials(*checked_utf8(username, password))
    return Credentials(*checked_utf8(*env_credentials(secrets)))


def checked_utf8(username: Optional[str], password: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(username, password) if both are text a registry can be sent (UTF-8); a byte that is none (from
    the environment or stdin) is a usage error naming the username, never the password."""
    for what, value in ((f"the username {username!r}", username), ("the password", password)):
        try:
            value is None or value.encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"{what} is not valid UTF-8", UTF8_HINT) from None
    return username, password


def password_from_stdin(username: Optional[str], stdin: Optional[TextIO] = None) -> str:
    """--password-stdin's password: the first line of standard input."""
    if username is None:
        raise UsageError("--password-stdin needs --username")
    stdin = stdin or sys.stdin
    if stdin is None:  # snap started with its standard input closed
        raise UsageError("--password-stdin: standard input is closed", "pipe the password to it")
    try:
        password = stdin.readline().rstrip("\r\n")
    except UnicodeDecodeError:
        raise UsageError("--password-stdin: the password is not valid UTF-8", UTF8_HINT) from None
    if not password:  # an empty pipe (a secret that was never set): no registry takes it
        raise UsageError("--password-stdin: standard input gave no password (its first line is empty)",
                         "pipe the password to it, e.g. printf %s \"$TOKEN\" | snap ...")
    return password


def env_credentials(secrets: dict[str, str]) -> tuple[Optional[str], Optional[str]]:
    """SNAP_USERNAME and SNAP_PASSWORD, both or neither: where a provider puts its secrets (a box it
    starts has no `docker login`). An empty variable counts as unset (a template's blank secret)."""
    username, password = secrets.get("SNAP_USERNAME") or None, secrets.get("SNAP_PASSWORD") or None
    if (username is None) != (password is None):
        given, missing = SECRET_ENV if username is not None else SECRET_ENV[::-1]
        raise UsageError(f"{given} is set but {missing} is not", "set both, or neither to use Docker's config")
    return username, password


DOCKER_HUB_KEY = "https://index.docker.io/v1/"  # the key Docker keeps Docker Hub's credentials under


def docker_credentials(registry: str) -> Optional[tuple[str, str]]:
    """(username, password) for `registry` from Docker's config, read as the docker SDK reads it:
    the helper it names for the registry (credHelpers, else credsStore) first, then inline auths;
    Docker Hub under any of its keys. A loopback registry's are also found under its other name
    (localhost or 127.0.0.1). None if there are none."""
    config = docker_config.load_for_reading()
    if not config:
        return None
    auths = config.get("auths") or {}
    for name in _names(registry):
        key = config_key(name)
        helper = helper_for(config, key)
        found = credential_helper.get(helper, key) if helper else None
        if found is None:
            index = _index_name(name)
            entry = auths.get(index) if index in auths else next(
                (v for k, v in auths.items() if _index_name(k) == index), None)
            if entry and "identitytoken" not in entry:  # an identity token: OAuth, which snap does not speak
                found = decode_auth(entry, index, config_path())
        if found is not None:
            return found
    return None


def _names(registry: str) -> Iterator[str]:
    if registry in DOCKER_HUB_NAMES:
        return iter(["docker.io"])
    import oras.utils  # only where a Docker config is read: its import costs every command ~7 ms

    return oras.utils.iter_localhosts(registry)


def _index_name(key: str) -> str:
    """An auths key as Docker matches it: its host[:port] (a URL's scheme and path dropped), Docker
    Hub's as docker.io."""
    host = key.replace("http://", "").replace("https://", "").split("/", 1)[0]
    return "docker.io" if host == "index.docker.io" else host


def config_key(registry: str) -> str:
    """The key Docker writes a registry's credentials under: host[:port], Docker Hub's legacy URL."""
    return DOCKER_HUB_KEY if registry in DOCKER_HUB_NAMES else registry


def save_docker_credentials(registry: str, username: str, password: str) -> str:
    """Keep (username, password) for `registry` as `docker login` does: through the credential
    helper the config names for it (credHelpers, else credsStore), the config keeping an empty
    entry, as Docker's; else inline in config.json. Returns where they went (the helper or the file).
    Where the config may not be written, nothing is stored."""
    key = config_key(registry)
    config = docker_config.load(config_path()) or {}
    docker_config.writable_target()  # refused before the helper is asked to store anything
    where = config_path()
    helper = helper_for(config, key)
    auths = config["auths"] = config.get("auths") or {}
    if helper:
        credential_helper.store(helper, key, username, password)
        auths[key] = {}  # no secret in the file; an inline one from before is dropped
        where = f"credential helper {credential_helper.PREFIX}{helper}"
    else:
        auths[key] = {"auth": base64.b64encode(f"{username}:{password}".encode()).decode()}
    docker_config.save(config)
    return where


def check_docker_config() -> None:
    """Refuse (one line) a config snap could not read or write, before a login asks the registry."""
    docker_config.load(config_path())
    docker_config.writable_target()


def erase_docker_credentials(registry: str) -> bool:
    """Forget `registry`'s credentials: its entries in config.json (under every key snap would read
    them from) and the helper's. False if there were none."""
    key = config_key(registry)
    config = docker_config.load(config_path()) or {}
    auths = config.get("auths") or {}
    names = {_index_name(n) for n in _names(registry)}
    gone = [k for k in auths if _index_name(k) in names]
    if gone:
        docker_config.writable_target()  # refused before the helper is asked to erase anything
    helper = helper_for(config, key)
    erased = bool(helper) and credential_helper.erase(helper, key)
    for k in gone:
        del auths[k]
    if gone:
        docker_config.save(config)
    return bool(gone) or erased
