"""A restore onto a live root counts what the layers delete, from their tar headers, before
anything is written (issue 33, class 1): hostile snapshots whose whiteouts, opaque markers or
replacing files delete usr/bin, usr/lib, usr/share or etc/passwd are refused (exit 6, one line,
the root unchanged) whatever the manifest's `dev.snap.deletes` says, with or without a skeleton,
and a skeleton that lies cannot let a layer delete more than was counted. `--force` applies them;
an honest snapshot that deletes a few files restores as before. A member over a link to a
directory (/bin -> usr/bin) deletes the link; members the extractor does not make re-add nothing;
a directory emptied one whiteout at a time is a deleted one; a file joined from part layers, or
one of its names, never replaces a directory."""

import hashlib
import io
import json
import os
import tarfile

import pytest

from snapshotter.snapshot.skeleton import PieceWriter, parse

from support.images import part_ann, push_annotated
from support.run import assert_one_line_error, snap
from support.tars import member, tar_bytes
from support.trees import snapshot_of_tree, write_tree

APP = {"dev.snap.layer": "app"}  # a snap layer's annotation


def live_root(tmp_path) -> str:
    """A live system (etc/os-release): 4 + 60 + 60 + 40 + 80 files in bin, etc, usr/bin, usr/lib, usr/share."""
    root = str(tmp_path / "live")
    files = {"bin/sh": "#!", "etc/os-release": "NAME=live\n", "etc/passwd": "root:x:0:0::/root:/bin/sh\n",
             "etc/group": "root:x:0:\n", "opt/app/main.py": "print('app')\n"}
    files.update({f"usr/bin/tool{i}": f"tool {i}\n" for i in range(60)})
    files.update({f"usr/lib/lib{i}.so": f"lib {i}\n" for i in range(60)})
    files.update({f"usr/share/doc/pkg{i}/README": f"doc {i}\n" for i in range(40)})
    files.update({f"etc/ssl/certs/ca{i}.pem": f"ca {i}\n" for i in range(120)})
    files.update({f"etc/nginx/site{i}.conf": f"site {i}\n" for i in range(5)})
    write_tree(root, files)
    return root


def diff_id(tar: bytes) -> str:
    return "sha256:" + hashlib.sha256(tar).hexdigest()


def skeleton_of(tar: bytes, key: bytes | None = None) -> bytes:
    """The skeleton piece snap commit writes for a layer tar (its exact headers), keyed by the diff_id
    of `key` (another tar: a skeleton that lies about the layer it names) or of the tar itself."""
    piece = PieceWriter()
    piece.start()
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        for m in t.getmembers():
            piece.add(tar[m.offset:m.offset_data], m.size if m.isreg() else 0)
    return piece.finish(diff_id(key if key is not None else tar))


def push_snapshot(registry, repo: str, tars: list[bytes], skeletons: list[bytes] | None = None,
                  annotations: dict | None = None, layer_annotations: dict | None = APP, zstd: bool = False,
                  one_blob: bool = False) -> str:
    """A snapshot of `tars` (all its layers snap's: --only-snapshot applies them all), with the
    skeleton pieces `skeletons` as snap commit names them: each as the headers blob of the layer
    whose diff_id it names (dev.snap.headers), or with `one_blob` as an older snapshot's one
    skeleton blob (dev.snap.skeleton); and more manifest annotations."""
    ann = {"dev.snap.base-layers": "0", **(annotations or {})}
    per_layer = [dict(layer_annotations) if layer_annotations else None for _ in tars]
    if skeletons and one_blob:
        ann["dev.snap.skeleton"] = registry.push_blob(repo, b"".join(skeletons))
    elif skeletons:
        ids = [diff_id(t) for t in tars]
        for piece in skeletons:
            (named,) = parse(piece)
            i = ids.index(named)
            per_layer[i] = {**(per_layer[i] or {}), "dev.snap.headers": registry.push_blob(repo, piece)}
    return push_annotated(registry, repo, list(zip(tars, per_layer)), ann, zstd=zstd)


def whiteout(name: str):
    return member(name)  # an empty regular file, as OCI whiteouts are


