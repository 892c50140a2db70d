"""The code layers (venv, custom_nodes, rest) cut into bundles that follow what users change: a
package or a custom node added, upgraded or removed changes only the bundles that hold its files
(and at most a neighbour); the same tree gets the same digests anywhere; a snapshot keeps to the
layer budget, weights included."""

import os
import random
import shutil
import subprocess

import pytest

from snapshotter import CommitOptions, commit_box, restore_image
from snapshotter.commit import push as push_module
from snapshotter.layer import bundling
from snapshotter.layer.units import units_of
from snapshotter.profile import parse_profile

from support.images import layer_tar, layers_by_name
from support.trees import NOT_CAPTURED, SMALL_WEIGHTS, make_box, snapshot_of_tree, write_tree

KiB = 1024
MiB = 1024 * KiB
SITE = "opt/app/venv/lib/python3.11/site-packages"
NODES = "opt/app/custom_nodes"


@pytest.fixture
def small_bundles(monkeypatch):
    """Bundles sized for a box of a few MB (the real floor, 16 MiB, would make this one bundle). The
    target is then the box's own: its code content over the budget, as on a real box."""
    monkeypatch.setattr(bundling, "MIN_BUNDLE", 32 * KiB, raising=False)
    # Files written within RACY_WINDOW_NS before a scan are not trusted to the stat cache; a real
    # box's files are older than that: here the window is closed instead.
    monkeypatch.setattr(push_module, "RACY_WINDOW_NS", 0)


