"""The GPU-box preset of `make bench`: snap on a real box's own venv, against tar | zstd and untar.

Run on a GPU box (bench/gpubox.sh packs what it needs and runs it there): the venv that is already
on the machine (/opt/torch/.venv: torch with its CUDA libraries), a generated weight beside it, a
loopback registry whose storage is in RAM (/dev/shm), so what is measured is snap, the disk and the
cores. Every step runs once, on a cold page cache, and reports its wall time and its busy cores
((user + sys) / wall of the measured process tree; the registry's meanwhile shown apart, "+ N reg"):

  pack:     tar -c | zstd -T0 -3 of the venv + weight   vs  snap commit (first, fresh state dir)
  same:     snap commit with nothing changed
  packages: a 10 KiB package added to the venv, then upgraded, then removed: bytes sent and seconds
  unpack:   zstd -d | tar -x into an empty dir          vs  snap restore into an empty root (fresh state)
  floor:    dd + fsync of the box's bytes (the disk's own write floor)
  --then:   when `snap restore --then` starts its command, of the whole restore
  verify:   snap verify of the restored tree
  watch:    snap watch, a package installed, SIGTERM 2 s later: seconds to the final snapshot, bytes sent
  torch:    the restored venv's torch sees the GPU (when there is one)

    python3 bench/gpubox.py --venv /opt/torch/.venv --weight-gib 4 --out /tmp/out
The table goes to stdout and to OUT/gpubox.md; the log of every command to OUT/gpubox.log.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench import (MiB, Bench, Run, drop_page_cache, restore_then, snap, start_watch, stop_watch,  # noqa: E402
                   tree_listing, write_floor)
from support.registry import RegistryServer  # noqa: E402  (bench put tests/ on the path)

PACKAGE = "snap_bench_tiny"  # the package the "packages" rows install, upgrade and remove


def site_packages(venv: str) -> str:
    lib = os.path.join(venv, "lib")
    found = [os.path.join(lib, d, "site-packages") for d in sorted(os.listdir(lib))
             if os.path.isdir(os.path.join(lib, d, "site-packages"))]
    if not found:
        raise SystemExit(f"gpubox: no lib/python*/site-packages in '{venv}'")
    return found[0]


def install_package(site: str, version: str, kib: int = 10) -> None:
    """What `pip install` leaves for a small pure-Python distribution: its module and a dist-info."""
    remove_package(site)
    mod = os.path.join(site, PACKAGE)
    os.makedirs(mod)
    body = "".join(f"VALUE_{i} = {i * 7919 % 1000003}  # {version}\n" for i in range(kib * 1024 // 40))
    with open(os.path.join(mod, "__init__.py"), "w") as f:
        f.write(body)
    info = os.path.join(site, f"{PACKAGE}-{version}.dist-info")
    os.makedirs(info)
    files = {"METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n",
             "INSTALLER": "pip\n", "WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             "RECORD": f"{PACKAGE}/__init__.py,,\n{PACKAGE}-{version}.dist-info/METADATA,,\n"}
    for name, text in files.items():
        with open(os.path.join(info, name), "w") as f:
            f.write(text)


def remove_package(site: str) -> None:
    for name in os.listdir(site):
        if name == PACKAGE or name.startswith(PACKAGE + "-"):
            shutil.rmtree(os.path.join(site, name))


def stored_bytes(reg: RegistryServer) -> int:
    """Bytes of blobs the registry holds: what a commit sent is the growth of this."""
    total = 0
    for d, _, names in os.walk(os.path.join(reg.storage, "docker/registry/v2/blobs")):
        total += sum(os.path.getsize(os.path.join(d, n)) for n in names if n == "data")
    return total


class GpuBox:
    def __init__(self, b: Bench, venv: str, weight: str, ref: str):
        self.b, self.venv, self.weight, self.ref = b, venv, weight, ref
        self.state = os.path.join(b.work, "state")
        self.rows: list[tuple[str, Run, str]] = []  # (step, run, what it shows)

    def step(self, label: str, fn, show=lambda r: "") -> Run:
        print(f"  {label} ...", end=" ", flush=True)
        r = fn()
        print(f"{r.secs:.1f}s" + ("" if r.ok else f" FAILED ({r.note})"), flush=True)
        self.rows.append((label, r, show(r)))
        return r

    def commit(self, tag: str, state: str | None = None, cold: bool = False) -> Run:
        return snap(self.b, "commit", f"{self.ref}:{tag}", "--base", "scratch", "--root", "/", "--include", self.venv,
                    "--include", os.path.dirname(self.weight), state=state or self.state, cold=cold)

    def sent(self, fn) -> Run:
        before = stored_bytes(self.b.reg)
        r = fn()
        r.note = f"{(stored_bytes(self.b.reg) - before) / MiB:.2f} MiB sent; {r.note}"
        return r


def busy(r: Run) -> str:
    """Busy cores of snap's process tree, and apart, the registry's meanwhile: on loopback it takes
    the same cores (~0.9 CPU s per GiB it serves), which a remote registry would not."""
    if not r.secs:
        return "-"
    return f"{r.cpu / r.secs:.1f}" + (f" + {r.reg_cpu / r.secs:.1f} reg" if r.reg_cpu >= 0.05 else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default="/opt/torch/.venv", help="the box's venv (default /opt/torch/.venv)")
    ap.add_argument("--weight-gib", type=float, default=4.0, help="size of the generated weight (default 4)")
    ap.add_argument("--work", default="/var/tmp/snap-gpubox", help="restores and the archive go here (the disk)")
    ap.add_argument("--registry-dir", default="/dev/shm/snap-gpubox-registry", help="registry storage (RAM)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(HERE, "out")), help="table and log")
    args = ap.parse_args()
    venv = os.path.realpath(args.venv)
    if not os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
        raise SystemExit(f"gpubox: '{venv}' is no venv (no pyvenv.cfg)")
    os.makedirs(args.out, exist_ok=True)
    for d in (args.work, args.registry_dir):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    b = Bench(args.work)
    b.log = os.path.join(args.out, "gpubox.log")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    weight_dir = os.path.join(os.path.dirname(venv.rstrip("/")), "snap-bench-models")
    weight = os.path.join(weight_dir, "model.safetensors")
    try:
        b.reg = RegistryServer(args.registry_dir).start()
        g = GpuBox(b, venv, weight, f"{b.reg.host}/gpubox/box")
        os.makedirs(weight_dir, exist_ok=True)
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/urandom", f"of={weight}", "bs=16M", f"count={int(args.weight_gib * 64)}",
                        "iflag=fullblock", "status=none"], check=True)
        print(f"generated the {args.weight_gib:g} GiB weight in {time.perf_counter() - t:.0f}s", flush=True)
        site = site_packages(venv)
        rel = [os.path.relpath(p, "/") for p in (venv, weight_dir)]
        archive = os.path.join(args.work, "box.tar.zst")
        tar = g.step("tar -c | zstd -T0 -3", lambda: b.run(
            f"tar -C / -cf - {' '.join(rel)} | zstd -q -f -T0 -3 -o {archive}", shell=True, cold=True))
        first = g.step("snap commit (first)", lambda: g.sent(lambda: g.commit("v1", cold=True)))
        g.step("snap commit (nothing changed)", lambda: g.sent(lambda: g.commit("v2")))
        install_package(site, "1.0")
        g.step("snap commit (10 KiB package added)", lambda: g.sent(lambda: g.commit("v3")))
        install_package(site, "1.1")
        g.step("snap commit (that package upgraded)", lambda: g.sent(lambda: g.commit("v4")))
        remove_package(site)
        g.step("snap commit (that package removed)", lambda: g.sent(lambda: g.commit("v5")))

        def watch_after_install() -> Run:
            p = start_watch(b, f"{g.ref}:watch", "scratch", "/", g.state, "1h", include=(venv, weight_dir))
            install_package(site, "2.0")
            time.sleep(2)  # the case: the notice comes 2 s after the install
            before = stored_bytes(b.reg)
            secs, out, code = stop_watch(b, p)
            remove_package(site)
            ok = code == 0 and "final snapshot" in out and "pushed" in out
            return Run(secs, None, ok, out, f"{(stored_bytes(b.reg) - before) / MiB:.2f} MiB sent"
                       + ("" if ok else f"; exit {code}: {out.strip().splitlines()[-1:]}"))
        g.step("snap watch: SIGTERM 2 s after a package install -> final snapshot", watch_after_install)

        untar_dir, restored = os.path.join(args.work, "untar"), os.path.join(args.work, "restored")
        os.makedirs(untar_dir)
        untar = g.step("zstd -d | tar -x", lambda: b.run(f"zstd -q -d -T0 -c {archive} | tar -C {untar_dir} -xf -",
                                                         shell=True, cold=True))
        os.unlink(archive)
        floor = g.step("disk write floor (dd + fsync)", lambda: write_floor(b, first_size(venv, weight)))
        restore = g.step("snap restore (empty root, fresh state)", lambda: snap(
            b, "restore", f"{g.ref}:v1", "--root", restored, state=os.path.join(args.work, "state-restore"), cold=True))
        g.step("snap verify (the restored tree)", lambda: snap(b, "verify", f"{g.ref}:v1", "--root", restored,
                                                              state=os.path.join(args.work, "state-restore"), cold=True))
        # The untar is of the venv as the first commit took it (the package rows changed the venv since).
        same = tree_listing(os.path.join(restored, rel[0])) == tree_listing(os.path.join(untar_dir, rel[0]))
        shutil.rmtree(restored)
        shutil.rmtree(untar_dir)
        then = g.step("snap restore --then (empty root, fresh state)", lambda: restore_then(
            b, "gpubox/box:v1", os.path.join(args.work, "restored-then"), os.path.join(args.work, "state-then"),
            link_bytes_per_sec=None))
        torch_py = os.path.join(args.work, "restored-then", rel[0], "bin", "python")
        gpu = subprocess.run([torch_py, "-c", "import torch; print(torch.cuda.is_available() and "
                              "torch.ones(1, device='cuda').item())"], capture_output=True, text=True)
        table = report(g, tar, first, untar, restore, floor, then, same, gpu)
        with open(os.path.join(args.out, "gpubox.md"), "w") as f:
            f.write(table)
        print(table)
        return 0
    finally:
        shutil.rmtree(weight_dir, ignore_errors=True)
        b.cleanup()
        shutil.rmtree(args.registry_dir, ignore_errors=True)


def first_size(venv: str, weight: str) -> int:
    return sum(os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(venv) for n in names) \
        + os.path.getsize(weight)


def report(g: GpuBox, tar: Run, first: Run, untar: Run, restore: Run, floor: Run, then: Run, same: bool,
           gpu: subprocess.CompletedProcess) -> str:
    ratio = lambda a, b: f"{a.secs / b.secs:.2f}x" if a.ok and b.ok and b.secs else "-"  # noqa: E731
    lines = ["| step | seconds | busy cores | note |", "|---|---|---|---|"]
    for label, r, _ in g.rows:
        lines.append(f"| {label.replace('|', chr(92) + '|')} | {r.secs:.1f}{'' if r.ok else ' FAILED'} | {busy(r)} | {r.note} |")
    lines += ["", f"- first commit / tar -c | zstd -T0 -3: {ratio(first, tar)} (target <= 1.0x)",
              f"- restore / zstd -d | tar -x: {ratio(restore, untar)} (target <= 0.6x, or <= 1.1x the disk floor: "
              f"{ratio(restore, floor)} of it)",
              f"- --then started the app at {then.first or 0:.1f} s: "
              f"{(then.first or 0) / untar.secs if untar.secs else 0:.2f}x untar's time (target <= 0.5x), "
              f"{(then.first or 0) / then.secs if then.secs else 0:.0%} of its own restore's",
              f"- restored venv identical to the untar of the same state: {same}",
              f"- torch from the restored venv on the GPU: {gpu.stdout.strip() or (gpu.stderr.strip().splitlines() or ['no output'])[-1]}",
              f"- page cache dropped before each cold step: {drop_page_cache()}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
