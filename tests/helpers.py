"""What test modules share beyond the real parts of support.py: snap's images read back, boxes for
particular cases, hostile layers and the jail they are restored into, the snap command line with its
peak memory, tar headers tarfile will not write, the watcher, and Docker's config with real
credential helper programs. The demo and the bench do not load this (nor pytest, jsonschema or the
watcher it imports)."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from urllib.parse import urljoin

import jsonschema
import pytest
import referencing
import referencing.jsonschema
import zstandard

from snapshotter import CommitOptions
from snapshotter.profile import load_profile
from snapshotter.watch.watcher import Watcher, WatchOptions

from support import (TIMEOUT, MiB, gzip_bytes, make_base_rootfs, make_box, member, push_base_image, snap, tar_bytes,
                     write_tree)

# ---- images snap made, read back -----------------------------------------------------------------

def commit_json(target, base, root, *extra):
    r = snap("commit", target, "--base", base, "--root", root, "--json", *extra, check=True)
    return json.loads(r.stdout)


def label(desc):
    ann = desc["annotations"]
    return f"{ann['dev.snap.layer']} ({ann['dev.snap.content']})" if "dev.snap.content" in ann else ann["dev.snap.layer"]


def layers_by_name(manifest):
    """snap's layers by label: the profile layer, and what part of it (for split layers)."""
    return {label(d): d for d in manifest["layers"] if "dev.snap.layer" in d.get("annotations", {})}


