"""`snap run` (run mode): hand a snapshot image to a Docker engine, which pulls it and starts it.

Extract mode (`snap restore`) needs no engine; run mode keeps the image's own entrypoint, command,
env and workdir, and only replaces the command when the user gives one. The engine is found the
way the docker CLI finds it (DOCKER_HOST, else the default socket)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional, Sequence

from snapshotter.errors import (AuthError, EngineUnavailable, IntegrityError, NotFound, RegistryError,
                                RegistryUnreachable, SnapError, UsageError, TERMINATED, exit_code_of)
from snapshotter.oci.image import Image
from snapshotter.oci.mediatypes import ENCRYPTED_SUFFIX, compression_of
from snapshotter.oci.reference import Reference
from snapshotter.registry.remote import Remote
from snapshotter.registry.transport import TransportOptions

GPU_MODES = ("auto", "all", "none")
RESTORE_HINT = "without an engine, use extract mode: snap restore REF --root DIR"
DOCKER_ZSTD = (23, 0)  # the first Docker that unpacks zstd layers (20.10 fails: archive/tar: invalid tar header)


class Interrupted(SnapError):
    """Ctrl-C or SIGTERM while the container ran attached: it was stopped. Exit 130 or 143, as the
    signal's (errors.exit_code_of of the KeyboardInterrupt)."""

    exit_code = 130

    def __init__(self, message: str, hint: str = "", exit_code: int = 130):
        super().__init__(message, hint)
        self.exit_code = exit_code


@dataclass
class RunResult:
    container_id: str
    name: str
    image: str  # what the container was created from: repo@digest (repo:tag where snap could not read it)
    exit_code: Optional[int]  # None when detached


def connect():
    """A client for the Docker engine, or EngineUnavailable naming where we looked."""
    try:
        import docker
    except ImportError:
        raise EngineUnavailable("the docker Python package is not installed", RESTORE_HINT)
    try:
        return docker.from_env()
    except docker.errors.DockerException as e:
        raise EngineUnavailable(f"no Docker engine answers at {engine_address()}: {_why(e)}", RESTORE_HINT)


def engine_address() -> str:
    """Where the engine is, as the docker CLI finds it."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


@contextlib.contextmanager
def talking_to_engine(doing: str):
    """Within: the engine failing mid-conversation (a dockerd restart dropping the connection, an
    answer cut short) is EngineUnavailable naming it. requests' and the socket's errors are OSErrors,
    which would otherwise read as a local disk's failure (exit 7)."""
    import docker  # importable: connect() checked
    import urllib3

    try:
        yield
    except (OSError, docker.errors.DockerException, urllib3.exceptions.HTTPError) as e:
        raise EngineUnavailable(f"the Docker engine at {engine_address()} failed while {doing}: {_why(e)}",
                                "check that it runs (docker info), then run again") from None


