"""Container engines: a real dockerd started as root on sockets of its own, and the Engine API of
a chosen version spoken by a HostileServer."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from typing import Optional

from support.run import stop_process


class Dockerd:
    """dockerd as root on its own socket, data-root and exec-root (its own containerd too)."""

    def __init__(self, workdir: str, insecure_registry: str, path: Optional[str] = None):
        self.workdir = workdir
        self.host = f"unix://{workdir}/docker.sock"
        self.log = os.path.join(workdir, "dockerd.log")
        self.env = {**os.environ, "PATH": path} if path else None  # where it looks for helpers (the NVIDIA hook)
        ns = f"snaptest{os.getpid()}-{os.path.basename(workdir)}"
        self.argv = [
            shutil.which("dockerd"), "--host", self.host, "--data-root", f"{workdir}/data",
            "--exec-root", f"{workdir}/exec", "--pidfile", f"{workdir}/docker.pid", "--bridge", "none",
            "--iptables=false", "--insecure-registry", insecure_registry,
            "--containerd-namespace", ns, "--containerd-plugins-namespace", ns + "-plugins",
        ]
        self.proc = None

    def start(self) -> "Dockerd":
        """Start it; return once it says READY=1 on $NOTIFY_SOCKET (systemd's readiness protocol,
        which dockerd speaks once it serves its API): an event, not a poll of its socket."""
        notify_path = os.path.join(self.workdir, "notify.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
            notify.bind(notify_path)
            notify.settimeout(120)
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"),
                                         env={**(self.env or os.environ), "NOTIFY_SOCKET": notify_path})
            try:
                while b"READY=1" not in notify.recv(4096).splitlines():
                    pass
            except TimeoutError:
                self.stop()
                raise RuntimeError(f"dockerd did not say it was ready in 120s: {self._tail()}")
        return self

    def client(self):
        import docker  # the docker SDK: only the interop tests need it

        return docker.DockerClient(base_url=self.host, timeout=120)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            for c in self.client().containers.list(all=True):
                c.remove(force=True)
        except Exception:
            pass  # stopping the daemon stops them too, only slower
        stop_process(self.proc, 60)
        # dockerd leaves its network namespace (exec/netns/default) mounted: pytest could then
        # never delete this temp dir, and each run would leave one more mount behind.
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f]
        for m in sorted((m for m in mounts if m.startswith(self.workdir + "/")), reverse=True):
            subprocess.run(["umount", "-l", m], check=False)

    def _tail(self) -> str:
        with open(self.log, errors="replace") as f:
            return " | ".join(f.read().splitlines()[-5:])



def engine_api(version: dict, pull_error: str | None = None, info: dict | None = None):
    """An `answer` for support.faults.HostileServer that speaks as a Docker engine of `version` (its
    GET /version document; /_ping too, under any /vX.Y prefix): a pull (POST .../images/create)
    fails in its stream with `pull_error` (one event, unchunked), or is refused with 500 when
    none is given; GET /info answers `info` where one is given; anything else is 404. Point
    DOCKER_HOST at tcp://HOST and read what reached the engine in `seen`."""
    def answer(method: str, path: str):
        route = path.split("?")[0]
        route = route.split("/", 2)[2] if route.startswith("/v1.") else route.lstrip("/")
        if method in ("GET", "HEAD") and route == "_ping":
            return 200, {"Content-Type": "text/plain", "Api-Version": version.get("ApiVersion", "")}, [b"OK"]
        if method == "GET" and route == "version":
            return 200, {"Content-Type": "application/json"}, [json.dumps(version).encode()]
        if method == "GET" and route == "info" and info is not None:
            return 200, {"Content-Type": "application/json"}, [json.dumps(info).encode()]
        if method == "POST" and route == "images/create" and pull_error is not None:
            event = {"errorDetail": {"message": pull_error}, "error": pull_error}
            return 200, {"Content-Type": "application/json"}, [json.dumps(event).encode()]
        if method == "POST" and route == "images/create":
            return 500, {"Content-Type": "application/json"}, [b'{"message": "this engine pulls nothing"}']
        return 404, {"Content-Type": "application/json"}, [b'{"message": "page not found"}']

    return answer

