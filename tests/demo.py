"""`make demo`: the whole job on an embedded default, end to end.

Starts a local registry, makes a small base image and a sample GPU-style box from it (a venv, custom
nodes, a model file, a changed and a deleted base file), commits it, changes one custom node and
commits again, restores into an empty directory and checks the restored tree byte for byte."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from support.images import push_base_image  # noqa: E402
from support.registry import RegistryServer  # noqa: E402
from support.trees import NOT_CAPTURED, make_base_rootfs, make_box, snapshot_of_tree, write_tree  # noqa: E402


def run(*args: str) -> str:
    print(f"$ snap {' '.join(args)}", flush=True)
    r = subprocess.run([sys.executable, "-m", "snapshotter", *args], text=True, capture_output=True)
    sys.stdout.write(r.stderr)  # snap's notes first: they were said before the result
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        sys.exit(f"demo failed: snap {args[0]} exited {r.returncode}")
    return r.stdout


def main() -> None:
    work = tempfile.mkdtemp(prefix="snap-demo-")
    os.environ["SNAP_STATE_DIR"] = os.path.join(work, "state")
    os.environ.setdefault("SNAP_PROGRESS", "off")  # snap's stderr is replayed after each command: no progress there
    reg = RegistryServer(os.path.join(work, "registry")).start()
    try:
        print(f"registry: {reg.url} (storage {reg.storage})")
        base = os.path.join(work, "base")
        os.makedirs(base)
        make_base_rootfs(base)
        push_base_image(reg, "demo/base", "1", base)
        base_ref, box_ref = f"{reg.host}/demo/base:1", f"{reg.host}/demo/box"
        box = make_box(base, os.path.join(work, "box"))
        print(f"sample box: {box} (base image {base_ref} + venv, custom nodes, models)\n")

        t = time.time()
        run("commit", f"{box_ref}:v1", "--base", base_ref, "--root", box)
        print(f"  ({time.time() - t:.1f}s)\n")

        write_tree(box, {"opt/app/custom_nodes/NodeB/__init__.py": "B = 3  # edited\n"}, mtime=int(time.time()))
        print("changed one custom node file; committing again (venv and models must be skipped):")
        run("commit", f"{box_ref}:v2", "--base", base_ref, "--root", box)
        print()

        out = os.path.join(work, "restored")
        t = time.time()
        run("restore", f"{box_ref}:v2", "--root", out)
        print(f"  ({time.time() - t:.1f}s)\n")

        want, got = snapshot_of_tree(box, NOT_CAPTURED), snapshot_of_tree(out, NOT_CAPTURED)
        if want != got:
            bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            sys.exit(f"demo failed: {len(bad)} path(s) differ after restore, e.g. {bad[:5]}")
        print(f"round trip OK: {len(got)} paths restored byte for byte (content, modes, owners, mtimes, links)")
    finally:
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
