"""The commands that capture a box: commit, watch, status."""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from snapshotter.errors import UsageError
from snapshotter.registry.options import RegistryOptions

from . import output
from .options import (AS_FOR_COMMIT, Diverge, EncryptSecret, EncryptTo, Every, Grace, Include, Jobs, JsonOut, Keep,
                      MaxLayerSize, Provider, PushForce, UploadOrigin, WeightsFromOrigin, with_registry)
from .output import say


@with_registry
def commit(
    target: Annotated[str, typer.Argument(help="Where to push the snapshot, e.g. registry.example.com/me/box:v2")],
    base: Annotated[Optional[str], typer.Option(
        "--base", "-b", help="The image the box was started from (read from the registry; no Docker needed). "
        "Required unless --from-container. `scratch` for a box with no base image (a VM): the snapshot holds the "
        "--include paths, or the whole root, and no base layer.")] = None,
    include: Include = None,
    root: Annotated[str, typer.Option("--root", help="Root of the box to capture.")] = "/",
    from_container: Annotated[Optional[str], typer.Option(
        "--from-container", help="Capture a Docker container's changes (the engine's diff) instead of --root; "
        "--base defaults to its image.")] = None,
    profile: Annotated[str, typer.Option(
        "--profile", help="Layer profile: a name from layers/ (default, comfyui, vllm) or a YAML file.")] = "default",
    compression: Annotated[Optional[str], typer.Option(
        "--compression", help="zstd (default) or gzip for engines that cannot pull zstd (Docker < 23). Weights stay "
        "uncompressed.")] = None,
    rehash: Annotated[bool, typer.Option(
        "--rehash", help="Read every changed-looking file: compare contents with the base, ignore the stat "
        "cache, and look up every blob of the image in the registry (a lost one is sent again).")] = False,
    max_layer_size: MaxLayerSize = "9.5GB", jobs: Jobs = None, force: PushForce = False, diverge: Diverge = False,
    encrypt_to: EncryptTo = None, encrypt_secret: EncryptSecret = None,
    weights_from_origin: WeightsFromOrigin = False, upload_origin: UploadOrigin = False,
    as_json: JsonOut = False, registry: RegistryOptions = RegistryOptions(),
):
    """Capture the box: diff it against its base image, split the diff into layers, push the image.
    The tag moves only from a snapshot this box came from (a finished `snap restore` here) or made;
    else the commit is refused (exit 2), or goes to TAG-diverged-<UTC time> with --diverge."""
    from snapshotter.commit.commit import commit_box

    opts = _commit_options(root, profile, include, compression, max_layer_size, registry, rehash=rehash,
                           force=force, jobs=jobs, diverge=diverge, log=say,
                           encryption=_encryption(encrypt_to, encrypt_secret),
                           **_origin_options(weights_from_origin, upload_origin))
    if from_container:
        from snapshotter.commit.container import commit_from_container
        result = commit_from_container(from_container, target, base, opts)
    elif base is None:
        raise UsageError("--base is required",
                         "name the image the box was started from, e.g. --base registry.example.com/me/base:1")
    else:
        result = commit_box(target, base, opts)
    output.commit_left_out(result)
    if as_json:
        output.as_json(output.with_ref(result))
    else:
        output.commit_pushed(result)


def _commit_options(root: str, profile: str, include: Optional[List[str]], compression: Optional[str],
                    max_layer_size: str, registry: RegistryOptions, **more):
    """CommitOptions for the flags commit, watch and status share; `more` as CommitOptions takes it."""
    from snapshotter.profile import include_path, load_profile, parse_size
    from snapshotter.commit.model import CommitOptions

    from snapshotter.commit.weights import in_layers_note

    prof = load_profile(profile)
    prof.include += tuple(include_path(p) for p in include or ())
    opts = CommitOptions(root=root, profile=prof, compression=compression, max_layer_size=parse_size(max_layer_size),
                         transport=registry.transport(), **more)
    if note := in_layers_note(opts):
        say(note)
    return opts


def _encryption(encrypt_to: Optional[List[str]], encrypt_secret: Optional[str]):
    from snapshotter.snapshot.encryption import load_encryption

    return load_encryption(encrypt_to or [], encrypt_secret, say)


def _origin_options(weights_from_origin: bool, upload_origin: bool = False) -> dict:
    """CommitOptions' weights-from-origin fields: the flag or $SNAP_WEIGHTS_FROM_ORIGIN; --upload-origin
    recognises the same files, to hold them in the layers."""
    from snapshotter.origin.snapshots import wanted

    return {"weights_from_origin": wanted(weights_from_origin) or upload_origin, "upload_origin": upload_origin}


