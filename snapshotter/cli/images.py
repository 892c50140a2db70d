"""The commands that bring a snapshot back: restore (extract mode), run (into Docker), verify."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from snapshotter.errors import UsageError, VerifyFailed
from snapshotter.registry.options import RegistryOptions

from . import output
from .options import (DecryptionKey, DecryptionKeyPasswordFile, Jobs, JsonOut, PasswordStdin, Ref, RestoreForce,
                      RestoreProfile, Then, Username, Wait, with_registry)
from .output import say


@with_registry
def restore(
    ref: Annotated[Optional[str], typer.Argument(
        help="The snapshot image, e.g. registry.example.com/me/box:v2 (not with --wait).")] = None,
    root: Annotated[Optional[str], typer.Option(
        "--root", help="Directory to restore into (use / on a fresh VM). With --wait: the root of the restore to "
        "wait for (default /).")] = None,
    then: Then = None,
    wait: Wait = None,
    timeout: Annotated[Optional[float], typer.Option(
        "--timeout", help="With --wait: give up after this many seconds (default: wait as long as the restore "
        "runs).")] = None,
    only_snapshot: Annotated[bool, typer.Option(
        "--only-snapshot", help="Apply only snap's layers (the base is already on disk).")] = False,
    allow_devices: Annotated[bool, typer.Option(
        "--allow-devices", help="Create device nodes (as root) and FIFOs from the layers.")] = False,
    allow_setuid: Annotated[bool, typer.Option(
        "--allow-setuid", help="Keep setuid/setgid bits (root only); stripped otherwise.")] = False,
    fsync: Annotated[bool, typer.Option(
        "--fsync", help="fsync every file before renaming it into place (survives power loss; slower).")] = False,
    force: RestoreForce = False,
    profile: RestoreProfile = None,
    jobs: Jobs = None, decryption_key: DecryptionKey = None, password_file: DecryptionKeyPasswordFile = None,
    as_json: JsonOut = False, registry: RegistryOptions = RegistryOptions(),
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
    if timeout is not None:
        raise UsageError("--timeout goes with --wait", "run `snap restore --wait PATH --timeout SECONDS`")
    if then is not None and not then.strip():
        raise UsageError("--then needs a command", "e.g. --then 'python main.py --listen'")
    opts = RestoreOptions(
        only_snapshot=only_snapshot, force=force, profile=profile, jobs=resolve_jobs(jobs),
        on_app_ready=(lambda: _started(start_then(then), then)) if then is not None else None,
        extract=ExtractOptions(allow_devices=allow_devices, allow_setuid=allow_setuid, fsync=fsync),
        transport=registry.transport(), log=say, decryption_keys=_decryption_keys(decryption_key, password_file),
    )
    result = restore_image(ref, root, opts)
    output.restored(result, root, as_json)


def _decryption_keys(paths: Optional[List[str]], password_file: Optional[str]):
    from snapshotter.snapshot.decryption import load_decryption_keys

    return load_decryption_keys(paths, say, password_file)


def _started(app_process, command: str) -> None:
    say(f"started {command!r} (pid {app_process.pid}) while the weights still arrive")


def run_image(
    ref: Ref,
    command: Annotated[Optional[List[str]], typer.Argument(
        help="After --: a command to run instead of the image's (its entrypoint is kept).")] = None,
    no_gpu: Annotated[bool, typer.Option(
        "--no-gpu", help="Give the container no GPUs (default: all of them when the host has NVIDIA GPUs).")] = False,
    publish: Annotated[Optional[List[str]], typer.Option(
        "--publish", "-p", help="Publish a port: [IP:]HOST:CONTAINER, e.g. 8188:8188. Repeatable.")] = None,
    volume: Annotated[Optional[List[str]], typer.Option(
        "--volume", "-v", help="Bind mount: HOST:CONTAINER[:ro]. Repeatable.")] = None,
    env: Annotated[Optional[List[str]], typer.Option(
        "--env", "-e", help="Set a variable: KEY=VALUE (or KEY, from snap's environment). Repeatable.")] = None,
    name: Annotated[Optional[str], typer.Option("--name", help="Name the container.")] = None,
    detach: Annotated[bool, typer.Option(
        "--detach", "-d", help="Start it in the background and print its id.")] = False,
    username: Username = None, password_stdin: PasswordStdin = False,
):
    """Run mode: pull the snapshot into the Docker engine (DOCKER_HOST) and start it with the image's own
    entrypoint, command, env and workdir. Exits with the container's exit code.
    `snap run REF -- CMD ARGS...` replaces the command. No engine? Use `snap restore` (extract mode)."""
    from snapshotter.engine.run import run as do_run
    from snapshotter.origin.snapshots import run_mounts

    transport = RegistryOptions(username=username, password_stdin=password_stdin).transport()
    # SIGTERM (app.command) stops the attached container as Ctrl-C does, instead of leaving it running
    result = do_run(ref, command, gpus="none" if no_gpu else "auto", ports=publish or [], volumes=volume or [],
                    env=env or [], name=name, detach=detach, transport=transport, log=say,
                    # weights from the origin of the image snap read, fetched here, mounted read-only
                    mounts_of=lambda image, elsewhere: run_mounts(image, transport, say, elsewhere))
    if detach:
        output.out(result.container_id)
        return
    raise typer.Exit(result.exit_code or 0)


@with_registry
def verify(
    ref: Ref,
    root: Annotated[str, typer.Option(
        "--root", help="Directory to compare with the image (use / on a restored VM).")],
    only_snapshot: Annotated[bool, typer.Option(
        "--only-snapshot", help="Compare only the paths of snap's layers (the base came from elsewhere).")] = False,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Also report files the image does not have (outside the profile's exclude list).")] = False,
    allow_devices: Annotated[bool, typer.Option(
        "--allow-devices", help="Expect device nodes and FIFOs (restored with --allow-devices).")] = False,
    allow_setuid: Annotated[bool, typer.Option(
        "--allow-setuid", help="Expect setuid/setgid bits (restored with --allow-setuid).")] = False,
    profile: Annotated[str, typer.Option(
        "--profile", help="Profile whose exclude list is not compared.")] = "default",
    read_layers: Annotated[bool, typer.Option(
        "--read-layers", help="Download every layer and check it, even one the directory holds whole "
                              "(checks the registry's copy too; slower).")] = False,
    jobs: Jobs = None, decryption_key: DecryptionKey = None, password_file: DecryptionKeyPasswordFile = None,
    as_json: JsonOut = False, registry: RegistryOptions = RegistryOptions(),
):
    """Compare a directory with the image, file by file: one line per path that differs (type, content,
    mode, owner, symlink target; missing; present though deleted). Exit 0 when equal, 9 when not.
    Paths the commit left out as secrets are listed as "left out (secret)": not compared, exit still 0.
    A snapshot layer the directory holds whole (its headers and the directory's bytes hash to the
    layer's digest) is not downloaded; --read-layers downloads it all the same."""
    from snapshotter.profile import load_profile
    from snapshotter.jobs import resolve_jobs
    from snapshotter.restore.verify import VerifyOptions
    from snapshotter.restore.verify import verify as do_verify

    opts = VerifyOptions(
        only_snapshot=only_snapshot, strict=strict, allow_setuid=allow_setuid, allow_devices=allow_devices,
        profile=load_profile(profile), transport=registry.transport(), log=say, jobs=resolve_jobs(jobs),
        decryption_keys=_decryption_keys(decryption_key, password_file), read_layers=read_layers,
    )
    result = do_verify(ref, root, opts)
    output.verified(result, root, as_json)
    if not result.ok:
        raise VerifyFailed(f"{len(result.differences)} path(s) in {root!r} differ from {result.ref}",
                           "restore again to put them back")
