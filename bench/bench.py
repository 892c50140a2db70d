"""`make bench`: snap's times on a generated box, against the tools it must beat, with peak memory.

Generates a box (the test base rootfs + a venv-like tree of small files, a few big random "weights"
and a custom-nodes tree), pushes the base image to a local registry, then times on the same data:
  snap: first commit, commit with nothing changed, after one custom node changed, after one small
        package added to the venv, after one model added (each with the bytes it sent), restore into an empty directory (fresh state dir, as on a new machine);
  peers: tar -c | zstd -T0 (packing floor), zstd -d | tar -x (unpacking floor), restic backup
        (1st, 2nd, after each change) and restore, docker commit + docker push (in a dockerd this
        script starts; skipped with the reason when it cannot start).
Prints one Markdown table (snap vs peer, ratio, peak RSS, targets PASS/FAIL) and writes it, with the
machine, to bench/out/results.md. Peak RSS is the largest process of the measured tree (what
/usr/bin/time -v reports: ru_maxrss from wait4); for docker it is dockerd's own peak (VmHWM).

    python3 bench/bench.py            # default sizes (20k files, 4 x 512 MiB weights)
    python3 bench/bench.py --small    # quick smoke run (2k files, 4 x 50 MiB weights)
    python3 bench/bench.py --scale    # a real GPU box (200k files, 40 weights, 32 GiB; ~75 GiB of disk, not in CI)
Sizes: --files --weights-mib --weight-files --nodes --new-model-mib (or BENCH_FILES, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.path.join(HERE, "out")
sys.path.insert(0, os.path.join(REPO, "tests"))
from support.faults import FaultProxy  # noqa: E402
from support.images import push_base_image  # noqa: E402
from support.registry import RegistryServer  # noqa: E402
from support.trees import make_base_rootfs  # noqa: E402

MiB = 1 << 20
# Reads snap's code (every module, with what each imports) back into the page cache: the package
# loads most modules on first use, so `snap --help` alone would leave the restore's code cold.
WARM_CODE = ("import importlib, pkgutil, snapshotter; "
             "[importlib.import_module(m.name) for m in pkgutil.walk_packages(snapshotter.__path__, 'snapshotter.') "
             "if m.name != 'snapshotter.__main__']")
LINK_BYTES_PER_SEC = 250 * 1000 * 1000  # the link of the --then row: a registry across a fast network
NOT_CAPTURED = ("proc", "sys", "dev", "tmp", "run")  # the default profile's never-captured dirs
SMALL_FILE = "opt/app/custom_nodes/Node000/nodes.py"  # the one custom node file changed in case 3
SITE = "opt/app/venv/lib/python3.11/site-packages"
SIZE_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}  # as snap prints sizes


@dataclass
class Run:
    secs: float
    rss: Optional[int]  # bytes
    ok: bool
    out: str = ""
    note: str = ""
    cpu: float = 0.0  # user + sys seconds of the measured tree
    reg_cpu: float = 0.0  # user + sys seconds the registry spent meanwhile (it shares the cores)
    first: Optional[float] = None  # restore --then: seconds until its command started
    sent: Optional[int] = None  # a commit: bytes of the layers it uploaded (as snap prints them, to 0.1 unit)


class Bench:
    """The run's state; cleanup() releases everything it started (also after Ctrl-C)."""

    def __init__(self, work: str):
        self.work = work
        self.log = os.path.join(work, "bench.log")
        self.reg: Optional[RegistryServer] = None
        self.dockerd: Optional[subprocess.Popen] = None
        self.child: Optional[subprocess.Popen] = None
        self.res: dict[str, Run] = {}
        self.skipped: dict[str, str] = {}  # peer -> why
        self.lean = False  # delete each copy once its rows are measured (--lean, --scale)
        self.probe_secs: Optional[float] = None  # creating PROBE_FILES files on a settled disk

    def discard(self, *paths: str) -> None:
        """With --lean, free a copy's disk once its rows are measured, then wait for the disk to
        settle: on a disk mounted with `discard`, creating files right after a big delete is slow
        for minutes, and the next measured step would pay for it."""
        if not self.lean:
            return
        for path in paths:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.unlink(path)
        os.sync()
        settle_disk(self)

    def run(self, cmd, env=None, shell=False, cold=False) -> Run:
        """Run one measured command: wall clock and peak RSS (wait4), output appended to bench.log.
        Dirty pages of the step before are written out first (untimed): otherwise their writeback
        lands in whichever command runs next, and a restore after a commit pays for the commit.
        `cold` also empties the page cache (as root): late in the run the cache is full of the
        earlier steps' files, and reclaiming it is charged to whoever writes next. Then snap's own
        code (Python and its packages) is read back in, untimed: data comes from disk, not code."""
        os.sync()
        if cold and drop_page_cache():
            subprocess.run([sys.executable, "-c", WARM_CODE], capture_output=True, cwd=REPO)
        with open(self.log, "ab") as lf:
            lf.write(f"\n$ {cmd if shell else ' '.join(cmd)}\n".encode())
            lf.flush()
            reg0 = self.registry_cpu()
            t0 = time.perf_counter()
            p = subprocess.Popen(["bash", "-o", "pipefail", "-c", cmd] if shell else cmd, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.child = p
            out = p.stdout.read()
            _, status, ru = os.wait4(p.pid, 0)
            secs = time.perf_counter() - t0
            reg_cpu = self.registry_cpu() - reg0
            p.returncode = os.waitstatus_to_exitcode(status)
            p.stdout.close()
            self.child = None
            lf.write(out)
        return Run(secs, ru.ru_maxrss * 1024, p.returncode == 0, out.decode(errors="replace"),
                   "" if p.returncode == 0 else f"exit {p.returncode}, see bench.log",
                   ru.ru_utime + ru.ru_stime, reg_cpu)

    def registry_cpu(self) -> float:
        return proc_cpu(self.reg.proc.pid) if self.reg and self.reg.proc else 0.0

    def cleanup(self) -> None:
        if self.child and self.child.poll() is None:
            self.child.kill()
        if self.reg:
            self.reg.stop()
        if self.dockerd:
            stop_dockerd(self.dockerd)
        # dockerd may leave overlay/netns mounts under our dir; they must go before rmtree.
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f]
        for m in sorted((m for m in mounts if m.startswith(self.work + "/")), reverse=True):
            subprocess.run(["umount", "-l", m], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)


def drop_page_cache() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


PROBE_FILES = 2000


def probe_file_creation(work: str) -> float:
    """Seconds to create, write, fsync and delete PROBE_FILES small files: the disk's state."""
    d = tempfile.mkdtemp(prefix="probe-", dir=work)
    t0 = time.perf_counter()
    for i in range(PROBE_FILES):
        with open(os.path.join(d, str(i)), "wb") as f:
            f.write(b"x" * 512)
    os.sync()
    secs = time.perf_counter() - t0
    shutil.rmtree(d)
    return secs


def settle_disk(b: Bench, limit: float = 180.0) -> None:
    """Wait (untimed) until creating files is as fast as it was at the start (within 50%), or has
    stopped getting faster (three probes in a row no better than the best by 10%: on some disks a
    big delete leaves creation slow for far longer than a run can wait), at most `limit` s."""
    if b.probe_secs is None:
        b.probe_secs = probe_file_creation(b.work)
        return
    t0 = time.time()
    best, stale = float("inf"), 0
    while time.time() - t0 < limit and stale < 3:
        secs = probe_file_creation(b.work)
        if secs <= 1.5 * b.probe_secs:
            break
        best, stale = (secs, 0) if secs < 0.9 * best else (best, stale + 1)
        time.sleep(5)
    print(f"[settled {time.time() - t0:.0f}s]", end=" ", flush=True)


