"""A lying or hostile registry, and images whose documents lie: restore and verify end, with the
right exit code (6 for a bad image, 10 for a registry answer that is malformed, 3 for one too
slow to wait for), within a time bounded by what the image declares (the subprocess timeout is
the failure signal only) and under 256 MiB of peak memory."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from snapshotter.errors import IntegrityError
from snapshotter.oci.reference import Reference
from snapshotter.registry.remote import Remote
from snapshotter.snapshot.files import last_snapshot_files

from support.images import TAR, push, push_annotated, repo_for
from support.run import PEAK_LIMIT_KIB, snap_with_peak
from support.tars import member, tar_bytes

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def both(jail, tmp_path, ref: str, env: dict | None = None) -> list[tuple[int, str, int]]:
    """[(exit code, last stderr line, peak KiB)] of restore and verify of `ref`."""
    out = []
    for cmd in ("restore", "verify"):
        jail.root.mkdir(exist_ok=True)
        r, peak = snap_with_peak(cmd, ref, "--root", str(jail.root), env=env)
        lines = [line for line in r.stderr.splitlines() if line.startswith("snap: error:")]
        assert len(lines) == 1, r.stderr
        out.append((r.returncode, lines[0], peak))
        jail.assert_untouched()
    return out


def _put_manifest(registry, repo: str, tag: str, doc: dict, media_type: str) -> str:
    body = json.dumps(doc).encode()
    r = registry.session().put(f"{registry.url}/v2/{repo}/manifests/{tag}", data=body,
                               headers={"Content-Type": media_type})
    r.raise_for_status()
    return "sha256:" + hashlib.sha256(body).hexdigest()


# ---- documents too big to read -----------------------------------------------------------------------

def test_a_huge_manifest_is_refused_before_it_is_read(registry, proxy, jail, request, tmp_path):
    ref = push(registry, request, tar_bytes(member("f", data=b"x")))
    repo = ref.split("/", 1)[1].split(":")[0]
    spaces = bytes(b" " * (1 << 20))
    proxy.lie = lambda method, path: ((200, {"Content-Type": OCI_MANIFEST}, [spaces] * 300)
                                      if path == f"/v2/{repo}/manifests/v1" else None)
    for code, line, peak in both(jail, tmp_path, ref.replace(registry.host, proxy.host)):
        assert code == 10 and "longer than" in line, line
        assert peak < PEAK_LIMIT_KIB, f"peaked at {peak // 1024} MiB"


def test_a_huge_config_is_refused_before_it_is_read(registry, jail, request, tmp_path):
    repo = repo_for(request)
    blob = tar_bytes(member("f", data=b"x"))
    registry.push_image(repo, "v1", [blob], config={"padding": "a" * (200 << 20)}, layer_media_type=TAR)
    for code, line, peak in both(jail, tmp_path, f"{registry.host}/{repo}:v1"):
        assert code == 6 and "config" in line, line
        assert peak < PEAK_LIMIT_KIB, f"peaked at {peak // 1024} MiB"


# ---- documents that are not what they claim ------------------------------------------------------------

def test_an_index_chain_too_deep_is_refused(registry, jail, request, tmp_path):
    repo = repo_for(request)
    blob = tar_bytes(member("f", data=b"x"))
    digest = registry.push_image(repo, "base", [blob], layer_media_type=TAR)
    size = len(registry.session().get(f"{registry.url}/v2/{repo}/manifests/base",
                                      headers={"Accept": OCI_MANIFEST}).content)
    media = OCI_MANIFEST
    for depth in range(12):
        doc = {"schemaVersion": 2, "mediaType": OCI_INDEX,
               "manifests": [{"mediaType": media, "digest": digest, "size": size,
                              "platform": {"os": "linux", "architecture": "amd64"}}]}
        digest = _put_manifest(registry, repo, f"i{depth}", doc, OCI_INDEX)
        size, media = len(json.dumps(doc).encode()), OCI_INDEX
    for code, line, _ in both(jail, tmp_path, f"{registry.host}/{repo}:i11"):
        assert code == 6 and "deep" in line, line


@pytest.mark.parametrize("change", ["layers-not-a-list", "no-config", "config-size-missing", "index-not-a-list",
                                    "manifest-not-an-object"])
def test_malformed_manifests_are_bad_images(registry, proxy, jail, request, tmp_path, change):
    ref = push(registry, request, tar_bytes(member("f", data=b"x")))
    repo = ref.split("/", 1)[1].split(":")[0]
    doc = json.loads(registry.session().get(f"{registry.url}/v2/{repo}/manifests/v1",
                                            headers={"Accept": OCI_MANIFEST}).content)
    media = OCI_MANIFEST
    if change == "layers-not-a-list":
        doc["layers"] = "all of them"
    elif change == "no-config":
        del doc["config"]
    elif change == "config-size-missing":
        del doc["config"]["size"]
    elif change == "index-not-a-list":
        doc, media = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": {"a": 1}}, OCI_INDEX
    else:
        doc = ["not", "an", "object"]
    body = json.dumps(doc).encode()
    proxy.lie = lambda method, path: (200, {"Content-Type": media},
                                      [body]) if path == f"/v2/{repo}/manifests/v1" else None
    for code, line, _ in both(jail, tmp_path, ref.replace(registry.host, proxy.host)):
        assert code == (10 if change == "manifest-not-an-object" else 6), line


@pytest.mark.parametrize("config", [["a", "list"], {"rootfs": {"type": "layers", "diff_ids": "sha256:x"}},
                                    {"rootfs": "layers"}], ids=["list", "diff-ids-not-a-list", "rootfs-not-an-object"])
def test_malformed_configs_are_bad_images(registry, jail, request, tmp_path, config):
    repo = repo_for(request)
    cfg = json.dumps(config).encode()
    blob = tar_bytes(member("f", data=b"x"))
    doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                      "digest": registry.push_blob(repo, cfg), "size": len(cfg)},
           "layers": [{"mediaType": TAR, "digest": registry.push_blob(repo, blob), "size": len(blob)}]}
    _put_manifest(registry, repo, "v1", doc, OCI_MANIFEST)
    for code, line, _ in both(jail, tmp_path, f"{registry.host}/{repo}:v1"):
        assert code == 6 and "config" in line, line


def test_a_tag_naming_no_readable_image_gives_a_watcher_no_versions_to_keep(registry, request, tmp_path):
    """A watcher reads the files of the snapshot its tag names, to keep a file being written at that
    version. A tag naming a document that is not a readable image gives none, not an error: an error
    there would be met again at every look, and no snapshot of the box would ever be made."""
    repo = repo_for(request)
    cfg = json.dumps(["a", "list"]).encode()
    blob = tar_bytes(member("f", data=b"x"))
    doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                      "digest": registry.push_blob(repo, cfg), "size": len(cfg)},
           "layers": [{"mediaType": TAR, "digest": registry.push_blob(repo, blob), "size": len(blob)}]}
    digest = _put_manifest(registry, repo, "v2", doc, OCI_MANIFEST)
    remote = Remote(Reference.parse(f"{registry.host}/{repo}:v2"))
    with pytest.raises(IntegrityError):
        remote.resolve(digest)
    assert last_snapshot_files(remote, str(tmp_path), digest) == {}


@pytest.mark.parametrize("base_layers", ["-1", "5", "one", "2.0"])
def test_base_layers_annotation_out_of_range_is_refused(registry, jail, request, tmp_path, base_layers):
    ref = push_annotated(registry, repo_for(request), [(tar_bytes(member("base", data=b"b")), {}),
                                                       (tar_bytes(member("snap", data=b"s")),
                                                        {"dev.snap.layer": "rest"})],
                         {"dev.snap.base-layers": base_layers})
    r, _ = snap_with_peak("restore", ref, "--root", str(jail.root), "--only-snapshot")
    assert "base-layers" in jail.refused(r)
    assert not os.path.lexists(jail.root / "base") and not os.path.lexists(jail.root / "snap")


# ---- blobs that do not end, or arrive too slowly ---------------------------------------------------------

def test_a_blob_longer_than_its_descriptor_is_refused_as_it_passes_its_size(registry, proxy, jail, request, tmp_path):
    blob = tar_bytes(member("f", data=os.urandom(100_000)))
    ref = push(registry, request, blob)
    proxy.endless_blob = "sha256:" + hashlib.sha256(blob).hexdigest()
    for code, line, _ in both(jail, tmp_path, ref.replace(registry.host, proxy.host)):
        assert code == 6 and "longer than" in line, line


def test_a_dripping_registry_meets_the_deadline(registry, proxy, jail, request, tmp_path):
    blob = tar_bytes(member("f", data=os.urandom(150_000)))
    ref = push(registry, request, blob)
    proxy.throttle = 20_000  # bytes per second: 7.5 s for the layer, which never stops arriving
    env = {"SNAP_MIN_THROUGHPUT": "100k", "SNAP_DOWNLOAD_GRACE": "0"}  # its deadline: 150 KB at 100 KiB/s, 1.5 s
    for code, line, _ in both(jail, tmp_path, ref.replace(registry.host, proxy.host), env):
        assert code == 3 and "slower than" in line, line
        assert f"of {len(blob)} bytes in {len(blob) / 102400:.0f} s" in line, line  # no grace added


@pytest.mark.parametrize("grace", ["-1", "soon", "nan", "inf"])
def test_a_download_grace_that_is_no_number_of_seconds_is_a_usage_error(registry, jail, request, tmp_path, grace):
    ref = push(registry, request, tar_bytes(member("f", data=b"x")))
    for code, line, _ in both(jail, tmp_path, ref, {"SNAP_DOWNLOAD_GRACE": grace}):
        assert code == 2 and f"SNAP_DOWNLOAD_GRACE={grace!r}" in line, line


# ---- error answers that lie ---------------------------------------------------------------------------

@pytest.mark.parametrize("body", [b'["not", "an", "object"]', b'{"errors": 5}', b'{"errors": [1, "two", null]}',
                                  b'{"errors": [{"code": "DENIED", "message": "no\\nsnap: error: forged line"}]}',
                                  b"\xff\xfe not json \x00", b" " * (1 << 20)],
                         ids=["list", "errors-not-a-list", "errors-not-objects", "newline-in-message", "binary",
                              "huge"])
def test_an_error_answer_of_any_shape_is_one_line(registry, proxy, jail, request, tmp_path, body):
    """A registry's error body is read capped and shown on one line, whatever its shape or size."""
    ref = push(registry, request, tar_bytes(member("f", data=b"x")))
    repo = ref.split("/", 1)[1].split(":")[0]
    pieces = [body] * (300 if len(body) == 1 << 20 else 1)
    proxy.lie = lambda method, path: ((400, {"Content-Type": "application/json"}, pieces)
                                      if path == f"/v2/{repo}/manifests/v1" else None)
    for code, line, peak in both(jail, tmp_path, ref.replace(registry.host, proxy.host)):
        assert code == 10 and "HTTP 400" in line, line
        assert "forged" not in line or "\\n" in line, line
        assert peak < PEAK_LIMIT_KIB, f"peaked at {peak // 1024} MiB"
