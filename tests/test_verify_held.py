"""`snap verify` of snapshot layers the directory holds whole (skip.hold_layer: their headers blob
and the directory's bytes hash to the layer's diff_id): the image's limits and the registry's
answers count as when the layers are read."""

import glob
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile

import pytest

from support.run import snap

MT = 1_600_000_000


def _layer(files) -> tuple[bytes, str, bytes]:
    """(a tar of `files` (a dict, or (name, bytes) pairs) with their parent directories, its diff_id,
    its headers blob as commit makes it)."""
    from snapshotter.snapshot.skeleton import PieceWriter
    items = list(files.items()) if isinstance(files, dict) else files
    dirs = sorted({os.path.dirname(n) for n, _ in items} - {""})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in [(d, None) for d in dirs] + items:
            ti = tarfile.TarInfo(name)
            ti.mtime, ti.uid, ti.gid = MT, os.getuid(), os.getgid()
            if data is None:
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            else:
                ti.size, ti.mode = len(data), 0o644
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    tar = buf.getvalue()
    piece = PieceWriter()
    piece.start()
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():
            piece.add(tar[m.offset:m.offset_data], m.size if m.isreg() else 0)
    diff_id = "sha256:" + hashlib.sha256(tar).hexdigest()
    return tar, diff_id, piece.finish(diff_id)


def _image(registry, repo: str, layers: list[dict[str, bytes]], root) -> str:
    """Push an image of `layers`, each naming its headers blob, and write its files into `root` as a
    restore leaves them: every layer is held there."""
    built = [_layer(files) for files in layers]
    heads = [registry.push_blob(repo, piece) for _, _, piece in built]
    registry.push_image(repo, "v1", [gzip.compress(tar) for tar, _, _ in built], diff_ids=[d for _, d, _ in built],
                        layer_annotations=[{"dev.snap.headers": h} for h in heads])
    os.makedirs(root)
    for tar, _, _ in built:  # GNU tar: Python's makedirs recurses once per directory of a deep path
        subprocess.run(["tar", "-C", str(root), "-xf", "-"], input=tar, check=True)
    return f"{registry.host}/{repo}:v1"


def _verify(ref, root, *args, env=None):
    r = snap("verify", ref, "--root", str(root), "--json", *args, env=env)
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr
    return r


TWO = [{"d1/a": b"alpha\n", "d1/b": b"beta\n"}, {"d2/c": b"gamma\n", "d2/e": b"eps\n"}]  # 3 entries each


def test_held_layers_count_toward_the_entry_cap(registry, tmp_path):
    ref = _image(registry, "held-cap", TWO, tmp_path / "root")
    r = _verify(ref, tmp_path / "root")
    assert r.returncode == 0 and json.loads(r.stdout)["layers_held"] == 2, r.stdout + r.stderr
    r = _verify(ref, tmp_path / "root", env={"SNAP_MAX_ENTRIES": "5"})
    assert r.returncode == 6 and "past 5 entries" in r.stderr, r.stderr


def _blob_file(registry, digest: str) -> str:
    hexd = digest.split(":")[1]
    (data,) = glob.glob(f"{registry.storage}/docker/registry/v2/blobs/sha256/{hexd[:2]}/{hexd}/data")
    return data


def test_a_held_layer_the_registry_lost_or_changed(registry, tmp_path):
    """A held layer is not downloaded, but its blob must be there (a restore needs it: exit 5 as
    when it is read); --read-layers downloads it and finds a blob changed in the registry (exit 6)."""
    ref = _image(registry, "held-lost", TWO, tmp_path / "root")
    first = registry.manifest("held-lost", "v1")["layers"][0]["digest"]
    data = _blob_file(registry, first)
    with open(data, "r+b") as f:
        f.seek(20)
        byte = f.read(1)[0]
        f.seek(20)
        f.write(bytes([byte ^ 0xFF]))
    r = _verify(ref, tmp_path / "root")
    assert r.returncode == 0 and json.loads(r.stdout)["layers_held"] == 2, r.stderr
    r = _verify(ref, tmp_path / "root", "--read-layers")
    assert r.returncode == 6 and "does not match its digest" in r.stderr, r.stderr
    os.remove(data)
    for args in ((), ("--read-layers",)):
        r = _verify(ref, tmp_path / "root", *args)
        assert r.returncode == 5 and first[:19] in r.stderr, r.stderr


@pytest.mark.parametrize("args", [(), ("--read-layers",)])
def test_a_path_thousands_of_directories_deep_is_compared(registry, tmp_path, args):
    """A path 1,200 directories deep (2,401 bytes, under PATH_MAX): compared, not a crash of the
    directory walk (its parents are looked at in a loop, not by recursion)."""
    try:
        ref = _image(registry, "held-deep", [{"a/" * 1200 + "f": b"x\n"}], tmp_path / "root")
        r = _verify(ref, tmp_path / "root", *args)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["layers_held"] == (0 if args else 1)
    finally:  # rm: pytest's own clean-up of old temp dirs recurses once per directory too
        subprocess.run(["rm", "-rf", str(tmp_path / "root")], check=True)


def test_one_images_skeletons_share_one_budget(monkeypatch):
    """The headers blobs of one image are parsed against one budget of entries and bytes (a hostile
    registry's blobs, each under the cap alone, cannot together hold more than the image may)."""
    from snapshotter.snapshot.skeleton import Budget, parse
    monkeypatch.setenv("SNAP_MAX_ENTRIES", "4")
    pieces = [_layer({f"d{k}/f{i}": b"x" for i in range(3)})[2] for k in range(2)]
    for piece in pieces:
        assert len(parse(piece)) == 1  # each alone: 4 entries (its directory and 3 files)
    budget = Budget()
    parse(pieces[0], budget=budget)
    with pytest.raises(ValueError, match="more than 4 entries"):
        parse(pieces[1], budget=budget)
    monkeypatch.setenv("SNAP_MAX_ENTRIES", "1000")
    budget = Budget()
    budget.take(budget.bytes_left - 1000)  # bytes: 4 headers of 512 bytes
    with pytest.raises(ValueError, match="too big"):
        parse(pieces[0], budget=budget)


def test_a_file_listed_twice_is_read_from_the_registry(registry, tmp_path):
    """A layer that lists a file twice is not checked in the directory: each listing would read the
    file again for one hash (a hostile headers blob could list a big file a million times, and only
    the hash at the end would tell). It is read from the registry."""
    ref = _image(registry, "held-twice", [[("d/f", b"same\n"), ("d/f", b"same\n")]], tmp_path / "root")
    r = _verify(ref, tmp_path / "root")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and (doc["layers_held"], doc["layers_read"]) == (0, 1), r.stdout + r.stderr