def disk_needed(args, lean: bool) -> int:
    """Bytes of free disk a run needs, roughly: the weights (and the model added) are incompressible,
    so every copy of the box costs their size; the text costs its size several times over."""
    w = (args.weights_mib + args.new_model_mib) * MiB
    text = args.files * 2200 + args.nodes * 2200
    # lean: two copies at a time (measure_all); else every copy side by side (box, registry,
    # archive, floor parts, restic, the restores; docker: its container, image and push)
    copies = 2 if lean else 7 + 2 * args.reps + (0 if args.no_docker else 3)
    return copies * w + 12 * text + (2 << 30)


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + sys) a running process has used so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


# ---------------------------------------------------------------- data

def python_lines(rng: random.Random) -> list[str]:
    """A pool of Python-looking lines: compressible, but not one repeated string."""
    words = ["torch", "tensor", "self", "config", "model", "layer", "weight", "batch", "device", "dtype",
             "hidden", "attention", "kwargs", "state", "cache", "output", "input", "index", "value", "name"]
    tpl = ["def {a}_{b}(self, {c}, {d}=None):", "    {a} = {b}.{c}({d}, dim={n})", "    return {a}_{b}",
           "class {A}{B}(nn.Module):", "    \"\"\"{A} {b} for the {c} {d}.\"\"\"", "import {a}.{b} as {c}",
           "from {a}.{b} import {A}{B}, {C}", "    if {a} is not None and {b} > {n}:", "        raise ValueError(\"bad {a}: %r\" % {b})",
           "    for {a} in range({n}):", "        {a}[{b}] = {c}.{d}({n})", "# {a} {b} {c}: see {d} #{n}", ""]
    out = []
    for _ in range(4000):
        a, b, c, d = rng.choices(words, k=4)
        out.append(rng.choice(tpl).format(a=a, b=b, c=c, d=d, A=a.title(), B=b.title(), C=c.title(), n=rng.randint(0, 4096)))
    return out


def write_text(path: str, rng: random.Random, lines: list[str], lo: int = 200, hi: int = 4000) -> int:
    target, parts, size = rng.randint(lo, hi), [], 0
    while size < target:
        s = rng.choice(lines)
        parts.append(s)
        size += len(s) + 1
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    return size


def write_random(path: str, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 * MiB)
            f.write(os.urandom(n))  # truly random: no tool may dedup or compress it
            left -= n


def generate_box(base: str, box: str, args) -> dict:
    subprocess.run(["cp", "-a", base, box], check=True)
    rng = random.Random(1234)
    lines = python_lines(rng)
    app = os.path.join(box, "opt/app")
    venv = os.path.join(app, "venv")
    os.makedirs(os.path.join(venv, "bin"))
    with open(os.path.join(venv, "pyvenv.cfg"), "w") as f:
        f.write("home = /usr/bin\nversion = 3.11.7\n")
    os.symlink("/usr/bin/python3", os.path.join(venv, "bin/python"))
    text = 0
    for i in range(args.files):  # packages of 100 files, in sub-packages of 20
        pkg, sub = divmod(i, 100)
        text += write_text(os.path.join(venv, f"lib/python3.11/site-packages/pkg{pkg:03d}/sub{sub // 20}/mod{sub}.py"), rng, lines)
    for i in range(args.nodes):  # custom nodes of 10 files
        node, k = divmod(i, 10)
        name = "nodes.py" if k == 0 else "__init__.py" if k == 1 else f"module_{k}.py"
        text += write_text(os.path.join(app, f"custom_nodes/Node{node:03d}/{name}"), rng, lines)
    per = args.weights_mib * MiB // args.weight_files
    for i in range(args.weight_files):
        write_random(os.path.join(app, f"models/checkpoints/model-{i + 1:02d}-of-{args.weight_files:02d}.safetensors"), per)
    # A real box's files are older than snap's 2 s racy-clean window (files changed that close to
    # a scan are not trusted to the stat cache); let the generated ones age past it too.
    time.sleep(2.5)
    return {"text_bytes": text, "weights_bytes": per * args.weight_files}


def write_tree_files(root: str, files: dict[str, str]) -> None:
    for rel, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "w") as f:
            f.write(content)


def progress_size(n: int) -> str:
    """Bytes for people, as snap prints them."""
    for unit in ("GiB", "MiB", "KiB"):
        if n >= SIZE_UNITS[unit]:
            return f"{n / SIZE_UNITS[unit]:.1f} {unit}"
    return f"{n} B"


