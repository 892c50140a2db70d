"""A root commit reads nothing the box should not make it read (issue 26, item 4): a path swapped
between the scan and the read for a symlink (the leaf, or a directory on the way), a FIFO, a path
longer than PATH_MAX, an unreadable file. Each swap is made at the commit's own hook between the
scan and the reads (CommitOptions.hold) or in the scan's secret check; inotify tells whether a file
outside the box, or a secret, was ever opened."""

import ctypes
import os
import subprocess
import sys
import threading

import pytest

from snapshotter import CommitOptions, commit_box
from snapshotter.box.scan import scan_box
from snapshotter.commit.model import CommitHooks
from snapshotter.profile import load_profile

from support.images import layer_tar
from support.trees import write_tree

IN_ACCESS, IN_OPEN = 0x1, 0x20
OUTSIDE = b"OUTSIDE-THE-ROOT " * 64
KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nTHE-BOX-OWN-SECRET\n-----END OPENSSH PRIVATE KEY-----\n"
HANG_GUARD_S = 120


class Opened:
    """inotify on some files: whether anything opened or read them since."""

    def __init__(self, *paths):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        for p in paths:
            assert libc.inotify_add_watch(self.fd, os.fsencode(str(p)), IN_OPEN | IN_ACCESS) >= 0

    def any(self) -> bool:
        try:
            os.read(self.fd, 65536)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(self.fd)


def all_pushed_bytes(registry, repo, tag) -> bytes:
    """Every member's name and content of the snapshot's own layers."""
    out = []
    for desc in registry.manifest(repo, tag)["layers"]:
        with layer_tar(registry, repo, desc) as tf:
            for m in tf:
                out.append(m.name.encode("utf-8", "surrogateescape"))
                if m.isreg():
                    out.append(tf.extractfile(m).read())
    return b"\n".join(out)


def pushed_files(registry, repo, tag) -> dict:
    files = {}
    for desc in registry.manifest(repo, tag)["layers"]:
        with layer_tar(registry, repo, desc) as tf:
            for m in tf:
                if m.isreg():
                    files[m.name] = tf.extractfile(m).read()
    return files


def commit_bounded(*args, **kw):
    """commit_box in a thread, bounded by HANG_GUARD_S (a commit stuck on a FIFO fails the test)."""
    got = {}

    def run():
        try:
            got["result"] = commit_box(*args, **kw)
        except BaseException as e:  # noqa: B902 - handed to the test
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    return t, got


class Swapping(CommitHooks):
    """Hooks whose hold() runs `swap` once the box is scanned: the box changing under the commit."""

    def __init__(self, swap):
        super().__init__()
        self.swap = swap

    def hold(self, scan, root):
        return self.swap(scan)