HOSTILE_WHITEOUTS = tar_bytes(whiteout("etc/.wh.passwd"), whiteout("usr/.wh.bin"), whiteout("usr/.wh.lib"),
                              whiteout("usr/.wh.share"), member("opt/app/new.py", data=b"new\n"))
HOSTILE_OPAQUE = tar_bytes(member("usr/bin/", "dir"), whiteout("usr/bin/.wh..wh..opq"),
                           member("usr/lib/", "dir"), whiteout("usr/lib/.wh..wh..opq"),
                           member("usr/share/", "dir"), whiteout("usr/share/.wh..wh..opq"),
                           member("usr/bin/tool0", data=b"mine\n"))
HONEST = tar_bytes(whiteout("usr/bin/.wh.tool3"), whiteout("usr/share/doc/pkg7/.wh.README"),
                   whiteout("etc/.wh.nginx"), member("opt/app/new.py", data=b"new\n"))


def hostile(registry, which: str) -> str:
    """Each way a snapshot tried to delete the live root's system past the old guard."""
    repo = f"guard33/{which}"
    if which == "whiteouts":
        return push_snapshot(registry, repo, [HOSTILE_WHITEOUTS], [skeleton_of(HOSTILE_WHITEOUTS)])
    if which == "opaque":
        return push_snapshot(registry, repo, [HOSTILE_OPAQUE], [skeleton_of(HOSTILE_OPAQUE)])
    if which == "forged-record":  # the manifest says it deletes nothing
        forged = {"dev.snap.deletes": json.dumps({"paths": 0, "of": 251, "top": []})}
        return push_snapshot(registry, repo, [HOSTILE_WHITEOUTS], [skeleton_of(HOSTILE_WHITEOUTS)], forged)
    if which == "no-skeleton":  # a foreign layer: no skeleton, no snap annotation
        return push_snapshot(registry, repo, [HOSTILE_WHITEOUTS], None, layer_annotations=None)
    if which == "skeleton-without-it":  # the skeleton has the other layer only
        other = tar_bytes(member("opt/app/other.py", data=b"other\n"))
        return push_snapshot(registry, repo, [other, HOSTILE_OPAQUE], [skeleton_of(other)])
    if which == "lying-skeleton":  # the skeleton under its diff_id holds no deletion
        decoy = tar_bytes(member("opt/app/decoy.py", data=b"decoy\n"))
        return push_snapshot(registry, repo, [HOSTILE_WHITEOUTS], [skeleton_of(decoy, key=HOSTILE_WHITEOUTS)])
    if which == "lying-skeleton-one-blob":  # the same in an older snapshot's one skeleton blob
        decoy = tar_bytes(member("opt/app/decoy.py", data=b"decoy\n"))
        return push_snapshot(registry, repo, [HOSTILE_WHITEOUTS], [skeleton_of(decoy, key=HOSTILE_WHITEOUTS)],
                             one_blob=True)
    if which == "lying-skeleton-parallel":  # the same, among layers applied at once (zstd)
        decoy = tar_bytes(member("opt/app/decoy.py", data=b"decoy\n"))
        others = [tar_bytes(member(f"opt/app/m{i}.py", data=b"m\n")) for i in range(3)]
        return push_snapshot(registry, repo, [*others, HOSTILE_WHITEOUTS],
                             [*(skeleton_of(t) for t in others), skeleton_of(decoy, key=HOSTILE_WHITEOUTS)], zstd=True)
    if which == "skeleton-credit":  # layer 2's skeleton says it writes again all layer 1 deletes; it writes one file
        claim = written_again()
        innocent = tar_bytes(member("opt/app/innocent.py", data=b"x\n"))
        return push_snapshot(registry, repo, [HOSTILE_OPAQUE, innocent],
                             [skeleton_of(HOSTILE_OPAQUE), skeleton_of(claim, key=innocent)])
    if which == "skeleton-credit-after-stream":  # layer 1's skeleton hides two whiteouts layer 2's credits
        share = [member("usr/share/", "dir"), whiteout("usr/share/.wh..wh..opq"),
                 *(member(d, "dir") for d in ["usr/share/doc/", *(f"usr/share/doc/pkg{i}/" for i in range(40))]),
                 *(member(p, data=b"again\n") for p in SYSTEM_FILES if p.startswith("usr/share/"))]
        first, first_said = tar_bytes(*share, whiteout("usr/.wh.bin"), whiteout("usr/.wh.lib")), tar_bytes(*share)
        claim = tar_bytes(*(member(p, data=b"again\n") for p in SYSTEM_FILES if not p.startswith("usr/share/")))
        innocent = tar_bytes(member("opt/app/innocent.py", data=b"x\n"))
        return push_snapshot(registry, repo, [first, innocent],
                             [skeleton_of(first_said, key=first), skeleton_of(claim, key=innocent)])
    if which == "file-over-dir":  # a regular file where usr/lib is: the extractor removes the tree
        tar = tar_bytes(member("usr/lib", data=b"not a directory\n"))
        return push_snapshot(registry, repo, [tar], [skeleton_of(tar)])
    if which == "big-system-dir":  # etc/ssl holds 121 paths
        tar = tar_bytes(whiteout("etc/.wh.ssl"))
        return push_snapshot(registry, repo, [tar], [skeleton_of(tar)])
    raise AssertionError(which)


