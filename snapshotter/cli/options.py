"""The options several commands share, defined once (as pip's cmdoptions): each is an Annotated type,
so a command's signature names it in one short line, and its flag and help are the same everywhere."""

from __future__ import annotations

import functools
import inspect
from typing import Annotated, Optional

import typer

from snapshotter.registry.options import RegistryOptions

# How to reach the registry and who we are to it: with_registry gathers them into RegistryOptions.
PlainHttp = Annotated[bool, typer.Option(
    "--plain-http", help="Talk to the registry over http (no TLS). Loopback registries try http first, then https.")]
CaCert = Annotated[Optional[str], typer.Option(
    "--ca-cert", help="CA bundle (PEM) to verify the registry's TLS certificate.")]
InsecureTls = Annotated[bool, typer.Option("--insecure-tls", help="Do not verify the registry's TLS certificate.")]
Username = Annotated[Optional[str], typer.Option(
    "--username", "-u", help="Registry user. Credentials come from --username with --password-stdin (or "
    "$SNAP_PASSWORD), else $SNAP_USERNAME with $SNAP_PASSWORD, else Docker's config as `snap login` or "
    "`docker login` wrote it ($DOCKER_CONFIG/config.json or ~/.docker/config.json, its credential helpers run).")]
PasswordStdin = Annotated[bool, typer.Option(
    "--password-stdin", help="Read the registry password from standard input.")]

JsonOut = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Jobs = Annotated[Optional[int], typer.Option(
    "--jobs", "-j", min=1, help="How much runs at once: layers packed (commit, watch: in worker processes when "
    "there is enough to compress), layers applied (restore), files hashed (verify). Default: $SNAP_JOBS, else one "
    "per core; 1: all in this process.")]

PushForce = Annotated[bool, typer.Option(
    "--force", help="Push even what snap refuses: a snapshot that deletes the base's system directories (bin, etc, "
    "usr, ...) or most of its paths (a wrong --root does), or moves a tag that names a snapshot this box neither "
    "came from (a finished `snap restore` into this root) nor made.")]


_REGISTRY_FLAGS = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=kind)
                   for name, kind, default in (("plain_http", PlainHttp, False), ("ca_cert", CaCert, None),
                                               ("insecure_tls", InsecureTls, False), ("username", Username, None),
                                               ("password_stdin", PasswordStdin, False))]


def with_registry(command):
    """`command`, which takes `registry: RegistryOptions`, as typer sees it: with the five registry
    options in its place (before --json, where the help lists them), gathered into one object."""
    shown = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "registry"]
    at = next((i for i, p in enumerate(shown) if p.name == "as_json"), len(shown))
    shown[at:at] = _REGISTRY_FLAGS

    @functools.wraps(command)
    def gathered(*args, plain_http, ca_cert, insecure_tls, username, password_stdin, **kwargs):
        registry = RegistryOptions(plain_http, ca_cert, insecure_tls, username, password_stdin)
        return command(*args, registry=registry, **kwargs)

    gathered.__signature__ = inspect.Signature(shown)
    gathered.__annotations__ = {p.name: p.annotation for p in shown}
    return gathered
