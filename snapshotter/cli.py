"""The `snap` command: a thin typer shell over the library (commit, restore, verify, run, watch,
log, status, tag, login, logout)."""

from __future__ import annotations

import contextlib
import functools
import getpass
import json
import os
import signal
import sys
from dataclasses import asdict
from typing import List, Optional

import typer

try:
    from typer import _click as click  # typer 0.2x vendors click; before, it depends on it
except ImportError:  # pragma: no cover
    import click

from snapshotter.registry.credentials import Credentials
from snapshotter.registry.transport import TransportOptions

from . import progress
from .errors import INTERRUPTED, SnapError, StorageError, UsageError, exit_code_of, exit_codes, printable
from .version import __version__

app = typer.Typer(
    help="snap: capture a rented GPU box as an OCI image in any registry, and get it back anywhere.\n\n"
    "Exit codes: " + ", ".join(f"{code} {meaning}" for code, meaning in exit_codes()) + ".\n\n"
    "Registry credentials: --username with --password-stdin, else SNAP_USERNAME with SNAP_PASSWORD, else Docker's "
    "config as `snap login REGISTRY` (or `docker login`) wrote it, its credential helpers included.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(asked: bool) -> None:
    if asked:
        _out(f"snap {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print snap's version and exit.")) -> None:
    pass  # options for snap itself, before the command


# typer's own exits; newer typers vendor click and no longer export click's exception classes.
_TYPER_WAYS_OUT = tuple({typer.Exit, typer.Abort, getattr(typer, "TyperException", typer.Exit)})


def _say(msg: str) -> None:
    """One line on stderr. Messages carry what registries, images, a box's file names and the engine
    said: control characters are escaped here, so none can forge a line or drive the terminal."""
    typer.echo(printable(msg), err=True)


def _out(msg: str) -> None:
    """One line on stdout, escaped as _say's."""
    _stdout(printable(msg))


def _stdout(text: str) -> None:
    """`text` and a newline on stdout (JSON as json.dumps escaped it). Once stdout's reader has gone
    (`snap log | head -1`) the rest is dropped, quietly: the command ends as it would have, with
    its own exit code (verify's 9 stays 9)."""
    try:
        typer.echo(text)
    except BrokenPipeError:
        # stdout's fd now points at /dev/null: what its buffer still holds goes there, at exit too,
        # instead of raising again ("Exception ignored ... BrokenPipeError").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, stopped as Ctrl-C is: transfers in flight given up, the journal left as it was; exit 143."""

    terminated = True  # errors.exit_code_of: 143, not 130


@contextlib.contextmanager
def _sigterm_stops():
    """Within the block SIGTERM stops the command the way Ctrl-C does, instead of killing it outright."""

    def stop(signum, frame):
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _errors(fn):
    """Turn a SnapError into one line on stderr and its exit code; never a traceback for bad input."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            progress.check_settings()
            return fn(*args, **kwargs)
        except SnapError as e:
            _say(f"snap: error: {e}")
            raise typer.Exit(e.exit_code)
        except KeyboardInterrupt as e:
            how, code = "terminated" if isinstance(e, _Terminated) else "interrupted", exit_code_of(e)
            _say(f"snap: {how} (run the command again: a commit re-sends only what is missing, a restore resumes)")
            raise typer.Exit(code)
        except _TYPER_WAYS_OUT:
            raise  # typer's own ways out (an exit code chosen by the command, a usage error)
        except OSError as e:  # the local machine failed us somewhere no closer handler knew
            if os.environ.get("SNAP_DEBUG"):
                raise
            where = "".join(f": {os.fsdecode(name)!r}" for name in (e.filename, e.filename2)
                            if isinstance(name, (str, bytes)))
            _say(f"snap: error: local I/O failed{where}: {e.strerror or e} "
                 "(check the disk, the path and its permissions)")
            raise typer.Exit(StorageError.exit_code)
        except Exception as e:  # a bug: still one line, the traceback on demand
            if os.environ.get("SNAP_DEBUG"):
                raise
            _say(f"snap: internal error: {type(e).__name__}: {e} (run again with SNAP_DEBUG=1 for the traceback)")
            raise typer.Exit(1)

    return wrapper


# The credential variables snap reads: taken out of its environment (_secret_env), so that no
# process it starts (`restore --then`'s app, a credential helper) inherits them.
SECRET_ENV = ("SNAP_USERNAME", "SNAP_PASSWORD")
_secrets: dict[str, str] = {}


def _secret_env() -> dict[str, str]:
    """SECRET_ENV's values, removed from os.environ (and so from every child's environment) the
    first time they are seen."""
    for name in SECRET_ENV:
        if name in os.environ:
            _secrets[name] = os.environ.pop(name)
    return _secrets


def _transport(plain_http: bool, ca_cert: Optional[str], insecure: bool, username: Optional[str],
               password_stdin: bool) -> TransportOptions:
    """How to reach the registry, with the credentials given: flags, else SNAP_USERNAME and
    SNAP_PASSWORD; none, and the transport reads Docker's config."""
    password = None
    secrets = _secret_env()
    if password_stdin:
        password = _password_from_stdin(username)
    elif username is not None:
        password = secrets.get("SNAP_PASSWORD")
        if password is None:
            raise UsageError("--username needs a password", "pipe it to --password-stdin, or set SNAP_PASSWORD")
    else:
        username, password = _env_credentials(secrets)
    return _reach(plain_http, ca_cert, insecure, Credentials(username, password))


