import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from support.faults import FaultProxy
from support.images import push_base_image
from support.registry import RegistryServer
from support.trees import Jail, make_base_rootfs, make_box

# A suite started in the background by a non-interactive shell (`make test &`, CI runners) inherits
# SIGINT ignored, and so would every snap it starts: the Ctrl-C tests need it delivered, as from a
# terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """For `--dist loadgroup` (make test): the tests of a file with a module or session fixture of its own
    (a dockerd, a TLS or token registry, a built wheel, an S3 server) share one worker, where it is built
    once; every other test goes to whichever worker is free, so a long file no longer keeps one worker busy
    while the others idle. Each worker has its own session registry: tests on different workers never meet."""
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (fixtures.name2fixturedefs.values() if fixtures else ()) for d in ds]
        if any(d.scope in ("module", "session") and d.baseid.endswith(".py") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.path.name))


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


@pytest.fixture
def box(base_rootfs, tmp_path):
    return make_box(base_rootfs, str(tmp_path / "box"))


@pytest.fixture
def jail(tmp_path):
    """A root to restore into, with a sentinel directory next to it that nothing may touch."""
    return Jail(tmp_path)
