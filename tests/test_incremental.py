"""Speed features that must stay correct: the stat cache, weight layers, part layers, bounded memory."""

import gzip
import json
import marshal
import os
import subprocess
import sys

import pytest

from snapshotter import CommitOptions, commit_box, restore_image
from snapshotter.commit import push as push_module
from snapshotter.profile import parse_profile

from support.registry import RegistryServer
from support.run import commit_json, snap
from support.trees import NOT_CAPTURED, WEIGHTS_PROFILE, snapshot_of_tree, write_tree

MiB = 1024 * 1024


def bytes_read_by_this_process() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def statuses(result):
    return {layer.name: layer.status for layer in result.layers}


@pytest.fixture
def model_box(box, monkeypatch):
    write_tree(box, {"opt/app/models/checkpoints/big.safetensors": os.urandom(40 * MiB)})
    # Files changed within RACY_WINDOW_NS before a scan are not trusted to the stat cache (racy
    # clean). A real box's files are older than that: here the window is closed instead.
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)
    return box


def test_files_changed_just_before_the_scan_are_read_again(registry, base_ref, box, monkeypatch):
    """The racy-clean rule: a layer with a file changed within the window before the scan is not cached."""
    write_tree(box, {"opt/app/models/checkpoints/fresh.safetensors": os.urandom(4 * MiB)})
    # An hour wide: the file is inside the window however long this machine takes to reach the scan.
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 3600 * 10**9)
    commit_box(f"{registry.host}/racy:v1", base_ref, CommitOptions(root=box))
    second = commit_box(f"{registry.host}/racy:v2", base_ref, CommitOptions(root=box))
    assert statuses(second)["models"] == "exists, skipped"  # read again, not trusted from the cache
    # The window is what made the difference: closed, the same files are cached and not read.
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)
    commit_box(f"{registry.host}/racy:v3", base_ref, CommitOptions(root=box))
    fourth = commit_box(f"{registry.host}/racy:v4", base_ref, CommitOptions(root=box))
    assert statuses(fourth)["models"] == "exists, skipped (unchanged, not read)"


def test_nothing_changed_commit_reads_no_model_bytes(registry, base_ref, model_box):
    opts = CommitOptions(root=model_box)
    first = commit_box(f"{registry.host}/cache:v1", base_ref, opts)
    before = bytes_read_by_this_process()
    second = commit_box(f"{registry.host}/cache:v2", base_ref, CommitOptions(root=model_box))
    read = bytes_read_by_this_process() - before
    assert read < 5 * MiB, f"a nothing-changed commit read {read} bytes"
    assert all("not read" in s for s in statuses(second).values()), statuses(second)
    assert [layer.digest for layer in first.layers] == [layer.digest for layer in second.layers]
    # --rehash reads everything again.
    before = bytes_read_by_this_process()
    third = commit_box(f"{registry.host}/cache:v3", base_ref, CommitOptions(root=model_box, rehash=True))
    assert bytes_read_by_this_process() - before > 40 * MiB
    assert not any("not read" in s for s in statuses(third).values())


_MODULES_WRAPPER = """
import os, runpy, sys
try:
    runpy.run_module("snapshotter", run_name="__main__", alter_sys=True)
finally:
    with open(os.environ["SNAP_TEST_MODULES"], "w") as f:
        f.write("\\n".join(sorted({m.partition(".")[0] for m in sys.modules})))
"""


@pytest.mark.parametrize("progress", ["off", "lines"])  # SNAP_QUIET (the suite's), or lines (no terminal)
def test_a_clear_commit_imports_no_package_it_does_not_use(registry, base_ref, box, tmp_path, progress):
    """What a command imports is most of a nothing-changed commit's time: a clear commit loads no
    cipher (cryptography), no progress bar where none is drawn (tqdm), no pydantic (typer 0.29's
    option coercion), no Docker SDK, and no oras (its auth helpers: the registry asks no credentials)."""
    ref = f"{registry.host}/imports-{progress}:v1"
    snap("commit", ref, "--base", base_ref, "--root", box, check=True)
    modules = tmp_path / "modules"
    r = snap("commit", ref, "--base", base_ref, "--root", box, command=[sys.executable, "-c", _MODULES_WRAPPER],
             env={"SNAP_TEST_MODULES": str(modules), "SNAP_PROGRESS": progress,
                  "SNAP_QUIET": "1" if progress == "off" else ""}, check=True)
    assert "nothing changed" in r.stdout + r.stderr
    assert (progress == "lines") == ("scanning box: " in r.stderr), r.stderr  # the lines were shown or not
    loaded = set(modules.read_text().split())
    assert "snapshotter" in loaded, loaded
    assert not loaded & {"cryptography", "tqdm", "pydantic", "docker", "oras"}


