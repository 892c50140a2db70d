"""Images pushed by hand (a base, hostile layers, annotated snap layers) and snap's images read back."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import tarfile
import tempfile
from pathlib import Path

import zstandard

from support.registry import RegistryServer
from support.tars import gzip_bytes, member, tar_bytes, tar_of_dir


def push_base_image(registry: RegistryServer, repo: str, tag: str, rootfs: str) -> str:
    """Push a two-layer base image of `rootfs`: /bin + /etc in one layer, the rest in another."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        for name in os.listdir(rootfs):
            src = os.path.join(rootfs, name)
            dst = os.path.join(a if name in ("bin", "etc") else b, name)
            subprocess.run(["cp", "-a", src, dst], check=True)
        layers = [gzip_bytes(tar_of_dir(a)), gzip_bytes(tar_of_dir(b))]
    return registry.push_image(repo, tag, layers)




TAR = "application/vnd.oci.image.layer.v1.tar"
GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MARK = "snap-pwned"  # the name every escape attempt tries to create


def push(registry, request, *layers: bytes, gzip: bool = False) -> str:
    """Push the layers as an image named after the test; returns its reference."""
    repo = repo_for(request)
    if gzip:
        registry.push_image(repo, "v1", [gzip_bytes(b) for b in layers], layer_media_type=GZIP)
    else:
        registry.push_image(repo, "v1", list(layers), layer_media_type=TAR)
    return f"{registry.host}/{repo}:v1"


def push_annotated(registry, repo: str, layers: list[tuple[bytes, dict]], manifest_annotations: dict | None = None,
                   tag: str = "v1", zstd: bool = False) -> str:
    """Push uncompressed layers (zstd-compressed with `zstd`: a restore applies those from the stream,
    several at once) with layer annotations (the dev.snap.* ones snap commit writes) and,
    optionally, manifest annotations. Returns the image's reference."""
    tars = [b for b, _ in layers]
    diff_ids = ["sha256:" + hashlib.sha256(b).hexdigest() for b in tars]
    blobs = [zstandard.ZstdCompressor(level=1).compress(b) for b in tars] if zstd else tars
    registry.push_image(repo, tag, blobs, layer_media_type=TAR + "+zstd" if zstd else TAR, diff_ids=diff_ids,
                        layer_annotations=[ann for _, ann in layers], manifest_annotations=manifest_annotations)
    return f"{registry.host}/{repo}:{tag}"


def part_ann(path: str, part: str) -> dict:
    """The annotations snap commit puts on a part layer ("i/n" of `path`)."""
    return {"dev.snap.layer": "models", "dev.snap.content": f"part {part} of {path}",
            "dev.snap.part": part, "dev.snap.part-file": path}


def repo_for(request) -> str:
    return "hostile/" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]


PART = "m/big.snap-part-{:04d}-of-{:04d}"


def part_image(registry, request, first: tuple[tarfile.TarInfo, bytes], anns=("1/2", "2/2"), extra=()) -> str:
    """m/big cut into two part layers: the first part is `first`, the second a regular file."""
    return push_annotated(registry, repo_for(request), [
        (tar_bytes(member("m/", "dir")), {}),
        (tar_bytes(first), part_ann("m/big", anns[0])),
        (tar_bytes(member(PART.format(2, 2), data=b"second part\n")), part_ann("m/big", anns[1])),
        *extra,
    ])



def _snap_descs(manifest) -> list[dict]:
    """The descriptors of the layers snap added (those with its dev.snap.layer annotation)."""
    return [d for d in manifest["layers"] if "dev.snap.layer" in d.get("annotations", {})]


def label(desc):
    ann = desc["annotations"]
    if "dev.snap.content" not in ann:
        return ann["dev.snap.layer"]
    return f"{ann['dev.snap.layer']} ({ann['dev.snap.content']})"


def layers_by_name(manifest):
    """snap's layers by label: the profile layer, and what part of it (for split layers)."""
    return {label(d): d for d in _snap_descs(manifest)}



def snap_layers(manifest):
    """snap's layers by what they hold: the file of a layer of its own, else the profile layer's name."""
    return {d["annotations"].get("dev.snap.content", d["annotations"]["dev.snap.layer"]): d
            for d in _snap_descs(manifest)}


def layer_tar(registry, repo: str, desc: dict) -> tarfile.TarFile:
    """One layer's tar, whatever its compression (every zstd frame read)."""
    blob = registry.blob(repo, desc["digest"])
    if desc["mediaType"].endswith("+zstd"):
        blob = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    elif desc["mediaType"].endswith("gzip"):
        blob = gzip.decompress(blob)
    return tarfile.open(fileobj=io.BytesIO(blob))



def snap_layer_files(registry: RegistryServer, repo: str, tag: str) -> dict[str, tarfile.TarInfo]:
    """Every tar member of the layers snap added to an image (gzip, zstd or plain), by name."""
    out: dict[str, tarfile.TarInfo] = {}
    for d in _snap_descs(registry.manifest(repo, tag)):
        with layer_tar(registry, repo, d) as t:
            out.update((m.name.rstrip("/"), m) for m in t.getmembers())
    return out


# A file capability (v2: effective, cap_net_bind_service permitted): setuid by another name.
CAP_NET_BIND = (0x02000001).to_bytes(4, "little") + (1 << 10).to_bytes(4, "little") + bytes(12)
XATTR_BOX = {"srv/app/a.txt": "alpha\n", "srv/app/b.txt": "beta\n", "srv/app/bin/tool": "#!/bin/sh\n"}


def xattr_snapshot(registry: RegistryServer, workdir, repo: str, prepare, files: dict | None = None,
                   *commit_args: str) -> str:
    """XATTR_BOX (or `files`) on no base, `prepare(box)` giving it its xattrs, committed as REPO:v1
    (the test is skipped where the filesystem refuses them)."""
    import pytest  # here alone: the bench imports support modules where pytest is not installed

    from support.run import snap
    from support.trees import write_tree
    box = Path(workdir) / "xattr-box"
    write_tree(str(box), files or XATTR_BOX)
    try:
        prepare(box)
    except OSError as e:
        pytest.skip(f"this filesystem refuses the xattrs: {e}")
    ref = f"{registry.host}/{repo}:v1"
    snap("commit", ref, "--base", "scratch", "--root", str(box), *commit_args, check=True)
    return ref
