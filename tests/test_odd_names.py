"""One rule for odd names (issue 33): a name holding a newline, a carriage return, a tab, an escape
sequence, a backslash, bytes that are not UTF-8 is a name like any other. Commit takes it (and
watch, which commits), restore writes it, verify compares it, byte for byte; wherever snap prints
it, it is escaped. A name no layer can hold (`.wh.NAME`, which a layer reads as "delete NAME") is
refused by commit up front, in one line."""

from __future__ import annotations

import json
import os
import signal

import pytest

from snapshotter.errors import quoted_path

from support.images import push_annotated, repo_for
from support.run import assert_clean, assert_one_line_error, snap
from support.tars import member, tar_bytes
from support.trees import NOT_CAPTURED, SMALL_WEIGHTS, MiB, snapshot_of_tree
from support.watch import WatchProcess

# Each one a name of its own: "nl\\nx" (a backslash and an n) must not meet "nl\nx" anywhere.
ODD = ["nl\nsnap: error: forged", "nl\\nsnap: error: forged", "cr\rx", "tab\tx", "esc\x1b[2J", "back\\slash", "\\",
       "bad\udcff\udcfe", "del\x7f", "c1\x9b2J", "ends\n", "ls\u2028x", " lead and trail "]
ODD_DIR = "opt/app/odd\ndir\x1b[31m"
SITE = "opt/app/venv/lib/python3.11/site-packages"
WEIGHT = "opt/app/models/checkpoints/w\n\x1b[2J\udcff.safetensors"  # cut into part layers: its name is an annotation


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def odd_box(box: str) -> dict[str, str]:
    """The class of odd names in every place a name goes: files, a directory, a symlink (name and
    target), hard links, a package directory (a layer unit's key), a weight cut into part layers."""
    for n in ODD:
        _write(os.path.join(box, ODD_DIR, n), os.fsencode(n) + b"\n")
    os.symlink("nl\nsnap: error: forged", os.path.join(box, ODD_DIR, "link\t\x1b"))
    os.link(os.path.join(box, ODD_DIR, "tab\tx"), os.path.join(box, ODD_DIR, "hard\nlink"))
    _write(os.path.join(box, SITE, "pkg\nx\udcff", "__init__.py"), b"odd = True\n")
    _write(os.path.join(box, WEIGHT), bytes(range(256)) * (3 * MiB // 256))
    profile = os.path.join(os.path.dirname(box), "small-weights.yaml")
    with open(profile, "w") as f:
        f.write(SMALL_WEIGHTS)
    return {"profile": profile}


def run(*args, **kw):
    r = snap(*args, **kw)
    assert_clean(r)
    return r


def test_odd_names_commit_restore_verify_byte_for_byte_and_print_escaped(registry, base_ref, box, tmp_path):
    prof = odd_box(box)["profile"]
    ref = f"{registry.host}/odd-names:v1"
    commit = ("commit", ref, "--base", base_ref, "--root", box, "--profile", prof, "--max-layer-size", "1MiB")
    r = run(*commit, env={"SNAP_QUIET": "", "SNAP_PROGRESS": "lines"})
    assert r.returncode == 0, r.stderr
    r = run(*commit, "--json")  # again: the stat cache holds the names
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["layers"] and "Traceback" not in r.stderr
    want = snapshot_of_tree(box, skip=NOT_CAPTURED)
    assert {os.path.join(ODD_DIR, n) for n in ODD} <= want.keys() and WEIGHT in want

    out = tmp_path / "out"
    r = run("restore", ref, "--root", str(out), env={"SNAP_QUIET": "", "SNAP_PROGRESS": "lines"})
    assert r.returncode == 0, r.stderr
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == want
    r = run("verify", ref, "--root", str(out), env={"SNAP_QUIET": "", "SNAP_PROGRESS": "lines"})
    assert (r.returncode, r.stdout.count("\n")) == (0, 1) and " matches " in r.stdout, r.stdout + r.stderr

    # A pod restart: the snap layers already on the volume are found there (hashed from the skeletons).
    r = run("restore", ref, "--root", str(out), "--only-snapshot", "--json",
            env={"SNAP_STATE_DIR": str(tmp_path / "s2")})
    assert r.returncode == 0 and json.loads(r.stdout)["skipped_layers"] >= 1, r.stdout + r.stderr
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == want

    # What differs is one line per path, quoted and escaped: a name cannot forge a line.
    changed, gone, extra = (os.path.join(ODD_DIR, n) for n in ("nl\nsnap: error: forged", "esc\x1b[2J", "new\r\x1b[K"))
    _write(str(out / changed), b"changed\n")
    os.unlink(out / gone)
    _write(str(out / extra), b"extra\n")
    r = run("verify", ref, "--root", str(out), "--strict")
    assert r.returncode == 9, r.stdout + r.stderr
    assert sorted(r.stdout.splitlines()) == sorted([f"{quoted_path(changed)}: content differs: 8 bytes, expected "
                                                    f"{len(os.fsencode(changed.rpartition('/')[2])) + 1}",
                                                    f"{quoted_path(gone)}: missing (expected a file)",
                                                    f"{quoted_path(extra)}: extra (not in the image)"]), r.stdout
    r = run("verify", ref, "--root", str(out), "--json")
    assert {d["path"] for d in json.loads(r.stdout)["differences"]} == {"/" + changed, "/" + gone}


def test_a_root_whose_path_is_not_utf8_commits_restores_and_verifies(registry, tmp_path):
    """A root (box or restore target) whose own path holds a byte that is not UTF-8: its files in the
    state dir are named by the path's bytes; no internal error."""
    box = os.path.join(str(tmp_path), "box\udcff\x1b")  # b"box\xff\x1b" on disk
    _write(os.path.join(box, "opt/app/f.txt"), b"in an odd root\n")
    ref = f"{registry.host}/odd-root:v1"
    for args in (("status", "--base", "scratch", "--root", box),
                 ("commit", ref, "--base", "scratch", "--root", box)):
        r = run(*args)
        assert r.returncode == 0 and "internal error" not in r.stderr, r.stderr
    out = os.path.join(str(tmp_path), "out\udcfe")
    assert run("restore", ref, "--root", out).returncode == 0
    assert snapshot_of_tree(out) == snapshot_of_tree(box)
    r = run("verify", ref, "--root", out)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_watcher_snapshots_odd_names_and_logs_them_escaped(registry, base_ref, box, tmp_path):
    odd_box(box)
    p = WatchProcess(f"{registry.host}/oddwatch:v2", "--base", base_ref, "--root", box, "--every", "1h",
                     env={"SNAP_WATCH_QUIET": "3600", "SNAP_QUIET": "", "SNAP_PROGRESS": "lines"})
    p.wait_for(" moved to it")  # the first snapshot
    _write(os.path.join(box, ODD_DIR, "later\n\x1b[2J\udcff"), b"saved by the final snapshot\n")
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 0, "".join(p.seen)
    assert not [c for line in p.seen for c in line.rstrip("\n") if not c.isprintable()], p.seen
    out = tmp_path / "out"
    assert run("restore", f"{registry.host}/oddwatch:v2", "--root", str(out)).returncode == 0
    assert snapshot_of_tree(str(out), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


WHITEOUT_NAMES = [".wh.config", ".wh..wh..opq", ".wh.dir\n\x1b[2J/"]


def _whiteout_named(box: str, name: str) -> str:
    rel = "opt/app/" + name.rstrip("/")
    if name.endswith("/"):
        _write(os.path.join(box, rel, "inside"), b"x")
    else:
        _write(os.path.join(box, rel), b"x")
    return rel


@pytest.mark.parametrize("name", WHITEOUT_NAMES)
def test_a_name_no_layer_can_hold_is_refused_up_front_in_one_line(registry, base_ref, box, name):
    """`.wh.NAME` in the box: a layer holding it would delete NAME on restore. Commit and status
    refuse it before anything is sent, naming it escaped; exit 2."""
    rel = _whiteout_named(box, name)
    target = f"{registry.host}/whiteout-named:v1"
    for args in (("commit", target, "--base", base_ref, "--root", box), ("status", "--base", base_ref, "--root", box)):
        r = run(*args)
        assert_one_line_error(r, 2, quoted_path(rel), "whiteout", "exclude")
    assert registry.session().get(f"{registry.url}/v2/whiteout-named/tags/list").status_code == 404


@pytest.mark.parametrize("name, later", [(WHITEOUT_NAMES[0], False), (WHITEOUT_NAMES[2], False),
                                         (WHITEOUT_NAMES[1], True), (WHITEOUT_NAMES[2], True)])
def test_a_watcher_leaves_out_a_name_no_layer_can_hold_and_saves_the_rest(registry, base_ref, box, tmp_path, request,
                                                                         name, later):
    """The same name under `snap watch` (there when it starts, or made while it watches) is left out
    and named once, escaped; the rest of the box, a change made after it included, is snapshotted
    and the final snapshot exits 0. A watcher that stopped over one name left the box unsaved."""
    target = f"{registry.host}/{repo_for(request)}:v1"
    rel = None if later else _whiteout_named(box, name)
    p = WatchProcess(target, "--base", base_ref, "--root", box, "--every", "1h",
                     env={"SNAP_WATCH_QUIET": "3600", "SNAP_QUIET": "", "SNAP_PROGRESS": "lines"})
    p.wait_for(" moved to it")  # the first snapshot
    if later:
        rel = _whiteout_named(box, name)
    _write(os.path.join(box, "opt/app/after.txt"), b"saved by the final snapshot\n")
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 0, "".join(p.seen)
    told = [line for line in p.seen if "left out: " + quoted_path(rel) in line]
    assert len(told) == 1 and "whiteout" in told[0], "".join(p.seen)
    assert not [c for line in p.seen for c in line.rstrip("\n") if not c.isprintable()], p.seen
    out = tmp_path / "out"
    assert run("restore", target, "--root", str(out)).returncode == 0
    assert not os.path.lexists(os.path.join(out, rel))
    assert os.path.exists(os.path.join(out, "opt/app/after.txt"))
    skip = (*NOT_CAPTURED, rel)
    assert snapshot_of_tree(str(out), skip=skip) == snapshot_of_tree(box, skip=skip)


def test_an_image_with_odd_names_restores_and_verifies_alike(registry, request, tmp_path):
    """An image snap did not make: the same names, a part layer naming its file with a newline."""
    names = [f"d/{n}" for n in ODD] + ["d/sub\n/x"]
    part = "d/big\x1b\nsnap: error: x"
    ref = push_annotated(registry, repo_for(request), [
        (tar_bytes(member("d/", "dir"), member("d/sub\n/", "dir"),
                   *(member(n, data=n.encode("utf-8", "surrogateescape"))
                                                                     for n in names)), {}),
        (tar_bytes(member(f"{part}.snap-part-0001-of-0001", data=b"whole")),
         {"dev.snap.layer": "models", "dev.snap.content": f"part 1/1 of {part}", "dev.snap.part": "1/1",
          "dev.snap.part-file": part}),
    ])
    root = tmp_path / "root"
    assert run("restore", ref, "--root", str(root)).returncode == 0
    got = snapshot_of_tree(str(root))
    assert set(names) | {part} <= got.keys() and (root / part).read_bytes() == b"whole"
    r = run("verify", ref, "--root", str(root))
    assert r.returncode == 0, r.stdout + r.stderr
