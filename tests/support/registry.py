"""docker-registry on 127.0.0.1 (plain, htpasswd, TLS, S3 storage, or token auth with its token
service beside it), and what tests read of a registry's repositories."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from typing import Optional
from urllib.parse import parse_qs, urlparse

import requests

from support.run import free_port, stop_process
from support.servers import NoDelayHandler, ThreadedServer

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"


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
            out = subprocess.run(["htpasswd", "-Bbn", self.auth[0], self.auth[1]], check=True, capture_output=True,
                                 text=True)
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
                   diff_ids: Optional[list[str]] = None, layer_annotations: Optional[list[dict]] = None,
                   manifest_annotations: Optional[dict] = None) -> str:
        """Push an image made of the given (already compressed) layer blobs, with annotations on the
        layers (each a dict, empty for none) and on the manifest if given. Returns the manifest digest."""
        if diff_ids is None:
            diff_ids = ["sha256:" + hashlib.sha256(gzip.decompress(b) if layer_media_type.endswith("gzip") else b)
                        .hexdigest() for b in layers]
        cfg = dict(config or {})
        cfg.setdefault("architecture", "amd64")
        cfg.setdefault("os", "linux")
        cfg.setdefault("config", {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                                  "Cmd": ["/bin/sh"]})
        cfg["rootfs"] = {"type": "layers", "diff_ids": diff_ids}
        cfg["history"] = [{"created_by": f"test layer {i}"} for i in range(len(layers))]
        cfg_bytes = json.dumps(cfg).encode()
        descs = [{"mediaType": layer_media_type, "digest": self.push_blob(repo, b), "size": len(b)} for b in layers]
        for desc, ann in zip(descs, layer_annotations or []):
            if ann:
                desc["annotations"] = ann
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": self.push_blob(repo, cfg_bytes), "size": len(cfg_bytes)},
            "layers": descs,
        }
        if manifest_annotations:
            manifest["annotations"] = manifest_annotations
        body = json.dumps(manifest).encode()
        r = self.session().put(f"{self.url}/v2/{repo}/manifests/{tag}", data=body,
                               headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
        r.raise_for_status()
        return "sha256:" + hashlib.sha256(body).hexdigest()



class TokenServer(ThreadedServer):
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

        class Handler(NoDelayHandler):
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
            token = self.tokens.issue([f"repository:{m.group(1)}:pull,push,delete"], "admin")
            r.headers["Authorization"] = "Bearer " + token
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