KINDS = ["whiteouts", "opaque", "forged-record", "no-skeleton", "skeleton-without-it", "lying-skeleton",
         "lying-skeleton-one-blob", "skeleton-credit", "skeleton-credit-after-stream", "file-over-dir",
         "big-system-dir"]
# the files live_root holds in the directories HOSTILE_OPAQUE empties
SYSTEM_FILES = [*(f"usr/bin/tool{i}" for i in range(60)), *(f"usr/lib/lib{i}.so" for i in range(60)),
                *(f"usr/share/doc/pkg{i}/README" for i in range(40))]


def written_again() -> bytes:
    """A layer that writes again every path HOSTILE_OPAQUE deletes of live_root, directories too."""
    dirs = ["usr/share/doc/", *(f"usr/share/doc/pkg{i}/" for i in range(40))]
    return tar_bytes(*(member(d, "dir") for d in dirs), *(member(p, data=b"again\n") for p in SYSTEM_FILES))


@pytest.mark.parametrize("which", KINDS)
def test_a_snapshot_that_deletes_the_live_system_is_refused_and_the_root_is_unchanged(which, registry, tmp_path):
    ref = hostile(registry, which)
    root = live_root(tmp_path)
    before = snapshot_of_tree(root)
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    assert_one_line_error(r, 6, repr(root), "live system", "--force")
    line = next(line for line in r.stderr.splitlines() if line.startswith("snap: error:"))
    if which.startswith("lying-skeleton"):  # counted as deleting nothing: the extractor refuses its first whiteout
        assert "'/etc/.wh.passwd'" in line, line
    else:  # counted: the directories named, each with the paths it deletes (a re-added one not)
        shown = {"big-system-dir": ["'/etc/ssl' 122 paths"], "opaque": ["'/usr/bin' 59 paths", "'/usr/lib' 60 paths"],
                 "skeleton-credit": ["'/usr/bin' 59 paths", "'/usr/lib' 60 paths"],
                 "skeleton-credit-after-stream": ["'/usr/bin' 61 paths", "'/usr/lib' 61 paths"],
                 "skeleton-without-it": ["'/usr/bin' 59 paths"], "file-over-dir": ["'/usr/lib' 60 paths"]
                 }.get(which, ["'/usr/bin' 61 paths", "'/usr/lib' 61 paths"])
        assert all(s in line for s in shown), line
    assert snapshot_of_tree(root) == before  # nothing written, nothing deleted
    assert not [n for n in os.listdir(root) if n.startswith(".snap-")]