def engine_elsewhere(client) -> Optional[str]:
    """The engine's host name when it is not this machine's (docker info's Name): an engine reached
    over TCP or SSH, or the host of a container snap runs in. A path snap binds names a file of that
    machine, not the one snap wrote. None when the names are the same or the engine does not say."""
    import docker  # importable: connect() checked
    import requests

    try:
        name = client.info().get("Name")
    except (docker.errors.DockerException, requests.RequestException, OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name and name != socket.gethostname() else None


def host_has_gpus() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None


def parse_port(spec: str) -> tuple[str, object]:
    """'8188', '8188:8188', '127.0.0.1:8188:8188', '9000:9000/udp' -> (container port key, host binding)."""
    ports, _, proto = spec.partition("/")
    parts = ports.split(":")
    host = parts[-2] if len(parts) > 1 else ""
    if (proto or "tcp") not in ("tcp", "udp", "sctp") or len(parts) > 3 or not parts[-1].isdigit() \
            or (host and not host.isdigit()):
        raise UsageError(f"port {spec!r} is not valid",
                         "write it as [IP:]HOST_PORT:CONTAINER_PORT[/udp], e.g. 8188:8188")
    key = f"{parts[-1]}/{proto or 'tcp'}"
    host_port = int(host) if host else None
    if len(parts) == 1:
        return key, None  # the engine picks a free host port
    return key, (parts[0], host_port) if len(parts) == 3 else host_port


def parse_volume(spec: str) -> str:
    """'/host:/ctr[:ro|rw]' (a relative host path is made absolute; a bare name is a named volume)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0] or not parts[1].startswith("/") or \
            (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise UsageError(f"volume {spec!r} is not valid",
                         "write it as HOST_PATH:CONTAINER_PATH[:ro], e.g. /data:/workspace")
    host = parts[0]
    if host.startswith((".", "/", "~")):
        host = os.path.abspath(os.path.expanduser(host))
    return ":".join([host, parts[1], parts[2] if len(parts) == 3 else "rw"])


def parse_env(specs: Sequence[str]) -> list[str]:
    """'K=V' as given; a bare 'K' takes its value from snap's own environment (as docker run does)."""
    out = []
    for s in specs:
        if "=" in s:
            out.append(s)
        elif s in os.environ:
            out.append(f"{s}={os.environ[s]}")
    return out


def run(ref: str, command: Optional[Sequence[str]] = None, gpus: str = "auto", ports: Sequence[str] = (),
        volumes: Sequence[str] = (), env: Sequence[str] = (), name: Optional[str] = None, detach: bool = False,
        transport: Optional[TransportOptions] = None, stdout: Optional[BinaryIO] = None,
        stderr: Optional[BinaryIO] = None, log: Callable[[str], None] = lambda msg: None,
        mounts_of: Callable[[Image, Callable[[], Optional[str]]], list[str]] = lambda image, elsewhere: []
        ) -> RunResult:
    """Pull `ref` into the engine and start it. Not detached: stream its output to stdout/stderr
    and return its exit code. The container is kept (like docker run without --rm), so its
    changes can be captured later with `snap commit --from-container`. `mounts_of` gives the bind
    mounts ("HOST:PATH:ro") the image snap read needs beside its layers (weights from the origin),
    with a way to ask for the engine's host when it is another machine (engine_elsewhere)."""
    reference = Reference.parse(ref)
    if gpus not in GPU_MODES:
        raise UsageError(f"gpus={gpus!r} is not one of {', '.join(GPU_MODES)}")
    port_map: dict[str, list] = {}
    for spec in ports:
        key, binding = parse_port(spec)
        port_map.setdefault(key, []).append(binding)
    binds = [parse_volume(v) for v in volumes]
    want_gpus = gpus == "all" or (gpus == "auto" and host_has_gpus())

    client = connect()
    import docker  # importable: connect() checked

    snapshot = checked_snapshot(client, reference, transport)
    binds += mounts_of(snapshot, lambda: engine_elsewhere(client)) if snapshot is not None else []
    with talking_to_engine(f"pulling {reference}"):
        image = pull(client, reference, snapshot, transport, log)
    device_requests = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])] if want_gpus else None
    with talking_to_engine("creating the container"):
        try:
            ct = client.containers.create(
                image, command=list(command) if command else None, name=name, environment=parse_env(env),
                ports={k: v[0] if len(v) == 1 else v for k, v in port_map.items()} or None,
                volumes=binds or None, device_requests=device_requests, detach=True)
        except docker.errors.APIError as e:
            raise _engine_error(e, name, "create")
    with talking_to_engine(f"attaching to container {ct.name}"):
        stream = None if detach else ct.attach(stdout=True, stderr=True, stream=True, demux=True, logs=True)
    result = RunResult(ct.id, ct.name, image, None)
    try:
        _start(ct, name)
        if not detach:
            result.exit_code = _attached(ct, stream, stdout or sys.stdout.buffer, stderr or sys.stderr.buffer)
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM where the CLI turns it into one: stop what runs
        code = exit_code_of(e)
        with talking_to_engine(f"stopping container {ct.name}"):
            ct.stop(timeout=10)
        raise Interrupted(f"{'terminated' if code == TERMINATED else 'interrupted'}: container {ct.name} stopped",
                          f"docker start -a {ct.name} runs it again", code) from None
    return result


def _start(ct, name: Optional[str]) -> None:
    import docker

    with talking_to_engine(f"starting container {ct.name}"):
        try:
            ct.start()
        except docker.errors.APIError as e:
            ct.remove(force=True)  # it never ran: leave nothing behind
            raise _engine_error(e, name, "start")


def _attached(ct, stream, out: BinaryIO, err: BinaryIO) -> int:
    """Copy the container's output until it ends; its exit code. Only reading from the engine is
    its failure: a write to our stdout that fails is ours (a closed pipe, a full disk)."""
    frames = iter(stream)
    while True:
        with talking_to_engine(f"streaming the output of container {ct.name}"):
            frame = next(frames, None)
        if frame is None:
            break
        for data, f in zip(frame, (out, err)):
            if data:
                f.write(data)
                f.flush()
    with talking_to_engine(f"waiting for container {ct.name}"):
        return ct.wait()["StatusCode"]