def tree_listing(root: str) -> dict[str, tuple]:
    """path -> (kind, size, mode, mtime) without the never-captured dirs: a cheap restore check."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in NOT_CAPTURED]
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            kind = "l" if os.path.islink(os.path.join(dirpath, n)) else "d" if n in dirnames else "f"
            out[os.path.normpath(os.path.join(rel_dir, n))] = (kind, st.st_size if kind == "f" else 0,
                                                                st.st_mode, int(st.st_mtime))
    return out


# ---------------------------------------------------------------- snap

def snap(b: Bench, *args: str, state: str, cold: bool = False) -> Run:
    env = dict(os.environ, SNAP_STATE_DIR=state, SNAP_QUIET="1", DOCKER_CONFIG=os.path.join(b.work, "docker-config"))
    r = b.run([sys.executable, "-m", "snapshotter", *args], env=env, cold=cold)
    if r.ok and args[0] == "commit":  # "name: status (size, kind, n entries, digest)" per layer
        up = [m for m in re.findall(r"^.+?: (uploaded|exists, skipped).*?\[(\d[\d.]* \w+),", r.out, re.M)]
        sent = [size for status, size in up if status == "uploaded"]
        r.sent = sum(int(float(n) * SIZE_UNITS[u]) for n, u in (size.split() for size in sent))
        r.note = f"{len(sent)} layer(s) uploaded ({', '.join(sent[:3])}{', ...' if len(sent) > 3 else ''}), " \
                 f"{len(up) - len(sent)} skipped"
    return r


def restore_then(b: Bench, repo_tag: str, out: str, state: str, link_bytes_per_sec: Optional[int] = LINK_BYTES_PER_SEC) -> Run:
    """`snap restore --then` over a link capped at `link_bytes_per_sec` (a proxy: on loopback the
    weights arrive before the venv is unpacked; None: straight from the registry): a whole restore,
    with the time its CMD started (it writes the wall clock) in `first`: the app's venv and nodes are
    on disk then, the weights still arriving."""
    marker = os.path.join(b.work, "then-started")
    link = FaultProxy(b.reg.host).start() if link_bytes_per_sec else None
    if link:
        link.throttle = link_bytes_per_sec
    try:
        r = snap(b, "restore", f"{link.host if link else b.reg.host}/{repo_tag}", "--root", out, "--then",
                 f"date +%s.%N > {marker}", state=state, cold=True)
        ended = time.time()  # counted back from the end: the untimed sync and cache drop come before the start
    finally:
        if link:
            link.stop()
    try:
        with open(marker) as f:
            r.first = r.secs - (ended - float(f.read()))
        os.unlink(marker)
    except (OSError, ValueError):
        r.ok, r.note = False, "the --then command did not run"
    return r


def start_watch(b: Bench, target: str, base_ref: str, box: str, state: str, every: str,
                include: tuple[str, ...] = ()) -> subprocess.Popen:
    """`snap watch` on the box (only `include`'s paths with base scratch), returned once its first
    snapshot is made (or found current)."""
    env = dict(os.environ, SNAP_STATE_DIR=state, SNAP_QUIET="1", DOCKER_CONFIG=os.path.join(b.work, "docker-config"))
    p = subprocess.Popen([sys.executable, "-m", "snapshotter", "watch", target, "--base", base_ref, "--root", box,
                          "--every", every, "--provider", "none", *(a for path in include for a in ("--include", path))],
                         stderr=subprocess.PIPE, text=True, env=env)
    b.child = p
    with open(b.log, "a") as lf:
        lf.write(f"\n$ snap watch {target} --every {every}\n")
        for line in p.stderr:
            lf.write(line)
            if " moved to it" in line or "already holds this box" in line:
                return p
    raise RuntimeError(f"snap watch exited ({p.wait()}) before watching: see bench.log")


def stop_watch(b: Bench, p: subprocess.Popen) -> tuple[float, str, int]:
    """SIGTERM, then wait for the final snapshot: (seconds from the signal to the exit, its output, code)."""
    t0 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    rest = p.stderr.read()
    code = p.wait()
    secs = time.perf_counter() - t0
    b.child = None
    with open(b.log, "a") as lf:
        lf.write(rest)
    return secs, rest, code


def run_ns(pid: int) -> int:
    """Nanoseconds the process's threads have run (the scheduler's count, /proc/PID/task/*/schedstat):
    fine enough to tell a watcher's check (milliseconds) from its waking up to sleep again (microseconds),
    which the clock ticks of /proc/PID/stat cannot."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0  # the process is gone
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended meanwhile
    return total


def watch_idle(b: Bench, target: str, base_ref: str, box: str, state: str, checks: int, limit: float) -> Run:
    """CPU of a watcher of the unchanged box at --every 60s, in its steady state: over `checks`
    checks, from the end of its second burst of CPU after the first snapshot on (a check runs for
    milliseconds or more; between checks the watcher sleeps). The first burst is the snapshot's
    tail or the first check, which follows a longer pause (the pace is set by the check before it,
    the one that filled the memo); a fixed window from the start (180 s, as this row once was)
    held no check at all on a 200k-file box and read 0.02% of a core. At most `limit` seconds."""
    p = start_watch(b, target, base_ref, box, state, "60s")
    t_end = time.perf_counter() + limit
    ends: list[tuple[float, float]] = []  # (time, CPU seconds) at the end of each check (no thread ends while idle)
    last, burst = run_ns(p.pid), 0
    while len(ends) < checks + 2 and time.perf_counter() < t_end and p.poll() is None:
        time.sleep(0.25)
        now = run_ns(p.pid)
        ran, last = max(now - last, 0), now
        if ran >= 1_000_000:  # a millisecond or more in a quarter second: a check is running
            burst += ran
        elif burst:
            if burst >= 5_000_000:
                ends.append((time.perf_counter(), now / 1e9))
            burst = 0
    _, out, code = stop_watch(b, p)
    if len(ends) < 3:
        return Run(0.0, None, False, out, f"fewer than 2 checks after the first in {limit:.0f} s: no steady state to measure")
    (t0, cpu0), (t1, cpu1) = ends[1], ends[-1]
    secs, cpu = t1 - t0, cpu1 - cpu0
    per_hour = cpu / secs * 3600
    return Run(secs, None, code == 0, out, f"{cpu:.2f} CPU s over {len(ends) - 2} checks in {secs:.0f} s (steady state): "
               f"{per_hour:.1f} CPU s per hour, {per_hour / 36:.2f}% of one core", cpu)


def watch_final(b: Bench, target: str, base_ref: str, box: str, state: str) -> Run:
    """Time from SIGTERM to the final snapshot pushed (the watcher exits right after), one file changed."""
    p = start_watch(b, target, base_ref, box, state, "1h")
    with open(os.path.join(box, SMALL_FILE), "a") as f:
        f.write("WATCHED = True  # changed just before the notice\n")
    os.sync()
    secs, out, code = stop_watch(b, p)
    ok = code == 0 and "final snapshot" in out and "pushed" in out
    return Run(secs, None, ok, out, "" if ok else f"exit {code}: {out.strip().splitlines()[-1:]}")


def watch_change(b: Bench, target: str, base_ref: str, box: str, state: str, every: str) -> tuple[Run, Run]:
    """(seconds from a new 4-byte file in /opt/app to the watcher's line that its snapshot is pushed,
    seconds from SIGTERM to the watcher's exit when nothing changed since that snapshot). At --every
    1h the change goes out when the box has been quiet (SNAP_WATCH_QUIET, 10 s)."""
    p = start_watch(b, target, base_ref, box, state, every)
    t0 = time.perf_counter()
    with open(os.path.join(box, "opt/app/bench-change.txt"), "w") as f:
        f.write("new\n")
    pushed = ""
    with open(b.log, "a") as lf:
        for line in p.stderr:
            lf.write(line)
            if line.split(" ", 1)[-1].startswith("snapshot ") and " pushed" in line:
                pushed = line
                break
    change = Run(time.perf_counter() - t0, None, bool(pushed), pushed, "" if pushed else "the watcher ended first")
    secs, out, code = stop_watch(b, p)
    ok = code == 0 and "nothing changed since" in out
    return change, Run(secs, None, ok, out, "" if ok else f"exit {code}: {out.strip().splitlines()[-1:]}")


# ---------------------------------------------------------------- peers

def restic_env(b: Bench) -> dict:
    d = os.path.join(b.work, "restic")
    return dict(os.environ, RESTIC_PASSWORD="bench", RESTIC_REPOSITORY=os.path.join(d, "repo"),
                RESTIC_CACHE_DIR=os.path.join(d, "cache"))


def restic_init(b: Bench) -> bool:
    if not shutil.which("restic"):
        b.skipped["restic"] = "restic is not installed (apt-get install restic)"
        return False
    r = b.run(["restic", "init"], env=restic_env(b))
    if not r.ok:
        b.skipped["restic"] = f"restic init failed ({r.note})"
    return r.ok


def restic_backup(b: Bench, box: str) -> Run:
    r = b.run(["restic", "backup", "--json", "--host", "bench", box], env=restic_env(b))
    lines, r.out = r.out.splitlines(), ""  # out: the snapshot id, for the restore
    for line in lines:
        if '"summary"' in line:
            s = json.loads(line)
            r.note = f"snapshot {s.get('snapshot_id', '?')[:8]}, {s.get('data_added', 0) / MiB:.1f} MiB added"
            r.out = s.get("snapshot_id", "")
    return r


def start_dockerd(b: Bench) -> Optional[str]:
    """Start our own dockerd; return its socket, or None with the reason in b.skipped."""
    if os.geteuid() != 0 or not shutil.which("dockerd") or not shutil.which("docker"):
        b.skipped["docker"] = "needs root and dockerd + docker (apt-get install docker.io)"
        return None
    d = os.path.join(b.work, "docker")
    os.makedirs(d)
    sock = os.path.join(d, "d.sock")
    log = os.path.join(d, "dockerd.log")
    b.dockerd = subprocess.Popen(
        ["dockerd", "--host", f"unix://{sock}", "--data-root", f"{d}/data", "--exec-root", f"{d}/exec",
         "--pidfile", f"{d}/d.pid", "--bridge", "none", "--iptables=false", "--insecure-registry", b.reg.host],
        stdout=subprocess.DEVNULL, stderr=open(log, "ab"), start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        if b.dockerd.poll() is not None:
            tail = open(log).read().strip().splitlines()[-1:] or ["(empty log)"]
            b.skipped["docker"] = f"dockerd exited {b.dockerd.returncode}: {tail[0][:200]}"
            b.dockerd = None
            return None
        if subprocess.run(["docker", "-H", f"unix://{sock}", "version"], capture_output=True).returncode == 0:
            return sock
        time.sleep(0.5)
    b.skipped["docker"] = "dockerd did not answer within 60s"
    return None


def stop_dockerd(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(p.pid, signal.SIGKILL)  # its containerd, if dockerd did not stop it
    except ProcessLookupError:
        pass
    p.wait()


def dockerd_peak(pid: int, reset: bool = False) -> Optional[int]:
    """dockerd's peak RSS in bytes (VmHWM), or reset it first (clear_refs 5)."""
    try:
        if reset:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
            return None
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def docker_setup(b: Bench, sock: str, base_ref: str, box: str) -> Optional[tuple[list[str], str]]:
    """A container of the base image holding the generated data (copied in, untimed), as if
    installed in it. Returns (docker command, container id), or None with the reason in b.skipped."""
    docker = ["docker", "-H", f"unix://{sock}"]
    try:
        subprocess.run(docker + ["pull", "-q", base_ref], check=True, capture_output=True)
        cid = subprocess.run(docker + ["create", base_ref, "/bin/sh"], check=True, capture_output=True, text=True).stdout.strip()
        subprocess.run(f"tar -C {box} -cf - opt/app/venv opt/app/custom_nodes opt/app/models | {' '.join(docker)} cp - {cid}:/",
                       shell=True, check=True, capture_output=True)
        return docker, cid
    except subprocess.CalledProcessError as e:
        b.skipped["docker"] = f"{' '.join(map(str, e.cmd))[:80]} failed: {(e.stderr or b'').strip()[-200:]!r}"
        return None


def docker_commit_push(b: Bench, docker: list[str], cid: str, ref: str) -> Run:
    dockerd_peak(b.dockerd.pid, reset=True)
    daemon0 = proc_cpu(b.dockerd.pid)  # the work is done by dockerd, not by the docker client
    c = b.run(docker + ["commit", cid, ref])
    p = b.run(docker + ["push", ref]) if c.ok else c
    runs = [c] if p is c else [c, p]
    rss = max(x for x in (c.rss, p.rss, dockerd_peak(b.dockerd.pid)) if x is not None)
    return Run(c.secs + p.secs, rss, c.ok and p.ok, note=f"commit {c.secs:.1f}s + push {p.secs:.1f}s {p.note}".strip(),
               cpu=sum(r.cpu for r in runs) + proc_cpu(b.dockerd.pid) - daemon0, reg_cpu=sum(r.reg_cpu for r in runs))


def registry_floor(b: Bench, archive: str, repo: str, streams: int = 4) -> Run:
    """The registry's own ingest time for the box's bytes: the tar.zst cut in `streams` parts
    (cut and hashed untimed), each sent by curl in one PUT, all at once, to a fresh repository.
    Nothing is packed or hashed on our side: no pusher can be faster than this. With --lean the
    parts are not written out but piped from the archive (`dd`), and the registry's copy
    is deleted afterwards."""
    size = os.path.getsize(archive)
    cuts = [size * k // streams for k in range(streams + 1)]
    parts = [f"dd if={archive} iflag=skip_bytes,count_bytes skip={lo} count={hi - lo} bs=1M status=none"
             for lo, hi in zip(cuts, cuts[1:])]
    d = os.path.join(b.work, "floor")
    if not b.lean:
        os.makedirs(d)
        subprocess.run(["split", "-n", str(streams), "-d", archive, os.path.join(d, "part")], check=True)
        parts = [f"cat {os.path.join(d, n)}" for n in sorted(os.listdir(d))]
    sums = [subprocess.run(f"{part} | openssl dgst -sha256 -r", shell=True, check=True, capture_output=True, text=True).stdout.split()[0]
            for part in parts]
    sources = ["-T -" if b.lean else f"-T {part.split()[1]}" for part in parts]
    uploads = [f"loc=$(curl -sf -D - -o /dev/null -X POST {b.reg.url}/v2/{repo}/blobs/uploads/ "
               f"| awk -F': ' 'tolower($1)==\"location\" {{print $2}}' | tr -d '\\r') && "
               + (f"{part} | " if b.lean else "")
               + f"curl -sf -o /dev/null {src} -H 'Content-Type: application/octet-stream' \"$loc&digest=sha256:{digest}\""
               for part, src, digest in zip(parts, sources, sums)]
    script = " ".join(f"( {u} ) & p{i}=$!;" for i, u in enumerate(uploads)) + " " + \
        " && ".join(f"wait $p{i}" for i in range(len(uploads)))
    r = b.run(script, shell=True)
    shutil.rmtree(d, ignore_errors=True)
    blobs = os.path.join(b.reg.storage, "docker/registry/v2/blobs/sha256")
    b.discard(*(os.path.join(blobs, digest[:2], digest) for digest in sums))
    r.note = f"{len(parts)} curl PUTs at once of the tar.zst's parts ({size / MiB:.0f} MiB)"
    return r


def sha256_floor(b: Bench, box: str) -> Run:
    """Hashing the box's bytes once (its tar through openssl's sha256, warm cache): every pusher
    must hash each byte. (coreutils' sha256sum is several times slower than openssl here.)"""
    r = b.run(f"tar -C {box} -cf - . | openssl dgst -sha256 -r", shell=True)
    r.note = "tar -c | openssl dgst -sha256"
    return r


def walk_floor(b: Bench, box: str) -> Run:
    """What a nothing-changed commit is held to: a Python walk of the box, every path lstat'ed,
    interpreter start included (issue 35: at most 3x)."""
    walk = "import os,sys; [os.lstat(os.path.join(d, n)) for d, _, ns in os.walk(sys.argv[1]) for n in ns]"
    r = b.run([sys.executable, "-c", walk, box])
    r.note = "os.walk + lstat"
    return r


def write_floor(b: Bench, nbytes: int) -> Run:
    """Writing the box's bytes to this disk (one file, fsync'd): no restore can land them faster."""
    path = os.path.join(b.work, "write-floor")
    r = b.run(["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={-(-nbytes // (8 * MiB))}", "conv=fsync", "status=none"])
    os.unlink(path)
    r.note = f"dd of {nbytes / MiB:.0f} MiB + fsync"
    return r


# ---------------------------------------------------------------- the run

THROUGHPUT = ("snap_first", "tar_zstd", "reg_floor", "sha_floor", "snap_restore", "untar", "write_floor")
ROWS = [  # case, snap key, peer label, peer key, target ratio, strict
    ("1 first commit", "snap_first", "tar -c \\| zstd -T0", "tar_zstd", 1.3, False),
    ("1 first commit", "snap_first", "restic backup (1st)", "restic_1", None, False),
    ("1 first commit", "snap_first", "docker commit + push (1st)", "docker_1", None, False),
    ("1 first commit", "snap_first", "registry ingest floor: 4 curl PUTs of the tar.zst", "reg_floor", None, False),
    ("1 first commit", "snap_first", "sha256 floor: tar -c \\| openssl dgst -sha256", "sha_floor", None, False),
    ("2 nothing changed", "snap_same", "restic backup (2nd, nothing changed)", "restic_2", 1.0, True),
    ("2 nothing changed", "snap_same", "Python walk of the box: os.walk + lstat", "walk_floor", 3.0, False),
    ("3 one custom node changed", "snap_node", "restic backup (after the change)", "restic_3", None, False),
    ("3 one custom node changed", "snap_node", "docker commit + push (after the change)", "docker_2", None, False),
    ("3b one small package added to the venv", "snap_pkg", "restic backup (after the package)", "restic_pkg", None, False),
    ("4 one model added", "snap_model", "restic backup (after the model)", "restic_4", None, False),
    ("1e first commit, encrypted (--encrypt-to)", "snap_first_enc", "snap commit (first, clear)", "snap_first", 1.1,
     False),
    ("5 restore to empty dir", "snap_restore", "zstd -d \\| tar -x", "untar", 1.3, False),
    ("5 restore to empty dir", "snap_restore", "restic restore", "restic_restore", None, False),
    ("5 restore to empty dir", "snap_restore", "disk write floor: dd + fsync of the box's bytes", "write_floor", None, False),
    ("5e restore, encrypted (--decryption-key)", "snap_restore_enc", "snap restore (v1, clear)", "snap_restore", 1.1,
     False),
    ("6 verify the restored tree", "snap_verify", "sha256 floor: tar -c \\| openssl dgst -sha256", "sha_floor", None, False),
]


def encryption_keys(work: str) -> tuple[str, str]:
    """(public, private) PEM files of an RSA 2048 key made for the encrypted rows."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pub, pem = os.path.join(work, "bench.pub"), os.path.join(work, "bench.pem")
    with open(pub, "wb") as f:
        f.write(key.public_key().public_bytes(serialization.Encoding.PEM,
                                              serialization.PublicFormat.SubjectPublicKeyInfo))
    with open(os.open(pem, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return pub, pem


def untar(b: Bench, archive: str, out: str, i: int, repeated, listings: dict, keep: bool = False) -> None:
    """Run i of `zstd -d | tar -x` into an empty dir (the first one's tree kept for the comparison);
    the tree is deleted after, unless `keep`."""
    os.makedirs(out)
    repeated("untar", "zstd -d | tar -x", i, lambda: b.run(f"zstd -q -d -c {archive} | tar -C {out} -xf -", shell=True, cold=True))
    if i == 0 and b.res["untar"].ok:
        listings["tar"] = tree_listing(out)
    if not keep:
        b.discard(out)


def watch_steps(b: Bench, args, step, box_ref: str, base_ref: str, box: str, state: str) -> None:
    """snap watch on the box as it is now: idle cost; a small change to the registry, then SIGTERM
    with nothing changed since; SIGTERM after one small change."""
    if os.environ.get("BENCH_WATCH_IDLE") != "0":  # (0: skipped; at 200k files its checks are ~10 minutes apart)
        step("watch_idle", "snap watch, idle at --every 60s", lambda: watch_idle(
            b, f"{box_ref}:watch", base_ref, box, state, checks=3, limit=3600 if args.scale else 600))
    changed: list[Run] = []
    every = os.environ.get("BENCH_WATCH_EVERY", "1h")

    def change() -> Run:
        run, final = watch_change(b, f"{box_ref}:watch", base_ref, box, state, every)
        changed.append(final)
        return run

    step("watch_change", f"snap watch, a small change to the registry (--every {every})", change)
    step("watch_same", "snap watch, SIGTERM -> exit, nothing changed", lambda: changed[0])
    step("watch_final", "snap watch, SIGTERM -> final snapshot", lambda: watch_final(b, f"{box_ref}:watch", base_ref, box, state))


def measure_all(b: Bench, args) -> dict:
    w = b.work
    base, box = os.path.join(w, "base"), os.path.join(w, "box")
    os.makedirs(base)
    make_base_rootfs(base)
    b.reg = RegistryServer(os.path.join(w, "registry")).start()
    push_base_image(b.reg, "bench/base", "1", base)
    base_ref, box_ref = f"{b.reg.host}/bench/base:1", f"{b.reg.host}/bench/box"
    t = time.time()
    data = generate_box(base, box, args)
    print(f"generated the box in {time.time() - t:.0f}s: {args.files} venv files + {args.nodes} custom-node files "
          f"({data['text_bytes'] / MiB:.0f} MiB of text), {args.weight_files} weights ({data['weights_bytes'] / MiB:.0f} MiB)",
          flush=True)
    state = os.path.join(w, "snap-state")
    res = b.res

    def step(key: str, label: str, fn) -> None:
        print(f"  {label} ...", end=" ", flush=True)
        r = res[key] = fn()
        print(f"{r.secs:.1f}s" + ("" if r.ok else f" FAILED ({r.note})"), flush=True)

    if args.watch_only:
        watch_steps(b, args, step, box_ref, base_ref, box, state)
        return data

    runs: dict[str, list[Run]] = {}

    def repeated(key: str, label: str, i: int, fn) -> None:
        """Run i of a case measured args.reps times (interleaved with its peers, so that a slow
        spell of the machine hits all of them); the result is the median run."""
        step(key, f"{label} [{i + 1}/{args.reps}]", fn)
        runs.setdefault(key, []).append(res[key])
        if i == args.reps - 1:
            done = runs[key]
            mid = sorted(done, key=lambda r: (not r.ok, r.secs))[len(done) // 2]
            times = ", ".join(f"{r.secs:.2f}" for r in done)
            res[key] = Run(mid.secs, max((r.rss for r in done if r.rss), default=None), all(r.ok for r in done), mid.out,
                           f"median of {len(done)} runs ({times} s){'; ' + mid.note if mid.note else ''}",
                           mid.cpu, mid.reg_cpu)

    # State 0: the generated box. The first-commit family is measured args.reps times: snap's
    # extra runs go to other repositories with their own state dirs, so each is a first commit.
    archive = os.path.join(w, "box.tar.zst")
    listings: dict[str, dict] = {}  # the first tar and snap restores' trees, compared at the end

    public_key, private_key = encryption_keys(w)

    def first_commit(i: int) -> None:
        last = i == args.reps - 1
        repeated("snap_first", "snap commit (first)", i, lambda: snap(
            b, "commit", f"{box_ref}:v1" if last else f"{box_ref}-r{i}:v1", "--base", base_ref, "--root", box,
            state=state if last else f"{state}-r{i}"))
        # The same box encrypted, into a repository and a state dir of its own: a first commit too.
        repeated("snap_first_enc", "snap commit (first, --encrypt-to)", i, lambda: snap(
            b, "commit", f"{box_ref}-enc:v1" if last else f"{box_ref}-enc-r{i}:v1", "--base", base_ref, "--root", box,
            "--encrypt-to", public_key, state=f"{state}-enc-r{i}"))
        b.discard(f"{state}-enc-r{i}")

    def archive_and_hash(i: int) -> None:
        repeated("tar_zstd", "tar -c | zstd -T0", i, lambda: b.run(f"tar -C {box} -cf - . | zstd -q -f -T0 -o {archive}", shell=True))
        data["archive_bytes"] = os.path.getsize(archive)
        repeated("sha_floor", "sha256 floor (tar | openssl sha256)", i, lambda: sha256_floor(b, box))

    def backups_before_the_change() -> None:
        step("restic_1", "restic backup (1st)", lambda: restic_backup(b, box))
        step("restic_2", "restic backup (2nd)", lambda: restic_backup(b, box))

    def nothing_changed() -> None:
        step("snap_same", "snap commit (nothing changed)", lambda: snap(b, "commit", f"{box_ref}:v2", "--base", base_ref, "--root", box, state=state))
        step("walk_floor", "Python walk of the box", lambda: walk_floor(b, box))

    restic = not args.no_restic and restic_init(b)
    if args.no_restic:
        b.skipped["restic"] = "--no-restic"  # its rows say SKIP, not ERROR
    if b.lean:
        # At most two copies of the box at any time (the disk of a scale run): every peer that
        # makes a copy runs before snap fills the registry. The box itself is deleted once archived;
        # the archive's restore (the untar row) is the box from then on, its tree the same.
        settle_disk(b)  # the disk's pace before anything is deleted
        for i in range(args.reps):
            archive_and_hash(i)
            b.discard(box)
            repeated("reg_floor", "registry ingest floor (curl)", i, lambda: registry_floor(b, archive, f"bench/floor{i}"))
            untar(b, archive, box, i, repeated, listings, keep=True)
            if not b.res["untar"].ok:  # the box is gone: nothing after this would measure it
                raise BenchError(f"the untar that makes the box again failed ({b.res['untar'].note})")
            b.discard(archive)
        if restic:
            backups_before_the_change()
            b.discard(os.path.join(w, "restic"))
            restic = False
            for key in ("restic_3", "restic_4", "restic_restore"):
                b.skipped[key] = "--lean: no room for its repository beside the registry's copy"
        for i in range(args.reps):
            first_commit(i)
        nothing_changed()
    else:
        for i in range(args.reps):
            archive_and_hash(i)
            repeated("reg_floor", "registry ingest floor (curl)", i, lambda: registry_floor(b, archive, f"bench/floor{i}"))
            first_commit(i)
        nothing_changed()
        if restic:
            backups_before_the_change()
    if args.no_docker or b.lean:
        b.skipped["docker"] = "--no-docker" if args.no_docker else "--lean: no room for docker's copies of the box"
    sock = None if "docker" in b.skipped else start_dockerd(b)
    dk = docker_setup(b, sock, base_ref, box) if sock else None
    if dk:
        docker, cid = dk
        step("docker_1", "docker commit + push (1st)", lambda: docker_commit_push(b, docker, cid, f"{b.reg.host}/bench/docker-box:v1"))

    # State 1: one custom node file changed.
    with open(os.path.join(box, SMALL_FILE), "a") as f:
        f.write("EDITED = True  # the one small change\n")
    step("snap_node", "snap commit (one custom node changed)", lambda: snap(b, "commit", f"{box_ref}:v3", "--base", base_ref, "--root", box, state=state))
    if restic:
        step("restic_3", "restic backup (after the change)", lambda: restic_backup(b, box))
    if dk:
        subprocess.run(f"tar -C {box} -cf - {SMALL_FILE} | {' '.join(docker)} cp - {cid}:/", shell=True, check=True)
        step("docker_2", "docker commit + push (after the change)", lambda: docker_commit_push(b, docker, cid, f"{b.reg.host}/bench/docker-box:v2"))
    if b.dockerd:
        stop_dockerd(b.dockerd)  # frees its memory for the rest
        b.dockerd = None

    # State 1b: one small package added to the venv, as `pip install` lays it out (10 KB).
    rng = random.Random(99)
    text = write_text(os.path.join(box, SITE, "tinypkg/__init__.py"), rng, python_lines(rng), 10_000, 10_000)
    write_tree_files(box, {f"{SITE}/tinypkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
                           f"{SITE}/tinypkg-1.0.dist-info/RECORD": f"tinypkg/__init__.py,,{text}\n"})
    step("snap_pkg", "snap commit (one small package added to the venv)",
         lambda: snap(b, "commit", f"{box_ref}:v3b", "--base", base_ref, "--root", box, state=state))
    if restic:
        step("restic_pkg", "restic backup (after the package)", lambda: restic_backup(b, box))

    # State 2: one model added.
    write_random(os.path.join(box, "opt/app/models/loras/new-model.safetensors"), args.new_model_mib * MiB)
    step("snap_model", f"snap commit (one {args.new_model_mib} MiB model added)", lambda: snap(b, "commit", f"{box_ref}:v4", "--base", base_ref, "--root", box, state=state))
    if restic:
        step("restic_4", "restic backup (after the model)", lambda: restic_backup(b, box))

    watch_steps(b, args, step, box_ref, base_ref, box, state)

    # Restores of state 0 (v1, the archive, restic's 1st snapshot), each into an empty dir.
    # Without --lean nothing is deleted between these runs: ext4 then allocates new inodes slowly for minutes.
    b.discard(box)  # --lean: nothing reads it from here on
    step("write_floor", "disk write floor (dd + fsync)", lambda: write_floor(b, data["text_bytes"] + data["weights_bytes"]))
    outs = []
    for i in range(args.reps):
        out_snap, fresh = os.path.join(w, f"restore-snap-{i}"), os.path.join(w, f"snap-state-restore-{i}")
        outs += [out_snap, fresh]  # fresh: a new machine, no blob cache, no journal
        repeated("snap_restore", "snap restore (v1, empty dir)", i,
                 lambda: snap(b, "restore", f"{box_ref}:v1", "--root", out_snap, state=fresh, cold=True))
        if i == 0 and res["snap_restore"].ok:
            listings["snap"] = tree_listing(out_snap)
            step("snap_verify", "snap verify (the restored tree)",
                 lambda: snap(b, "verify", f"{box_ref}:v1", "--root", out_snap, state=fresh))
        b.discard(out_snap, fresh)
        out_enc, fresh = os.path.join(w, f"restore-enc-{i}"), os.path.join(w, f"snap-state-restore-enc-{i}")
        outs += [out_enc, fresh]
        repeated("snap_restore_enc", "snap restore (v1 encrypted, --decryption-key, empty dir)", i,
                 lambda: snap(b, "restore", f"{box_ref}-enc:v1", "--root", out_enc, "--decryption-key", private_key,
                              state=fresh, cold=True))
        if i == 0 and res["snap_restore_enc"].ok:
            listings["snap encrypted"] = tree_listing(out_enc)
        b.discard(out_enc, fresh)
        if not b.lean:
            outs.append(os.path.join(w, f"restore-tar-{i}"))
            untar(b, archive, outs[-1], i, repeated, listings)
    thens = []  # --then runs: the one of median CMD-start share counts
    for i in range(args.reps):
        out_then, fresh = os.path.join(w, f"restore-then-{i}"), os.path.join(w, f"snap-state-restore-then-{i}")
        outs += [out_then, fresh]
        step("snap_then", f"snap restore --then (v1, empty dir) [{i + 1}/{args.reps}]",
             lambda: restore_then(b, "bench/box:v1", out_then, fresh))
        thens.append(res["snap_then"])
        b.discard(out_then, fresh)
    share = lambda r: r.first / r.secs if r.ok and r.first is not None and r.secs else float("inf")  # noqa: E731
    mid = sorted(thens, key=share)[len(thens) // 2]
    mid.note = (f"median of {len(thens)} runs (CMD start / whole: "
                f"{', '.join(f'{r.first:.2f}/{r.secs:.2f}' if share(r) != float('inf') else 'error' for r in thens)} s)"
                + (f"; {mid.note}" if mid.note else ""))
    res["snap_then"] = mid
    for key, name in (("snap_restore", "snap"), ("snap_restore_enc", "snap encrypted")):
        if name in listings and "tar" in listings:
            want, got = listings["tar"], listings[name]
            bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
            res[key].note += f"; {len(got)} paths, same as the tar restore" if not bad else \
                f"; DIFFERS from the tar restore at {len(bad)} path(s), e.g. {bad[:3]}"
    for d in outs:  # disk space for the next restore
        shutil.rmtree(d, ignore_errors=True)
    if os.path.exists(archive):
        os.unlink(archive)
    snap_id = res["restic_1"].out if "restic_1" in res else ""
    if snap_id and restic:
        step("restic_restore", "restic restore (1st snapshot)",
             lambda: b.run(["restic", "restore", snap_id, "--target", os.path.join(w, "restore-restic")], env=restic_env(b),
                           cold=True))
    return data


# ---------------------------------------------------------------- report

def fmt_cpu(r: Optional[Run]) -> str:
    if not (r and r.ok):
        return "-"
    return f"{r.cpu:.1f}" + (f" + {r.reg_cpu:.1f} reg" if r.reg_cpu >= 0.05 else "")


def fmt_mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / MiB:.0f} MiB"


def machine() -> str:
    mem = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    df = subprocess.run(["df", "-hT", tempfile.gettempdir()], capture_output=True, text=True).stdout.splitlines()[-1].split()
    ver = lambda *c: (subprocess.run(list(c), capture_output=True, text=True).stdout.strip().splitlines() or ["?"])[0]  # noqa: E731
    rev = ver("git", "-C", REPO, "rev-parse", "--short", "HEAD")
    dirty = " (+ uncommitted changes)" if ver("git", "-C", REPO, "status", "--porcelain") != "?" else ""
    return "\n".join([
        f"- CPU: {os.cpu_count()} x {cpu}; RAM: {mem / 1024 / 1024:.1f} GiB",
        f"- disk (temp dir): {df[0]} {df[1]}, {df[2]} total, {df[4]} free",
        f"- load average (1 min) at the end: {os.getloadavg()[0]:.2f} (other work on the machine skews the times)",
        f"- kernel {platform.release()}; Python {platform.python_version()}; snap at {rev}{dirty}",
        f"- zstd {ver('zstd', '-q', '-V')}; {ver('restic', 'version')}; {ver('dockerd', '--version')}",
    ])


def memory_row(b: Bench, args, data: dict, label: str) -> tuple[list[str], dict]:
    """Is snap's peak RSS flat in the weights' size? Against the other standard run (small <->
    default, scale -> default) if bench/out has it, else against the weights' total (25% of it at most)."""
    peak = max((r.rss for k, r in b.res.items() if k.startswith("snap_") and r.rss), default=0)
    weights = data["weights_bytes"]
    me = {"label": label, "weights_bytes": weights, "snap_peak_rss": peak}
    other_path = os.path.join(OUT, f"run-{ {'small': 'default', 'default': 'small', 'scale': 'default'}.get(label)}.json")
    other = json.load(open(other_path)) if os.path.exists(other_path) else None
    if other and other["weights_bytes"] != weights:
        lo, hi = sorted([me, other], key=lambda d: d["weights_bytes"])
        slope = (hi["snap_peak_rss"] - lo["snap_peak_rss"]) / (hi["weights_bytes"] - lo["weights_bytes"])
        peer = f"{lo['label']}: {fmt_mib(lo['snap_peak_rss'])} at {fmt_mib(lo['weights_bytes'])} weights; " \
               f"{hi['label']}: {fmt_mib(hi['snap_peak_rss'])} at {fmt_mib(hi['weights_bytes'])} weights"
        verdict = "PASS" if slope <= 0.05 else "FAIL"
        target = f"growth <= 5% of the weights' growth (here {slope:.1%})"
    else:
        peer = f"weights: {fmt_mib(weights)} (run --small and the default for a slope)"
        limit = weights // 4
        verdict = "INFO" if args.small else "PASS" if peak <= limit else "FAIL"
        target = f"<= 25% of the weights ({fmt_mib(limit)})" + (", not judged with --small" if args.small else "")
    return ["mem: peak RSS (max of snap runs)", "", "", fmt_mib(peak), peer, "", "", "", "", target, verdict], me


def watch_rows(res: dict) -> list[list[str]]:
    """The rows with absolute targets and no peer: the watcher's, restore --then's."""
    rows = []
    final, idle = res.get("watch_final"), res.get("watch_idle")
    change, same = res.get("watch_change"), res.get("watch_same")
    quiet = float(os.environ.get("SNAP_WATCH_QUIET", 10))
    if change:
        verdict = "ERROR" if not change.ok else "PASS" if change.secs < quiet + 5 else "FAIL"
        rows.append([f"6 snap watch: a new 4-byte file in /opt/app to its snapshot pushed "
                     f"(--every {os.environ.get('BENCH_WATCH_EVERY', '1h')})",
                     f"{change.secs:.2f}" if change.ok else "error", "-", "-", "-", "-", "-", "-", "-",
                     f"< quiet + 5 s ({quiet + 5:g} s)", verdict])
    if same:
        verdict = "ERROR" if not same.ok else "PASS" if same.secs < 1.0 else "FAIL"
        rows.append(["6 snap watch: SIGTERM to exit, nothing changed since the last snapshot",
                     f"{same.secs:.2f}" if same.ok else "error", "-", "-", "-", "-", "-", "-", "-", "< 1 s", verdict])
    if final:
        verdict = "ERROR" if not final.ok else "PASS" if final.secs < 2.0 else "FAIL"
        rows.append(["6 snap watch: SIGTERM to final snapshot pushed (one custom node changed)",
                     f"{final.secs:.2f}" if final.ok else "error", "-", "-", "-", "-", "-", "-", "-", "< 2 s", verdict])
    if idle:
        pct = idle.cpu / idle.secs * 100 if idle.secs else 0.0
        verdict = "ERROR" if not idle.ok else "PASS" if pct < 0.5 else "FAIL"
        per_hour = f" ({pct * 36:.1f} CPU s per hour, steady state)" if idle.ok else ""
        rows.append([f"7 snap watch idle, box unchanged, --every 60s{per_hour}",
                     "-", f"{pct:.2f}% of a core" if idle.ok else "error", "-", "-", "-", "-", "-", "-", "< 0.5% of a core", verdict])
    then = res.get("snap_then")
    if then:
        pct = then.first / then.secs * 100 if then.ok and then.secs else None
        verdict = "ERROR" if pct is None else "PASS" if pct < 25 else "FAIL"
        rows.append([f"8 snap restore --then: CMD start / whole restore (v1, empty dir, link capped at "
                     f"{LINK_BYTES_PER_SEC // 1000**2} MB/s)",
                     f"{then.first:.2f} / {then.secs:.2f} ({pct:.0f}%)" if pct is not None else "error",
                     fmt_cpu(then), fmt_mib(then.rss), "-", "-", "-", "-", "-", "< 25% of the whole restore", verdict])
    return rows


def report(b: Bench, args, data: dict, label: str, total_secs: float) -> str:
    res = b.res
    cold_restores = os.access("/proc/sys/vm/drop_caches", os.W_OK)
    head = ["case", "snap s", "snap CPU s", "snap peak RSS", "peer", "peer s", "peer CPU s", "peer peak RSS",
            "ratio snap/peer", "target", "result"]
    rows = []
    for case, sk, peer, pk, limit, strict in ROWS:
        s, p = res.get(sk), res.get(pk)
        why = next((v for k, v in b.skipped.items() if pk.startswith(k)), None)
        ratio = s.secs / p.secs if s and p and s.ok and p.ok and p.secs > 0 else None
        target = "" if limit is None else (f"< {limit:.1f}x" if strict else f"<= {limit:.1f}x")
        verdict = "" if limit is None else "SKIP" if ratio is None and why else "ERROR" if ratio is None else \
            "PASS" if (ratio < limit if strict else ratio <= limit) else "FAIL"
        sent = f" ({progress_size(s.sent)} sent)" if s and s.ok and s.sent is not None else ""
        rows.append([case + sent, f"{s.secs:.2f}" if s and s.ok else "error" if s else "-", fmt_cpu(s), fmt_mib(s.rss) if s else "-",
                     peer, f"{p.secs:.2f}" if p and p.ok else f"skipped: {why}" if why else "error" if p else "-",
                     fmt_cpu(p), fmt_mib(p.rss) if p else "-", f"{ratio:.2f}x" if ratio else "-", target, verdict])
    mem_row, me = memory_row(b, args, data, label)
    rows.append(mem_row)
    rows.extend(watch_rows(res))
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]
    notes = [f"- {k}: {r.note}" for k, r in res.items() if r.note]
    box_bytes = data["text_bytes"] + data["weights_bytes"]
    speeds = [f"{k} {box_bytes / MiB / res[k].secs:.0f}" for k in THROUGHPUT if k in res and res[k].ok and res[k].secs]
    if speeds:
        notes.append(f"- throughput over the box's {box_bytes / MiB:.0f} MiB, MiB/s: {', '.join(speeds)}")
    lines = [
        f"# snap benchmark ({label})", "",
        f"Box: {args.files} venv files + {args.nodes} custom-node files ({data['text_bytes'] / MiB:.0f} MiB of text), "
        f"{args.weight_files} weights of {data['weights_bytes'] // args.weight_files // MiB} MiB "
        f"({data['weights_bytes'] / MiB:.0f} MiB); model added in case 4: {args.new_model_mib} MiB; "
        f"tar.zst of the box: {data.get('archive_bytes', 0) / MiB:.0f} MiB. Commits with a warm page cache; local registry on 127.0.0.1. "
        f"Whole run: {total_secs / 60:.1f} min.", "", *table, "",
        "Peak RSS: largest process of the measured tree (wait4 ru_maxrss, as /usr/bin/time -v); docker: dockerd's VmHWM.",
        "CPU s: user + sys seconds of the measured tree (docker: with dockerd's); \"+ N reg\": what the registry "
        f"spent meanwhile, on the same {os.cpu_count()} cores (pushes: it hashes every byte it receives).",
        "Restores are of state 0 (snap v1, the tar.zst, restic's 1st snapshot); snap restores with an empty state dir. "
        + ("Each restore starts with an empty page cache (dropped, untimed, then snap's code read back): the registry, "
           "zstd and restic read their data from disk."
           if cold_restores else "The page cache could not be dropped (not root): restores compete with earlier steps' files."), "",
        "Notes:", *notes, *[f"- {k} skipped: {v}" for k, v in b.skipped.items()], "", "Machine:", machine(), "",
    ]
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"run-{label}.json"), "w") as f:
        json.dump(me, f)
    return "\n".join(lines)


def parse_args():
    env = lambda name, default: int(os.environ.get(f"BENCH_{name}", default))  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="quick run: 2k files, 4 x 50 MiB weights, 64 MiB model added")
    ap.add_argument("--scale", action="store_true",
                    help="a real GPU box: 200k venv files, 40 weights totalling 32 GiB, 1 GiB model added, one run "
                         "of each, --lean (about an hour, ~75 GiB of disk; `make bench ARGS=--scale`, not in CI)")
    ap.add_argument("--files", type=int, help="venv files (default 20000; BENCH_FILES)")
    ap.add_argument("--weights-mib", type=int, help="total weights in MiB (default 2048; BENCH_WEIGHTS_MIB)")
    ap.add_argument("--weight-files", type=int, help="weights files (default 4; BENCH_WEIGHT_FILES)")
    ap.add_argument("--nodes", type=int, help="custom-node files (default 500; BENCH_NODES)")
    ap.add_argument("--new-model-mib", type=int, help="model added in case 4 (default 256; BENCH_NEW_MODEL_MIB)")
    ap.add_argument("--reps", type=int, default=int(os.environ.get("BENCH_REPS", 3)),
                    help="runs of the first commit and the restore (and their floors); the median counts (default 3)")
    ap.add_argument("--no-docker", action="store_true", help="skip the docker peer")
    ap.add_argument("--no-restic", action="store_true", help="skip the restic peer")
    ap.add_argument("--lean", action="store_true",
                    help="at most two copies of the box at a time (about 2x the weights of disk instead of 9x): "
                         "each copy is deleted once measured, the peers that copy the box run before snap's commits, "
                         "no docker peer, restic only before the change; on with --scale")
    ap.add_argument("--watch-only", action="store_true",
                    help="only the box, its base and the watcher's rows (idle, a small change, SIGTERM): minutes")
    ap.add_argument("--workdir", default=os.environ.get("BENCH_WORKDIR"), help="where the temp dir goes (default $TMPDIR)")
    a = ap.parse_args()
    small = {"files": 2000, "weights_mib": 200, "weight_files": 4, "nodes": 100, "new_model_mib": 64}
    full = {"files": 20000, "weights_mib": 2048, "weight_files": 4, "nodes": 500, "new_model_mib": 256}
    scale = {"files": 200_000, "weights_mib": 32 * 1024, "weight_files": 40, "nodes": 2000, "new_model_mib": 1024}
    if a.scale and a.small:
        ap.error("--small and --scale are two different sizes: pick one")
    if a.scale and "BENCH_REPS" not in os.environ and "--reps" not in sys.argv:
        a.reps = 1  # each run moves 32 GiB several times
    a.lean = a.lean or a.scale
    for k, v in (scale if a.scale else small if a.small else full).items():
        if getattr(a, k) is None:
            setattr(a, k, env(k.upper(), v))
    return a


class BenchError(Exception):
    """A run that cannot go on: one line, exit 1."""


def _interrupt(*_):
    raise KeyboardInterrupt  # SIGTERM cleans up like Ctrl-C


def main() -> int:
    args = parse_args()
    label = "scale" if args.scale else "small" if args.small else "default"
    preset = (200_000, 32 * 1024, 2000) if args.scale else (2000, 200, 100) if args.small else (20000, 2048, 500)
    if (args.files, args.weights_mib, args.nodes) != preset:
        label += f"-{args.files}f-{args.weights_mib}m"
    if args.watch_only:
        label += "-watch"  # (its peak RSS is no run's to compare with)
    need, free = disk_needed(args, args.lean), shutil.disk_usage(args.workdir or tempfile.gettempdir()).free
    if need > free:
        print(f"bench: error: this run needs about {need / 2**30:.0f} GiB of free disk and "
              f"{args.workdir or tempfile.gettempdir()!r} has {free / 2**30:.0f} GiB: "
              f"{'' if args.lean else 'add --lean, or '}lower --weights-mib", file=sys.stderr)
        return 2
    b = Bench(tempfile.mkdtemp(prefix="snap-bench-", dir=args.workdir))
    b.lean = args.lean
    signal.signal(signal.SIGTERM, _interrupt)
    os.makedirs(OUT, exist_ok=True)
    # snap runs from byte code, as an installed package does (pip compiles it), even where
    # PYTHONDONTWRITEBYTECODE keeps Python from caching it: else each run compiles snap's modules
    # again, a tenth of a second before a restore's app can start.
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(REPO, "snapshotter")], check=True, capture_output=True)
    print(f"snap benchmark ({label}) in {b.work}", flush=True)
    t0 = time.time()
    try:
        data = measure_all(b, args)
        md = report(b, args, data, label, time.time() - t0)
        print("\n" + md)
        with open(os.path.join(OUT, "results.md"), "w") as f:
            f.write(md)
        print(f"written to {os.path.relpath(os.path.join(OUT, 'results.md'), os.getcwd())}")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        return 130
    except BenchError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        if os.path.exists(b.log):  # every command's output, for a look after the temp dir is gone
            shutil.copy(b.log, os.path.join(OUT, f"bench-{label}.log"))
        b.cleanup()


if __name__ == "__main__":
    sys.exit(main())