def unblock(fifo):
    """Let a reader stuck opening `fifo` go (after a failed hang guard)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.fixture
def outside(tmp_path):
    d = tmp_path / "outside"
    d.mkdir()
    (d / "leak.txt").write_bytes(OUTSIDE)
    return d


def test_a_file_swapped_for_a_symlink_out_of_the_root_is_not_read(registry, base_ref, box, outside):
    rel = "opt/app/notes.txt"
    write_tree(box, {rel: b"my notes\n"})
    watch = {}

    def swap(scan):
        watch["w"] = Opened(outside / "leak.txt")
        os.unlink(os.path.join(box, rel))
        os.symlink(str(outside / "leak.txt"), os.path.join(box, rel))
        return {}

    t, got = commit_bounded(f"{registry.host}/swap-out:v1", base_ref, CommitOptions(root=box), Swapping(swap))
    assert not t.is_alive() and "error" not in got, got
    assert not watch["w"].any(), "the file outside the root was opened"
    assert got["result"].held == {rel: "changed since the scan"}
    assert b"OUTSIDE-THE-ROOT" not in all_pushed_bytes(registry, "swap-out", "v1")


def test_a_file_swapped_for_a_symlink_to_the_boxs_own_secret_is_not_read(registry, base_ref, box):
    rel = "opt/app/config.txt"
    write_tree(box, {rel: b"setting = 1\n", "root/.ssh/id_rsa": KEY})
    secret = os.path.join(box, "root/.ssh/id_rsa")
    watch = {}

    def swap(scan):
        assert "root/.ssh" in scan.skipped_secrets  # the directory, left out whole
        watch["w"] = Opened(secret)
        os.unlink(os.path.join(box, rel))
        os.symlink("../../root/.ssh/id_rsa", os.path.join(box, rel))  # the box's secret, under another name
        return {}

    t, got = commit_bounded(f"{registry.host}/swap-secret:v1", base_ref, CommitOptions(root=box), Swapping(swap))
    assert not t.is_alive() and "error" not in got, got
    assert not watch["w"].any(), "the box's secret was opened"
    assert rel in got["result"].held
    assert b"THE-BOX-OWN-SECRET" not in all_pushed_bytes(registry, "swap-secret", "v1")


def test_a_directory_on_the_way_swapped_for_a_symlink_is_not_followed(registry, base_ref, box, outside):
    write_tree(box, {"opt/app/data/leak.txt": b"box data\n", "opt/app/data/other.txt": b"other\n"})
    (outside / "other.txt").write_bytes(OUTSIDE)
    data = os.path.join(box, "opt/app/data")
    watch = {}

    def swap(scan):
        watch["w"] = Opened(outside / "leak.txt", outside / "other.txt")
        os.rename(data, data + ".old")
        os.symlink(str(outside), data)
        return {}

    t, got = commit_bounded(f"{registry.host}/swap-dir:v1", base_ref, CommitOptions(root=box), Swapping(swap))
    assert not t.is_alive() and "error" not in got, got
    assert not watch["w"].any(), "a file outside the root was opened"
    assert set(got["result"].held) == {"opt/app/data/leak.txt", "opt/app/data/other.txt"}
    assert b"OUTSIDE-THE-ROOT" not in all_pushed_bytes(registry, "swap-dir", "v1")


def test_a_file_swapped_for_a_fifo_does_not_block_the_commit(registry, base_ref, box):
    rel = "opt/app/queue.bin"
    write_tree(box, {rel: b"q" * 1000, "opt/app/ok.txt": b"fine\n"})
    fifo = os.path.join(box, rel)

    def swap(scan):
        os.unlink(fifo)
        os.mkfifo(fifo)
        return {}

    t, got = commit_bounded(f"{registry.host}/swap-fifo:v1", base_ref, CommitOptions(root=box), Swapping(swap))
    if t.is_alive():
        unblock(fifo)
        pytest.fail("the commit blocked on a FIFO swapped in")
    assert "error" not in got, got
    assert got["result"].held == {rel: "changed since the scan"}
    files = pushed_files(registry, "swap-fifo", "v1")
    assert rel not in files and files["opt/app/ok.txt"] == b"fine\n"


def _deep_dir(top: str, length: int) -> tuple[str, int]:
    """Nested directories below `top` whose path (relative to it) is longer than `length`, made
    through handles (a path that long cannot be named whole). (rel path, handle of the deepest)."""
    name = "d" * 200
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    parts = []
    while len("/".join(parts)) <= length:
        os.mkdir(name, dir_fd=fd)
        nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
        parts.append(name)
    return "/".join(parts), fd


def test_a_path_longer_than_path_max_is_committed(registry, base_ref, box):
    os.makedirs(os.path.join(box, "opt/app/deep"))
    rel_dir, fd = _deep_dir(os.path.join(box, "opt/app/deep"), 4200)
    try:
        wfd = os.open("weights.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(wfd, b"deep content\n")
        os.close(wfd)
    finally:
        os.close(fd)
    rel = f"opt/app/deep/{rel_dir}/weights.bin"
    assert len(os.path.join(box, rel)) > 4096
    write_tree(box, {"opt/app/ok.txt": b"fine\n"})
    t, got = commit_bounded(f"{registry.host}/deep:v1", base_ref, CommitOptions(root=box))
    assert not t.is_alive() and "error" not in got, got
    files = pushed_files(registry, "deep", "v1")
    assert files[rel] == b"deep content\n" and files["opt/app/ok.txt"] == b"fine\n"


SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
from snapshotter import CommitOptions, commit_box
from snapshotter.commit.model import CommitHooks
box, rel = {box!r}, {rel!r}
class Lock(CommitHooks):
    def hold(self, scan, root):
        os.chmod(os.path.join(box, rel), 0)
        return {{}}
r = commit_box({target!r}, {base!r}, CommitOptions(root=box), Lock())
print(repr(r.held))
"""


