"""Trees on disk: the base rootfs, boxes made from it for particular cases, the one fingerprint a
restore is compared by, and the jail a hostile image is restored into."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
from typing import Callable

from support.images import MARK, layer_tar, layers_by_name, push_base_image
from support.run import snap

MiB = 1024 * 1024


def write_tree(root: str, files: dict[str, bytes | str], mtime: int = 1_600_000_000) -> None:
    """Write files (path -> content; a value starting with '->' makes a symlink)."""
    for rel, content in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, str) and content.startswith("->"):
            os.symlink(content[2:], path)
            continue
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
        os.utime(path, (mtime, mtime))


def flip_byte(path, offset: int = 0) -> None:
    """Change one byte in place, whatever it was (writing b"x" over random bytes is a no-op once in 256)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def rewrite_on_read(box: str, rel: str, at: int | None) -> tuple[list[str], Callable[[str, int], None]]:
    """A commit's after_read hook (model.CommitHooks) that notes each read of the box's file `rel` and
    rewrites it in place after read number `at` (None: never): (the reads, the hook)."""
    reads: list[str] = []

    def after_read(path: str, attempt: int) -> None:
        if path == rel:
            reads.append(path)
            if len(reads) == at:
                with open(os.path.join(box, rel), "r+b") as f:
                    f.write(b"REWRITTEN")

    return reads, after_read