def test_a_snapshot_that_empties_system_directories_and_writes_them_again_restores(registry, tmp_path):
    """The deletions a later layer makes good are not counted: on its skeleton's word once its own
    headers are read (the deletions would be the system's without it), and the root is the image's."""
    again = written_again()
    ref = push_snapshot(registry, "guard33/written-again", [HOSTILE_OPAQUE, again],
                        [skeleton_of(HOSTILE_OPAQUE), skeleton_of(again)])
    root = live_root(tmp_path)
    snap("restore", ref, "--root", root, "--only-snapshot", check=True)
    tree = snapshot_of_tree(root)
    assert sorted(p for p in tree if p.startswith(("usr/bin/", "usr/lib/")) or p.endswith("/README")) == sorted(
        SYSTEM_FILES)
    assert all(open(os.path.join(root, p)).read() == "again\n" for p in SYSTEM_FILES)


def test_a_lying_skeleton_among_layers_applied_at_once_deletes_nothing(registry, tmp_path):
    """The parallel applier's workers get the counted deletions too: the system stays."""
    ref = hostile(registry, "lying-skeleton-parallel")
    root = live_root(tmp_path)
    system = {p: v for p, v in snapshot_of_tree(root).items() if p.startswith(("usr", "etc"))}
    r = snap("restore", ref, "--root", root, "--only-snapshot", "--jobs", "4")
    assert_one_line_error(r, 6, "'/etc/.wh.passwd'", "live system", "--force")
    assert {p: v for p, v in snapshot_of_tree(root).items() if p.startswith(("usr", "etc"))} == system


@pytest.mark.parametrize("which", ["whiteouts", "opaque", "no-skeleton", "lying-skeleton", "lying-skeleton-parallel",
                                   "file-over-dir"])
def test_force_applies_them(which, registry, tmp_path):
    ref = hostile(registry, which)
    root = live_root(tmp_path)
    snap("restore", ref, "--root", root, "--only-snapshot", "--force", check=True)
    lib = os.path.join(root, "usr/lib")
    if which == "file-over-dir":
        assert os.path.isfile(lib)
    elif which == "opaque":
        assert os.listdir(os.path.join(root, "usr/bin")) == ["tool0"] and os.listdir(lib) == []
    else:
        assert not os.path.exists(lib) and not os.path.exists(os.path.join(root, "etc/passwd"))


@pytest.mark.parametrize("with_skeleton", [True, False], ids=["skeleton", "streamed"])
def test_an_honest_snapshot_that_deletes_a_few_files_restores(with_skeleton, registry, tmp_path):
    """Deleting two files and a package's small directory of /etc (5 paths) is not the system."""
    ref = push_snapshot(registry, f"guard33/honest-{str(with_skeleton).lower()}", [HONEST],
                        [skeleton_of(HONEST)] if with_skeleton else None)
    root = live_root(tmp_path)
    before = snapshot_of_tree(root)
    snap("restore", ref, "--root", root, "--only-snapshot", check=True)
    after = snapshot_of_tree(root)
    gone = {"usr/bin/tool3", "usr/share/doc/pkg7/README", "etc/nginx", *(f"etc/nginx/site{i}.conf" for i in range(5))}
    assert set(before) - set(after) == gone
    assert set(after) - set(before) == {"opt/app/new.py"}
    touched = ("opt", "usr/bin", "usr/share/doc/pkg7", "etc")
    assert {p: v for p, v in after.items() if not p.startswith(touched)} == \
        {p: v for p, v in before.items() if not p.startswith(touched) and p not in gone}


def test_a_link_a_layer_plants_cannot_carry_a_counted_whiteout_elsewhere(registry, tmp_path):
    """x -> usr, then x/.wh.bin: counted as /x/bin (nothing there), it would delete /usr/bin."""
    tar = tar_bytes(member("x", "symlink", linkname="usr"), whiteout("x/.wh.bin"))
    ref = push_snapshot(registry, "guard33/planted-link", [tar], [skeleton_of(tar)])
    root = live_root(tmp_path)
    bins = {p: v for p, v in snapshot_of_tree(root).items() if p.startswith("usr/bin")}
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    assert_one_line_error(r, 6, "'/x/.wh.bin'", "'/usr/bin'")
    assert {p: v for p, v in snapshot_of_tree(root).items() if p.startswith("usr/bin")} == bins