def test_a_file_unreadable_at_its_read_is_held_back_and_the_rest_committed(registry, base_ref, box, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to drop root's capabilities")
    rel = "opt/app/private.bin"
    write_tree(box, {rel: b"p" * 100, "opt/app/ok.txt": b"fine\n"})
    script = SCRIPT.format(tests=os.path.dirname(__file__), box=box, rel=rel,
                           target=f"{registry.host}/unreadable-read:v1",
                           base=base_ref)
    # Root reads everything: drop the capabilities that let it ignore permissions.
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search",
           sys.executable, "-c", script]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_GUARD_S,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr({rel: "could not be read"})
    files = pushed_files(registry, "unreadable-read", "v1")
    assert rel not in files and files["opt/app/ok.txt"] == b"fine\n"


class SwappingProfile:
    """The profile, whose secret check first swaps a path (as a racing process could, between the
    scan's lstat of a name and its read of the name's head), at the first path checked below `at`."""

    def __init__(self, profile, at, swap):
        self._profile, self._at, self._swap = profile, at, swap

    def __getattr__(self, name):
        return getattr(self._profile, name)

    def is_secret(self, path, is_dir, is_file, read_head):
        if self._swap is not None and path.startswith(self._at):
            self._swap, swap = None, self._swap
            swap()
        return self._profile.is_secret(path, is_dir, is_file, read_head)


def _scan_swapping(root, at, swap, watched):
    """Scan `root`, `swap` made at the secret check of the first path below `at`; bounded by the
    hang guard. (the thread, what it got, whether `watched` was opened)."""
    watch = Opened(watched)
    got = {}
    profile = SwappingProfile(load_profile(), at, swap)
    t = threading.Thread(target=lambda: got.update(scan=scan_box(str(root), profile)), daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    return t, got, watch.any()


def test_the_scans_secret_check_neither_follows_a_symlink_nor_blocks_on_a_fifo(tmp_path, outside):
    root = tmp_path / "root"
    write_tree(str(root), {"srv/tls/server.pem": b"-----BEGIN CERTIFICATE-----\n", "srv/keys/other.pem": b"x\n"})
    (outside / "key.pem").write_bytes(KEY)
    pem = str(root / "srv/tls/server.pem")

    def to_symlink():
        os.unlink(pem)
        os.symlink(str(outside / "key.pem"), pem)

    t, got, opened = _scan_swapping(root, "srv/tls/server.pem", to_symlink, outside / "key.pem")
    assert not t.is_alive() and not opened, "the scan opened a file outside the root"

    other = str(root / "srv/keys/other.pem")

    def to_fifo():
        os.unlink(other)
        os.mkfifo(other)

    t, got, _ = _scan_swapping(root, "srv/keys/other.pem", to_fifo, outside / "key.pem")
    if t.is_alive():
        unblock(other)
        pytest.fail("the scan blocked on a FIFO swapped in")


def test_the_scan_does_not_walk_through_a_directory_swapped_for_a_symlink(tmp_path, outside):
    """Swapped after the directory was listed, while its names are visited: the rest are stat'ed
    through the handle of the directory listed, not through the symlink."""
    root = tmp_path / "root"
    write_tree(str(root), {"srv/tls/a.pem": b"not a key\n", "srv/tls/z.pem": b"not a key\n"})
    for name in ("a.pem", "z.pem"):
        (outside / name).write_bytes(KEY)
    tls = str(root / "srv/tls")

    def swap():
        os.rename(tls, tls + ".old")
        os.symlink(str(outside), tls)

    t, got, opened = _scan_swapping(root, "srv/tls/", swap, outside)
    assert not t.is_alive() and not opened, "the scan opened a file outside the root"
    entries = got["scan"].entries
    assert {"srv/tls/a.pem", "srv/tls/z.pem"} <= set(entries) and got["scan"].skipped_secrets == []  # the box's own
