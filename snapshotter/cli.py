"""The `snap` command: a thin typer shell over the library (commit, restore, verify, run)."""

from __future__ import annotations

import functools
import json
import os
import sys
from dataclasses import asdict
from typing import List, Optional

import typer

from .errors import SnapError, UsageError
from .registry import Credentials, TransportOptions

app = typer.Typer(
    help="snap: capture a rented GPU box as an OCI image in any registry, and get it back anywhere.\n\n"
    "Exit codes: 0 ok, 1 unexpected, 2 bad input, 3 registry unreachable, 4 auth, 5 not found, "
    "6 integrity (digest mismatch or hostile layer), 7 local disk, 8 no Docker engine, 9 verify found "
    "differences, 10 registry error, 130 interrupted.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _say(msg: str) -> None:
    typer.echo(msg, err=True)


def _errors(fn):
    """Turn a SnapError into one line on stderr and its exit code; never a traceback for bad input."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SnapError as e:
            _say(f"snap: error: {e}")
            raise typer.Exit(e.exit_code)
        except KeyboardInterrupt:
            _say("snap: interrupted; nothing half-written was left at an original path (run it again to resume)")
            raise typer.Exit(130)

    return wrapper


def _transport(plain_http: bool, ca_cert: Optional[str], insecure: bool, username: Optional[str],
               password_stdin: bool) -> TransportOptions:
    password = None
    if password_stdin:
        if username is None:
            raise UsageError("--password-stdin needs --username")
        password = sys.stdin.readline().rstrip("\r\n")
    elif username is not None:
        password = os.environ.get("SNAP_PASSWORD")
        if password is None:
            raise UsageError("--username needs a password", "pipe it to --password-stdin, or set SNAP_PASSWORD")
    if ca_cert and not os.path.isfile(ca_cert):
        raise UsageError(f"CA certificate {ca_cert} does not exist")
    return TransportOptions(
        plain_http=True if plain_http else None,
        ca_bundle=ca_cert,
        tls_verify=not insecure,
        credentials=Credentials(username, password),
    )


# Options shared by the commands that talk to a registry.
PlainHttp = typer.Option(False, "--plain-http", help="Talk to the registry over http (no TLS). Loopback registries try https first, then http.")
CaCert = typer.Option(None, "--ca-cert", help="CA bundle (PEM) to verify the registry's TLS certificate.")
Insecure = typer.Option(False, "--insecure-tls", help="Do not verify the registry's TLS certificate.")
Username = typer.Option(None, "--username", "-u", help="Registry user (default: ~/.docker/config.json auths and credential helpers).")
PasswordStdin = typer.Option(False, "--password-stdin", help="Read the registry password from standard input.")
JsonOut = typer.Option(False, "--json", help="Print the result as JSON on stdout.")


def _fmt_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command()
@_errors
def commit(
    target: str = typer.Argument(..., help="Where to push the snapshot, e.g. registry.example.com/me/box:v2"),
    base: str = typer.Option(..., "--base", "-b", help="The image the box was started from (read from the registry; no Docker needed)."),
    root: str = typer.Option("/", "--root", help="Root of the box to capture."),
    profile: str = typer.Option("default", "--profile", "-p", help="Layer profile: a name from layers/ (default, comfyui, vllm) or a YAML file."),
    compression: Optional[str] = typer.Option(None, "--compression", help="zstd (default) or gzip for engines that cannot pull zstd (Docker < 23). Weights stay uncompressed."),
    rehash: bool = typer.Option(False, "--rehash", help="Read every changed-looking file: compare contents with the base, ignore the stat cache."),
    max_layer_size: str = typer.Option("9.5GB", "--max-layer-size", help="Cut files bigger than this into part layers (registries reject layers over 10 GB); snap restore joins them."),
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin, as_json: bool = JsonOut,
):
    """Capture the box: diff it against its base image, split the diff into layers, push the image."""
    from .commit import CommitOptions, commit as do_commit
    from .profile import load_profile, parse_size

    opts = CommitOptions(
        root=root, profile=load_profile(profile), compression=compression, rehash=rehash,
        max_layer_size=parse_size(max_layer_size),
        transport=_transport(plain_http, ca_cert, insecure_tls, username, password_stdin), log=_say,
    )
    result = do_commit(target, base, opts)
    if result.skipped_secrets:
        _say(f"left out {len(result.skipped_secrets)} secret-looking path(s) (set include_secrets in the profile to keep them):")
        for p in result.skipped_secrets:
            _say(f"  /{p}")
    if result.changed_while_read:
        _say(f"warning: {len(result.changed_while_read)} file(s) changed while being captured: " +
             ", ".join("/" + p for p in result.changed_while_read[:5]))
    if as_json:
        doc = asdict(result)
        doc["ref"] = str(result.ref)
        typer.echo(json.dumps(doc, indent=2))
        return
    _say(f"base: {result.base_layers} layer(s); deleted paths: {result.deleted}")
    for layer in result.layers:
        kind = layer.media_type.rsplit(".", 1)[-1]
        typer.echo(f"{layer.name}: {layer.status} ({_fmt_size(layer.size)}, {kind}, {layer.entries} entries, {layer.digest[:19]})")
    if not result.layers:
        typer.echo("no changes against the base: the snapshot is the base image")
    typer.echo(f"pushed {result.ref}")


@app.command()
@_errors
def restore(
    ref: str = typer.Argument(..., help="The snapshot image, e.g. registry.example.com/me/box:v2"),
    root: str = typer.Option(..., "--root", help="Directory to restore into (use / on a fresh VM)."),
    only_snapshot: bool = typer.Option(False, "--only-snapshot", help="Apply only snap's layers (the base is already on disk)."),
    allow_devices: bool = typer.Option(False, "--allow-devices", help="Create device nodes from the layers (root only)."),
    allow_setuid: bool = typer.Option(False, "--allow-setuid", help="Keep setuid/setgid bits (root only); stripped otherwise."),
    fsync: bool = typer.Option(False, "--fsync", help="fsync every file before renaming it into place (survives power loss; slower)."),
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin, as_json: bool = JsonOut,
):
    """Extract mode: pull the image's layers, verify every digest, and write them at their original paths.
    Needs no Docker. An interrupted restore leaves no half-written file and resumes when run again."""
    from .extract import ExtractOptions
    from .restore import RestoreOptions, restore as do_restore

    opts = RestoreOptions(
        only_snapshot=only_snapshot,
        extract=ExtractOptions(allow_devices=allow_devices, allow_setuid=allow_setuid, fsync=fsync),
        transport=_transport(plain_http, ca_cert, insecure_tls, username, password_stdin), log=_say,
    )
    result = do_restore(ref, root, opts)
    if result.skipped_devices:
        _say(f"skipped {len(result.skipped_devices)} device node(s) (pass --allow-devices as root to create them)")
    if result.stripped_setuid:
        _say(f"stripped setuid/setgid from {len(result.stripped_setuid)} file(s) (pass --allow-setuid as root to keep them)")
    if as_json:
        doc = asdict(result)
        doc["ref"] = str(result.ref)
        typer.echo(json.dumps(doc, indent=2))
        return
    typer.echo(f"restored {result.ref} into {root}: {len(result.applied)} layer(s) applied"
               f"{f', {result.resumed} already applied' if result.resumed else ''}, "
               f"{result.files} files, {_fmt_size(result.bytes)}")


@app.command("profiles")
@_errors
def list_profiles():
    """List the layer profiles shipped in layers/."""
    from .profile import available_profiles, load_profile

    for name in available_profiles():
        p = load_profile(name)
        typer.echo(f"{name}: layers {', '.join(p.layer_names)}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