def test_file_rewritten_with_old_mtime_is_still_detected(registry, base_ref, model_box):
    path = os.path.join(model_box, "opt/app/models/checkpoints/big.safetensors")
    first = commit_box(f"{registry.host}/ctime:v1", base_ref, CommitOptions(root=model_box))
    st = os.stat(path)
    with open(path, "r+b") as f:  # same size, other bytes, mtime put back: only ctime tells
        f.write(b"\x00" * 4096)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = commit_box(f"{registry.host}/ctime:v2", base_ref, CommitOptions(root=model_box))
    label = "models"  # 40 MiB: under the default 64 MiB single-file threshold, so in the models bundle
    assert statuses(second)[label] == "uploaded"
    a = {layer.name: layer.digest for layer in first.layers}
    b = {layer.name: layer.digest for layer in second.layers}
    assert a[label] != b[label]
    assert a["venv"] == b["venv"]


def test_cache_of_another_root_is_not_used(registry, base_ref, model_box, tmp_path):
    commit_box(f"{registry.host}/other:v1", base_ref, CommitOptions(root=model_box))
    # Moved, not copied: every file keeps its inode and ctime, so each layer's fingerprint is the
    # same. Only the root tells the two boxes apart.
    moved = str(tmp_path / "moved")
    os.rename(model_box, moved)
    result = commit_box(f"{registry.host}/other:v2", base_ref, CommitOptions(root=moved))
    # Same content, so the same digests the registry already has, but found by reading, not from the cache.
    assert all(s == "exists, skipped" for s in statuses(result).values()), statuses(result)
    os.rename(moved, model_box)  # back at its own root, the box finds its cache again
    again = commit_box(f"{registry.host}/other:v3", base_ref, CommitOptions(root=model_box))
    assert all("not read" in s for s in statuses(again).values()), statuses(again)


def test_weight_layers_are_stable_when_a_model_is_added_or_removed(registry, base_ref, box, tmp_path):
    profile = parse_profile(WEIGHTS_PROFILE)
    os.unlink(os.path.join(box, "opt/app/models/vae/vae.pt"))  # 500 KB: would sit alone in a bundle over the cap
    write_tree(box, {f"opt/app/models/loras/l{i:02d}.safetensors": os.urandom(1 * MiB + i) for i in range(3)})
    write_tree(box, {f"opt/app/models/configs/c{i:03d}.json": os.urandom(3000) for i in range(120)})

    def layers(tag):
        r = commit_box(f"{registry.host}/weights:{tag}", base_ref, CommitOptions(root=box, profile=profile))
        return {layer.name: layer for layer in r.layers}

    v1 = layers("v1")
    singles = [n for n in v1 if n.startswith("models (opt/app/models/loras/")]
    assert len(singles) == 3
    bundles = [n for n in v1 if n.startswith("models (bundle")]
    assert len(bundles) > 3  # 360 KB of small files in bundles of at most 64 KiB
    assert all(v1[n].media_type == "application/vnd.oci.image.layer.v1.tar" for n in singles + bundles)
    # The cap is on content; a tar adds a 512-byte header a file, padding, and a 10 KiB record at most.
    sizes = [(v1[n].size, v1[n].entries) for n in bundles]
    assert all(size <= 64 * 1024 + 1024 * entries + 10240 for size, entries in sizes), sizes

    meta = "models (directories and deletions)"
    assert [n for n in v1 if n.startswith("models")][-1] == meta  # last of its layers: its dir mtimes are final

    write_tree(box, {"opt/app/models/loras/new.safetensors": os.urandom(2 * MiB)}, mtime=1_700_000_001)
    os.utime(os.path.join(box, "opt/app/models/loras"), (1_700_000_001, 1_700_000_001))  # not the same second as v1
    v2 = layers("v2")
    assert {n: v1[n].digest for n in singles + bundles} == {n: v2[n].digest for n in singles + bundles}
    assert v2["models (opt/app/models/loras/new.safetensors)"].status == "uploaded"
    assert v2[meta].digest != v1[meta].digest  # loras/ has a new mtime: only this small layer follows it

    os.unlink(os.path.join(box, "opt/app/models/loras/l01.safetensors"))
    v3 = layers("v3")
    assert "models (opt/app/models/loras/l01.safetensors)" not in v3
    assert {n: v1[n].digest for n in singles + bundles if "l01" not in n} == \
        {n: v3[n].digest for n in singles + bundles if "l01" not in n}

    # One small file added: only the bundle it falls into changes (content-defined cuts).
    write_tree(box, {"opt/app/models/configs/c050b.json": os.urandom(3000)}, mtime=1_700_000_002)
    v4 = layers("v4")
    old = {v3[n].digest for n in v3 if n.startswith("models (bundle")}
    new = {v4[n].digest for n in v4 if n.startswith("models (bundle")}
    assert len(old - new) <= 1 and len(new - old) <= 2, "one insertion rewrote more than its own bundle"


