"""The system calls a layer of many small files costs (layer/extract.py): a venv is tens of
thousands of them, and each call per file shows in a restore's time. A file new in a directory the
layer made is created with its mode and this process's owner, so neither is set again; a directory
the layer made is its members' parent without a lookup of the path to it. The tree is the same."""

import io
import os
import stat
import struct
import tarfile

import pytest

from snapshotter.layer.extract import Extractor

from support.images import push
from support.run import snap
from support.tars import member, tar_bytes

DEPTH, LEAVES, FILES = 8, 12, 5


def _venv_like() -> bytes:
    """LEAVES directories DEPTH deep, each with FILES plain files (and one owned by another user)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        made = set()
        for leaf in range(LEAVES):
            parts = ["venv", "lib", "python3.11", "site-packages", f"pkg{leaf}", "sub", "deeper", "deepest"][:DEPTH]
            for k in range(1, len(parts) + 1):
                d = "/".join(parts[:k])
                if d not in made:
                    made.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, 1_600_000_000
                    t.addfile(ti)
            for n in range(FILES):
                data = b"x = %d\n" % n
                ti = tarfile.TarInfo(f"{d}/mod{n}.py")
                ti.size, ti.mode, ti.mtime = len(data), 0o644 if n else 0o755, 1_600_000_000 + n
                ti.uid = ti.gid = os.geteuid() if n != 1 else 4321
                t.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def counted(monkeypatch):
    calls = {"lstat": 0, "fchmod": 0, "fchown": 0}
    real = {name: getattr(os, name) for name in ("lstat", "chmod", "chown")}

    def lstat(path, *a, **kw):
        calls["lstat"] += 1
        return real["lstat"](path, *a, **kw)

    def chmod(path, *a, **kw):
        calls["fchmod"] += isinstance(path, int)
        return real["chmod"](path, *a, **kw)

    def chown(path, *a, **kw):
        calls["fchown"] += isinstance(path, int)
        return real["chown"](path, *a, **kw)

    for name, f in (("lstat", lstat), ("chmod", chmod), ("chown", chown)):
        monkeypatch.setattr(os, name, f)
    old = os.umask(0o022)
    yield calls
    os.umask(old)


def test_a_layer_of_small_files_costs_no_lookup_and_no_attribute_call_per_file(tmp_path, counted):
    root = tmp_path / "root"
    Extractor(str(root)).apply(io.BytesIO(_venv_like()), in_place=True)
    dirs = sum(1 for _, ds, _ in os.walk(root) for _ in ds)
    # Before: every new directory was looked up from the root down (DEPTH lstat calls each), and
    # each file had its mode and owner set again on its fd.
    assert counted["lstat"] <= dirs + LEAVES, counted  # about one per directory (381 before)
    as_root = os.geteuid() == 0
    assert counted["fchmod"] == 0, counted
    assert counted["fchown"] == (LEAVES if as_root else 0), counted  # only the files of another owner
    leaf = root / "venv/lib/python3.11/site-packages/pkg0/sub/deeper/deepest"
    for n in range(FILES):
        st = os.lstat(leaf / f"mod{n}.py")
        assert stat.S_IMODE(st.st_mode) == (0o644 if n else 0o755)
        assert st.st_mtime_ns == (1_600_000_000 + n) * 10**9
        if as_root:
            assert (st.st_uid, st.st_gid) == ((4321, 4321) if n == 1 else (0, 0))
    assert (leaf / "mod3.py").read_bytes() == b"x = 3\n"
    assert os.lstat(leaf).st_mtime_ns == 1_600_000_000 * 10**9 and stat.S_IMODE(os.lstat(leaf).st_mode) == 0o755


def test_a_file_in_a_setgid_directory_gets_its_owner_set(tmp_path, counted):
    """A setgid directory gives a new file its group, not this process's: the owner is set."""
    if os.geteuid() != 0:
        pytest.skip("owners are set as root only")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        d = tarfile.TarInfo("shared")
        d.type, d.mode, d.gid = tarfile.DIRTYPE, 0o2775, 4321
        t.addfile(d)
        f = tarfile.TarInfo("shared/f")
        f.size, f.mode = 1, 0o644
        t.addfile(f, io.BytesIO(b"x"))
    root = tmp_path / "root"
    Extractor(str(root)).apply(io.BytesIO(buf.getvalue()), in_place=True)
    st = os.lstat(root / "shared/f")
    assert (st.st_uid, st.st_gid) == (0, 0) and counted["fchown"] == 1


def test_a_directory_in_a_setgid_directory_gets_its_own_mode_and_group(tmp_path):
    """The kernel gives a directory made in a setgid one the setgid bit and that group: its header's are set."""
    if os.geteuid() != 0:
        pytest.skip("owners are set as root only")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, mode, gid in (("shared", 0o2775, 4321), ("shared/sub", 0o755, 0)):
            d = tarfile.TarInfo(name)
            d.type, d.mode, d.gid = tarfile.DIRTYPE, mode, gid
            t.addfile(d)
    root = tmp_path / "root"
    Extractor(str(root)).apply(io.BytesIO(buf.getvalue()), in_place=True)
    st = os.lstat(root / "shared/sub")
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o755, 0)


@pytest.fixture
def dir_calls(monkeypatch):
    """chown, chmod and utime calls on directories, by path: what a layer's directories cost."""
    calls = {"chown": 0, "chmod": 0, "utime": 0}
    real = {name: getattr(os, name) for name in calls}

    def counting(name):
        def call(path, *a, **kw):
            calls[name] += isinstance(path, str) and os.path.isdir(path) and not os.path.islink(path)
            return real[name](path, *a, **kw)
        return call

    for name in calls:
        monkeypatch.setattr(os, name, counting(name))
    old = os.umask(0o022)
    yield calls
    os.umask(old)


