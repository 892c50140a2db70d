"""The options several commands share, defined once (as pip's cmdoptions): each is an Annotated type,
so a command's signature names it in one short line, and its flag and help are the same everywhere."""

from __future__ import annotations

import functools
import inspect
from typing import Annotated, List, Optional

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


# The commands' own options (capture.py: commit, watch; images.py: restore, run, verify).
AS_FOR_COMMIT = "(as for commit)"
Include = Annotated[Optional[List[str]], typer.Option(
    "--include", help="With --base scratch: capture only this path of the box (with its parent directories), e.g. "
    "/home/ubuntu/ComfyUI. Repeatable; adds to the profile's `include` list.")]
Diverge = Annotated[bool, typer.Option(
    "--diverge", help="Where TARGET's tag names a snapshot this box neither came from nor made, push to a tag of the "
    "box's own instead of refusing: TAG-diverged-<UTC time> (its own from before, if it made one), which `snap log` "
    "and `snap status` list. For a cron line on a box whose restore may fail.")]
MaxLayerSize = Annotated[str, typer.Option(
    "--max-layer-size", help="Cut files bigger than this into part layers (registries reject layers over 10 GB); "
    "snap restore joins them.")]
Every = Annotated[str, typer.Option(
    "--every", help="At most one snapshot per this interval (90s, 5m, 1h); a burst of writes is snapshotted as soon "
    "as it is over.")]
Keep = Annotated[Optional[int], typer.Option(
    "--keep", help="Keep this many TAG-<time> snapshots, and this many TAG-diverged-<time> tags; older ones are "
    "deleted (where the registry allows deletes), never TAG.")]
Grace = Annotated[float, typer.Option(
    "--grace", help="Seconds the final snapshot may take after SIGTERM/SIGINT/SIGHUP or a reclaim notice (RunPod "
    "kills 5 s after SIGTERM).")]
Provider = Annotated[str, typer.Option(
    "--provider", help="Reclaim notices to poll: auto (the cloud the machine's DMI data names, else none), aws, gcp, "
    "azure or none.")]
Ref = Annotated[str, typer.Argument(help="The snapshot image, e.g. registry.example.com/me/box:v2")]
Then = Annotated[Optional[str], typer.Option(
    "--then", help="Start this command (by the shell, in the background, with snap's stdout and stderr) as soon as "
    "every layer but the weights is applied, while the weights still arrive. It keeps running when the restore "
    "ends, whatever the restore's exit code, which is its own (a Ctrl-C in the terminal reaches both).")]
Wait = Annotated[Optional[str], typer.Option(
    "--wait", help="Instead of restoring: block until the restore into --root has landed this file (a path on this "
    "machine). Exit 0 once it is there; 2 if no restore is running, 5 if the image lacks it, 11 on --timeout.")]
RestoreForce = Annotated[bool, typer.Option(
    "--force", help="Apply a full image (base layers too), or a snapshot that deletes the system (its top-level "
    "directories, most of the base's paths), even onto a root that already holds an operating system (an "
    "etc/os-release, a populated usr/): refused otherwise.")]
RestoreProfile = Annotated[Optional[str], typer.Option(
    "--profile", help="Profile (name or YAML file) whose `exclude` paths (/etc/hostname, /etc/resolv.conf, /proc, "
    "...) are never written. Default: the one the snapshot was committed with, if snap ships it, else default.")]

# Encryption (docs/encryption.md): files only, never a key's text in argv or the environment.
EncryptTo = Annotated[Optional[List[str]], typer.Option(
    "--encrypt-to", help="Encrypt snap's layers (ocicrypt's format, as skopeo's --encryption-key) to this RSA or EC "
    "public key (PEM, or an X.509 certificate; `jwe:FILE` as skopeo writes it is taken too). Repeatable: any one "
    "recipient's private key decrypts. Default: $SNAP_ENCRYPT_TO (files, separated by ':'). Paths and headers are "
    "not pushed in clear.")]
EncryptSecret = Annotated[Optional[str], typer.Option(
    "--encrypt-secret", help="With --encrypt-to: a file of at least 32 random bytes (`openssl rand -out FILE 32`) "
    "the layers' keys are derived from, so that boxes sharing it push an unchanged layer once (what that reveals: "
    "docs/encryption.md). Default: $SNAP_ENCRYPT_SECRET.")]
DecryptionKey = Annotated[Optional[List[str]], typer.Option(
    "--decryption-key", help="A private key file (PEM) that opens an encrypted image. Repeatable. Default: "
    "$SNAP_DECRYPTION_KEY (files, separated by ':'). Without one that opens it: exit 4, nothing written.")]
DecryptionKeyPasswordFile = Annotated[Optional[str], typer.Option(
    "--decryption-key-password-file", help="A file holding the password of the encrypted --decryption-key "
    "file(s) (its final newline dropped; never the password itself in argv or the environment). Default: "
    "$SNAP_DECRYPTION_KEY_PASSWORD_FILE.")]
WeightsFromOrigin = Annotated[bool, typer.Option(
    "--weights-from-origin", help="Keep the Hugging Face hub cache's weights (blobs named by their sha256, each "
    "checked) as references that `snap restore` fetches from the origin ($HF_ENDPOINT, $HF_TOKEN), not uploaded; "
    "the box's HF token files are never pushed. Default: $SNAP_WEIGHTS_FROM_ORIGIN=1.")]
UploadOrigin = Annotated[bool, typer.Option(
    "--upload-origin", help="Upload the hub weights a snapshot keeps as references after all, and move the tag to "
    "a snapshot that holds them (self-contained: an origin that deletes or gates a model cannot lose the box).")]