def package(name: str, version: str, size: int, rng: random.Random) -> dict:
    """A distribution as pip lays it out: its package, its dist-info, and sometimes a .libs dir."""
    files = {f"{SITE}/{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{SITE}/{name}/core.py": os.urandom(size),
             f"{SITE}/{name}-{version}.dist-info/METADATA": f"Name: {name}\nVersion: {version}\n",
             f"{SITE}/{name}-{version}.dist-info/RECORD": f"{name}/__init__.py,,\n"}
    if rng.random() < 0.2:
        files[f"{SITE}/{name}.libs/lib{name}.so"] = os.urandom(size // 2)
    return files


def venv_box(base_rootfs: str, dest: str) -> str:
    """make_box's box with a venv of 40 distributions of 4-120 KB, a namespace directory holding three
    (nvidia/cublas, ...), a top-level module with its byte code, a 1.5 MB torch of 60 files, and 12
    custom nodes of 20-150 KB: about 6 MB of code."""
    box = make_box(base_rootfs, dest)
    rng = random.Random(7)
    tree: dict = {}
    for i in range(40):
        tree.update(package(f"pkg{i:02d}", "1.0", rng.randrange(4 * KiB, 120 * KiB), rng))
    for sub in ("cublas", "cudnn", "nccl"):
        tree[f"{SITE}/nvidia/{sub}/lib/lib{sub}.so.12"] = os.urandom(rng.randrange(100 * KiB, 250 * KiB))
        tree[f"{SITE}/nvidia/{sub}/__init__.py"] = ""
        tree[f"{SITE}/nvidia_{sub}_cu12-12.1.dist-info/METADATA"] = f"Name: nvidia-{sub}-cu12\n"
    tree[f"{SITE}/six.py"] = os.urandom(30 * KiB)
    tree[f"{SITE}/__pycache__/six.cpython-311.pyc"] = os.urandom(20 * KiB)
    tree[f"{SITE}/six-1.16.0.dist-info/METADATA"] = "Name: six\n"
    tree.update({f"{SITE}/torch/nn/m{i:02d}.py": os.urandom(25 * KiB) for i in range(60)})
    for i in range(12):
        tree[f"{NODES}/Node{i:02d}/__init__.py"] = "NODE_CLASS_MAPPINGS = {}\n"
        tree[f"{NODES}/Node{i:02d}/nodes.py"] = os.urandom(rng.randrange(20 * KiB, 150 * KiB))
    write_tree(box, tree)
    return box


def bundles(result, name: str) -> dict[str, str]:
    """The digests of a profile layer's bundles, by label."""
    return {layer.name: layer.digest for layer in result.layers
            if layer.name.startswith(f"{name} (bundle ")}


def changed(before: dict, after: dict) -> tuple[set, set]:
    """(digests gone, digests new) between two commits' bundles of one layer."""
    return set(before.values()) - set(after.values()), set(after.values()) - set(before.values())


def holding(registry, repo: str, tag: str, name: str, word: str) -> int:
    """How many of the snapshot's bundles of layer `name` hold a file whose path has `word`."""
    return sum(1 for n, d in layers_by_name(registry.manifest(repo, tag)).items() if n.startswith(f"{name} (bundle ")
               and any(word in m.name and m.isfile() for m in layer_tar(registry, repo, d).getmembers()))


def test_a_package_added_upgraded_or_removed_changes_only_its_bundle(registry, base_ref, base_rootfs, tmp_path,
                                                                        small_bundles):
    box = venv_box(base_rootfs, str(tmp_path / "box"))

    def commit(tag):
        return commit_box(f"{registry.host}/bundles:{tag}", base_ref, CommitOptions(root=box))

    v1 = commit("v1")
    venv1, nodes1 = bundles(v1, "venv"), bundles(v1, "custom_nodes")
    assert len(venv1) >= 12 and len(nodes1) >= 3, (len(venv1), len(nodes1))
    names = [layer.name for layer in v1.layers]
    # Directories and deletions last of each layer: a new package's site-packages/ mtime goes there.
    last_venv = max(i for i, n in enumerate(names) if n.startswith("venv"))
    assert names.index("venv (directories and deletions)") == last_venv
    assert names.index("venv (directories and deletions)") < names.index("custom_nodes (bundle 1)")

    # A 10 KB package added: the bundle it lands in changes, and at most a neighbour splits off it.
    write_tree(box, package("pkg_new", "0.1", 10 * KiB, random.Random(1)), mtime=1_700_000_001)
    v2 = commit("v2")
    gone, new = changed(venv1, bundles(v2, "venv"))
    assert len(gone) == 1 and 1 <= len(new) <= 2, (gone, new)
    assert bundles(v2, "custom_nodes") == nodes1
    uploaded = [layer.name for layer in v2.layers if layer.status == "uploaded"]
    assert len(uploaded) <= 3 and all(n.startswith("venv") for n in uploaded), uploaded

    # An upgrade (other content, the dist-info renamed): the bundles that hold it, and at most two more.
    os.rename(os.path.join(box, SITE, "pkg17-1.0.dist-info"), os.path.join(box, SITE, "pkg17-2.0.dist-info"))
    write_tree(box, {f"{SITE}/pkg17/core.py": os.urandom(40 * KiB),
                     f"{SITE}/pkg17-2.0.dist-info/METADATA": "Name: pkg17\nVersion: 2.0\n"}, mtime=1_700_000_002)
    v3 = commit("v3")
    gone, new = changed(bundles(v2, "venv"), bundles(v3, "venv"))
    assert 1 <= len(gone) <= holding(registry, "bundles", "v2", "venv", "pkg17") + 2, gone
    assert holding(registry, "bundles", "v3", "venv", "pkg17") == 1  # a small package is never cut apart

    # A package removed: its bundle, merged at most with a neighbour.
    shutil.rmtree(os.path.join(box, SITE, "pkg05"))
    shutil.rmtree(os.path.join(box, SITE, "pkg05-1.0.dist-info"))
    v4 = commit("v4")
    gone, new = changed(bundles(v3, "venv"), bundles(v4, "venv"))
    assert 1 <= len(gone) <= 2 and len(new) <= 1, (gone, new)

    # A namespace distribution upgraded (nvidia/cudnn and its dist-info): no more than that.
    write_tree(box, {f"{SITE}/nvidia/cudnn/lib/libcudnn.so.12": os.urandom(180 * KiB)}, mtime=1_700_000_003)
    v5 = commit("v5")
    gone, new = changed(bundles(v4, "venv"), bundles(v5, "venv"))
    assert 1 <= len(gone) <= 2, gone

    # A custom node added, then another removed: one bundle of custom_nodes each time, the venv as it was.
    write_tree(box, {f"{NODES}/Node05b/__init__.py": "X = 1\n", f"{NODES}/Node05b/nodes.py": os.urandom(30 * KiB)},
               mtime=1_700_000_004)
    v6 = commit("v6")
    gone, new = changed(bundles(v5, "custom_nodes"), bundles(v6, "custom_nodes"))
    assert len(gone) == 1 and 1 <= len(new) <= 2, (gone, new)
    assert bundles(v6, "venv") == bundles(v5, "venv")
    shutil.rmtree(os.path.join(box, NODES, "Node09"))
    v7 = commit("v7")
    gone, new = changed(bundles(v6, "custom_nodes"), bundles(v7, "custom_nodes"))
    assert 1 <= len(gone) <= 2 and len(new) <= 1, (gone, new)
    assert bundles(v7, "venv") == bundles(v5, "venv")


def test_the_same_tree_gets_the_same_bundles_anywhere_and_a_second_commit_reads_nothing(
        registry, base_ref, base_rootfs, tmp_path, small_bundles):
    box = venv_box(base_rootfs, str(tmp_path / "box"))
    first = commit_box(f"{registry.host}/anywhere:v1", base_ref, CommitOptions(root=box))
    assert len(bundles(first, "venv")) >= 12
    # Nothing changed: every bundle is known from stat data, none is read.
    again = commit_box(f"{registry.host}/anywhere:v2", base_ref, CommitOptions(root=box))
    assert all(layer.status.endswith("(unchanged, not read)") for layer in again.layers), \
        [(layer.name, layer.status) for layer in again.layers]
    # A copy at another root (other inodes, ctimes, path): the same layers, digest for digest.
    other = str(tmp_path / "elsewhere" / "box")
    os.makedirs(os.path.dirname(other))
    subprocess.run(["cp", "-a", box, other], check=True)
    moved = commit_box(f"{registry.host}/anywhere:v3", base_ref, CommitOptions(root=other))
    assert [(layer.name, layer.digest) for layer in moved.layers] == \
        [(layer.name, layer.digest) for layer in first.layers]


def test_many_weights_and_files_keep_to_the_layer_budget(registry, base_ref, base_rootfs, tmp_path, small_bundles,
                                                         monkeypatch):
    """64 weights of a layer of their own each and 6 MB of code in bundles, under a budget of 40
    layers: the smaller weights fold into bundles, the code's bundles grow, and the image fits."""
    monkeypatch.setattr(bundling, "LAYER_BUDGET", 40, raising=False)
    box = venv_box(base_rootfs, str(tmp_path / "box"))
    write_tree(box, {f"opt/app/models/loras/l{i:02d}.safetensors": os.urandom(MiB + i * KiB) for i in range(60)})
    write_tree(box, {f"opt/app/models/checkpoints/c{i}.safetensors": os.urandom(3 * MiB) for i in range(4)})
    profile = parse_profile(SMALL_WEIGHTS)  # weights of 1 MiB and more in layers of their own
    commit_box(f"{registry.host}/budget:v1", base_ref, CommitOptions(root=box, profile=profile))
    manifest = registry.manifest("budget", "v1")
    names = list(layers_by_name(manifest))
    assert len(manifest["layers"]) <= 40, names
    assert any(n.startswith("venv (bundle") for n in names), names
    assert any(n.startswith("models (bundle") for n in names), names
    # The biggest keep a layer of their own.
    assert sorted(n for n in names if n.startswith("models (opt/")) == \
        [f"models (opt/app/models/checkpoints/c{i}.safetensors)" for i in range(4)]


def test_natural_units():
    paths = [f"{SITE}/numpy/__init__.py", f"{SITE}/numpy-1.26.4.dist-info/RECORD", f"{SITE}/numpy.libs/libgfortran.so",
             f"{SITE}/six.py", f"{SITE}/__pycache__/six.cpython-311.pyc", f"{SITE}/six-1.16.0.dist-info/METADATA",
             f"{SITE}/Typing_Extensions-4.9.dist-info/METADATA", f"{SITE}/typing_extensions.py",
             f"{SITE}/nvidia/cublas/lib/libcublas.so", f"{SITE}/nvidia/cudnn/lib/libcudnn.so",
             f"{SITE}/google/protobuf/__init__.py", f"{SITE}/yaml/__init__.py", f"{SITE}/yaml/x/y.py",
             f"{NODES}/NodeA/nodes.py", f"{NODES}/NodeA/web/js/a.js", "usr/share/doc/libfoo/copyright",
             "usr/share/doc/libfoo/examples/deep/x.txt", "usr/lib/x86_64-linux-gnu/libz.so.1"]
    keys = dict(zip(paths, units_of(paths)))
    assert len({keys[p] for p in paths[:3]}) == 1  # numpy, its dist-info, its .libs
    assert len({keys[p] for p in paths[3:6]}) == 1  # six.py, its byte code, its dist-info
    assert keys[paths[6]] == keys[paths[7]]
    assert keys[paths[8]] != keys[paths[9]]  # a namespace directory: a unit per distribution
    assert keys[paths[11]] == keys[paths[12]]  # a package with __init__.py: one unit
    assert keys[paths[13]] == keys[paths[14]] == f"{NODES}/NodeA"
    assert keys[paths[15]] == keys[paths[16]] == "usr/share/doc/libfoo"
    assert keys[paths[17]] == "usr/lib/x86_64-linux-gnu"


def test_odd_names_and_hardlinks_across_units_restore_as_the_box(registry, base_ref, base_rootfs, tmp_path,
                                                                 small_bundles):
    """Names that are not UTF-8, hold a newline or are long, in a venv cut into bundles by their
    units' hashes; and two names of one file in two packages, kept in one bundle (Docker and podman
    refuse a link to a lower layer's file)."""
    box = venv_box(base_rootfs, str(tmp_path / "box"))
    site = os.path.join(box, SITE)
    os.makedirs(os.fsencode(os.path.join(site, "odd")) + b"/caf\xe9")
    for name in (b"caf\xe9/m\xff.py", b"new\nline.py", b"l" * 250 + b".py"):
        with open(os.fsencode(os.path.join(site, "odd")) + b"/" + name, "wb") as f:
            f.write(os.urandom(20 * KiB))
    with open(os.fsencode(site) + b"/\xfe\xfe.py", "wb") as f:
        f.write(os.urandom(20 * KiB))
    os.link(os.path.join(site, "pkg03", "core.py"), os.path.join(site, "pkg31", "same_as_pkg03.py"))
    commit_box(f"{registry.host}/odd:v1", base_ref, CommitOptions(root=box))
    out = tmp_path / "r"
    restore_image(f"{registry.host}/odd:v1", str(out))
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def pyyaml(version: str, rng: random.Random) -> dict:
    """A distribution whose packages are not named as it is (PyYAML installs yaml/ and _yaml/), its
    RECORD listing them, a script in the venv's bin/ and its own dist-info."""
    info = f"PyYAML-{version}.dist-info"
    files = {f"{SITE}/yaml/__init__.py": f"__version__ = {version!r}\n", f"{SITE}/yaml/core.py": os.urandom(60 * KiB),
             f"{SITE}/_yaml/__init__.py": os.urandom(30 * KiB), f"{SITE}/{info}/METADATA": f"Name: PyYAML\n{version}\n"}
    record = [f"{p[len(SITE) + 1:]},sha256=x,1" for p in files] + [f"{info}/RECORD,,",
                                                                   "../../../bin/yamlcheck,,", "/etc/shadow,,"]
    files[f"{SITE}/{info}/RECORD"] = "\n".join(record) + "\n"
    files["opt/app/venv/bin/yamlcheck"] = "#!/bin/sh\n"
    return files


def test_a_distribution_is_one_unit_as_its_record_says(registry, base_ref, base_rootfs, tmp_path, small_bundles):
    """yaml/, _yaml/ and PyYAML-*.dist-info are one unit because PyYAML's RECORD lists them (by their
    names they are three): an upgrade of it changes one bundle, which holds all of it."""
    box = venv_box(base_rootfs, str(tmp_path / "box"))
    write_tree(box, pyyaml("6.0.1", random.Random(3)))
    v1 = commit_box(f"{registry.host}/record:v1", base_ref, CommitOptions(root=box))
    assert holding(registry, "record", "v1", "venv", "yaml") == 1

    shutil.rmtree(os.path.join(box, SITE, "PyYAML-6.0.1.dist-info"))
    write_tree(box, pyyaml("6.0.2", random.Random(4)), mtime=1_700_000_005)
    v2 = commit_box(f"{registry.host}/record:v2", base_ref, CommitOptions(root=box))
    gone, new = changed(bundles(v1, "venv"), bundles(v2, "venv"))
    assert len(gone) == 1 and len(new) == 1, (gone, new)
    assert holding(registry, "record", "v2", "venv", "yaml") == 1


def test_owners_from_records(tmp_path):
    """Who owns a path: the RECORD that lists it; a file no RECORD lists (byte code compiled later),
    the owner of its nearest directory holding listed files of one distribution only; a path two
    RECORDs list (a namespace's __init__.py), the first dist-info by name. A RECORD that is not a
    regular file or is too big is not read; paths leaving the root are dropped."""
    from snapshotter.box import records
    from snapshotter.index.entry import FILE, Entry

    site = "venv/lib/python3.11/site-packages"
    tree = {f"{site}/PyYAML-6.0.1.dist-info/RECORD": "yaml/__init__.py,,\n_yaml/x.so,,\n../../../bin/y,,\n"
                                                     "../../../../../../../etc/passwd,,\nnvidia/__init__.py,,\n",
            f"{site}/nvidia_cublas-12.dist-info/RECORD": "nvidia/__init__.py,,\nnvidia/cublas/lib/a.so,,\n",
            f"{site}/huge-1.dist-info/RECORD": "huge/a.py,,\n" + "x" * 2000,
            f"{site}/yaml/__pycache__/__init__.cpython-311.pyc": "", "venv/bin/other": ""}
    write_tree(str(tmp_path), tree)
    os.mkfifo(tmp_path / site / "nvidia_cublas-12.dist-info" / "RECORD.fifo")
    entries = {p: Entry(p, FILE, 0o644, size=os.path.getsize(tmp_path / p), stamp="1:2:3") for p in tree}
    entries[f"{site}/x-1.dist-info/RECORD"] = Entry(f"{site}/x-1.dist-info/RECORD", FILE, 0o644, stamp="1:2:3")
    os.makedirs(tmp_path / site / "x-1.dist-info")
    os.mkfifo(tmp_path / site / "x-1.dist-info" / "RECORD")  # swapped for a FIFO since the scan: not read
    old_max, records.RECORD_MAX = records.RECORD_MAX, 1000
    try:
        owners = records.owners_of(str(tmp_path), entries)
    finally:
        records.RECORD_MAX = old_max
    yaml, cublas = f"{site}/PyYAML-6.0.1.dist-info", f"{site}/nvidia_cublas-12.dist-info"
    assert owners.owner_of(f"{site}/yaml/__init__.py") == owners.owner_of(f"{site}/_yaml/x.so") == yaml
    assert owners.owner_of(f"{site}/yaml/__pycache__/__init__.cpython-311.pyc") == yaml
    assert owners.owner_of("venv/bin/y") == yaml and owners.owner_of("venv/bin/other") is None
    assert owners.owner_of(f"{site}/nvidia/__init__.py") == yaml  # "PyYAML..." sorts before "nvidia..."
    assert owners.owner_of(f"{site}/nvidia/cublas/lib/a.so") == cublas
    assert owners.owner_of(f"{site}/nvidia/cudnn/lib/b.so") is None  # nvidia/ has two owners
    assert owners.owner_of(f"{site}/huge/a.py") is None and owners.owner_of("etc/passwd") is None
    keys = dict(zip([f"{site}/yaml/core.py", f"{site}/PyYAML-6.0.1.dist-info/METADATA"],
                    units_of([f"{site}/yaml/core.py", f"{site}/PyYAML-6.0.1.dist-info/METADATA"], owners)))
    assert len(set(keys.values())) == 1