def _reach(plain_http: bool, ca_cert: Optional[str], insecure: bool, credentials: Credentials) -> TransportOptions:
    if ca_cert and not os.path.isfile(ca_cert):
        raise UsageError(f"CA certificate {ca_cert} does not exist")
    return TransportOptions(
        plain_http=True if plain_http else None,
        ca_bundle=ca_cert,
        tls_verify=not insecure,
        credentials=credentials,
    )


def _password_from_stdin(username: Optional[str]) -> str:
    """--password-stdin's password: the first line of standard input."""
    if username is None:
        raise UsageError("--password-stdin needs --username")
    return sys.stdin.readline().rstrip("\r\n")


def _env_credentials(secrets: dict[str, str]) -> tuple:
    """SNAP_USERNAME and SNAP_PASSWORD, both or neither: where a provider puts its secrets (a box it
    starts has no `docker login`). An empty variable counts as unset (a template's blank secret)."""
    username, password = secrets.get("SNAP_USERNAME") or None, secrets.get("SNAP_PASSWORD") or None
    if (username is None) != (password is None):
        given, missing = ("SNAP_USERNAME", "SNAP_PASSWORD") if username is not None else ("SNAP_PASSWORD", "SNAP_USERNAME")
        raise UsageError(f"{given} is set but {missing} is not", "set both, or neither to use Docker's config")
    return username, password


# Options shared by the commands that talk to a registry.
PlainHttp = typer.Option(False, "--plain-http", help="Talk to the registry over http (no TLS). Loopback registries try http first, then https.")
CaCert = typer.Option(None, "--ca-cert", help="CA bundle (PEM) to verify the registry's TLS certificate.")
Insecure = typer.Option(False, "--insecure-tls", help="Do not verify the registry's TLS certificate.")
Username = typer.Option(None, "--username", "-u", help="Registry user. Credentials come from --username with "
                        "--password-stdin (or $SNAP_PASSWORD), else $SNAP_USERNAME with $SNAP_PASSWORD, else Docker's "
                        "config as `snap login` or `docker login` wrote it ($DOCKER_CONFIG/config.json or "
                        "~/.docker/config.json, its credential helpers run).")
PasswordStdin = typer.Option(False, "--password-stdin", help="Read the registry password from standard input.")
JsonOut = typer.Option(False, "--json", help="Print the result as JSON on stdout.")
Jobs = typer.Option(None, "--jobs", "-j", min=1, help="How much runs at once: layers packed (commit, watch: in "
                    "worker processes when there is enough to compress), layers applied (restore), files hashed "
                    "(verify). Default: $SNAP_JOBS, else one per core; 1: all in this process.")
PushForce = typer.Option(False, "--force", help="Push even what snap refuses: a snapshot that deletes the base's "
                         "system directories (bin, etc, usr, ...) or most of its paths (a wrong --root does), or "
                         "moves a tag that names a snapshot this box neither came from (a finished `snap restore` "
                         "into this root) nor made.")
Diverge = typer.Option(False, "--diverge", help="Where TARGET's tag names a snapshot this box neither came from nor "
                       "made, push to a tag of the box's own instead of refusing: TAG-diverged-<UTC time> (its own "
                       "from before, if it made one), which `snap log` and `snap status` list. For a cron line on a "
                       "box whose restore may fail.")


_fmt_size = progress.human_size