def digest_of(registry, repo, tag):
    """The manifest digest `tag` names in `repo`; None where the tag names nothing."""
    r = registry.session().head(f"{registry.url}/v2/{repo}/manifests/{tag}",
                                headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    return r.headers.get("Docker-Content-Digest") if r.status_code == 200 else None


def diverged_tags(registry, repo, tag="v2") -> list[str]:
    """The repository's tags TAG-diverged-<UTC time>[-N], oldest first (the test's own reading of the names)."""
    found = registry.session().get(f"{registry.url}/v2/{repo}/tags/list").json().get("tags") or []
    pat = re.escape(tag) + r"-diverged-(\d{8}T\d{6}Z)(?:-(\d+))?"
    return sorted((t for t in found if re.fullmatch(pat, t)),
                  key=lambda t: (re.fullmatch(pat, t).group(1), int(re.fullmatch(pat, t).group(2) or 1)))


def blobs_in(registry) -> set[str]:
    """Every blob the registry's storage holds, by digest (what a refused push or commit must not add to)."""
    top = os.path.join(registry.storage, "docker/registry/v2/blobs/sha256")
    return {d for _, dirs, _ in os.walk(top) for d in dirs if len(d) == 64}


def snap_layers(manifest):
    """snap's layers by what they hold: the file of a layer of its own, else the profile layer's name."""
    return {d["annotations"].get("dev.snap.content", d["annotations"]["dev.snap.layer"]): d
            for d in manifest["layers"] if "dev.snap.layer" in d.get("annotations", {})}


def layer_tar(registry, repo: str, desc: dict) -> tarfile.TarFile:
    """One layer's tar, whatever its compression (every zstd frame read)."""
    blob = registry.blob(repo, desc["digest"])
    if desc["mediaType"].endswith("+zstd"):
        blob = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    elif desc["mediaType"].endswith("gzip"):
        blob = gzip.decompress(blob)
    return tarfile.open(fileobj=io.BytesIO(blob))


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
                assert m.linkname in names and names[m.linkname].isreg(), f"{label}: {m.name} -> {m.linkname} not in the layer"
    for first, *others in LINKED:
        assert not any(n in regular for n in others), f"a second copy of {first}"
    return layers


SCHEMA_DIR = os.path.join(os.path.dirname(__file__), "data", "oci-schema")


def _ids(doc) -> set:
    """Every "id" in a schema: relative $refs resolve against the nearest one."""
    if isinstance(doc, dict):
        found = {doc["id"]} if isinstance(doc.get("id"), str) else set()
        return found.union(*(_ids(v) for v in doc.values()))
    if isinstance(doc, list):
        return set().union(*(_ids(v) for v in doc))
    return set()


def oci_validator(name: str):
    """A validator for one of the image-spec's schemas, its $refs resolved from tests/data only
    (each file is known by its name under every base URI the schemas use: no network)."""
    docs = {}
    for fname in sorted(os.listdir(SCHEMA_DIR)):
        if fname.endswith(".json"):
            with open(os.path.join(SCHEMA_DIR, fname)) as f:
                docs[fname] = json.load(f)
    bases = set().union(*(_ids(d) for d in docs.values()))
    resources = []
    for fname, doc in docs.items():
        resource = referencing.jsonschema.DRAFT4.create_resource(doc)
        resources += [(fname, resource)] + [(urljoin(base, fname), resource) for base in bases]
    registry = referencing.Registry().with_resources(resources)
    return jsonschema.Draft4Validator(docs[name], registry=registry, format_checker=jsonschema.FormatChecker())


# ---- boxes and bases for particular cases ---------------------------------------------------------

def make_home_base(registry, workdir: str, repo: str) -> tuple[str, str]:
    """A base with /home/user (0700, 1000:1000) and /home/user/proj, and /root 0700; returns
    (base ref, its rootfs). The box made from it adds a file to each of proj and /root."""
    if os.geteuid() != 0:
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
SMALL_WEIGHTS = open(os.path.join(os.path.dirname(__file__), "..", "layers", "default.yaml")).read() \
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


# ---- hostile layers, built by hand, and the jail they are restored into --------------------------

TAR = "application/vnd.oci.image.layer.v1.tar"
GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
MARK = "snap-pwned"  # the name every escape attempt tries to create


def push(registry, request, *layers: bytes, gzip: bool = False) -> str:
    """Push the layers as an image named after the test; returns its reference."""
    repo = repo_for(request)
    if gzip:
        registry.push_image(repo, "v1", [gzip_bytes(b) for b in layers], layer_media_type=GZIP)
    else:
        registry.push_image(repo, "v1", list(layers), layer_media_type=TAR)
    return f"{registry.host}/{repo}:v1"


def push_annotated(registry, repo: str, layers: list[tuple[bytes, dict]], manifest_annotations: dict | None = None,
                   tag: str = "v1", zstd: bool = False) -> str:
    """Push uncompressed layers (zstd-compressed with `zstd`: a restore applies those from the stream,
    several at once) with layer annotations (the dev.snap.* ones snap commit writes) and,
    optionally, manifest annotations. Returns the image's reference."""
    blobs = [b for b, _ in layers]
    cfg = json.dumps({"architecture": "amd64", "os": "linux",
                      "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(b).hexdigest() for b in blobs]},
                      "history": [{"created_by": f"test layer {i}"} for i in range(len(blobs))]}).encode()
    descs = []
    for b, ann in layers:
        if zstd:
            b = zstandard.ZstdCompressor(level=1).compress(b)
        d = {"mediaType": TAR + "+zstd" if zstd else TAR, "digest": registry.push_blob(repo, b), "size": len(b)}
        if ann:
            d["annotations"] = ann
        descs.append(d)
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": registry.push_blob(repo, cfg), "size": len(cfg)},
                "layers": descs}
    if manifest_annotations:
        manifest["annotations"] = manifest_annotations
    r = registry.session().put(f"{registry.url}/v2/{repo}/manifests/{tag}", data=json.dumps(manifest).encode(),
                               headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    r.raise_for_status()
    return f"{registry.host}/{repo}:{tag}"


def part_ann(path: str, part: str) -> dict:
    """The annotations snap commit puts on a part layer ("i/n" of `path`)."""
    return {"dev.snap.layer": "models", "dev.snap.content": f"part {part} of {path}",
            "dev.snap.part": part, "dev.snap.part-file": path}


def repo_for(request) -> str:
    return "hostile/" + hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]


PART = "m/big.snap-part-{:04d}-of-{:04d}"


def part_image(registry, request, first: tuple[tarfile.TarInfo, bytes], anns=("1/2", "2/2"), extra=()) -> str:
    """m/big cut into two part layers: the first part is `first`, the second a regular file."""
    return push_annotated(registry, repo_for(request), [
        (tar_bytes(member("m/", "dir")), {}),
        (tar_bytes(first), part_ann("m/big", anns[0])),
        (tar_bytes(member(PART.format(2, 2), data=b"second part\n")), part_ann("m/big", anns[1])),
        *extra,
    ])