@pytest.mark.parametrize("marker", [".wh.bin", "bin/.wh..wh..opq", "bin/.wh.tool5"],
                         ids=["link", "through-link", "one-file"])
def test_a_merged_usr_root_is_judged_where_its_links_lead(marker, registry, tmp_path):
    """/bin -> usr/bin: deleting the link deletes /bin; an opaque bin/ empties /usr/bin; one file through it
    is one file."""
    tar = tar_bytes(whiteout(marker))
    ref = push_snapshot(registry, f"guard33/merged-{marker.replace('.', '-').replace('/', '-').strip('-')}", [tar],
                        [skeleton_of(tar)])
    root = live_root(tmp_path)
    os.rename(os.path.join(root, "bin/sh"), os.path.join(root, "usr/bin/sh"))
    os.rmdir(os.path.join(root, "bin"))
    os.symlink("usr/bin", os.path.join(root, "bin"))
    before = snapshot_of_tree(root)
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    if marker.endswith("tool5"):
        assert r.returncode == 0, r.stderr
        assert set(before) - set(snapshot_of_tree(root)) == {"usr/bin/tool5"}
        return
    assert_one_line_error(r, 6, "'/bin'" if marker == ".wh.bin" else "'/usr/bin' 61 paths", "--force")
    assert snapshot_of_tree(root) == before


def test_the_count_walks_only_the_deleted_trees(tmp_path):
    """A few deletions on a root of thousands of paths: the rest of the root is looked at only until
    it is more than twice what is deleted (enough for the half rule), never walked whole."""
    from snapshotter.box.deletions import Deleting, LiveRoot, count_live

    root = live_root(tmp_path)
    write_tree(root, {f"data/set{i // 100}/f{i}": "x" for i in range(3000)})
    looked: list[str] = []
    live = LiveRoot(root, lambda rel: looked.append(rel) or False)
    d, where = count_live(live, [Deleting("usr/bin/.wh.tool3", "usr/bin", "tool3"),
                                 Deleting("usr/share/doc/.wh.pkg7", "usr/share/doc", "pkg7")], set())
    assert (d.paths, d.deletes_system, d.exact) == (3, False, False) and d.of == 7
    assert len(looked) < 20, len(looked)
    assert where == {"usr/bin/.wh.tool3": "usr/bin/tool3", "usr/share/doc/.wh.pkg7": "usr/share/doc/pkg7"}


def merged_usr(root: str) -> str:
    """The live root made merged-usr: /bin -> usr/bin, /lib64 -> usr/lib64 (which holds ld.so)."""
    os.rename(os.path.join(root, "bin/sh"), os.path.join(root, "usr/bin/sh"))
    os.rmdir(os.path.join(root, "bin"))
    os.symlink("usr/bin", os.path.join(root, "bin"))
    write_tree(root, {"usr/lib64/ld.so": "ld\n"})
    os.symlink("usr/lib64", os.path.join(root, "lib64"))
    return root


OVER_LINKS = {"dir-over-bin": tar_bytes(member("bin/", "dir")),
              "file-over-bin": tar_bytes(member("bin", data=b"not a link\n")),
              "symlink-over-lib64": tar_bytes(member("lib64", "symlink", linkname="/nonexistent"))}


@pytest.mark.parametrize("which", [*OVER_LINKS, "lying-skeleton"])
def test_a_member_over_a_top_level_link_deletes_the_link(which, registry, tmp_path):
    """On a merged-usr root, any member landing on /bin or /lib64 (a directory too) replaces the link."""
    tar = OVER_LINKS["dir-over-bin" if which == "lying-skeleton" else which]
    decoy = tar_bytes(member("opt/app/decoy.py", data=b"decoy\n"))
    ref = push_snapshot(registry, f"guard33/over-{which}", [tar],
                        [skeleton_of(decoy, key=tar) if which == "lying-skeleton" else skeleton_of(tar)])
    root = merged_usr(live_root(tmp_path))
    before = snapshot_of_tree(root)
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    shown = "'/lib64'" if "lib64" in which else "'/bin'"
    assert_one_line_error(r, 6, shown, "live system", "--force")
    assert snapshot_of_tree(root) == before
    snap("restore", ref, "--root", root, "--only-snapshot", "--force", check=True)
    replaced = os.path.join(root, shown.strip("'/"))
    if which == "symlink-over-lib64":
        assert os.readlink(replaced) == "/nonexistent"  # the image's own link
    else:
        assert not os.path.islink(replaced)