@app.command()
@_errors
def commit(
    target: str = typer.Argument(..., help="Where to push the snapshot, e.g. registry.example.com/me/box:v2"),
    base: Optional[str] = typer.Option(None, "--base", "-b", help="The image the box was started from (read from the registry; no Docker needed). Required unless --from-container. `scratch` for a box with no base image (a VM): the snapshot holds the --include paths, or the whole root, and no base layer."),
    include: Optional[List[str]] = typer.Option(None, "--include", help="With --base scratch: capture only this path of the box (with its parent directories), e.g. /home/ubuntu/ComfyUI. Repeatable; adds to the profile's `include` list."),
    root: str = typer.Option("/", "--root", help="Root of the box to capture."),
    from_container: Optional[str] = typer.Option(None, "--from-container", help="Capture a Docker container's changes (the engine's diff) instead of --root; --base defaults to its image."),
    profile: str = typer.Option("default", "--profile", help="Layer profile: a name from layers/ (default, comfyui, vllm) or a YAML file."),
    compression: Optional[str] = typer.Option(None, "--compression", help="zstd (default) or gzip for engines that cannot pull zstd (Docker < 23). Weights stay uncompressed."),
    rehash: bool = typer.Option(False, "--rehash", help="Read every changed-looking file: compare contents with the base, ignore the stat cache."),
    max_layer_size: str = typer.Option("9.5GB", "--max-layer-size", help="Cut files bigger than this into part layers (registries reject layers over 10 GB); snap restore joins them."),
    jobs: Optional[int] = Jobs,
    force: bool = PushForce,
    diverge: bool = Diverge,
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin, as_json: bool = JsonOut,
):
    """Capture the box: diff it against its base image, split the diff into layers, push the image.
    The tag moves only from a snapshot this box came from (a finished `snap restore` here) or made;
    else the commit is refused (exit 2), or goes to TAG-diverged-<UTC time> with --diverge."""
    from snapshotter.box.profile import include_path, load_profile, parse_size
    from snapshotter.commit.commit import commit_box
    from snapshotter.commit.model import CommitOptions
    from snapshotter.commit.push import grown_line

    prof = load_profile(profile)
    prof.include += tuple(include_path(p) for p in include or ())
    opts = CommitOptions(
        root=root, profile=prof, compression=compression, rehash=rehash,
        max_layer_size=parse_size(max_layer_size), force=force, jobs=jobs, diverge=diverge,
        transport=_transport(plain_http, ca_cert, insecure_tls, username, password_stdin), log=_say,
    )
    if from_container:
        from snapshotter.commit.container import commit_from_container
        result = commit_from_container(from_container, target, base, opts)
    elif base is None:
        raise UsageError("--base is required", "name the image the box was started from, e.g. --base registry.example.com/me/base:1")
    else:
        with _sigterm_stops():
            result = commit_box(target, base, opts)
    if result.skipped_secrets:
        _say(f"left out {len(result.skipped_secrets)} secret-looking path(s) (set include_secrets in the profile to keep them):")
        for p in result.skipped_secrets:
            _say(f"  {'/' + p!r}")
    if result.unreadable:
        _say(f"left out {len(result.unreadable)} path(s) snap may not read (run snap as root, or exclude them in the "
             "profile): " + ", ".join(repr("/" + p) for p in result.unreadable[:20])
             + (f" and {len(result.unreadable) - 20} more" if len(result.unreadable) > 20 else ""))
    if result.host_files:
        _say(f"left out {len(result.host_files)} file(s) bind-mounted from the host (GPU driver files and links to them; "
             "the next host's runtime mounts its own): " + ", ".join(repr("/" + p) for p in result.host_files))
    for path, why in sorted(result.held.items())[:20]:
        kept = "kept the last snapshot's version" if path in result.carried else "left out (the base's version, if any, stays)"
        _say(f"held back: {'/' + path!r} ({why}): never read half-written; {kept}; commit again once it is written")
    if len(result.held) > 20:
        _say(f"held back {len(result.held) - 20} more file(s) being written")
    for path, size in sorted(result.grown.items()):
        _say(grown_line(path, size))
    if as_json:
        doc = asdict(result)
        doc["ref"] = str(result.ref)
        _stdout(json.dumps(doc, indent=2))
        return
    _say(f"base: {result.base_layers} layer(s); deleted paths: {result.deleted}")
    for layer in result.layers:
        kind = layer.media_type.rsplit(".", 1)[-1]
        _out(f"{layer.name}: {layer.status}  [{_fmt_size(layer.size)}, {kind}, {layer.entries} entries, {layer.digest[:19]}]")
    if not result.layers:
        _out("no changes against the base: the snapshot is the base image")
    _out(result.sent())
    _out(f"pushed {result.ref}")


