"""Trust boundaries, round 3: what registries, images and a box's names say is printed escaped (no
raw control character reaches the terminal, no forged `snap: error:` line), and what snap reads of
an image that is malformed (annotations of the wrong JSON type, unknown layer media types, hostile
parts, hardlinks and names) ends the command with exit 6 and one line, in `snap log`, `snap
restore`, `snap verify` and a commit's base reading alike."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import pytest
import zstandard

from snapshotter.errors import RegistryError
from snapshotter.registry.answers import json_object
from snapshotter.registry.destinations import check_destination, origin

from support.images import PART, part_ann, push_annotated, repo_for
from support.run import assert_clean, assert_one_line_error, snap
from support.tars import member, tar_bytes

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
HOSTILE = {"esc": "\x1b[31mred\x1b[0m", "bel": "ring\x07", "cr": "over\rwritten", "csi": "c1\x9b2J",
           "newline": "x\nsnap: error: forged"}


def assert_refused(r, code: int = 6, *words: str) -> None:
    assert_one_line_error(r, code, *words)
    assert_clean(r)


def snapshot_image(registry, repo: str, layer_ann: dict | None = None, manifest_ann: dict | None = None) -> str:
    """A two-layer image as snap commit makes one: a base layer, then a snap layer holding f."""
    return push_annotated(registry, repo, [
        (tar_bytes(member("d/", "dir")), {}),
        (tar_bytes(member("d/f", data=b"hello\n")), {"dev.snap.layer": "venv", **(layer_ann or {})}),
    ], {"dev.snap.base-layers": "1", **(manifest_ann or {})})


def serve_instead(registry, proxy, repo: str, change) -> str:
    """Serve, through the proxy, the image's manifest as `change(doc)` leaves it (a document a real
    registry refuses to store); returns the reference to use."""
    doc = json.loads(registry.session().get(f"{registry.url}/v2/{repo}/manifests/v1",
                                            headers={"Accept": OCI_MANIFEST}).content)
    change(doc)
    body = json.dumps(doc).encode()
    headers = {"Content-Type": OCI_MANIFEST, "Docker-Content-Digest": "sha256:" + hashlib.sha256(body).hexdigest()}
    proxy.lie = lambda method, path: ((200, headers, [body]) if path.startswith(f"/v2/{repo}/manifests/")
                                      and method in ("GET", "HEAD") else None)
    return f"{proxy.host}/{repo}:v1"


# ---- snap log prints what the registry says escaped ------------------------------------------------

@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_log_prints_annotations_and_labels_escaped(registry, request, case):
    text = HOSTILE[case]
    repo = repo_for(request)
    snapshot_image(registry, repo, {"dev.snap.layer": f"venv{text}", "dev.snap.content": f"bundle{text}"},
                   {"org.opencontainers.image.created": f"2024-01-01T00:00:00Z{text}",
                    "org.opencontainers.image.base.name": f"base{text}"})
    r = snap("log", f"{registry.host}/{repo}:v1")
    assert r.returncode == 0, r.stderr
    assert_clean(r)
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "base base" in lines[0] and lines[1].startswith("    new: venv"), lines
    assert not any(line.startswith("snap: error") for line in r.stderr.splitlines() + lines)
    assert repr(text)[1:-1] in lines[0] and repr(text)[1:-1] in lines[1]


@pytest.mark.parametrize("tag", ["x\x1b[31m", "v1\nsnap: error: forged", "../../v2/other", "\x9b2J\udcff", "-" * 300])
def test_log_lists_a_registry_with_names_that_are_not_tags_and_names_them_escaped(registry, proxy, request, tag):
    """A tag list holding names that are not tags (control characters, a path): the snapshots of
    the tags are listed, exit 0; the others are named escaped in one warning line, never asked for."""
    repo = repo_for(request)
    snapshot_image(registry, repo)
    body = json.dumps({"name": repo, "tags": ["v1", tag] + [f"junk\x07{i}" for i in range(50)]}).encode()
    proxy.lie = lambda method, path: ((200, {"Content-Type": "application/json"}, [body])
                                      if path.startswith(f"/v2/{repo}/tags/list") else None)
    r = snap("log", f"{proxy.host}/{repo}:v1")
    assert r.returncode == 0, r.stderr
    assert_clean(r)
    assert r.stdout.splitlines()[0].startswith("v1  "), r.stdout
    (warning,) = [line for line in r.stderr.splitlines() if "not tags" in line]
    assert "51 name(s)" in warning and repr(tag[:200]) in warning and "and 46 more" in warning, warning
    assert len(warning) < 2000
    asked = [path for method, path, status in proxy.log if "/manifests/" in path]
    assert asked and all(path.endswith("/manifests/v1") or "sha256:" in path for path in asked), asked


# ---- annotations of the wrong JSON type: exit 6 wherever they are read -----------------------------

MANIFEST_KEYS = ["dev.snap.base-layers", "org.opencontainers.image.created", "org.opencontainers.image.base.name",
                 "org.opencontainers.image.base.digest", "dev.snap.profile", "dev.snap.max-layer-size",
                 "dev.snap.left-out.secrets", "dev.snap.left-out.secrets-count", "dev.snap.deletes",
                 "dev.snap.skeleton", "dev.snap.base-index"]
LAYER_KEYS = ["dev.snap.layer", "dev.snap.content", "dev.snap.part", "dev.snap.part-file", "dev.snap.part-links",
              "dev.snap.headers"]
WRONG = [5, ["a", "list"], {"an": "object"}, None, True]
CASES = ([("manifest", k, WRONG[i % len(WRONG)]) for i, k in enumerate(MANIFEST_KEYS)]
         + [("layer", k, WRONG[(i + 1) % len(WRONG)]) for i, k in enumerate(LAYER_KEYS)]
         + [("manifest", None, ["not", "a", "map"]), ("layer", None, "not a map"), ("layer", None, 7)])


@pytest.mark.parametrize("place,key,value", CASES, ids=[f"{p}-{k}-{type(v).__name__}" for p, k, v in CASES])
def test_annotations_of_the_wrong_json_type_are_bad_images(registry, proxy, request, jail, place, key, value):
    repo = repo_for(request)
    snapshot_image(registry, repo)

    def change(doc):
        where = doc if place == "manifest" else doc["layers"][1]
        if key is None:
            where["annotations"] = value
        else:
            where["annotations"][key] = value
    ref = serve_instead(registry, proxy, repo, change)
    jail.root.mkdir()
    for args in (("log", ref), ("restore", ref, "--root", str(jail.root)), ("verify", ref, "--root", str(jail.root))):
        r = snap(*args)
        assert_refused(r, 6, "annotations")
    jail.assert_untouched()
    assert not any(jail.root.iterdir())


# ---- unknown layer media types: refused, never sniffed and applied ---------------------------------

@pytest.mark.parametrize("media_type", ["application/vnd.example.layer.v1.tar+bzip2", "",
                                        "application/vnd.oci.image.layer.v1.tar+gzip\x1b[2J",
                                        "text/plain\nsnap: error: forged", "application/vnd.oci.image.config.v1+json"])
def test_unknown_layer_media_types_are_refused(registry, proxy, request, jail, media_type):
    repo = repo_for(request)
    snapshot_image(registry, repo)
    ref = serve_instead(registry, proxy, repo, lambda doc: doc["layers"][1].update(mediaType=media_type))
    jail.root.mkdir()
    with tempfile.TemporaryDirectory() as box:  # not in tmp_path: the jail watches what appears there
        with open(os.path.join(box, "new.txt"), "w") as f:
            f.write("new\n")
        for args in (("restore", ref, "--root", str(jail.root)), ("verify", ref, "--root", str(jail.root)),
                     ("commit", f"{registry.host}/{repo}-out:v1", "--base", ref, "--root", box)):
            r = snap(*args)
            assert_refused(r, 6, "unsupported layer media type", repr(media_type))
    jail.assert_untouched()
    assert not any(jail.root.iterdir())


# ---- verify is as strict as restore ----------------------------------------------------------------

LONG = "a" * 300


def _parts(anns, first=None):
    first = first or member(PART.format(1, 2), data=b"first part\n")
    layers = [(tar_bytes(member("m/", "dir")), {}), (tar_bytes(first), part_ann("m/big", anns[0]))]
    if len(anns) > 1:
        layers.append((tar_bytes(member(PART.format(2, 2), data=b"second part\n")), part_ann("m/big", anns[1])))
    return layers


VERIFY_CASES = {
    # (layers, also refused by restore)
    "parts-disagree": (_parts(("1/2", "2/3")), True),
    "part-twice": (_parts(("1/2", "1/2")), True),
    "part-missing": (_parts(("1/2",)), True),
    "part-malformed": (_parts(("one/2", "2/2")), True),
    "hardlink-out-in-part-layer": (_parts(("1/2", "2/2"), member("m/evil", "hardlink", linkname="../outside/secret")),
                                   True),
    "hardlink-to-nothing-in-part-layer": (_parts(("1/2", "2/2"), member("m/evil", "hardlink", linkname="m/none")),
                                          True),
    "hardlink-to-dir": ([(tar_bytes(member("m/", "dir"), member("m/l", "hardlink", linkname="m")), {})], True),
    "name-too-long": ([(tar_bytes(member(f"d/{LONG}", data=b"x")), {})], False),
    "path-too-long": ([(tar_bytes(member("/".join(["b" * 200] * 21) + "/f", data=b"x")), {})], False),
}


@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_verify_refuses_what_restore_refuses(registry, request, jail, case):
    layers, restore_refuses = VERIFY_CASES[case]
    ref = push_annotated(registry, repo_for(request), layers)
    jail.root.mkdir()
    r = snap("verify", ref, "--root", str(jail.root))
    assert_refused(r, 6)
    if restore_refuses:
        r = snap("restore", ref, "--root", str(jail.root))
        assert_refused(r, 6)
    jail.assert_untouched()


def test_every_layer_media_type_engines_write_is_restored(registry, request, jail):
    """Docker's zstd layer type (containerd and BuildKit write it) is zstd, as OCI's is."""
    data = tar_bytes(member("etc/", "dir"), member("etc/zstd.txt", data=b"zstd\n"))
    repo = repo_for(request)
    registry.push_image(repo, "v1", [zstandard.ZstdCompressor().compress(data)],
                        layer_media_type="application/vnd.docker.image.rootfs.diff.tar.zstd",
                        diff_ids=["sha256:" + hashlib.sha256(data).hexdigest()])
    jail.ok(jail.restore(f"{registry.host}/{repo}:v1"))
    assert (jail.root / "etc/zstd.txt").read_bytes() == b"zstd\n"


def test_answers_nested_beyond_the_parser_and_locations_that_are_no_url_are_one_line():
    assert json_object(b"[" * 100_000 + b"]" * 100_000) is None
    with pytest.raises(RegistryError, match="not a URL"):
        check_destination("https://[x/v2/")
    assert origin("https://[x") == ("", "", -1)