def cannot_read_zstd(version: dict) -> Optional[str]:
    """The engine, as a user names it ('Docker 20.10.24'), when its /version answer says it cannot
    unpack zstd layers: Docker before 23.0. None when it can, or when the answer is not sure of it
    (podman answers with its own version, and reads zstd; a version that is no number)."""
    if not isinstance(version, dict):
        return None
    components = version.get("Components")
    names = [c.get("Name", "") for c in components if isinstance(c, dict)] if isinstance(components, list) else []
    platform = version.get("Platform")
    names.append(platform.get("Name", "") if isinstance(platform, dict) else "")
    if any("podman" in str(n).lower() for n in names):
        return None
    number = str(version.get("Version", ""))
    m = re.match(r"(\d+)\.(\d+)", number)
    if m is None or (int(m[1]), int(m[2])) >= DOCKER_ZSTD:
        return None
    return f"Docker {number}"


def zstd_error(engine: str, image: str) -> EngineUnavailable:
    """The one line for an engine that cannot unpack the zstd layers of `image`."""
    return EngineUnavailable(f"{engine} cannot read zstd layers (needs {'.'.join(map(str, DOCKER_ZSTD))} or later), "
                             f"and {image} has them",
                             "upgrade Docker, or commit the snapshot again with --compression gzip; or " + RESTORE_HINT)


def encrypted_error(image: str) -> EngineUnavailable:
    """The one line for an image with ocicrypt layers: no Docker engine decrypts them (containerd's
    imgcrypt does, given the key, but the Docker API has no way to pass one)."""
    return EngineUnavailable(f"{image!r} has encrypted layers, which the Docker engine cannot decrypt",
                             "restore it with its key in extract mode: snap restore REF --root DIR "
                             "--decryption-key FILE; or decrypt a copy and run that: skopeo copy "
                             "--decryption-key FILE docker://REF docker://COPY")


def checked_snapshot(client, reference: Reference, transport: Optional[TransportOptions]) -> Optional[Image]:
    """Read the snapshot's manifest, once, for the engine's platform, and refuse what the engine
    cannot unpack (refuse_unreadable_layers). The image read is what the engine then pulls, by its
    digest (pull). None where snap cannot read it (a registry only the engine's host reaches): the
    engine's pull goes ahead and its failure is mapped to one line (_pull_error)."""
    version = _version_of(client)
    platform = (version.get("Os"), version.get("Arch"))
    try:
        image = Remote(reference, transport).resolve(want=platform if all(platform) else None)
    except SnapError:
        return None
    refuse_unreadable_layers(version, image, str(reference))
    return image


def refuse_unreadable_layers(version: dict, image: Image, name: str) -> None:
    """Refuse, before the engine pulls anything, an image it cannot unpack: encrypted layers on any
    engine (Docker 20.10 pulls them and fails with 'invalid tar header'), zstd layers on an engine
    (of this /version answer) too old for them."""
    if any(_is_encrypted(d) for d in image.layers):
        raise encrypted_error(name)
    engine = cannot_read_zstd(version)
    if engine is not None and any(_is_zstd(d) for d in image.layers):
        raise zstd_error(engine, name)


def _is_encrypted(desc) -> bool:
    # mediatypes' suffix, not crypt.layer's is_encrypted: that module needs `cryptography`, which a
    # clear snapshot's run does not.
    return isinstance(desc, dict) and str(desc.get("mediaType", "")).endswith(ENCRYPTED_SUFFIX)


def _is_zstd(desc) -> bool:
    try:
        return isinstance(desc, dict) and compression_of(str(desc.get("mediaType", ""))) == "zstd"
    except IntegrityError:
        return False  # a type snap does not read: the engine judges it


