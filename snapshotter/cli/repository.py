"""The commands about a repository and the registry itself: log, tag, profiles, login, logout."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from snapshotter.registry.options import RegistryOptions, reach

from . import output
from .options import CaCert, InsecureTls, JsonOut, PlainHttp, with_registry
from .output import out, say

Registry = Annotated[str, typer.Argument(help="The registry, e.g. ghcr.io, 127.0.0.1:5000 or docker.io")]


@with_registry
def log_(
    target: Annotated[str, typer.Argument(
        help="The repository (any tag of it), e.g. registry.example.com/me/box:v2")],
    as_json: JsonOut = False, registry: RegistryOptions = RegistryOptions(),
):
    """List the snapshots of the repository, newest first: tags, UTC time, total size, base, and the
    layers new in each versus the one before (label and size); then the diverged tags of TARGET's tag
    (TAG-diverged-<time>: boxes that could not move it saved their work there)."""
    from snapshotter.commit.history import snapshot_log
    from snapshotter.oci.reference import Reference

    snaps = snapshot_log(target, registry.transport(),
                         log=say)
    output.snapshots(snaps, Reference.parse(target).tag, as_json)


@with_registry
def tag_(
    source: Annotated[str, typer.Argument(
        help="The snapshot, e.g. registry.example.com/me/box:v2-diverged-20260101T120000Z")],
    dest: Annotated[str, typer.Argument(help="The tag to put on it, in the same repository, e.g. v2")],
    force: Annotated[bool, typer.Option(
        "--force", help="Move DEST where it names another snapshot already.")] = False,
    registry: RegistryOptions = RegistryOptions(),
):
    """Put a tag on the snapshot SOURCE names (the manifest as it is, nothing else pushed): adopt a
    diverged tag onto the moving one. The line says what DEST named before and how to put it back."""
    from snapshotter.commit.history import retag

    transport = registry.transport()
    dst, digest, before = retag(source, dest, transport, force)
    back = (f" (it named {before}: `snap tag {dst.name}@{before} {dst.tag} --force` puts it back)"
            if before not in (None, digest) else "")
    out(f"{dst} names {digest}{back}")


def list_profiles():
    """List the layer profiles shipped in layers/."""
    from snapshotter.profile import available_profiles, load_profile

    for name in available_profiles():
        out(f"{name}: layers {', '.join(load_profile(name).layer_names)}")


def login(
    registry: Registry,
    username: Annotated[Optional[str], typer.Option(
        "--username", "-u", help="Registry user (default: $SNAP_USERNAME, else asked for on the terminal).")] = None,
    password_stdin: Annotated[bool, typer.Option(
        "--password-stdin", help="Read the password (or token) from standard input (default: $SNAP_PASSWORD, else "
        "asked for on the terminal, not echoed).")] = False,
    plain_http: PlainHttp = False, ca_cert: CaCert = None, insecure_tls: InsecureTls = False,
):
    """Log in to a registry without Docker, as `docker login` does.

    The credentials are checked with the registry (its token service for a token registry), then kept
    in Docker's config ($DOCKER_CONFIG/config.json or ~/.docker/config.json, 0600), or by the credential
    helper it names for the registry (credHelpers, credsStore), where later snap commands, docker, oras
    and crane find them. Nothing is saved if the registry refuses them (exit 4) or cannot be reached
    (exit 3). Every command takes its credentials from --username with --password-stdin first, then
    SNAP_USERNAME with SNAP_PASSWORD, then what `snap login` (or `docker login`) kept."""
    from snapshotter.oci.reference import parse_registry
    from snapshotter.registry.login import login as do_login
    from snapshotter.registry.login import login_credentials

    host = parse_registry(registry)  # a bad name is said before any password is asked for
    username, password = login_credentials(username, password_stdin)
    where = do_login(registry, username, password, reach(plain_http, ca_cert, insecure_tls))
    out(f"logged in to {host}: credentials kept in {where}")  # the host, not what was typed (a path, ESC)


def logout(registry: Registry):
    """Forget a registry's credentials (as `docker logout`): its entry in Docker's config, or the credential helper's."""  # noqa: E501 (help)
    from snapshotter.oci.reference import parse_registry
    from snapshotter.registry.login import logout as do_logout

    host = parse_registry(registry)  # said as the host it names, not as typed (a path, ESC)
    out(f"logged out of {host}" if do_logout(registry) else f"not logged in to {host}")
