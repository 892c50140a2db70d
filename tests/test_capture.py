"""What a commit captures from a live box, and what it deliberately leaves out: files bind-mounted
by the container runtime (GPU driver files), secrets, files that change while they are read."""

import json
import os
import subprocess

import pytest

from conftest import snap
from support import snap_layer_files, write_tree

CUDA_DIR = "usr/lib/x86_64-linux-gnu"
CUDA_LIB = f"{CUDA_DIR}/libcuda.so.555.42.06"


@pytest.fixture
def bind_mounts():
    """`mount --bind SRC DST`, undone at teardown."""
    done = []

    def mount(src, dst):
        subprocess.run(["mount", "--bind", src, dst], check=True)
        done.append(dst)

    yield mount
    for dst in reversed(done):
        subprocess.run(["umount", dst], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_gpu_driver_files_bind_mounted_by_the_runtime_are_left_out(registry, base_ref, box, tmp_path, bind_mounts):
    # What the NVIDIA container toolkit does: an empty file in the container's rootfs, the host's
    # driver library mounted over it, and its ldconfig hook's symlinks to it.
    host = tmp_path / "host-driver"
    host.mkdir()
    (host / "libcuda.so.555.42.06").write_bytes(b"\x7fELF host driver 555.42.06")
    (host / "data").mkdir()
    (host / "data" / "dataset.txt").write_text("a volume's content is the user's\n")
    write_tree(box, {
        CUDA_LIB: "",
        f"{CUDA_DIR}/libcuda.so.1": "->libcuda.so.555.42.06",
        f"{CUDA_DIR}/libcuda.so": "->libcuda.so.1",  # a chain of links
        "usr/lib/libcuda-abs.so": f"->/{CUDA_LIB}",  # an absolute link, seen from inside the box
        f"{CUDA_DIR}/libfoo.so.1": "->libfoo.so.1.0",
        f"{CUDA_DIR}/libfoo.so.1.0": "a library of the box\n",
        "workspace/data/.keep": "",
    })
    bind_mounts(str(host / "libcuda.so.555.42.06"), os.path.join(box, CUDA_LIB))
    bind_mounts(str(host / "data"), os.path.join(box, "workspace/data"))  # a directory: kept

    r = snap("commit", f"{registry.host}/gpu:v1", "--base", base_ref, "--root", box, check=True)
    names = snap_layer_files(registry, "gpu", "v1")
    gone = [CUDA_LIB, f"{CUDA_DIR}/libcuda.so.1", f"{CUDA_DIR}/libcuda.so", "usr/lib/libcuda-abs.so"]
    for path in gone:
        assert path not in names
    assert f"{CUDA_DIR}/libfoo.so.1" in names and f"{CUDA_DIR}/libfoo.so.1.0" in names
    assert "workspace/data/dataset.txt" in names
    line = next(x for x in r.stderr.splitlines() if "bind-mounted" in x)
    assert line.startswith("left out 4 file(s) bind-mounted from the host")
    for path in gone:
        assert repr("/" + path) in line