def make_base_rootfs(root: str) -> None:
    """A tiny rootfs: a few dirs, files, a symlink, a hardlink, and busybox if the machine has it."""
    write_tree(root, {
        "etc/os-release": "NAME=snap-test-base\n",
        "etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
        "usr/share/doc/base/README": "base image for snap tests\n" * 20,
        "usr/lib/libfake.so.1": os.urandom(50_000),
        "usr/lib/libfake.so": "->libfake.so.1",
        "opt/app/main.py": "print('hello from the app')\n",
        "opt/app/config.yaml": "port: 8188\n",
        "opt/app/old_cache.bin": os.urandom(10_000),
        "var/lib/app/state.db": "v1\n",
    })
    os.link(os.path.join(root, "usr/share/doc/base/README"), os.path.join(root, "usr/share/doc/base/README.hard"))
    for d in ("root", "tmp", "proc", "sys", "dev", "bin"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    os.chmod(os.path.join(root, "tmp"), 0o1777)
    busybox = shutil.which("busybox")
    if busybox:
        shutil.copy2(busybox, os.path.join(root, "bin/busybox"))
        os.symlink("busybox", os.path.join(root, "bin/sh"))
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                os.utime(p, (1_600_000_000, 1_600_000_000))
    os.utime(root, (1_600_000_000, 1_600_000_000))



NOT_CAPTURED = ("proc", "sys", "dev", "tmp", "run")


def make_box(base_rootfs: str, dest: str) -> str:
    """A box started from the base: a venv, custom nodes, a model file, a new config, a deleted base file."""
    subprocess.run(["cp", "-a", base_rootfs, dest], check=True)
    write_tree(dest, {
        "opt/app/venv/pyvenv.cfg": "home = /usr/bin\nversion = 3.11.7\n",
        "opt/app/venv/lib/python3.11/site-packages/torch/__init__.py": "import math\n" * 200,
        "opt/app/venv/lib/python3.11/site-packages/torch/_C.so": os.urandom(300_000),
        "opt/app/venv/bin/python": "->/usr/bin/python3",
        "opt/app/custom_nodes/NodeA/__init__.py": "NODE_CLASS_MAPPINGS = {}\n",
        "opt/app/custom_nodes/NodeA/nodes.py": "class A: pass\n",
        "opt/app/custom_nodes/NodeB/__init__.py": "B = 2\n",
        "opt/app/models/checkpoints/sd15.safetensors": os.urandom(2_000_000),
        "opt/app/models/vae/vae.pt": os.urandom(500_000),
        "etc/app.conf": "threads = 8\n",
        "tmp/scratch.txt": "never captured\n",
    })
    write_tree(dest, {"opt/app/config.yaml": "port: 9000\n"}, mtime=1_700_000_000)  # a changed base file
    os.unlink(os.path.join(dest, "opt/app/old_cache.bin"))  # deleted base file -> whiteout
    os.link(os.path.join(dest, "opt/app/custom_nodes/NodeA/nodes.py"),
            os.path.join(dest, "opt/app/custom_nodes/NodeA/nodes_link.py"))
    os.chmod(os.path.join(dest, "opt/app/custom_nodes/NodeB/__init__.py"), 0o600)
    return dest



def snapshot_of_tree(root: str, skip: tuple[str, ...] = (), exact: bool = False) -> dict[str, tuple]:
    """Everything a restore must reproduce, per path below `root`: type, mode, owner, mtime, content
    digest or link target (a device's numbers), which paths share an inode (hardlinks), and extended
    attributes. `exact`: mtimes to the nanosecond and each path's link count too, for a tree that
    must not change at all. Written independently of snap's code."""
    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        # In name order (not the filesystem's): the first name of a hardlinked file is the same in any copy.
        dirnames[:] = sorted(d for d in dirnames if os.path.join(rel_dir, d) not in skip)
        for name in sorted(dirnames + filenames):
            rel = os.path.join(rel_dir, name)
            if rel in skip:
                continue
            full = os.path.join(root, rel)
            st = os.lstat(full)
            kind, extra = _kind_and_content(full, st)
            if kind == "file" and st.st_nlink > 1:
                first = inodes.setdefault((st.st_dev, st.st_ino), rel)
                extra += f" linked-with:{first}"
            xattrs = tuple(sorted((n, os.getxattr(full, n, follow_symlinks=False))
                                  for n in os.listxattr(full, follow_symlinks=False)
                                  if not n.startswith("security.selinux")))
            mtime = st.st_mtime_ns if exact else int(st.st_mtime)
            out[rel] = ((kind, oct(st.st_mode & 0o7777), st.st_uid, st.st_gid, mtime, extra)
                        + ((st.st_nlink,) if exact else ()) + ((xattrs,) if xattrs else ()))
    return out


def _kind_and_content(path: str, st: os.stat_result) -> tuple[str, str]:
    """A path's type and what it holds: a regular file's digest, a link's target, a device's numbers."""
    if stat.S_ISDIR(st.st_mode):
        return "dir", ""
    if stat.S_ISLNK(st.st_mode):
        return "link", os.readlink(path)
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            return "file", hashlib.sha256(f.read()).hexdigest()
    return stat.filemode(st.st_mode)[0], f"{os.major(st.st_rdev)},{os.minor(st.st_rdev)}"



def make_home_base(registry, workdir: str, repo: str) -> tuple[str, str]:
    """A base with /home/user (0700, 1000:1000) and /home/user/proj, and /root 0700; returns
    (base ref, its rootfs). The box made from it adds a file to each of proj and /root."""
    if os.geteuid() != 0:
        import pytest  # here alone: the bench imports this module where pytest is not installed
        pytest.skip("owners other than our own need root")
    rootfs = os.path.join(workdir, "home-base")
    os.makedirs(rootfs)
    make_base_rootfs(rootfs)
    write_tree(rootfs, {"home/user/proj/old.txt": "old\n", "home/user/.profile": "export A=1\n"})
    for rel, mode, owner in (("home/user", 0o700, 1000), ("home/user/proj", 0o750, 1000), ("home", 0o755, 0),
                             ("root", 0o700, 0)):
        path = os.path.join(rootfs, rel)
        os.chown(path, owner, owner)
        os.chmod(path, mode)
    for rel in ("home/user/proj/old.txt", "home/user/.profile"):
        os.chown(os.path.join(rootfs, rel), 1000, 1000)
    for rel in ("home/user/proj", "home/user", "home", "root", ""):
        os.utime(os.path.join(rootfs, rel), (1_600_000_000, 1_600_000_000))
    push_base_image(registry, repo, "1", rootfs)
    return f"{registry.host}/{repo}:1", rootfs


def home_box(base_rootfs: str, dest: str) -> str:
    """The home base with new files in unchanged-mode directories: /home/user/proj/new.txt, /root/notes.txt."""
    subprocess.run(["cp", "-a", base_rootfs, dest], check=True)
    write_tree(dest, {"home/user/proj/new.txt": "new\n", "root/notes.txt": "root's\n"}, mtime=1_700_000_000)
    os.chown(os.path.join(dest, "home/user/proj/new.txt"), 1000, 1000)
    os.setxattr(os.path.join(dest, "home"), "user.snap.parent", b"kept in every layer under it")
    os.utime(os.path.join(dest, "home/user/proj"), (1_700_000_005, 1_700_000_005))
    os.utime(os.path.join(dest, "root"), (1_700_000_006, 1_700_000_006))
    return dest


WEIGHTS_PROFILE = """
extends: default
layers:
  - name: venv
    venv: true
  - name: models
    paths: ["**/models/**"]
    compression: none
    file_layer_min: 1MiB
    bundle_max: 64KiB
"""

# The default profile with weights of 1 MiB and more in layers of their own (so tests stay small).
SMALL_WEIGHTS = open(os.path.join(os.path.dirname(__file__), "..", "..", "layers", "default.yaml")).read() \
    .replace("file_layer_min: 64MiB", "file_layer_min: 1MiB").replace("min_size: 64MiB", "min_size: 1MiB")


BIG = "opt/app/models/checkpoints/big.safetensors"
# Names of one inode each, its first name (in path order) first.
LINKED = [(BIG, "opt/app/models/loras/big-link.safetensors", "opt/app/models/zz/alias.bin"),
          ("opt/app/models/configs/c000.json", "opt/app/models/zz/c000-link.json")]


def hardlink_box(base_rootfs: str, dest: str) -> tuple[str, str]:
    """The usual box plus a 3 MiB weight with two more names, and a small file (among 60 that fill
    several 64 KiB bundles) with another name far from it in path order. Returns (box, profile file)."""
    box = make_box(base_rootfs, dest)
    write_tree(box, {BIG: os.urandom(3 * MiB + 5)})
    write_tree(box, {f"opt/app/models/configs/c{i:03d}.json": os.urandom(3000) for i in range(60)})
    for first, *others in LINKED:
        for name in others:
            os.makedirs(os.path.dirname(os.path.join(box, name)), exist_ok=True)
            os.link(os.path.join(box, first), os.path.join(box, name))
    profile = dest + "-profile.yaml"
    with open(profile, "w") as f:
        f.write(WEIGHTS_PROFILE)  # weights of 1 MiB get a layer of their own, bundles of 64 KiB
    return box, profile


def profile_excluding_nothing(folder) -> str:
    """A restore profile that excludes nothing: a test whose paths lie below /tmp (never written
    in a restore root by the default profile, not even through a link) sees them land where they
    resolve. The profile file's path."""
    path = os.path.join(str(folder), "open.yaml")
    with open(path, "w") as f:
        f.write("name: open\nlayers:\n  - name: rest\nexclude: []\n")
    return path



def assert_content_written_once(registry, repo: str, tag: str) -> dict[str, list[tarfile.TarInfo]]:
    """Each inode's content is in the image once: its other names are hardlinks to it in the same
    layer (Docker refuses a hardlink to a lower layer's file). Returns the layers' members by label."""
    layers = {}
    regular: dict[str, str] = {}
    for label, desc in layers_by_name(registry.manifest(repo, tag)).items():
        with layer_tar(registry, repo, desc) as t:
            members = t.getmembers()
        layers[label] = members
        names = {m.name: m for m in members}
        for m in members:
            if m.isreg():
                regular[m.name] = label
            if m.islnk():
                assert m.linkname in names and names[m.linkname].isreg(), \
                    f"{label}: {m.name} -> {m.linkname} not in the layer"
    for first, *others in LINKED:
        assert not any(n in regular for n in others), f"a second copy of {first}"
    return layers



class Jail:
    def __init__(self, tmp_path):
        self.base = tmp_path
        self.root = tmp_path / "root"
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        (self.outside / "keep").write_text("sentinel\n")
        (self.outside / "secret").write_text("do not link me\n")
        (self.outside / "sub").mkdir()
        (self.outside / "sub" / "deep").write_text("deep\n")
        self.before = self._state()

    def _state(self):
        # Above the test dir other test sessions may come and go: look only for the escape's mark.
        around = [os.path.join(p, n) for p in (self.base.parent, self.base.parent.parent, "/")
                  for n in os.listdir(p) if n.startswith(MARK)]
        return snapshot_of_tree(str(self.outside), exact=True), sorted(n for n in os.listdir(self.base)), around

    def through(self, link: str, via: str, target: str) -> str:
        """The member name that reaches `target` (outside the root) through symlink `link` -> `via`
        when the OS follows it as an ordinary path: what a naive extractor would write to."""
        seen_from = os.path.normpath(os.path.join(self.root, via))
        return os.path.normpath(f"{link}/{os.path.relpath(target, seen_from)}")

    def restore(self, ref: str, *args: str):
        r = snap("restore", ref, "--root", str(self.root), *args)
        assert "Traceback" not in r.stderr, r.stderr
        return r

    def assert_untouched(self):
        outside, names, around = self._state()
        assert outside == self.before[0], "the sentinel directory next to the root changed"
        assert set(names) <= set(self.before[1]) | {"root", "snap-state"}, names
        assert around == self.before[2], "something appeared above the test directory"

    def refused(self, r):
        assert r.returncode == 6, (r.returncode, r.stdout, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.startswith("snap: error:")]
        assert len(lines) == 1, r.stderr
        self.assert_untouched()
        return lines[0]

    def ok(self, r):
        assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
        self.assert_untouched()