@with_registry
def watch(
    target: Annotated[Optional[str], typer.Argument(
        help="The moving tag, e.g. registry.example.com/me/box:v2; each snapshot also gets TAG-yyyymmddThhmmssZ "
        "(UTC).")] = None,
    base: Annotated[Optional[str], typer.Option(
        "--base", "-b", help="The image the box was started from (as for commit).")] = None,
    root: Annotated[str, typer.Option("--root", help="Root of the box to watch.")] = "/",
    every: Every = "5m", keep: Keep = None, grace: Grace = 4.0, provider: Provider = "auto",
    metadata_url: Annotated[Optional[str], typer.Option(
        "--metadata-url", help="Base URL of the metadata service (default: the provider's; or "
        "SNAP_METADATA_URL).")] = None,
    daemon: Annotated[bool, typer.Option(
        "--daemon", help="Detach; pid file and log in the state dir. For containers without an init "
        "system.")] = False,
    stop: Annotated[bool, typer.Option(
        "--stop", help="Stop the watcher of --root: SIGTERM, then wait for its final snapshot; exits with its "
        "code.")] = False,
    profile: Annotated[str, typer.Option("--profile", help=f"Layer profile {AS_FOR_COMMIT}.")] = "default",
    include: Annotated[Optional[List[str]], typer.Option(
        "--include", help="With --base scratch: watch and capture only this path (as for commit). "
        "Repeatable.")] = None,
    compression: Annotated[Optional[str], typer.Option(
        "--compression", help=f"zstd (default) or gzip {AS_FOR_COMMIT}.")] = None,
    max_layer_size: Annotated[str, typer.Option(
        "--max-layer-size", help=f"Cut files bigger than this into part layers {AS_FOR_COMMIT}.")] = "9.5GB",
    jobs: Jobs = None, force: PushForce = False, weights_from_origin: WeightsFromOrigin = False,
    encrypt_to: EncryptTo = None, encrypt_secret: EncryptSecret = None,
    registry: RegistryOptions = RegistryOptions(),
):
    """Keep the registry's snapshot of the box seconds old: commit when the box changed (big files go
    up as soon as they are complete), and one final snapshot on SIGTERM, SIGINT, SIGHUP or a provider's
    reclaim notice (AWS, GCP, Azure). The moving tag only ever names a complete snapshot. Where it
    names a snapshot this box neither came from nor made, it is not moved: the snapshots go to a
    tag of the box's own, TAG-diverged-<UTC time>, and each line says so.
    Exits 0 after the final snapshot; non-zero with one line if it could not finish within --grace."""
    from snapshotter.watch import daemon as dmn
    from snapshotter.watch.notices import notice_watcher
    from snapshotter.watch.options import WatchOptions, parse_duration
    from snapshotter.watch.watcher import log_line

    if stop:
        raise typer.Exit(dmn.stop(root, log=say))
    if target is None or base is None:
        raise UsageError("watch needs TARGET and --base",
                         "e.g. snap watch registry.example.com/me/box:v2 --base registry.example.com/me/base:1")
    commit_opts = _commit_options(root, profile, include, compression, max_layer_size, registry, force=force,
                                  jobs=jobs, encryption=_encryption(encrypt_to, encrypt_secret),
                                  **_origin_options(weights_from_origin))
    # log_line: its lines, its snapshots' progress lines included, with their time
    opts = WatchOptions(commit=commit_opts, every=parse_duration(every), keep=keep, grace=grace,
                        notices=notice_watcher(provider, metadata_url), log=log_line)
    dmn.serve(target, base, opts, detached=daemon)


@with_registry
def status(
    base: Annotated[Optional[str], typer.Option(
        "--base", "-b", help="The image the box was started from (default: the base of the last commit or watch of "
        "--root).")] = None,
    root: Annotated[str, typer.Option("--root", help="Root of the box.")] = "/",
    profile: Annotated[str, typer.Option("--profile", help=f"Layer profile {AS_FOR_COMMIT}.")] = "default",
    compression: Annotated[Optional[str], typer.Option(
        "--compression", help=f"zstd (default) or gzip {AS_FOR_COMMIT}.")] = None,
    max_layer_size: Annotated[str, typer.Option(
        "--max-layer-size", help=f"Part-layer cap {AS_FOR_COMMIT}.")] = "9.5GB",
    as_json: JsonOut = False, registry: RegistryOptions = RegistryOptions(),
):
    """What a commit would send now: the layers that changed since the last commit (with the size of
    their files) and those it would skip. Reads only file metadata; pushes nothing."""
    from snapshotter.commit.history import box_status

    opts = _commit_options(root, profile, None, compression, max_layer_size, registry, log=say,
                           **_origin_options(False))
    output.box_status(box_status(base, opts), as_json)
