"""Weights from the origin (docs/weights-from-origin.md), measured: the first snapshot of a box with
N MiB of Hugging Face weights in its hub cache, with and without `--weights-from-origin` (bytes
uploaded, seconds), and its restore with the weights from a loopback origin vs from the registry.

The hub cache is made by the real huggingface_hub client against tests/support/hub.py (a loopback
hub that redirects its LFS files to a CDN on 127.0.0.2, as Hugging Face does); the registry is the
tests' docker-registry. Both are on loopback: the rows show what is sent and the work on each side,
not a real uplink (at 100 Mbit/s every 12.5 MB not sent is a second saved).

    python3 bench/origin.py               # 4 x 64 MiB of weights
    python3 bench/origin.py --mib 1024    # 4 x 1 GiB
Prints one Markdown table, also written to bench/out/origin.md."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from support.hub import HubServer, Repo, hub_download  # noqa: E402
from support.images import push_base_image  # noqa: E402
from support.registry import RegistryServer  # noqa: E402
from support.trees import make_base_rootfs  # noqa: E402

from snapshotter.progress import human_size  # noqa: E402

COMMIT = "ab" * 20
HF_HOME = "root/.cache/huggingface"


def weights(files: int, mib: int) -> dict[str, bytes]:
    rng = random.Random(7)  # in 64 MiB pieces: randbytes takes at most 256 MiB at once
    return {f"model-{i:05d}-of-{files:05d}.safetensors": b"".join(rng.randbytes(min(64, mib - j) << 20)
                                                               for j in range(0, mib, 64)) for i in range(files)}


def snap(*args: str, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "snapshotter", *args], capture_output=True, text=True,
                       env={**os.environ, "SNAP_QUIET": "1", **env})
    took = time.monotonic() - start
    if r.returncode:
        raise SystemExit(f"snap {' '.join(args)} failed: {r.stderr}")
    return took, r


def measure(work: str, files: int, mib: int) -> list[tuple[str, str, str]]:
    repo = Repo(COMMIT, {"config.json": b"{}\n", **weights(files, mib)}, {"main": COMMIT})
    with HubServer({("model", "bench/model"): repo}) as hub:
        reg = RegistryServer(os.path.join(work, "registry")).start()
        try:
            base_fs = os.path.join(work, "base")
            os.makedirs(base_fs)
            make_base_rootfs(base_fs)
            push_base_image(reg, "base", "1", base_fs)
            box = os.path.join(work, "box")
            subprocess.run(["cp", "-a", base_fs, box], check=True)
            hub_download(hub.url, os.path.join(box, HF_HOME),
                         [("model", "bench/model", "main", name, None) for name in repo.files], timeout=3600)
            return _rows(work, reg, hub, box)
        finally:
            reg.stop()


def _rows(work: str, reg: RegistryServer, hub: HubServer, box: str) -> list[tuple[str, str, str]]:
    base = f"{reg.host}/base:1"
    env = {"HF_ENDPOINT": hub.url}
    rows = []
    for label, repo, extra in (("first commit, weights as layers", "plain", ()),
                               ("first commit, --weights-from-origin", "refs", ("--weights-from-origin",))):
        took, r = snap("commit", f"{reg.host}/{repo}:v1", "--base", base, "--root", box, "--json", *extra,
                       env={**env, "SNAP_STATE_DIR": os.path.join(work, f"state-{repo}")})
        doc = json.loads(r.stdout)
        rows.append((label, f"{took:.2f} s", f"{human_size(doc['uploaded_bytes'])} uploaded"
                     + (f", {doc['references']} file(s) as references" if doc["references"] else "")))
    for label, repo in (("restore, weights from the registry", "plain"),
                        ("restore, weights from a loopback origin", "refs")):
        out = tempfile.mkdtemp(dir=work)
        took, r = snap("restore", f"{reg.host}/{repo}:v1", "--root", out,
                       env={**env, "SNAP_STATE_DIR": tempfile.mkdtemp(dir=work)})
        said = [line for line in r.stdout.splitlines() if line.startswith(("restored", "weights from"))]
        rows.append((label, f"{took:.2f} s", "; ".join(line.split(": ", 1)[-1] for line in said)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4, help="weight files in the hub cache")
    parser.add_argument("--mib", type=int, default=64, help="MiB per weight file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="snap-origin-bench-") as work:
        rows = measure(work, args.files, args.mib)
    lines = [f"weights: {args.files} x {args.mib} MiB in the hub cache", "", "| case | time | what |",
             "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)]
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "origin.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