def test_a_layer_that_writes_a_top_level_link_again_restores(registry, tmp_path):
    """The same link (a commit that saw /bin's times change) deletes nothing."""
    tar = tar_bytes(member("bin", "symlink", linkname="usr/bin"), member("opt/app/new.py", data=b"new\n"))
    ref = push_snapshot(registry, "guard33/same-link", [tar], [skeleton_of(tar)])
    root = merged_usr(live_root(tmp_path))
    snap("restore", ref, "--root", root, "--only-snapshot", check=True)
    assert os.readlink(os.path.join(root, "bin")) == "usr/bin" and len(os.listdir(os.path.join(root, "bin"))) == 61


def unmade_then_deleted(registry, which: str) -> str:
    """usr/bin and usr/lib deleted, their files written again only by what the deletion does not spare."""
    names = [f"usr/bin/tool{i}" for i in range(60)] + [f"usr/lib/lib{i}.so" for i in range(60)]
    gone = [whiteout("usr/.wh.bin"), whiteout("usr/.wh.lib")]
    if which == "devices":  # device nodes: not made without --allow-devices
        tars = [tar_bytes(*(member(n, "char", dev=(1, 3)) for n in names), *gone)]
    else:  # written by an earlier layer: the later one deletes them
        tars = [tar_bytes(*(member(n, data=b"again\n") for n in names)), tar_bytes(*gone)]
    return push_snapshot(registry, f"guard33/unmade-{which}", tars, [skeleton_of(t) for t in tars])


@pytest.mark.parametrize("which", ["devices", "earlier-layer"])
def test_members_that_do_not_outlive_the_deletion_hide_nothing(which, registry, tmp_path):
    ref = unmade_then_deleted(registry, which)
    root = live_root(tmp_path)
    before = snapshot_of_tree(root)
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    assert_one_line_error(r, 6, "'/usr/bin' 61 paths", "'/usr/lib' 61 paths", "live system")
    assert snapshot_of_tree(root) == before
    snap("restore", ref, "--root", root, "--only-snapshot", "--force", check=True)
    assert not os.path.exists(os.path.join(root, "usr/bin"))


EMPTYING = [f"usr/bin/.wh.tool{i}" for i in range(60)] + [f"usr/lib/.wh.lib{i}.so" for i in range(60)] + ["bin/.wh.sh"]


def test_a_directory_emptied_one_file_at_a_time_is_a_deleted_one(registry, tmp_path):
    tar = tar_bytes(*(whiteout(n) for n in EMPTYING))
    ref = push_snapshot(registry, "guard33/emptying", [tar], [skeleton_of(tar)])
    root = live_root(tmp_path)
    write_tree(root, {f"data/f{i}": "x" for i in range(400)})  # under the half rule
    before = snapshot_of_tree(root)
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    assert_one_line_error(r, 6, "'/bin' 1 paths", "'/usr/bin' 60 paths", "'/usr/lib' 60 paths", "live system")
    assert snapshot_of_tree(root) == before
    snap("restore", ref, "--root", root, "--only-snapshot", "--force", check=True)
    assert os.listdir(os.path.join(root, "usr/bin")) == [] and os.listdir(os.path.join(root, "bin")) == []