@app.command()
@_errors
def restore(
    ref: Optional[str] = typer.Argument(None, help="The snapshot image, e.g. registry.example.com/me/box:v2 "
                                        "(not with --wait)."),
    root: Optional[str] = typer.Option(None, "--root", help="Directory to restore into (use / on a fresh VM). "
                                       "With --wait: the root of the restore to wait for (default /)."),
    then: Optional[str] = typer.Option(None, "--then", help="Start this command (by the shell, in the background, "
                                       "with snap's stdout and stderr) as soon as every layer but the weights is "
                                       "applied, while the weights still arrive. It keeps running when the restore "
                                       "ends, whatever the restore's exit code, which is its own (a Ctrl-C in the "
                                       "terminal reaches both)."),
    wait: Optional[str] = typer.Option(None, "--wait", help="Instead of restoring: block until the restore into "
                                       "--root has landed this file (a path on this machine). Exit 0 once it is "
                                       "there; 2 if no restore is running, 5 if the image lacks it, 11 on --timeout."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="With --wait: give up after this many seconds "
                                            "(default: wait as long as the restore runs)."),
    only_snapshot: bool = typer.Option(False, "--only-snapshot", help="Apply only snap's layers (the base is already on disk)."),
    allow_devices: bool = typer.Option(False, "--allow-devices", help="Create device nodes (as root) and FIFOs from the layers."),
    allow_setuid: bool = typer.Option(False, "--allow-setuid", help="Keep setuid/setgid bits (root only); stripped otherwise."),
    fsync: bool = typer.Option(False, "--fsync", help="fsync every file before renaming it into place (survives power loss; slower)."),
    force: bool = typer.Option(False, "--force", help="Apply a full image (base layers too), or a snapshot that deletes "
                               "the system (its top-level directories, most of the base's paths), even onto a root that "
                               "already holds an operating system (an etc/os-release, a populated usr/): refused otherwise."),
    profile: Optional[str] = typer.Option(None, "--profile", help="Profile (name or YAML file) whose `exclude` paths "
                                          "(/etc/hostname, /etc/resolv.conf, /proc, ...) are never written. "
                                          "Default: the one the snapshot was committed with, if snap ships it, else default."),
    jobs: Optional[int] = Jobs,
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin, as_json: bool = JsonOut,
):
    """Extract mode: pull the image's layers, verify every digest, and write them at their original paths.
    Needs no Docker. An interrupted restore leaves no half-written file and resumes when run again.
    The profile's excluded paths are never written; a full image onto a live system is refused.
    Weights are applied last: --then starts the app before they land, --wait PATH waits for one."""
    from snapshotter.jobs import resolve_jobs
    from snapshotter.layer.extract_model import ExtractOptions
    from snapshotter.restore.landing import start_then, wait_landed
    from snapshotter.restore.restore import RestoreOptions, restore_image

    if wait is not None:
        if ref is not None or then is not None:
            raise UsageError("--wait takes no image and no --then", "run `snap restore --wait PATH [--root ROOT]`")
        wait_landed(wait, root or "/", timeout)
        return
    if ref is None or root is None:
        raise UsageError("snap restore needs an image and --root", "run `snap restore REF --root DIR`")
    opts = RestoreOptions(
        only_snapshot=only_snapshot, force=force, profile=profile, jobs=resolve_jobs(jobs),
        on_app_ready=(lambda: _started(start_then(then), then)) if then is not None else None,
        extract=ExtractOptions(allow_devices=allow_devices, allow_setuid=allow_setuid, fsync=fsync),
        transport=_transport(plain_http, ca_cert, insecure_tls, username, password_stdin), log=_say,
    )
    with _sigterm_stops():
        result = restore_image(ref, root, opts)
    if result.skipped_devices_count:
        _say(f"skipped {result.skipped_devices_count} device node(s) and FIFO(s) (pass --allow-devices, as root for "
             "device nodes, to create them)")
    if result.stripped_setuid_count:
        _say(f"stripped setuid/setgid from {result.stripped_setuid_count} file(s) (pass --allow-setuid as root to keep them)")
    if as_json:
        doc = asdict(result)
        doc["ref"] = str(result.ref)
        _stdout(json.dumps(doc, indent=2))
        return
    _out(f"restored {result.ref} into {root}: {len(result.applied)} layer(s) applied"
               f"{f', {result.resumed} already applied' if result.resumed else ''}"
               f"{f', {result.skipped_layers} already there (not downloaded)' if result.skipped_layers else ''}, "
               f"{result.files} files, {_fmt_size(result.bytes)}")
    if result.seeded_layers:
        _say(f"stat cache: the next commit of {root} will not re-read the {result.seeded_layers} snap layer(s) "
             "left unchanged")