def test_a_directory_gets_its_mode_and_owner_at_creation_and_its_times_once(tmp_path, dir_calls):
    """A directory a layer makes is made with its mode (and this process's owner): no chmod or chown
    after; its times are set once, after what it holds is written. Applied again (a resumed restore,
    another layer holding the same parents), what it has already is not set again."""
    root = tmp_path / "root"
    layer = _venv_like()
    Extractor(str(root)).apply(io.BytesIO(layer), in_place=True)
    dirs = sum(1 for _, ds, _ in os.walk(root) for _ in ds)
    # Before: made 0700, then chown (as root), chmod and utime, and utime again after its members.
    # Only the top one, made in a directory the layer did not set (the root: perhaps setgid), has
    # its owner and mode set; the root's times are put back.
    owner = 1 if os.geteuid() == 0 else 0
    assert dir_calls == {"chown": owner, "chmod": 1, "utime": dirs + 1}, (dir_calls, dirs)
    first = dict(dir_calls)
    Extractor(str(root)).apply(io.BytesIO(layer))
    assert (dir_calls["chown"], dir_calls["chmod"]) == (first["chown"], first["chmod"]), dir_calls
    leaf = root / "venv/lib/python3.11/site-packages/pkg0/sub/deeper/deepest"
    st = os.lstat(leaf)
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns, st.st_atime_ns) == (0o755, 1_600_000_000 * 10**9,
                                                                         1_600_000_000 * 10**9)


def test_settling_directories_sets_only_what_differs(tmp_path, dir_calls):
    """After layers applied at once, each directory is read once (lstat) and only an owner, mode or
    time that differs from its topmost header is set (restore/schedule.py settles each layer's)."""
    root = tmp_path / "root"
    ex = Extractor(str(root))
    ex.parallel = True
    ex.apply(io.BytesIO(_venv_like()))
    headers, touched = dict(ex.layer_dir_headers), ex.layer_touched_dirs
    before = dict(dir_calls)
    ex.settle_dirs(headers, touched)
    # Before: chown (as root), chmod and two utime calls per directory, each time a layer was settled.
    assert dir_calls == before, (dir_calls, before)
    top = root / "venv"
    os.chmod(top, 0o700)
    os.utime(top, ns=(5, 5))
    ex.settle_dirs(headers, touched)
    assert (dir_calls["chmod"], dir_calls["utime"]) == (before["chmod"] + 1, before["utime"] + 1), dir_calls
    st = os.lstat(top)
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns) == (0o755, 1_600_000_000 * 10**9)


def test_a_layer_of_directories_already_there_sets_little(tmp_path, dir_calls):
    """A layer whose directories are all there with its owners, modes and times (snap's layers repeat
    their parents'; a resumed restore applies a layer again) writes nothing into them: no owner or
    mode is set, nor the times of a directory it did not read."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name in ("venv", "venv/lib", "venv/lib/site", "venv/bin"):
            d = tarfile.TarInfo(name)
            d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o755, 1_600_000_000
            d.uid, d.gid = os.geteuid(), os.getegid()
            t.addfile(d)
    root = tmp_path / "root"
    Extractor(str(root)).apply(io.BytesIO(buf.getvalue()))
    first = dict(dir_calls)
    Extractor(str(root)).apply(io.BytesIO(buf.getvalue()))
    # Before: each directory's times set again (4), and the root's put back. Now only those of the
    # two its members are in, read for a killed run's temp files (their atime changes).
    assert dir_calls == {**first, "utime": first["utime"] + 2}, (dir_calls, first)
    for d in ("venv", "venv/lib", "venv/lib/site"):
        st = os.lstat(root / d)
        assert (st.st_atime_ns, st.st_mtime_ns) == (1_600_000_000 * 10**9,) * 2, d


# A default ACL of user::rwx, group::r-x, other::--- (`setfacl -d -m o::---` on a 0755 directory),
# as the kernel stores it (acl_ea_header and entries: tag, perm, id).
DEFAULT_ACL_NO_OTHER = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, 0xFFFFFFFF)
                                                       for tag, perm in ((0x01, 7), (0x04, 5), (0x20, 0)))
ACL_MODES = {"top/": 0o755, "top/a.txt": 0o644, "top/run.sh": 0o755, "top/sub/": 0o711, "top/sub/k": 0o604,
             "top/secret": 0o600, "here.txt": 0o644, "bin/": 0o755}
LATER_MODES = {"top/b.txt": 0o644, "here2.txt": 0o664, "bin/tool": 0o755}


def test_a_restore_under_a_default_acl_gives_every_mode_the_image_does(registry, request, tmp_path):
    """A directory with a default ACL gives what is made in it the ACL's modes, not the umask's (here
    no bits for others): each file and directory, new in a directory a layer made or not, still ends
    with its mode from the image."""
    root = tmp_path / "root"
    root.mkdir()
    try:
        os.setxattr(root, "system.posix_acl_default", DEFAULT_ACL_NO_OTHER)
    except OSError as e:
        pytest.skip(f"this filesystem takes no default ACL: {e.strerror}")

    def layer(modes: dict) -> bytes:
        return tar_bytes(*(member(name, "dir", mode=mode) if name.endswith("/") else
                           member(name, data=name.encode(), mode=mode) for name, mode in modes.items()))

    ref = push(registry, request, layer(ACL_MODES), layer(LATER_MODES))
    r = snap("restore", ref, "--root", str(root))
    assert r.returncode == 0, r.stderr
    for name, mode in {**ACL_MODES, **LATER_MODES}.items():
        assert stat.S_IMODE(os.lstat(root / name).st_mode) == mode, name