def test_commit_judges_a_directory_emptied_one_file_at_a_time():
    """The same rule at commit: the base's usr/bin loses each of its files, one by one."""
    from snapshotter.box.deletions import count
    from snapshotter.index.entry import DIR, Entry

    index = {rel: Entry(rel, DIR, 0o755) for rel in ("usr", "usr/bin", "usr/share", "etc")}
    index.update({rel: Entry(rel, "file", 0o644) for rel in
                  [f"usr/bin/tool{i}" for i in range(60)] + [f"usr/share/f{i}" for i in range(200)] + ["etc/passwd"]})
    d = count(index, [f"usr/bin/tool{i}" for i in range(60)])
    assert d.deletes_system and d.system == ["usr/bin"] and d.paths == 60
    assert not count(index, [f"usr/bin/tool{i}" for i in range(59)]).deletes_system
    # A top-level directory that is not the system's, emptied (the base's files in /workspace or
    # /root deleted), is a box's own business; deleted whole, it still counts.
    index.update({rel: Entry(rel, DIR, 0o755) for rel in ("workspace", "root")})
    index.update({rel: Entry(rel, "file", 0o644) for rel in ("workspace/README.md", "root/.bashrc", "root/.profile")})
    assert not count(index, ["workspace/README.md", "root/.bashrc", "root/.profile"]).deletes_system
    assert count(index, ["workspace"]).top == ["workspace"]


def test_emptying_a_directory_that_is_not_the_system_restores(registry, tmp_path):
    """The base's files in /workspace and /root deleted one by one: not the system, restored."""
    tar = tar_bytes(whiteout("workspace/.wh.README.md"), whiteout("root/.wh..bashrc"), whiteout("root/.wh..profile"))
    ref = push_snapshot(registry, "guard33/emptying-own", [tar], [skeleton_of(tar)])
    root = live_root(tmp_path)
    write_tree(root, {"workspace/README.md": "hi\n", "root/.bashrc": "x\n", "root/.profile": "y\n"})
    snap("restore", ref, "--root", root, "--only-snapshot", check=True)
    assert os.listdir(os.path.join(root, "workspace")) == [] and os.listdir(os.path.join(root, "root")) == []


def part_snapshot(registry, repo: str, path: str, links: list[str], first: bytes = b"") -> str:
    """A file cut into two part layers, with other names (dev.snap.part-links) on the last, after a layer `first`."""
    def part(k: int) -> bytes:
        return tar_bytes(member(f"{path}.snap-part-{k:04d}-of-0002", data=b"part %d\n" % k))

    last = {**part_ann(path, "2/2"), "dev.snap.part-links": json.dumps(links)}
    layers = ([(first, APP)] if first else []) + [(part(1), part_ann(path, "1/2")), (part(2), last)]
    return push_annotated(registry, repo, layers, {"dev.snap.base-layers": "0"})


@pytest.mark.parametrize("which", ["links", "file-named-bin"])
def test_a_joined_file_never_replaces_a_directory(which, registry, tmp_path):
    """Forged part annotations name /usr/lib, /usr/bin, /etc, or the /bin link, as what the join makes."""
    if which == "links":
        ref = part_snapshot(registry, "guard33/part-links", "opt/big", ["usr/lib", "usr/bin", "etc"])
    else:
        ref = part_snapshot(registry, "guard33/part-bin", "bin", [])
    root = live_root(tmp_path)
    if which == "file-named-bin":
        merged_usr(root)
    before = snapshot_of_tree(root)
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    assert_one_line_error(r, 6, "'/usr/lib'" if which == "links" else "'/bin'", "hostile image")
    assert snapshot_of_tree(root) == before
    # Not a deletion to allow: refused when joining (the parts applied), the system kept.
    r = snap("restore", ref, "--root", root, "--only-snapshot", "--force")
    assert_one_line_error(r, 6, "hostile image")
    after = snapshot_of_tree(root)
    assert {p: after.get(p) for p in before} == before


def test_a_joined_file_never_replaces_a_directory_its_layers_made(registry, tmp_path):
    """Checked again when joining: a directory the image's own layers put where a name of the file goes."""
    made = tar_bytes(member("opt/made/", "dir"), member("opt/made/keep", data=b"keep\n"))
    ref = part_snapshot(registry, "guard33/part-over-made", "opt/big", ["opt/made"], first=made)
    root = live_root(tmp_path)
    r = snap("restore", ref, "--root", root, "--only-snapshot")
    assert_one_line_error(r, 6, "'/opt/made'", "hostile image")
    assert os.listdir(os.path.join(root, "opt/made")) == ["keep"]
