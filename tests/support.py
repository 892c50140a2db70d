"""Real parts for tests and the demo: a distribution registry on 127.0.0.1, and small base images
made from files we write (pushed with snap's own registry client, no Docker). Below them, in
sections, the plain helpers of the tests, the demo and the bench; what only tests share is in
helpers.py, the fixtures are in conftest.py."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional
from urllib.parse import parse_qs, urlparse

import requests
import zstandard

MiB = 1024 * 1024
IS_ROOT = os.geteuid() == 0
TIMEOUT = 120  # generous overall bound for a process or a thread to get somewhere: reaching it means a hang
REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RegistryServer:
    """docker-registry (distribution v2) with its own config, port and storage dir.
    Optionally with htpasswd auth and TLS (a self-signed certificate made here), or with its S3
    driver's parameters (`s3`, e.g. an S3 API server on loopback) instead of the storage dir."""

    def __init__(self, workdir: str, auth: Optional[tuple[str, str]] = None, tls: bool = False,
                 port: Optional[int] = None, delete: bool = True, s3: Optional[dict] = None):
        self.workdir = workdir
        self.delete = delete  # storage.delete.enabled: whether manifests may be deleted
        self.s3 = s3
        self.port = port or free_port()
        self.auth = auth
        self.tls = tls
        self.storage = os.path.join(workdir, "storage")
        self.proc: Optional[subprocess.Popen] = None
        self.cert = os.path.join(workdir, "cert.pem")
        self.key = os.path.join(workdir, "key.pem")
        os.makedirs(self.storage, exist_ok=True)
        self.config = os.path.join(workdir, "config.yml")
        self._write_config()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    def _write_config(self) -> None:
        lines = [
            "version: 0.1",
            "log: {level: info, accesslog: {disabled: true}}",  # info: its "listening on" line, see start()
            "storage:",
            f"  s3: {json.dumps(self.s3)}" if self.s3 else f"  filesystem: {{rootdirectory: {self.storage}}}",
            f"  delete: {{enabled: {'true' if self.delete else 'false'}}}",
            "http:",
            f"  addr: 127.0.0.1:{self.port}",
        ]
        if self.tls:
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                 "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", self.key, "-out", self.cert],
                check=True, capture_output=True)
            lines.append(f"  tls: {{certificate: {self.cert}, key: {self.key}}}")
        if self.auth:
            htpasswd = os.path.join(self.workdir, "htpasswd")
            out = subprocess.run(["htpasswd", "-Bbn", self.auth[0], self.auth[1]], check=True, capture_output=True, text=True)
            with open(htpasswd, "w") as f:
                f.write(out.stdout)
            lines += ["auth:", "  htpasswd:", "    realm: snap-test", f"    path: {htpasswd}"]
        with open(self.config, "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self) -> "RegistryServer":
        """Start it; return once it logs that it listens (an event, not a poll of its port)."""
        # Its S3 driver reads the AWS_* settings too (AWS_CA_BUNDLE makes it panic on a plain-http
        # endpoint): the config alone says where its storage is and who it is there.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", self.config], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=env)
        said, listening = threading.Event(), []
        threading.Thread(target=self._copy_log, args=(self.proc.stderr, said, listening), daemon=True).start()
        if not said.wait(60) or not listening:
            self.stop()
            raise RuntimeError(f"docker-registry did not start: see {self.workdir}/registry.log")
        return self

    def _copy_log(self, stderr, said: threading.Event, listening: list) -> None:
        """Copy the registry's log to registry.log, and say (`said`) whether it listens or exited."""
        with stderr, open(os.path.join(self.workdir, "registry.log"), "ab", buffering=0) as log:
            for line in stderr:
                log.write(line)
                if not said.is_set() and b'msg="listening on ' in line:
                    listening.append(True)
                    said.set()
        said.set()

    def stop(self) -> None:
        if self.proc:
            stop_process(self.proc, 10)
        self.proc = None

    def session(self) -> requests.Session:
        s = requests.Session()
        if self.auth:
            s.auth = self.auth
        s.verify = self.cert if self.tls else True
        s.trust_env = False  # else REQUESTS_CA_BUNDLE from the environment overrides s.verify
        return s

    def has_blob(self, repo: str, digest: str) -> bool:
        # allow_redirects: a registry on object storage answers with a redirect to the bucket
        return self.session().head(f"{self.url}/v2/{repo}/blobs/{digest}", allow_redirects=True).status_code == 200

    def manifest(self, repo: str, ref: str) -> dict:
        r = self.session().get(f"{self.url}/v2/{repo}/manifests/{ref}",
                               headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
        r.raise_for_status()
        return r.json()

    def blob(self, repo: str, digest: str) -> bytes:
        r = self.session().get(f"{self.url}/v2/{repo}/blobs/{digest}")
        r.raise_for_status()
        return r.content

    def push_blob(self, repo: str, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        s = self.session()
        r = s.post(f"{self.url}/v2/{repo}/blobs/uploads/")
        r.raise_for_status()
        loc = r.headers["Location"]
        loc = loc if loc.startswith("http") else self.url + loc
        r = s.put(loc + ("&" if "?" in loc else "?") + f"digest={digest}", data=data,
                  headers={"Content-Type": "application/octet-stream"})
        r.raise_for_status()
        return digest

    def push_image(self, repo: str, tag: str, layers: list[bytes], config: Optional[dict] = None,
                   layer_media_type: str = "application/vnd.oci.image.layer.v1.tar+gzip",
                   diff_ids: Optional[list[str]] = None) -> str:
        """Push an image made of the given (already compressed) layer blobs. Returns the manifest digest."""
        if diff_ids is None:
            diff_ids = ["sha256:" + hashlib.sha256(_gunzip(b) if layer_media_type.endswith("gzip") else b).hexdigest()
                        for b in layers]
        cfg = dict(config or {})
        cfg.setdefault("architecture", "amd64")
        cfg.setdefault("os", "linux")
        cfg.setdefault("config", {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                                  "Cmd": ["/bin/sh"]})
        cfg["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
        cfg["history"] = [{"created_by": f"test layer {i}"} for i in range(len(layers))]
        cfg_bytes = json.dumps(cfg).encode()
        descs = [{"mediaType": layer_media_type, "digest": self.push_blob(repo, b), "size": len(b)} for b in layers]
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": self.push_blob(repo, cfg_bytes), "size": len(cfg_bytes)},
            "layers": descs,
        }
        body = json.dumps(manifest).encode()
        r = self.session().put(f"{self.url}/v2/{repo}/manifests/{tag}", data=body,
                               headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        r.raise_for_status()
        return "sha256:" + hashlib.sha256(body).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    """A test server's request handler. TCP_NODELAY: its headers and body go out as separate
    writes, and Nagle would hold the body back until the client's delayed ACK (40 ms a request)."""

    disable_nagle_algorithm = True


class _ThreadedServer:
    """An HTTP server of the test process, run in a thread: `_httpd` is set by the subclass."""

    _httpd: ThreadingHTTPServer
    _thread: Optional[threading.Thread] = None

    def start(self):
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        # Not serve_forever: its shutdown() waits for a 0.5 s poll (per test, with a proxy).
        # Here stop() wakes the loop with a connection of its own.
        self._httpd.timeout = None
        while not self._stopping.is_set():
            self._httpd.handle_request()

    def stop(self) -> None:
        if self._thread:
            self._stopping.set()
            socket.create_connection(self._httpd.server_address[:2]).close()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()


class TokenServer(_ThreadedServer):
    """A token service as Docker Hub, GHCR or Harbor run one (distribution's token auth spec), on
    127.0.0.1 in a thread of the test process. It checks Basic credentials and issues RS256 JWTs
    signed with a key whose certificate is the registry's rootcertbundle. A known user gets the
    actions asked for (only pull for a user in `read_only`), anonymous gets a token granting
    nothing, wrong credentials get 401. `requests` records (user, scope) of each token asked for."""

    service = "snap-test-registry"
    issuer = "snap-test-token-issuer"

    def __init__(self, workdir: str, users: dict[str, str], read_only: tuple[str, ...] = ()):
        self.users, self.read_only = users, read_only
        self.key = os.path.join(workdir, "token-key.pem")
        self.cert = os.path.join(workdir, "token-cert.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                        "-subj", "/CN=snap-test-token", "-keyout", self.key, "-out", self.cert],
                       check=True, capture_output=True)
        with open(self.cert) as f:
            pem = f.read()
        self._x5c = "".join(pem.split("-----")[2].split())  # the certificate's DER, base64
        self._signer = _rs256_signer(self.key)
        self.requests: list[tuple[Optional[str], str]] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def issue(self, scopes: list[str], subject: str = "") -> str:
        """A token for space-separated scopes such as "repository:box:pull,push"."""
        access = []
        for scope in scopes:
            for one in scope.split():
                kind, _, rest = one.partition(":")
                name, _, actions = rest.rpartition(":")
                access.append({"type": kind, "name": name, "actions": actions.split(",") if actions else []})
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        claims = {"iss": self.issuer, "sub": subject, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": uuid.uuid4().hex, "access": access}
        signing_input = _b64url(json.dumps(header).encode()) + "." + _b64url(json.dumps(claims).encode())
        return signing_input + "." + _b64url(self._signer(signing_input.encode()))

    def _handler(self):
        server = self

        class Handler(_Handler):
            def do_GET(self):
                q = parse_qs(urlparse(self.path).query)
                user = None
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
                    if server.users.get(user) != password:
                        server.requests.append((user, "refused"))
                        return self._reply(401, {"details": "incorrect username or password"})
                scopes = q.get("scope", [])
                server.requests.append((user, " ".join(scopes)))
                granted = []
                for scope in scopes:
                    for one in scope.split():
                        kind, _, rest = one.partition(":")
                        name, _, actions = rest.rpartition(":")
                        allowed = [] if user is None else ["pull"] if user in server.read_only else actions.split(",")
                        granted.append(f"{kind}:{name}:{','.join(a for a in actions.split(',') if a in allowed)}")
                token = server.issue(granted, user or "")
                self._reply(200, {"token": token, "access_token": token, "expires_in": 300})

            def _reply(self, code: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        return Handler


class _AdminBearer(requests.auth.AuthBase):
    """For the test's own requests to a token registry: a full-access token for the URL's repository."""

    def __init__(self, tokens: TokenServer):
        self.tokens = tokens

    def __call__(self, r):
        m = re.match(r"^/v2/(.+?)/(?:blobs|manifests|tags)/", urlparse(r.url).path)
        if m:
            r.headers["Authorization"] = "Bearer " + self.tokens.issue([f"repository:{m.group(1)}:pull,push,delete"], "admin")
        return r


class TokenRegistryServer(RegistryServer):
    """docker-registry with token auth (as Docker Hub, GHCR, GitLab, Harbor), its TokenServer beside it."""

    def __init__(self, workdir: str, users: dict[str, str], read_only: tuple[str, ...] = (),
                 port: Optional[int] = None):
        self.tokens = TokenServer(workdir, users, read_only)
        super().__init__(workdir, port=port)

    def _write_config(self) -> None:
        super()._write_config()
        with open(self.config, "a") as f:
            f.write("auth:\n  token:\n"
                    f"    realm: {self.tokens.realm}\n"
                    f"    service: {self.tokens.service}\n"
                    f"    issuer: {self.tokens.issuer}\n"
                    f"    rootcertbundle: {self.tokens.cert}\n")

    def start(self) -> "TokenRegistryServer":
        self.tokens.start()
        super().start()
        return self

    def stop(self) -> None:
        super().stop()
        self.tokens.stop()

    def session(self) -> requests.Session:
        s = super().session()
        s.auth = _AdminBearer(self.tokens)
        return s


def _b64url(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def _rs256_signer(key_path: str):
    """RSASSA-PKCS1-v1_5 with SHA-256: with the cryptography package when it is installed, else openssl."""
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding
    except ImportError:
        return lambda data: subprocess.run(["openssl", "dgst", "-sha256", "-sign", key_path], input=data,
                                           capture_output=True, check=True).stdout
    with open(key_path, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), None)
    return lambda data: key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def _gunzip(b: bytes) -> bytes:
    return gzip.decompress(b)


# ---- tars: one builder, (TarInfo, content) pairs in; the conveniences below feed it ----------------

def tar_bytes(*members: tuple[tarfile.TarInfo, bytes], format: int = tarfile.PAX_FORMAT, **options) -> bytes:
    """An uncompressed tar of the members, in order (content is written for regular files only).
    `options` go to tarfile.open (pax_headers, encoding, errors)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=format, **options) as tar:
        for ti, data in members:
            tar.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def member(name: str, kind: str = "file", data: bytes = b"", mode: int | None = None, linkname: str = "",
           dev: tuple[int, int] = (0, 0), pax: dict | None = None,
           mtime: int = 1_600_000_000) -> tuple[tarfile.TarInfo, bytes]:
    """One tar member, as tar_bytes takes it: kind is file, dir, symlink, hardlink, char or block."""
    ti = tarfile.TarInfo(name)
    ti.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
               "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE}[kind]
    ti.mode = mode if mode is not None else (0o755 if kind == "dir" else 0o644)
    ti.mtime = mtime
    ti.linkname = linkname
    ti.devmajor, ti.devminor = dev
    ti.size = len(data) if kind == "file" else 0
    if pax:
        ti.pax_headers = pax
    return ti, data


def tar_of_files(files: dict[str, bytes], dirs: tuple[str, ...] = (), mode: int = 0o644,
                 mtime: int = 1_600_000_000) -> bytes:
    """A tar of the directories `dirs` (first), then of the files (path -> content), all of one mode."""
    return tar_bytes(*[member(d + "/", "dir", mtime=mtime) for d in dirs],
                     *[member(name, data=data, mode=mode, mtime=mtime) for name, data in files.items()])


def tar_of_dir(root: str) -> bytes:
    """An uncompressed tar of a directory tree, as an image layer holds it (numeric owners)."""
    members = []
    with tarfile.open(fileobj=io.BytesIO(), mode="w") as stat_reader:  # gettarinfo also finds hardlinks
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                ti = stat_reader.gettarinfo(full, arcname=os.path.relpath(full, root))
                ti.uname = ti.gname = ""
                data = b""
                if ti.isreg():
                    with open(full, "rb") as f:
                        data = f.read()
                members.append((ti, data))
    return tar_bytes(*members)


def gzip_bytes(b: bytes) -> bytes:
    return gzip.compress(b, mtime=0)


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


def push_base_image(registry: RegistryServer, repo: str, tag: str, rootfs: str) -> str:
    """Push a two-layer base image of `rootfs`: /bin + /etc in one layer, the rest in another."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        for name in os.listdir(rootfs):
            src = os.path.join(rootfs, name)
            dst = os.path.join(a if name in ("bin", "etc") else b, name)
            subprocess.run(["cp", "-a", src, dst], check=True)
        layers = [gzip_bytes(tar_of_dir(a)), gzip_bytes(tar_of_dir(b))]
    return registry.push_image(repo, tag, layers)


# Paths the default profile never captures; a restored tree is compared without them.
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
    os.link(os.path.join(dest, "opt/app/custom_nodes/NodeA/nodes.py"), os.path.join(dest, "opt/app/custom_nodes/NodeA/nodes_link.py"))
    os.chmod(os.path.join(dest, "opt/app/custom_nodes/NodeB/__init__.py"), 0o600)
    return dest


def snap(*args, input=None, env=None, check=False):
    """Run the real `snap` command line in a subprocess."""
    e = dict(os.environ)
    e.update(env or {})
    # `python -m snapshotter` is the `snap` entry point without PATH lookups (Ubuntu's snapd is also `snap`).
    r = subprocess.run([sys.executable, "-m", "snapshotter", *args], capture_output=True, text=True, input=input, env=e, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"snap {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def assert_one_line_error(r, code: int, *words: str) -> None:
    """snap exited `code` and said why in one `snap: error:` line holding each of `words`, without a traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("snap: error:")]
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def assert_clean(r) -> None:
    """No raw control character (nor a name's undecodable byte) in snap's output but the newline
    ending each line."""
    for text in (r.stdout, r.stderr):
        bad = [c for c in text if c != "\n" and not c.isprintable()]
        assert not bad, (bad, text)


def snapshot_of_tree(root: str, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Everything a restore must reproduce, per path: type, mode, owner, mtime, content digest or
    link target, and which paths share an inode (hardlinks). Written independently of snap's code."""
    out: dict[str, tuple] = {}
    inodes: dict[tuple[int, int], str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames[:] = [d for d in dirnames if os.path.join(rel_dir, d) not in skip]
        for name in sorted(dirnames + filenames):
            rel = os.path.join(rel_dir, name)
            if rel in skip:
                continue
            full = os.path.join(root, rel)
            st = os.lstat(full)
            kind = "dir" if os.path.isdir(full) and not os.path.islink(full) else "link" if os.path.islink(full) else "file"
            extra = ""
            if kind == "link":
                extra = os.readlink(full)
            elif kind == "file":
                with open(full, "rb") as f:
                    extra = hashlib.sha256(f.read()).hexdigest()
                if st.st_nlink > 1:
                    first = inodes.setdefault((st.st_dev, st.st_ino), rel)
                    extra += f" linked-with:{first}"
            xattrs = tuple(sorted((n, os.getxattr(full, n, follow_symlinks=False))
                                  for n in os.listxattr(full, follow_symlinks=False) if not n.startswith("security.selinux")))
            out[rel] = (kind, oct(st.st_mode & 0o7777), st.st_uid, st.st_gid, int(st.st_mtime), extra) + ((xattrs,) if xattrs else ())
    return out


def snap_layer_files(registry: RegistryServer, repo: str, tag: str) -> dict[str, tarfile.TarInfo]:
    """Every tar member of the layers snap added to an image (gzip, zstd or plain), by name."""
    out: dict[str, tarfile.TarInfo] = {}
    for d in registry.manifest(repo, tag)["layers"]:
        if "dev.snap.layer" not in d.get("annotations", {}):
            continue
        blob = registry.blob(repo, d["digest"])
        if d["mediaType"].endswith("zstd"):
            blob = zstandard.ZstdDecompressor().stream_reader(blob).read()
        elif d["mediaType"].endswith("gzip"):
            blob = _gunzip(blob)
        with tarfile.open(fileobj=io.BytesIO(blob)) as t:
            out.update((m.name.rstrip("/"), m) for m in t.getmembers())
    return out


class FaultProxy(_ThreadedServer):
    """A reverse proxy on 127.0.0.1 in front of a registry, in a thread of the test process, that
    counts what passes and makes the faults a real link or registry has: a connection cut in the
    middle of an upload, a slow download, a 429/503 answer with Retry-After, a registry that
    refuses PATCH. Point snap at `proxy.host` instead of `registry.host`.

    - `answer(method, path)`: return (status, headers) to answer a request without forwarding it
      (None forwards it); set it from the test.
    - `stall_uploads_after`: bytes of a PATCH body after which the proxy stops forwarding (sets
      `stalled`) until `release` is set.
    - `cut_upload_after`: bytes of the next upload body (PATCH or PUT) after which both
      connections are cut; the registry keeps what it got. One cut, then it resets to None.
    - `throttle`: bytes per second for blob download bodies, shared by all of them as on one
      link; `midway` is set once `midway_at` bytes of one have passed.
    - `body_bytes[method]`: request body bytes forwarded (manifests under "PUT manifest");
      `blob_bytes_sent`: blob download body bytes passed to the client; `log`: (method, path, status).
    - A lying registry: `lie(method, path)` may return (status, headers, body pieces) to answer
      with a body of its own (a 300 MiB manifest, ...), streamed; `endless_blob`: the digest of a
      blob whose body goes on past its end with zeros, without a length, until the client hangs up.
    - `hold_blob`: the digest of a blob whose downloads wait (setting `holding`) until `unhold` is set.
    - `wait_for(request)`: block until a logged (method, path, status) matches, instead of polling;
      a request the upstream refused (a registry that is down) is logged with status REFUSED and
      its connection closed unanswered.
    - `back`: an Event for a registry that restarts: once one request has been REFUSED, later
      ones that find it down wait for `back` (set by the test once it is up again), so a client
      that retries at once (SNAP_RETRY_SCALE=0) still meets it back, however long its restart.
    - `down`: while set, every request is refused so (an outage the test starts and ends at will,
      the registry behind it kept as it is)."""

    REFUSED = -2

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.down = threading.Event()
        self.answer = lambda method, path: None
        self.lie = lambda method, path: None
        self.endless_blob: Optional[str] = None
        self.hold_blob: Optional[str] = None
        self.back: Optional[threading.Event] = None
        self.holding, self.unhold = threading.Event(), threading.Event()
        self.cut_upload_after: Optional[int] = None
        self.stall_uploads_after: Optional[int] = None
        self.stalled, self.release = threading.Event(), threading.Event()
        self.cut = threading.Event()
        self.throttle: Optional[int] = None
        self.midway_at = 1 << 20
        self.midway = threading.Event()
        self.body_bytes: dict[str, int] = {}
        self.blob_bytes_sent = 0
        self.log: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._link_free_at = 0.0  # monotonic time the throttled link has sent what it was given
        self._logged = threading.Condition()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._httpd.server_address[1]}"

    def upload_bytes(self) -> int:
        return self.body_bytes.get("PATCH", 0) + self.body_bytes.get("PUT", 0)

    def wait_for(self, request: Callable[[str, str, int], bool], timeout: float = 120) -> bool:
        """Wait until a request matching `request(method, path, status)` has been logged; False on timeout."""
        with self._logged:
            return self._logged.wait_for(lambda: any(request(*entry) for entry in self.log), timeout)

    def _log(self, method: str, path: str, status: int) -> None:
        with self._logged:
            self.log.append((method, path, status))
            self._logged.notify_all()

    def _count(self, method: str, n: int) -> None:
        with self._lock:
            self.body_bytes[method] = self.body_bytes.get(method, 0) + n

    def _handler(self):
        proxy = self
        import http.client

        class Handler(_Handler):
            protocol_version = "HTTP/1.1"

            def _body(self):
                """The request body, decoded from chunked encoding if it is chunked."""
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return
                        data = self.rfile.read(size)
                        self.rfile.readline()
                        yield data
                else:
                    left = int(self.headers.get("Content-Length") or 0)
                    while left:
                        data = self.rfile.read(min(left, 1 << 16))
                        if not data:
                            return
                        left -= len(data)
                        yield data

            def _forwarded(self, method: str, upstream):
                limit = proxy.cut_upload_after if method in ("PATCH", "PUT") else None
                if "/manifests/" in self.path:
                    method = f"{method} manifest"  # counted apart from blob bytes
                sent = 0
                for data in self._body():
                    if limit is not None and sent + len(data) > limit:
                        data = data[:limit - sent]
                        upstream.send(b"%x\r\n%s\r\n" % (len(data), data) if data else b"")
                        proxy._count(method, len(data))
                        proxy.cut_upload_after = None
                        raise _Cut()
                    sent += len(data)
                    proxy._count(method, len(data))
                    yield data
                    if proxy.stall_uploads_after is not None and method == "PATCH" and sent >= proxy.stall_uploads_after:
                        proxy.stalled.set()
                        proxy.release.wait(300)  # a link that stops moving, until the test lets it go

            def _any(self):
                method, path = self.command, self.path
                canned = proxy.answer(method, path)
                if canned is not None:
                    for _ in self._body():
                        pass
                    status, headers = canned
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    proxy._log(method, path, status)
                    return
                if proxy.hold_blob and method == "GET" and path.endswith(f"/blobs/{proxy.hold_blob}"):
                    proxy.holding.set()
                    proxy.unhold.wait(300)  # a weight still on its way, until the test lets it arrive
                lie = proxy.lie(method, path)
                if lie is not None:
                    self._lie(method, path, *lie)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=300)
                try:
                    if proxy.down.is_set():
                        raise ConnectionRefusedError()
                    upstream.connect()
                except ConnectionRefusedError:  # the registry is down: the client's request goes unanswered
                    if proxy.back is None or not proxy.wait_for(lambda *entry: entry[2] == proxy.REFUSED, 0):
                        proxy._log(method, path, proxy.REFUSED)
                        self.close_connection = True
                        return
                    proxy.back.wait(300)  # refused once already: this one waits for the registry's restart
                    upstream.connect()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length", "connection")}
                chunked = self.headers.get("Transfer-Encoding", "").lower() == "chunked"
                try:
                    if chunked or self.headers.get("Content-Length") not in (None, "0"):
                        upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                        for k, v in headers.items():
                            upstream.putheader(k, v)
                        upstream.putheader("Transfer-Encoding", "chunked")
                        upstream.endheaders()
                        for data in self._forwarded(method, upstream):
                            upstream.send(b"%x\r\n%s\r\n" % (len(data), data))
                        upstream.send(b"0\r\n\r\n")
                    else:
                        upstream.request(method, path, headers={**headers, "Content-Length": "0"})
                    r = upstream.getresponse()
                except _Cut:
                    upstream.sock.shutdown(socket.SHUT_RDWR)
                    upstream.close()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    proxy._log(method, path, -1)
                    proxy.cut.set()
                    return
                proxy._log(method, path, r.status)
                if proxy.endless_blob and path.endswith(f"/blobs/{proxy.endless_blob}") and method == "GET":
                    self._lie(method, path, r.status, {"Content-Type": "application/octet-stream"},
                              itertools.chain([r.read()], itertools.repeat(bytes(1 << 16))), length=False)
                    upstream.close()
                    return
                self.send_response_only(r.status)
                length = r.getheader("Content-Length")
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                body = b"" if method == "HEAD" or length is not None else r.read()
                self.send_header("Content-Length", length if length is not None else str(len(body)))
                self.end_headers()
                if method == "HEAD":
                    upstream.close()
                    return
                if length is None:
                    self.wfile.write(body)
                    upstream.close()
                    return
                passed = 0
                slow = proxy.throttle and "/blobs/" in path and method == "GET"
                # The slow link: one for all downloads (two streams share its rate), paced against
                # the clock, in pieces of ~10 ms of it (cheap on a fast link).
                piece = max(16384, min(1 << 20, proxy.throttle // 100)) if slow else 1 << 20
                while data := r.read(piece):
                    try:
                        self.wfile.write(data)
                    except OSError:
                        break
                    passed += len(data)
                    if "/blobs/" in path and method == "GET":
                        with proxy._lock:
                            proxy.blob_bytes_sent += len(data)
                    if slow:
                        if passed >= proxy.midway_at:
                            proxy.midway.set()
                        with proxy._lock:
                            now = time.monotonic()
                            proxy._link_free_at = max(now, proxy._link_free_at) + len(data) / proxy.throttle
                            ahead = proxy._link_free_at - now
                        if ahead > 0:
                            time.sleep(ahead)
                upstream.close()

            def _lie(self, method, path, status, headers, pieces, length=True):
                """Answer with `pieces` as the body: with a Content-Length (their total), or without
                one, the end of the body being the end of the connection."""
                for _ in self._body():
                    pass
                proxy._log(method, path, status)
                pieces = list(pieces) if length else pieces
                _answer(self, status, headers, pieces, length)

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *args):
                pass

        return Handler


class HostileServer(_ThreadedServer):
    """A lying HTTP server on 127.0.0.1 (over TLS with a self-signed certificate if `workdir` is
    given), in a thread of the test process: a registry's front, its token service, or the other
    host that a registry's answer points at. `answer(method, path)` returns (status, headers,
    body pieces), sent with their total as Content-Length (default: 404). Each request is noted
    in `seen` as (method, path, its Authorization header or None)."""

    def __init__(self, workdir: Optional[str] = None):
        self.answer: Callable[[str, str], tuple[int, dict, list[bytes]]] = lambda method, path: (404, {}, [])
        self.seen: list[tuple[str, str, Optional[str]]] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        if workdir:
            import ssl
            cert, key = os.path.join(workdir, "hostile-cert.pem"), os.path.join(workdir, "hostile-key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                            "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", cert], check=True, capture_output=True)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._httpd.server_address[1]}"

    def _handler(self):
        server = self

        class Handler(_Handler):
            protocol_version = "HTTP/1.1"

            def _any(self):
                left = int(self.headers.get("Content-Length") or 0)
                while left > 0:
                    left -= len(self.rfile.read(min(left, 1 << 16)) or b"\0" * left)
                server.seen.append((self.command, self.path, self.headers.get("Authorization")))
                _answer(self, *server.answer(self.command, self.path))

            do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, *args):
                pass

        return Handler


def _answer(handler: BaseHTTPRequestHandler, status: int, headers: dict, pieces, length: bool = True) -> None:
    """Answer with `pieces` as the body: with a Content-Length (their total: a list), or without
    one, the end of the body being the end of the connection."""
    handler.send_response_only(status)
    for k, v in headers.items():
        handler.send_header(k, v)
    if length:
        handler.send_header("Content-Length", str(sum(len(p) for p in pieces)))
    else:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    if handler.command == "HEAD":
        return
    for piece in pieces:
        try:
            handler.wfile.write(piece)
        except OSError:
            return  # the client hung up


class _Cut(Exception):
    """The proxy cuts this upload's connections here."""


class MetadataServer(_ThreadedServer):
    """A cloud's instance metadata service on 127.0.0.1, in a thread of the test process. It speaks
    only the documented paths and headers of one provider and refuses requests without them:
    aws   IMDSv2: PUT /latest/api/token (X-aws-ec2-metadata-token-ttl-seconds), then
          GET /latest/meta-data/spot/instance-action (X-aws-ec2-metadata-token): 404 until a notice;
    gcp   GET /computeMetadata/v1/instance/preempted (Metadata-Flavor: Google): FALSE, then TRUE;
    azure GET /metadata/scheduledevents?api-version=2020-07-01 (Metadata: true): Events, Preempt.
    `preempt()` issues the notice; `requests` records (method, path) of every request, `refused`
    those it turned away."""

    def __init__(self, provider: str):
        self.provider = provider
        self.noticed = False
        self.requests: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []
        self.answered = threading.Event()  # set once a well-formed poll was answered
        self.token = uuid.uuid4().hex
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def preempt(self) -> None:
        self.noticed = True

    def _handler(self):
        server = self

        class Handler(_Handler):
            def _reply(self, code: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                if code >= 400 and code != 404:
                    server.refused.append((self.command, self.path))
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                server.requests.append(("PUT", self.path))
                if server.provider != "aws" or self.path != "/latest/api/token":
                    return self._reply(404)
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "").isdigit():
                    return self._reply(400)
                self._reply(200, server.token.encode())

            def do_GET(self):
                server.requests.append(("GET", self.path))
                p, h = self.path, self.headers
                if server.provider == "aws" and p == "/latest/meta-data/spot/instance-action":
                    if h.get("X-aws-ec2-metadata-token") != server.token:
                        return self._reply(401)
                    server.answered.set()
                    if not server.noticed:
                        return self._reply(404)
                    return self._reply(200, json.dumps({"action": "terminate", "time": "2026-12-03T12:00:00Z"}).encode(),
                                       "application/json")
                if server.provider == "gcp" and p == "/computeMetadata/v1/instance/preempted":
                    if h.get("Metadata-Flavor") != "Google":
                        return self._reply(403)
                    server.answered.set()
                    return self._reply(200, b"TRUE" if server.noticed else b"FALSE")
                if server.provider == "azure" and p == "/metadata/scheduledevents?api-version=2020-07-01":
                    if h.get("Metadata") != "true":
                        return self._reply(400)
                    server.answered.set()
                    events = [{"EventId": "A123", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                               "Resources": ["box"], "EventStatus": "Scheduled", "NotBefore": "Thu, 03 Dec 2026 12:00:30 GMT"}]
                    doc = {"DocumentIncarnation": 2 if server.noticed else 1, "Events": events if server.noticed else []}
                    return self._reply(200, json.dumps(doc).encode(), "application/json")
                self._reply(404)

            def log_message(self, *args):
                pass

        return Handler


def fake_dmi(path: str, **files: str) -> str:
    """A directory laid out like /sys/class/dmi/id with the given files (sys_vendor=..., ...)."""
    os.makedirs(path, exist_ok=True)
    for name, value in files.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(value + "\n")
    return path


# Wheels .ci/setup fetched for tests that pip-install into venvs of their own, never from an index.
WHEELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci", "wheels")
PIP_OFFLINE = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_CONFIG_FILE": os.devnull}


def have_wheels(*names: str) -> bool:
    """Whether .ci/wheels holds a wheel of each distribution (names as in wheel file names)."""
    files = os.listdir(WHEELS) if os.path.isdir(WHEELS) else []
    return all(any(f.lower().startswith(n + "-") for f in files) for n in names)


def pip_install_offline(venv: str, *args: str) -> subprocess.CompletedProcess:
    """`VENV/bin/pip install ARGS` from .ci/wheels alone."""
    env = {**os.environ, **PIP_OFFLINE}
    env.pop("PYTHONPATH", None)
    return subprocess.run([os.path.join(venv, "bin/pip"), "install", "-q", "--no-index", "--find-links", WHEELS, *args],
                          capture_output=True, text=True, env=env)
