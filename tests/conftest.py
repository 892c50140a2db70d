import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from support import FaultProxy, RegistryServer, make_base_rootfs, push_base_image, write_tree  # noqa: E402

# A suite started in the background by a non-interactive shell (`make test &`, CI runners) inherits
# SIGINT ignored, and so would every snap it starts: the Ctrl-C tests need it delivered, as from a
# terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Paths the default profile never captures; a restored tree is compared without them.
NOT_CAPTURED = ("proc", "sys", "dev", "tmp", "run")


@pytest.fixture(scope="session")
def registry(tmp_path_factory):
    reg = RegistryServer(str(tmp_path_factory.mktemp("registry"))).start()
    yield reg
    reg.stop()


@pytest.fixture
def proxy(registry):
    """A FaultProxy in front of the session's registry: snap pointed at proxy.host."""
    p = FaultProxy(registry.host).start()
    yield p
    p.stop()


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    """Each test gets its own snap state dir (built layers, blob cache, base index cache)."""
    d = tmp_path / "snap-state"
    monkeypatch.setenv("SNAP_STATE_DIR", str(d))
    monkeypatch.setenv("SNAP_QUIET", "1")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker-config"))  # never the user's own credentials
    return d


@pytest.fixture(scope="session")
def base_rootfs(tmp_path_factory):
    root = tmp_path_factory.mktemp("base") / "rootfs"
    root.mkdir()
    make_base_rootfs(str(root))
    return str(root)


@pytest.fixture(scope="session")
def base_ref(registry, base_rootfs):
    push_base_image(registry, "base", "1", base_rootfs)
    return f"{registry.host}/base:1"


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


@pytest.fixture
def box(base_rootfs, tmp_path):
    return make_box(base_rootfs, str(tmp_path / "box"))


def snap(*args, input=None, env=None, check=False):
    """Run the real `snap` command line in a subprocess."""
    e = dict(os.environ)
    e.update(env or {})
    # `python -m snapshotter` is the `snap` entry point without PATH lookups (Ubuntu's snapd is also `snap`).
    r = subprocess.run([sys.executable, "-m", "snapshotter", *args], capture_output=True, text=True, input=input, env=e, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"snap {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r