def tree_state(path: str) -> dict:
    """path -> (mode, link count, owner, mtime in ns, content digest or link target), the root itself left out."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            content = ""
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    content = hashlib.sha256(f.read()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            out[os.path.relpath(p, path)] = (st.st_mode, st.st_nlink, st.st_uid, st.st_mtime_ns, content)
    return out


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
        return tree_state(str(self.outside)), sorted(n for n in os.listdir(self.base)), around

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


# ---- the snap command line, with its peak memory ---------------------------------------------------

RUN_TIMEOUT = 300  # far more than a refusal takes: reaching it means a hang
PEAK_LIMIT_KIB = 256 * 1024
# Runs the snap CLI in this process and notes its peak RSS (VmHWM: since its exec, unlike
# ru_maxrss, which counts the test process it was forked from) and that of its children (the
# extraction process, forked from it) in the file named by $SNAP_TEST_PEAK, in KiB.
_WRAPPER = """
import os, resource, runpy
try:
    runpy.run_module("snapshotter", run_name="__main__", alter_sys=True)
finally:
    with open("/proc/self/status") as f:
        own = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    peak = max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    with open(os.environ["SNAP_TEST_PEAK"], "w") as f:
        f.write(str(peak))
"""


def run_snap(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, int]:
    """(result, peak RSS in KiB) of the snap command line."""
    with tempfile.TemporaryDirectory() as d:  # not in tmp_path: the jail watches what appears there
        peak_file = os.path.join(d, "peak")
        e = {**os.environ, "SNAP_TEST_PEAK": peak_file, **(env or {})}
        r = subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True, text=True, env=e,
                           timeout=RUN_TIMEOUT)
        with open(peak_file) as f:
            peak = int(f.read())
    assert "Traceback" not in r.stderr, r.stderr
    return r, peak


# ---- tar headers tarfile will not write ------------------------------------------------------------

def raw_header(name: bytes, kind: bytes = b"0", size: int = 0, size_field: bytes | None = None,
               extra: dict[int, bytes] | None = None) -> bytes:
    """A ustar header block with a correct checksum; `extra` overwrites bytes at given offsets."""
    buf = bytearray(512)
    buf[0:len(name)] = name
    buf[100:108] = b"0000644\0"
    buf[108:116] = b"0000000\0"
    buf[116:124] = b"0000000\0"
    buf[124:136] = size_field if size_field is not None else b"%011o\0" % size
    buf[136:148] = b"%011o\0" % 1_600_000_000
    buf[156:157] = kind
    buf[257:265] = b"ustar\x0000"
    for at, data in (extra or {}).items():
        buf[at:at + len(data)] = data
    buf[148:156] = b" " * 8
    buf[148:156] = b"%06o\0 " % sum(buf)
    return bytes(buf)


# ---- the watcher -----------------------------------------------------------------------------------

# Tiny pacing for watcher processes: scan at once, a burst is over after 0.2 s, files stable after 0.2 s.
FAST = {"SNAP_WATCH_MIN_SCAN": "0", "SNAP_WATCH_BUDGET": "1", "SNAP_WATCH_QUIET": "0.2", "SNAP_WATCH_STABLE": "0.2",
        "SNAP_NOTICE_POLL": "0.05"}


class FakeClock:
    """Wall-clock seconds that move only when the test says so."""

    def __init__(self):
        self.t = time.time()

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def watcher(registry, base_ref, box, repo, lines, clock=None, profile=None, **kw) -> Watcher:
    opts = WatchOptions(commit=CommitOptions(root=box, profile=profile or load_profile()), log=lines.append,
                        clock=clock or FakeClock(), **kw)
    return Watcher(f"{registry.host}/{repo}:v2", base_ref, opts)


class WatchProcess:
    """`snap watch` as a process; wait_for() reads what it prints on stderr, as it prints it."""

    def __init__(self, *args, env=None):
        e = {**os.environ, **FAST, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "snapshotter", "watch", *args], stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True, env=e)
        self.seen: list[str] = []
        self._timer = threading.Timer(TIMEOUT, self.proc.kill)  # a hung test still ends
        self._timer.start()

    def wait_for(self, text: str) -> str:
        for line in self.proc.stderr:
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"snap watch ended without saying {text!r}:\n{''.join(self.seen)}")

    def finish(self) -> int:
        self.seen.extend(self.proc.stderr)
        code = self.proc.wait()
        self._timer.cancel()
        return code


# ---- a Docker Engine API of a chosen version -----------------------------------------------------

def engine_api(version: dict, pull_error: str | None = None):
    """An `answer` for support.HostileServer that speaks as a Docker engine of `version` (its
    GET /version document; /_ping too, under any /vX.Y prefix): a pull (POST .../images/create)
    fails in its stream with `pull_error` (one event, unchunked), or is refused with 500 when
    none is given; anything else is 404. Point DOCKER_HOST at tcp://HOST and read what reached
    the engine in `seen`."""
    def answer(method: str, path: str):
        route = path.split("?")[0]
        route = route.split("/", 2)[2] if route.startswith("/v1.") else route.lstrip("/")
        if method in ("GET", "HEAD") and route == "_ping":
            return 200, {"Content-Type": "text/plain", "Api-Version": version.get("ApiVersion", "")}, [b"OK"]
        if method == "GET" and route == "version":
            return 200, {"Content-Type": "application/json"}, [json.dumps(version).encode()]
        if method == "POST" and route == "images/create" and pull_error is not None:
            event = {"errorDetail": {"message": pull_error}, "error": pull_error}
            return 200, {"Content-Type": "application/json"}, [json.dumps(event).encode()]
        if method == "POST" and route == "images/create":
            return 500, {"Content-Type": "application/json"}, [b'{"message": "this engine pulls nothing"}']
        return 404, {"Content-Type": "application/json"}, [b'{"message": "page not found"}']

    return answer


# ---- hooks run in packer processes (layer/packers.py) ------------------------------------------------
# generate.after_read travels to each packer with its layer, pickled: these are classes, and a packer
# imports this module (PYTHONPATH must name tests/, see packer_env).

def packer_env() -> dict:
    """The environment under which packers can load the hooks below."""
    tests = os.path.dirname(os.path.abspath(__file__))
    return {"PYTHONPATH": os.pathsep.join([tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])}


class NoteReader:
    """Notes the pid of each process that reads a box file (one line each) in `log`."""

    def __init__(self, log: str):
        self.log = log

    def __call__(self, path: str, attempt: int) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


class RewriteOnRead(NoteReader):
    """Also rewrites `paths` (of `root`) in place after every read: they never hold still."""

    def __init__(self, log: str, root: str, paths: set[str]):
        super().__init__(log)
        self.root, self.paths = root, paths

    def __call__(self, path: str, attempt: int) -> None:
        super().__call__(path, attempt)
        if path in self.paths:
            with open(os.path.join(self.root, path), "r+b") as f:
                f.write(os.urandom(64))


class BlockOnRead:
    """In a packer (not in the process `maker`): writes its pid to the FIFO `ready`, then blocks
    for good (opening the FIFO `never` for reading, which no one writes)."""

    def __init__(self, ready: str, never: str):
        self.ready, self.never, self.maker = ready, never, os.getpid()

    def __call__(self, path: str, attempt: int) -> None:
        if os.getpid() == self.maker:
            return
        fd = os.open(self.ready, os.O_WRONLY)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        os.open(self.never, os.O_RDONLY)


# ---- Docker's config and its credential helpers -------------------------------------------------------

def docker_config(tmp_path, auths: dict, **more) -> str:
    """A Docker config dir holding `auths` (host -> {"auth": base64 user:password}) and `more` keys
    (credHelpers, credsStore); for DOCKER_CONFIG."""
    cfg_dir = tmp_path / "docker-config"
    cfg_dir.mkdir(exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps({"auths": auths, **more}))
    return str(cfg_dir)


def basic(user: str, password: str) -> dict:
    return {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}


def credential_helper(tmp_path, name: str, secrets: dict) -> tuple[str, str]:
    """A real `docker-credential-NAME` program (as docker-credential-pass or -ecr-login are) that
    keeps credentials in a JSON file, seeded with `secrets` (server -> (user, password)), speaks the
    helper protocol (get, store, erase) and logs each call as "ACTION SERVER". Returns (PATH with it
    first, the log file); the store is the log's name with .json."""
    bin_dir = tmp_path / "helper-bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"{name}.log"
    store = tmp_path / f"{name}.log.json"
    store.write_text(json.dumps({k: {"Username": u, "Secret": p} for k, (u, p) in secrets.items()}))
    prog = bin_dir / f"docker-credential-{name}"
    prog.write_text(f"""#!{sys.executable}
import json, sys
action, data = sys.argv[1], sys.stdin.read()
table = json.load(open({str(store)!r}))
server = json.loads(data)["ServerURL"] if action == "store" else data.strip()
open({str(log)!r}, "a").write(action + " " + server + "\\n")
if action == "store":
    table[server] = {{k: v for k, v in json.loads(data).items() if k != "ServerURL"}}
elif action == "get" and server in table:
    print(json.dumps(dict(table[server], ServerURL=server)))
elif action == "erase" and server in table:
    del table[server]
else:
    print("credentials not found in native keychain")
    sys.exit(1)
json.dump(table, open({str(store)!r}, "w"))
""")
    prog.chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}", str(log)