def _started(app_process, command: str) -> None:
    _say(f"started {command!r} (pid {app_process.pid}) while the weights still arrive")


@app.command("run")
@_errors
def run_image(
    ref: str = typer.Argument(..., help="The snapshot image, e.g. registry.example.com/me/box:v2"),
    command: Optional[List[str]] = typer.Argument(None, help="After --: a command to run instead of the image's (its entrypoint is kept)."),
    no_gpu: bool = typer.Option(False, "--no-gpu", help="Give the container no GPUs (default: all of them when the host has NVIDIA GPUs)."),
    publish: Optional[List[str]] = typer.Option(None, "--publish", "-p", help="Publish a port: [IP:]HOST:CONTAINER, e.g. 8188:8188. Repeatable."),
    volume: Optional[List[str]] = typer.Option(None, "--volume", "-v", help="Bind mount: HOST:CONTAINER[:ro]. Repeatable."),
    env: Optional[List[str]] = typer.Option(None, "--env", "-e", help="Set a variable: KEY=VALUE (or KEY, from snap's environment). Repeatable."),
    name: Optional[str] = typer.Option(None, "--name", help="Name the container."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Start it in the background and print its id."),
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin,
):
    """Run mode: pull the snapshot into the Docker engine (DOCKER_HOST) and start it with the image's own
    entrypoint, command, env and workdir. Exits with the container's exit code.
    `snap run REF -- CMD ARGS...` replaces the command. No engine? Use `snap restore` (extract mode)."""
    from snapshotter.engine.run import run as do_run

    transport = _transport(False, None, False, username, password_stdin)
    result = do_run(ref, command, gpus="none" if no_gpu else "auto", ports=publish or [], volumes=volume or [],
                    env=env or [], name=name, detach=detach, transport=transport, log=_say)
    if detach:
        _out(result.container_id)
        return
    raise typer.Exit(result.exit_code or 0)


@app.command()
@_errors
def verify(
    ref: str = typer.Argument(..., help="The snapshot image, e.g. registry.example.com/me/box:v2"),
    root: str = typer.Option(..., "--root", help="Directory to compare with the image (use / on a restored VM)."),
    only_snapshot: bool = typer.Option(False, "--only-snapshot", help="Compare only the paths of snap's layers (the base came from elsewhere)."),
    strict: bool = typer.Option(False, "--strict", help="Also report files the image does not have (outside the profile's exclude list)."),
    allow_devices: bool = typer.Option(False, "--allow-devices", help="Expect device nodes and FIFOs (restored with --allow-devices)."),
    allow_setuid: bool = typer.Option(False, "--allow-setuid", help="Expect setuid/setgid bits (restored with --allow-setuid)."),
    profile: str = typer.Option("default", "--profile", help="Profile whose exclude list is not compared."),
    jobs: Optional[int] = Jobs,
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin, as_json: bool = JsonOut,
):
    """Compare a directory with the image, file by file: one line per path that differs (type, content,
    mode, owner, symlink target; missing; present though deleted). Exit 0 when equal, 9 when not.
    Paths the commit left out as secrets are listed as "left out (secret)": not compared, exit still 0."""
    from snapshotter.box.profile import load_profile
    from snapshotter.jobs import resolve_jobs
    from snapshotter.restore.verify import VerifyOptions
    from snapshotter.restore.verify import verify as do_verify

    from .errors import VerifyFailed

    opts = VerifyOptions(
        only_snapshot=only_snapshot, strict=strict, allow_setuid=allow_setuid, allow_devices=allow_devices,
        profile=load_profile(profile), transport=_transport(plain_http, ca_cert, insecure_tls, username, password_stdin),
        log=_say, jobs=resolve_jobs(jobs),
    )
    result = do_verify(ref, root, opts)
    if as_json:
        _stdout(json.dumps({"ref": str(result.ref), "manifest_digest": result.manifest_digest, "checked": result.checked,
                               "ok": result.ok, "differences": [asdict(d) for d in result.differences],
                               "left_out_secrets": result.left_out_secrets, "left_out_total": result.left_out_total},
                              indent=2))
    else:
        for d in result.differences:
            _out(str(d))
        for p in result.left_out_secrets:
            _out(f"left out (secret): {p!r}")
        if result.left_out_total > len(result.left_out_secrets):
            _out(f"left out (secret): {result.left_out_total - len(result.left_out_secrets)} more, "
                       "not listed in the image")
    if not result.ok:
        raise VerifyFailed(f"{len(result.differences)} path(s) in {root} differ from {result.ref}",
                           "restore again to put them back")
    if as_json:
        return
    if result.left_out_total:
        # Not a difference (no restore can bring them back: the image never held them), not a plain match either.
        _out(f"verified {result.ref}: {root} matches ({result.checked} paths), except {result.left_out_total} "
                   "path(s) the commit left out as secrets (not in the image)")
    else:
        _out(f"verified {result.ref}: {root} matches ({result.checked} paths)")


@app.command()
@_errors
def watch(
    target: Optional[str] = typer.Argument(None, help="The moving tag, e.g. registry.example.com/me/box:v2; each snapshot also gets TAG-yyyymmddThhmmssZ (UTC)."),
    base: Optional[str] = typer.Option(None, "--base", "-b", help="The image the box was started from (as for commit)."),
    root: str = typer.Option("/", "--root", help="Root of the box to watch."),
    every: str = typer.Option("5m", "--every", help="At most one snapshot per this interval (90s, 5m, 1h); a burst of writes is snapshotted as soon as it is over."),
    keep: Optional[int] = typer.Option(None, "--keep", help="Keep this many TAG-<time> snapshots, and this many TAG-diverged-<time> tags; older ones are deleted (where the registry allows deletes), never TAG."),
    grace: float = typer.Option(4.0, "--grace", help="Seconds the final snapshot may take after SIGTERM/SIGINT/SIGHUP or a reclaim notice (RunPod kills 5 s after SIGTERM)."),
    provider: str = typer.Option("auto", "--provider", help="Reclaim notices to poll: auto (the cloud the machine's DMI data names, else none), aws, gcp, azure or none."),
    metadata_url: Optional[str] = typer.Option(None, "--metadata-url", help="Base URL of the metadata service (default: the provider's; or SNAP_METADATA_URL)."),
    daemon: bool = typer.Option(False, "--daemon", help="Detach; pid file and log in the state dir. For containers without an init system."),
    stop: bool = typer.Option(False, "--stop", help="Stop the watcher of --root: SIGTERM, then wait for its final snapshot; exits with its code."),
    profile: str = typer.Option("default", "--profile", help="Layer profile (as for commit)."),
    include: Optional[List[str]] = typer.Option(None, "--include", help="With --base scratch: watch and capture only this path (as for commit). Repeatable."),
    compression: Optional[str] = typer.Option(None, "--compression", help="zstd (default) or gzip (as for commit)."),
    max_layer_size: str = typer.Option("9.5GB", "--max-layer-size", help="Cut files bigger than this into part layers (as for commit)."),
    jobs: Optional[int] = Jobs,
    force: bool = PushForce,
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin,
):
    """Keep the registry's snapshot of the box seconds old: commit when the box changed (big files go
    up as soon as they are complete), and one final snapshot on SIGTERM, SIGINT, SIGHUP or a provider's
    reclaim notice (AWS, GCP, Azure). The moving tag only ever names a complete snapshot. Where it
    names a snapshot this box neither came from nor made, it is not moved: the snapshots go to a
    tag of the box's own, TAG-diverged-<UTC time>, and each line says so.
    Exits 0 after the final snapshot; non-zero with one line if it could not finish within --grace."""
    from snapshotter.box.profile import include_path, load_profile, parse_size
    from snapshotter.commit.model import CommitOptions
    from snapshotter.watch import daemon as dmn
    from snapshotter.watch.notices import notice_watcher
    from snapshotter.watch.watcher import WatchOptions, exit_now, log_line, parse_duration
    from snapshotter.watch.watcher import watch as do_watch

    if stop:
        raise typer.Exit(dmn.stop(root, log=_say))
    if target is None or base is None:
        raise UsageError("watch needs TARGET and --base", "e.g. snap watch registry.example.com/me/box:v2 --base registry.example.com/me/base:1")
    prof = load_profile(profile)
    prof.include += tuple(include_path(p) for p in include or ())
    opts = WatchOptions(
        commit=CommitOptions(root=root, profile=prof, compression=compression,
                             max_layer_size=parse_size(max_layer_size), force=force, jobs=jobs,
                             transport=_transport(plain_http, ca_cert, insecure_tls, username, password_stdin)),
        every=parse_duration(every), keep=keep, grace=grace,
        notices=notice_watcher(provider, metadata_url), log=log_line,
    )
    progress.write_line = log_line  # its snapshots' progress lines in its log, with their time
    files = dmn.watch_files(root)
    lock = dmn.take_lock(files, root)
    ready = dmn.detach(files, keep=(lock,)) if daemon else (lambda: None)
    dmn.note_pid(files, lock, target, grace)
    notices = f"{opts.notices.provider} notices at {opts.notices.base_url}" if opts.notices else "no provider notices"

    def on_ready() -> None:
        log_line(f"watching {root!r} for {target} (pid {os.getpid()}, every {opts.every:g}s, grace {grace:g}s, {notices})")
        ready()

    try:
        code = do_watch(target, base, opts, on_ready)
    except SnapError as e:
        dmn.note_exit(files, e.exit_code, f"snap: error: {e}")
        raise
    dmn.note_exit(files, code)
    exit_now(code)


@app.command("log")
@_errors
def log_(
    target: str = typer.Argument(..., help="The repository (any tag of it), e.g. registry.example.com/me/box:v2"),
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin, as_json: bool = JsonOut,
):
    """List the snapshots of the repository, newest first: tags, UTC time, total size, base, and the
    layers new in each versus the one before (label and size); then the diverged tags of TARGET's tag
    (TAG-diverged-<time>: boxes that could not move it saved their work there)."""
    from snapshotter.commit.history import snapshot_log
    from snapshotter.oci.reference import Reference

    snaps = snapshot_log(target, _transport(plain_http, ca_cert, insecure_tls, username, password_stdin), log=_say)
    if as_json:
        _stdout(json.dumps([asdict(s) for s in snaps], indent=2))
        return
    for s in snaps:
        _out(f"{', '.join(s.tags)}  {_utc(s.created)}  {_fmt_size(s.size)}  {s.digest[:19]}  base {s.base}")
        for layer in s.new:
            _out(f"    new: {layer.label}  {_fmt_size(layer.size)}")
        if not s.new:
            _out("    no new layers")
    apart = sorted((tag, s) for s in snaps for tag in s.diverged)
    if apart:
        tag = Reference.parse(target).tag
        _out(f"diverged from {tag} (boxes that could not move it saved their work there; docs/watch.md: look, adopt):")
        for name, s in apart:
            _out(f"    {name}  {_utc(s.created)}  {s.digest}")


def _utc(created: str) -> str:
    return created.replace("T", " ").replace("Z", " UTC")


@app.command()
@_errors
def status(
    base: Optional[str] = typer.Option(None, "--base", "-b", help="The image the box was started from (default: the base of the last commit or watch of --root)."),
    root: str = typer.Option("/", "--root", help="Root of the box."),
    profile: str = typer.Option("default", "--profile", help="Layer profile (as for commit)."),
    compression: Optional[str] = typer.Option(None, "--compression", help="zstd (default) or gzip (as for commit)."),
    max_layer_size: str = typer.Option("9.5GB", "--max-layer-size", help="Part-layer cap (as for commit)."),
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin, as_json: bool = JsonOut,
):
    """What a commit would send now: the layers that changed since the last commit (with the size of
    their files) and those it would skip. Reads only file metadata; pushes nothing."""
    from snapshotter.box.profile import load_profile, parse_size
    from snapshotter.commit.history import box_status
    from snapshotter.commit.model import CommitOptions

    opts = CommitOptions(root=root, profile=load_profile(profile), compression=compression,
                         max_layer_size=parse_size(max_layer_size),
                         transport=_transport(plain_http, ca_cert, insecure_tls, username, password_stdin), log=_say)
    st = box_status(base, opts)
    if as_json:
        _stdout(json.dumps({**asdict(st), "to_send": st.to_send}, indent=2))
        return
    for layer in st.layers:
        what = "changed, would send" if layer.changed else "unchanged, skipped"
        _out(f"{layer.label}: {what}  [{_fmt_size(layer.size)}, {layer.entries} entries]")
    changed = sum(1 for layer in st.layers if layer.changed)
    _out(f"{changed} of {len(st.layers)} layer(s) changed against base {st.base}, "
               f"{_fmt_size(st.to_send)} of files to send; {st.deleted} deleted path(s)")
    if st.tags_error:
        _out(f"tag {st.tag}: not looked up ({st.tags_error})")
    elif st.tag:
        whose = ("this box may move it" if st.movable else
                 "a snapshot this box neither came from nor made: its snapshots go to a diverged tag")
        _out(f"tag {st.tag}: {st.tag_digest or 'no such tag yet'} ({whose})")
    for d in st.diverged:
        _out(f"diverged: {d.tag}  {_utc(d.created)}  {d.digest}" + ("  (this box's)" if d.own else ""))


@app.command("tag")
@_errors
def tag_(
    source: str = typer.Argument(..., help="The snapshot, e.g. registry.example.com/me/box:v2-diverged-20260101T120000Z"),
    dest: str = typer.Argument(..., help="The tag to put on it, in the same repository, e.g. v2"),
    force: bool = typer.Option(False, "--force", help="Move DEST where it names another snapshot already."),
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
    username: Optional[str] = Username, password_stdin: bool = PasswordStdin,
):
    """Put a tag on the snapshot SOURCE names (the manifest as it is, nothing else pushed): adopt a
    diverged tag onto the moving one. The line says what DEST named before and how to put it back."""
    from snapshotter.commit.history import retag

    dst, digest, before = retag(source, dest, _transport(plain_http, ca_cert, insecure_tls, username, password_stdin),
                                force)
    back = (f" (it named {before}: `snap tag {dst.name}@{before} {dst.tag} --force` puts it back)"
            if before not in (None, digest) else "")
    _out(f"{dst} names {digest}{back}")


@app.command("profiles")
@_errors
def list_profiles():
    """List the layer profiles shipped in layers/."""
    from snapshotter.box.profile import available_profiles, load_profile

    for name in available_profiles():
        p = load_profile(name)
        _out(f"{name}: layers {', '.join(p.layer_names)}")


@app.command()
@_errors
def login(
    registry: str = typer.Argument(..., help="The registry, e.g. ghcr.io, 127.0.0.1:5000 or docker.io"),
    username: Optional[str] = typer.Option(None, "--username", "-u", help="Registry user (default: $SNAP_USERNAME, "
                                           "else asked for on the terminal)."),
    password_stdin: bool = typer.Option(False, "--password-stdin", help="Read the password (or token) from standard "
                                        "input (default: $SNAP_PASSWORD, else asked for on the terminal, not echoed)."),
    plain_http: bool = PlainHttp, ca_cert: Optional[str] = CaCert, insecure_tls: bool = Insecure,
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

    parse_registry(registry)  # a bad name is said before any password is asked for
    username, password = _login_credentials(username, password_stdin)
    where = do_login(registry, username, password, _reach(plain_http, ca_cert, insecure_tls, Credentials()))
    _out(f"logged in to {registry}: credentials kept in {where}")


def _login_credentials(username: Optional[str], password_stdin: bool) -> tuple[str, str]:
    """Who logs in: flags, else SNAP_USERNAME and SNAP_PASSWORD, else asked for on the terminal."""
    secrets = _secret_env()
    if password_stdin:
        password = _password_from_stdin(username)
    elif username is None and (secrets.get("SNAP_USERNAME") or secrets.get("SNAP_PASSWORD")):
        username, password = _env_credentials(secrets)
    else:
        password = (secrets.get("SNAP_PASSWORD") or None) if username is not None else None
        if password is None:
            if not sys.stdin.isatty():
                raise UsageError("no password given and no terminal to ask for it",
                                 "pipe it to --password-stdin with --username, or set SNAP_USERNAME and SNAP_PASSWORD")
            if username is None:
                username = input("Username: ")
            password = getpass.getpass("Password: ")  # from the terminal, not echoed
    if not username or not password:
        raise UsageError("the username and the password must not be empty")
    return username, password


@app.command()
@_errors
def logout(registry: str = typer.Argument(..., help="The registry, e.g. ghcr.io, 127.0.0.1:5000 or docker.io")):
    """Forget a registry's credentials (as `docker logout`): its entry in Docker's config, or the credential helper's."""
    from snapshotter.registry.login import logout as do_logout

    if do_logout(registry):
        _out(f"logged out of {registry}")
    else:
        _out(f"not logged in to {registry}")


def main() -> None:
    _secret_env()  # before anything can start a process
    try:
        code = app(standalone_mode=False)
    except click.exceptions.ClickException as e:
        sys.exit(_usage_error(e))
    except typer.Abort:
        _say("snap: interrupted")
        sys.exit(INTERRUPTED)
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(e) -> int:
    """A command line click refuses (an unknown option, a missing argument, a bad value): one
    `snap: error:` line, as any other bad input, instead of click's usage panel. `snap` alone
    still shows the help."""
    if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):
        e.show()
        return e.exit_code
    ctx = getattr(e, "ctx", None)
    command = f"snap {ctx.info_name}" if ctx is not None and ctx.parent is not None else "snap"
    _say(f"snap: error: {e.format_message()} (see `{command} --help`)")
    return e.exit_code


if __name__ == "__main__":
    main()