def pull(client, reference: Reference, snapshot: Optional[Image], transport: Optional[TransportOptions],
         log: Callable[[str], None]) -> str:
    """Have the engine pull the image; returns the name to create the container from: the manifest
    snap read and checked, by its digest (a watcher may move the tag meanwhile: the engine must run
    the snapshot that was judged, and whose weights are mounted), then tagged as a pull of the tag
    would. Credentials given to snap (--username) go to the engine; else it uses its own docker config."""
    import docker

    # snap could not read the manifest (a registry only the engine's host reaches): the ref as given.
    pinned = snapshot.manifest_digest if snapshot is not None else reference.digest
    target = pinned or reference.target
    image = f"{reference.name}@{pinned}" if pinned else f"{reference.name}:{target}"
    creds = transport.credentials if transport else None
    auth = None
    if creds and creds.username is not None:
        auth = {"username": creds.username, "password": creds.password or ""}
    log(f"pulling {image}" if image == str(reference) else f"pulling {image}, which {reference} names")
    try:
        # The high-level images.pull drops errors reported inside the stream: read it ourselves.
        for event in client.api.pull(reference.name, tag=target, stream=True, decode=True, auth_config=auth):
            if "error" in event:
                raise _pull_error(client, image, event["error"])
    except docker.errors.APIError as e:
        raise _pull_error(client, image, e.explanation or str(e))
    if snapshot is not None and reference.digest is None:
        _tag(client, image, reference, log)
    return image


def _tag(client, image: str, reference: Reference, log: Callable[[str], None]) -> None:
    """Name the pulled image by its tag in the engine, as a pull of the tag would have: `docker
    images` shows it, `docker run REF` finds it."""
    import docker

    try:
        client.api.tag(image, reference.name, reference.tag)
    except docker.errors.APIError as e:
        log(f"the engine did not tag {image} as {reference}: {' '.join(str(e.explanation or e).split())}")


def _pull_error(client, image: str, msg: str) -> SnapError:
    msg = " ".join(str(msg).split())
    low = msg.lower()
    if "invalid tar header" in low or "zstd" in low:
        engine = cannot_read_zstd(_version_of(client))
        if engine is not None:
            return zstd_error(engine, image) if "zstd" in low else _unpack_error(engine, image)
    if any(k in low for k in ("unauthorized", "authentication required", "no basic auth credentials", "denied")):
        return AuthError(f"the registry refused the engine's pull of {image}: {msg}")
    if "not found" in low or "manifest unknown" in low:
        return NotFound(f"image {image} not found: {msg}")
    if "http response to https client" in low:
        return RegistryUnreachable(f"the Docker engine cannot pull {image}: {msg}",
                                   "add the registry to the engine's insecure-registries (daemon.json)")
    if any(k in low for k in ("connection refused", "no such host", "dial tcp", "i/o timeout", "timeout")):
        return RegistryUnreachable(f"the Docker engine cannot reach the registry of {image}: {msg}",
                                   "check the host and port from the engine's host")
    return RegistryError(f"the Docker engine failed to pull {image}: {msg}")


def _unpack_error(engine: str, image: str) -> EngineUnavailable:
    """Docker before 23.0 says 'invalid tar header' of zstd layers and of encrypted ones alike: snap
    could not read the manifest to tell which, so the line names both, and the ways out of each."""
    return EngineUnavailable(f"{engine} failed to unpack {image} (archive/tar: invalid tar header): its layers are "
                             f"either zstd, which {engine} cannot read (needs {'.'.join(map(str, DOCKER_ZSTD))} "
                             "or later), or encrypted, which no Docker engine decrypts",
                             f"if zstd: {zstd_error(engine, image).hint}; if encrypted: {encrypted_error(image).hint}")


def _version_of(client) -> dict:
    import docker

    try:
        return client.version()
    except (docker.errors.DockerException, OSError):
        return {}


def _engine_error(e, name: Optional[str], doing: str) -> SnapError:
    """The engine's refusal to create or start the container, by its status: a 4xx refuses what we
    asked (a name taken, a bad option: exit 2), a 5xx (or none) is the engine's own failure (exit 8)."""
    msg = " ".join(str(e.explanation or e).split())
    if "could not select device driver" in msg and "gpu" in msg:
        return EngineUnavailable(f"the Docker engine cannot give the container GPUs ({msg})",
                                 "install the NVIDIA Container Toolkit on the host, or pass --no-gpu")
    if e.status_code == 409:
        return UsageError(f"a container named {name} already exists ({msg})",
                          f"pick another --name, or remove it: docker rm -f {name}")
    if e.status_code and 400 <= e.status_code < 500:
        return UsageError(f"the Docker engine refused to {doing} the container: {msg}")
    return EngineUnavailable(f"the Docker engine at {engine_address()} failed to {doing} the container: {msg}")


def _why(e: Exception) -> str:
    text = str(e)
    for key in ("No such file or directory", "Connection refused", "Permission denied", "timed out",
                "Name or service not known", "Remote end closed connection without response", "Connection broken",
                "Connection reset by peer"):
        if key in text:
            return key
    return " ".join(text.split())[:200]