def test_files_over_the_layer_cap_are_split_and_joined_back(registry, base_ref, box, tmp_path):
    write_tree(box, {"opt/app/models/huge.safetensors": os.urandom(3 * MiB + 123)})
    r = snap("commit", f"{registry.host}/parts:v1", "--base", base_ref, "--root", box, "--max-layer-size", "1MiB",
             "--json", check=True)
    parts = [layer for layer in json.loads(r.stdout)["layers"] if "part" in layer["name"] and "huge" in layer["name"]]
    assert [p["name"] for p in parts] == [f"models (part {i}/4 of opt/app/models/huge.safetensors)"
                                          for i in range(1, 5)]
    manifest = registry.manifest("parts", "v1")
    assert max(d["size"] for d in manifest["layers"]) < 1 * MiB + 16384  # content cap + tar header and record padding
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/parts:v1", "--root", str(out), check=True)
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    assert not any(".snap-part-" in name for name in os.listdir(out / "opt/app/models"))


def test_commit_and_restore_memory_is_flat_in_model_size(registry, base_ref, box, tmp_path):
    """A big weight file is streamed: peak RSS stays far below its size."""
    size = 400 * MiB
    with open(os.path.join(box, "opt/app/models/large.safetensors"), "wb") as f:
        for _ in range(size // (8 * MiB)):
            f.write(os.urandom(8 * MiB))
    code = (
        "import sys\n"
        "from snapshotter import commit_box, restore_image, CommitOptions\n"
        f"commit_box('{registry.host}/mem:v1', '{base_ref}', CommitOptions(root='{box}'))\n"
        f"restore_image('{registry.host}/mem:v1', '{tmp_path / 'out'}')\n"
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent (pytest,
        # which may hold hundreds of MiB from earlier tests); VmHWM is this process's own peak.
        "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=600)
    assert r.returncode == 0, r.stderr
    peak_kib = int(r.stdout.strip().splitlines()[-1])
    assert peak_kib * 1024 < 200 * MiB, f"peak RSS {peak_kib // 1024} MiB for a {size // MiB} MiB model"
    assert os.path.getsize(tmp_path / "out/opt/app/models/large.safetensors") == size


def test_a_restored_box_commits_without_reading_its_layers(registry, base_ref, model_box, tmp_path):
    """After a reclaim: restore on a new machine (fresh state dir), then commit within seconds."""
    first = commit_box(f"{registry.host}/seed:v1", base_ref, CommitOptions(root=model_box))
    fresh_state = tmp_path / "new-machine-state"
    env = {"SNAP_STATE_DIR": str(fresh_state)}
    out = tmp_path / "restored"
    r = snap("restore", f"{registry.host}/seed:v1", "--root", str(out), "--json", env=env, check=True)
    assert json.loads(r.stdout)["seeded_layers"] == len(first.layers)

    os.environ["SNAP_STATE_DIR"] = str(fresh_state)  # monkeypatched per test by conftest
    write_tree(str(out), {"opt/app/custom_nodes/NodeA/nodes.py": "class A: changed = True\n"}, mtime=1_700_000_100)
    before = bytes_read_by_this_process()
    second = commit_box(f"{registry.host}/seed:v2", base_ref, CommitOptions(root=str(out)))
    read = bytes_read_by_this_process() - before
    assert read < 5 * MiB, f"the first commit after a restore read {read} bytes"
    st = statuses(second)
    assert st.pop("custom_nodes") == "uploaded"
    assert all("not read" in s for s in st.values()), st
    a = {layer.name: layer.digest for layer in first.layers}
    b = {layer.name: layer.digest for layer in second.layers}
    assert {k: v for k, v in a.items() if k != "custom_nodes"} == {k: v for k, v in b.items() if k != "custom_nodes"}


def test_a_restored_file_changed_since_is_read_again(registry, base_ref, model_box, tmp_path):
    """The restore's record is trusted only for files not changed since the restore: a weight
    rewritten in place, same size, with its mtime put back, is read and uploaded again."""
    commit_box(f"{registry.host}/seedchg:v1", base_ref, CommitOptions(root=model_box))
    fresh_state = tmp_path / "new-machine-state"
    out = tmp_path / "restored"
    snap("restore", f"{registry.host}/seedchg:v1", "--root", str(out), env={"SNAP_STATE_DIR": str(fresh_state)},
         check=True)
    big = out / "opt/app/models/checkpoints/big.safetensors"
    st = os.stat(big)
    with open(big, "r+b") as f:
        f.seek(1000)
        f.write(b"tampered after the restore")
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as restored: only ctime tells

    os.environ["SNAP_STATE_DIR"] = str(fresh_state)  # monkeypatched per test by conftest
    second = commit_box(f"{registry.host}/seedchg:v2", base_ref, CommitOptions(root=str(out)))
    st2 = statuses(second)
    big_layer = "models"  # 40 MiB: below the single-file threshold, in the models bundle
    assert st2[big_layer] == "uploaded", st2
    assert all("not read" in s for name, s in st2.items() if name != big_layer), st2
    snap("restore", f"{registry.host}/seedchg:v2", "--root", str(tmp_path / "again"), check=True)
    assert (tmp_path / "again/opt/app/models/checkpoints/big.safetensors").read_bytes() == big.read_bytes()


# ---- caches of another format ------------------------------------------------------------------

def _swap(row: list, i: int, j: int) -> list:
    row = list(row)
    row[i], row[j] = row[j], row[i]
    return row


@pytest.mark.parametrize("header", ["none (version 1)", "another version", "another field layout"])
def test_a_base_index_cache_of_another_format_is_rebuilt(registry, base_ref, box, state_dir, header):
    """A base-index cache whose rows are laid out otherwise (here size and mtime swapped) is never
    read into the wrong fields: the commit rebuilds the index and gives the same image."""
    repo = "idxfmt-" + "".join(c for c in header if c.isalnum())  # each box pushes to tags of its own
    first = commit_box(f"{registry.host}/{repo}:v1", base_ref, CommitOptions(root=box))
    [cache] = (state_dir / "base-index").iterdir()
    with gzip.open(cache, "rt") as f:
        current, *rows = [json.loads(line) for line in f]
    size, mtime = current["fields"].index("size"), current["fields"].index("mtime")
    lines = [_swap(row, size, mtime) for row in rows]
    if header == "another version":
        lines.insert(0, {**current, "version": current["version"] + 1})
    elif header == "another field layout":
        lines.insert(0, {**current, "fields": _swap(current["fields"], size, mtime)})
    with gzip.open(cache, "wt") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)

    second = commit_box(f"{registry.host}/{repo}:v2", base_ref, CommitOptions(root=box))
    assert [(lay.name, lay.digest) for lay in second.layers] == [(lay.name, lay.digest) for lay in first.layers]
    assert second.deleted == first.deleted
    [cache] = (state_dir / "base-index").iterdir()  # the stale one gone; the one its repository holds, or rebuilt
    with gzip.open(cache, "rt") as f:
        assert json.loads(f.readline()) == current  # rebuilt in this version's format


def test_a_stat_cache_of_another_layout_is_ignored(registry, base_ref, model_box, state_dir):
    first = commit_box(f"{registry.host}/scfmt:v1", base_ref, CommitOptions(root=model_box))
    [path] = (state_dir / "stat-cache").iterdir()
    doc = json.loads(path.read_text())
    assert doc["layers"]  # the first commit did cache its layers
    # The same key, but each blob as a list: not what this version writes.
    doc["layers"] = {fp: [b["digest"], b["diff_id"], b["size"], b["media_type"]] for fp, b in doc["layers"].items()}
    path.write_text(json.dumps(doc))
    second = commit_box(f"{registry.host}/scfmt:v2", base_ref, CommitOptions(root=model_box))
    assert all(s == "exists, skipped" for s in statuses(second).values()), statuses(second)  # read, not trusted
    assert [layer.digest for layer in second.layers] == [layer.digest for layer in first.layers]
    third = commit_box(f"{registry.host}/scfmt:v3", base_ref, CommitOptions(root=model_box))
    assert all("not read" in s for s in statuses(third).values()), statuses(third)  # rewritten in this version's layout


def test_a_restore_record_of_another_layout_is_ignored(registry, base_ref, model_box, tmp_path, state_dir):
    first = commit_box(f"{registry.host}/recfmt:v1", base_ref, CommitOptions(root=model_box))
    out = tmp_path / "restored"
    snap("restore", f"{registry.host}/recfmt:v1", "--root", str(out), check=True)
    [path] = (state_dir / "restored").iterdir()
    doc = json.loads(path.read_text())
    for layer in doc["layers"].values():
        layer["diff-id"] = layer.pop("diff_id")  # a field renamed: not what this version writes
    path.write_text(json.dumps(doc))
    second = commit_box(f"{registry.host}/recfmt:v2", base_ref, CommitOptions(root=str(out)))
    assert all(s == "exists, skipped" for s in statuses(second).values()), statuses(second)  # read, not trusted
    assert [layer.digest for layer in second.layers] == [layer.digest for layer in first.layers]


def stored_blobs(registry) -> dict[str, int]:
    """The registry's blobs as its storage holds them (manifests are blobs there too): {path: size}."""
    top = os.path.join(registry.storage, "docker/registry/v2/blobs")
    return {os.path.join(d, f): os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(top) for f in files}


def is_manifest(path: str) -> bool:
    with open(path, "rb") as f:
        data = f.read(1 << 20)
    try:
        return "schemaVersion" in json.loads(data)
    except (ValueError, TypeError):
        return False


def test_every_byte_a_commit_pushes_is_counted(base_ref, model_box, tmp_path):
    """--json's uploaded_bytes and the 'sent' line count every byte put into the registry: layers,
    the base's layers (copied from its own registry), the headers blobs, the base index, the config
    and the manifests, each by what it is. What the registry's storage gained matches: its new blobs
    byte for byte, and its new manifests at most what was counted as manifests (an artifact manifest
    put again unchanged is stored once). A registry of its own: storage holds each blob once for all
    repositories, so one another test pushed would be sent here but not stored again."""
    registry = RegistryServer(str(tmp_path / "own-registry")).start()
    ref = f"{registry.host}/counted:v1"
    headers, last = {}, None
    for step in ("first", "one small change", "nothing changed"):
        if step == "one small change":
            write_tree(model_box, {"opt/app/custom_nodes/NodeA/nodes.py": "class A: pass  # v2\n"}, mtime=1_700_000_100)
        before = stored_blobs(registry)
        doc = commit_json(ref, base_ref, model_box)
        new = {p: n for p, n in stored_blobs(registry).items() if p not in before}
        if step == "nothing changed":  # the tag names this very snapshot: nothing sent, the tag not moved
            assert doc["current"] and doc["uploaded_bytes"] == 0 and doc["uploaded"] == {} and not new, (doc, new)
            assert doc["manifest_digest"] == last, (doc["manifest_digest"], last)
            headers[step] = 0
            continue
        last = doc["manifest_digest"]
        blobs = sum(n for p, n in new.items() if not is_manifest(p))
        manifests = sum(n for p, n in new.items() if is_manifest(p))
        counted = doc["uploaded"]
        assert doc["uploaded_bytes"] == sum(counted.values()) > 0, (step, doc["uploaded_bytes"], counted)
        assert sum(n for what, n in counted.items() if what != "manifests") == blobs, (step, counted, blobs)
        # the same manifest is stored once
        assert 0 <= manifests <= counted["manifests"] > 0, (step, counted, manifests)
        sent_layers = sum(layer["size"] for layer in doc["layers"] if layer["status"] == "uploaded")
        assert counted.get("layers", 0) == sent_layers, (step, counted, sent_layers)
        headers[step] = counted.get("headers", 0)
    # Each layer's headers are a blob of their own: a commit sends those of the layers it changed.
    assert 0 < headers["one small change"] < headers["first"] / 2 and headers["nothing changed"] == 0, headers
    r = snap("commit", ref, "--base", base_ref, "--root", model_box, check=True)
    assert not any(line.startswith("sent ") for line in r.stdout.splitlines()), r.stdout  # nothing sent
    assert r.stdout.splitlines()[-1] == f"nothing changed: {ref} is current", r.stdout
    registry.stop()


def test_a_second_commit_reads_again_only_what_changed_since_the_first(registry, base_ref, box, monkeypatch,
                                                                       tmp_path):
    """The last commit's walk and RECORDs are kept in the state dir (snapshot/kept.py): a commit
    after it reads no xattrs, symlink target or RECORD of a path whose lstat is as then, and one
    path changed (chmod: its ctime moves) is read again, and committed as it is now."""
    from snapshotter.box import records as records_module
    from snapshotter.box import memo as memo_module

    write_tree(box, {"opt/app/venv/lib/python3.11/site-packages/pkg/__init__.py": "x = 1\n",
                     "opt/app/venv/lib/python3.11/site-packages/pkg-1.0.dist-info/RECORD": "pkg/__init__.py,,\n"})
    monkeypatch.setattr(memo_module, "RACY_WINDOW_NS", 0)  # a real box's files are older than the window
    xattr_reads, record_reads = [], []
    real_listxattr, real_read = os.listxattr, records_module._read
    monkeypatch.setattr(os, "listxattr", lambda p, **kw: xattr_reads.append(p) or real_listxattr(p, **kw))
    monkeypatch.setattr(records_module, "_read", lambda fd, p: record_reads.append(p) or real_read(fd, p))
    first = commit_box(f"{registry.host}/kept:v1", base_ref, CommitOptions(root=box))
    assert xattr_reads and record_reads
    xattr_reads.clear(), record_reads.clear()
    second = commit_box(f"{registry.host}/kept:v2", base_ref, CommitOptions(root=box))
    assert xattr_reads == [] and record_reads == []
    assert [x.digest for x in second.layers] == [x.digest for x in first.layers]
    changed = os.path.join(box, "opt/app/main.py")
    os.chmod(changed, 0o700)
    third = commit_box(f"{registry.host}/kept:v3", base_ref, CommitOptions(root=box))
    assert [p.rpartition("/")[2] for p in xattr_reads] == ["main.py"] and record_reads == []
    assert [x.digest for x in third.layers] != [x.digest for x in second.layers]
    restore_image(f"{registry.host}/kept:v3", str(tmp_path / "out"))
    assert snapshot_of_tree(str(tmp_path / "out"), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_a_commit_with_nothing_changed_reuses_the_last_plan(registry, base_ref, box, monkeypatch, tmp_path):
    """The plan is kept with the walk (snapshot/kept.py): while every entry is as the kept walk has
    it and the diff, base, RECORDs, profile and options are the same, the next commit reuses the plan
    and its keys (the same layers); a new file, or a path changed within the racy window, plans again."""
    from snapshotter.box import memo as memo_module
    from snapshotter.commit import model as model_module

    monkeypatch.setattr(memo_module, "RACY_WINDOW_NS", 0)
    planned = []
    real = model_module.plan_layers
    monkeypatch.setattr(model_module, "plan_layers", lambda *a, **kw: planned.append(1) or real(*a, **kw))

    def layers(tag):
        return [x["digest"] for x in registry.manifest("reuse", tag)["layers"]]

    commit_box(f"{registry.host}/reuse:v1", base_ref, CommitOptions(root=box))
    commit_box(f"{registry.host}/reuse:v2", base_ref, CommitOptions(root=box))
    assert len(planned) == 1 and layers("v2") == layers("v1")
    write_tree(box, {"opt/app/added.py": "print('new')\n"})
    commit_box(f"{registry.host}/reuse:v3", base_ref, CommitOptions(root=box))
    assert len(planned) == 2 and layers("v3") != layers("v2")
    restore_image(f"{registry.host}/reuse:v3", str(tmp_path / "out"))
    assert snapshot_of_tree(str(tmp_path / "out"), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
    monkeypatch.setattr(memo_module, "RACY_WINDOW_NS", 3600 * 10**9)  # every path changed just now: not trusted
    commit_box(f"{registry.host}/reuse:v4", base_ref, CommitOptions(root=box))
    commit_box(f"{registry.host}/reuse:v5", base_ref, CommitOptions(root=box))
    assert len(planned) == 4 and layers("v5") == layers("v3")


def test_a_nothing_changed_commit_asks_about_no_artifact_blob(registry, base_ref, box, monkeypatch):
    """The base index and the layers' headers go up as artifacts (index/base.py's push_artifact):
    where the artifact's tag already names the very manifest, the registry holds its blobs (a
    manifest keeps what it lists), and a nothing-changed commit asks about none of them."""
    from snapshotter.index import base as base_module

    asked = []
    real = base_module.in_registry
    monkeypatch.setattr(base_module, "in_registry",
                        lambda remote, d, sources: asked.append(d) or real(remote, d, sources))
    commit_box(f"{registry.host}/artifacts:v1", base_ref, CommitOptions(root=box))
    assert asked
    asked.clear()
    commit_box(f"{registry.host}/artifacts:v2", base_ref, CommitOptions(root=box))
    assert asked == []


def test_a_nothing_changed_commit_pushes_nothing_and_asks_no_head_per_layer(registry, proxy, base_ref, box,
                                                                            monkeypatch):
    """A commit of an unchanged box to the tag that names its snapshot: the tag's manifest, read once
    for the lineage check, lists every blob the snapshot has (a registry keeps those), so no HEAD is
    asked for any of them; and the image would be that one but for its creation time, so no config
    or manifest is pushed: the tag stays, and the result says it is current."""
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)  # the box's files count as old: the first commit caches
    ref = f"{proxy.host}/still:v1"
    first = commit_box(ref, base_ref, CommitOptions(root=box))
    manifest = registry.manifest("still", "v1")
    listed = [d["digest"] for d in [manifest["config"], *manifest["layers"]]]
    proxy.log.clear()
    again = commit_box(ref, base_ref, CommitOptions(root=box))
    assert again.current and again.manifest_digest == first.manifest_digest, again
    assert again.uploaded_bytes == 0 and again.uploaded == {}, again.uploaded
    assert [(m, p) for m, p, _ in proxy.log if m not in ("GET", "HEAD")] == [], proxy.log  # nothing written
    asked = [p for m, p, _ in proxy.log if m == "HEAD" and "/blobs/" in p]
    assert not [p for p in asked if p.rsplit("/", 1)[-1] in listed], asked
    assert registry.manifest("still", "v1") == manifest


def test_a_stored_walk_not_as_written_is_not_trusted(registry, base_ref, box, monkeypatch, tmp_path, state_dir):
    """The kept walk is data in the state dir, not a verdict: one not as save() writes it (a value of
    another type, a path twice) makes the walk read every path again; kept, `b.txt` would have
    gained the xattrs written into its (otherwise valid) entry. (A path's entry is made from the
    path column itself: it cannot be filed under another path.)"""
    from snapshotter.box import memo as memo_module
    from snapshotter.snapshot import kept

    monkeypatch.setattr(memo_module, "RACY_WINDOW_NS", 0)  # a real box's files are older than the window
    write_tree(box, {"opt/x/a.txt": "aaaa\n", "opt/x/b.txt": "bbbb\n"})
    commit_box(f"{registry.host}/crafted:v1", base_ref, CommitOptions(root=box))
    [path] = [os.path.join(state_dir, "walk-memo", n) for n in os.listdir(os.path.join(state_dir, "walk-memo"))]
    with open(path, "rb") as f:
        key, (columns, secrets) = marshal.loads(f.read()[64:])
    field = kept._FIELDS.index
    paths = columns[field("path")]
    columns[field("xattrs")][paths.index("opt/x/b.txt")] = {"user.injected": "1"}
    columns[field("uid")][paths.index("opt/x/a.txt")] = False  # a bool where save() writes a number
    kept._write(path, key, (columns, secrets))
    commit_box(f"{registry.host}/crafted:v2", base_ref, CommitOptions(root=box))
    out = str(tmp_path / "out")
    restore_image(f"{registry.host}/crafted:v2", out)
    assert snapshot_of_tree(out, skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)
