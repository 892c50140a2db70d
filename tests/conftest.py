import errno
import json
import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from support import memtemp
from support.faults import FaultProxy
from support.images import push_base_image
from support.ocicrypt import make_keys
from support.registry import RegistryServer
from support.trees import Jail, make_base_rootfs, make_box

# A suite started in the background by a non-interactive shell (`make test &`, CI runners) inherits
# SIGINT ignored, and so would every snap it starts: the Ctrl-C tests need it delivered, as from a
# terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Seconds each slow test took (setup, call and teardown) on 2 cores: what `make test` starts first. A test
# not listed is taken as quick; `pytest -n 3 --record-durations tests/...` notes the tests it runs.
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")
QUICK = 1.0


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="note each test's seconds in tests/durations.json (the order make test starts them in)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups marked here
def pytest_collection_modifyitems(config, items):
    """For `--dist loadgroup` (make test): the tests of a file with a module or session fixture of its own
    (a dockerd, a TLS or token registry, an S3 server) share one worker, where it is built once; every
    other test goes to whichever worker is free. The longest groups and tests go first (make test keeps
    xdist from reordering them): one that started last would keep its worker busy while the others idle.
    Each worker has its own session registry: tests on different workers never meet."""
    groups = {}
    for item in items:
        fixtures = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (fixtures.name2fixturedefs.values() if fixtures else ()) for d in ds]
        if any(d.scope in ("module", "session") and d.baseid.endswith(".py") for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
            groups.setdefault(item.path.name, []).append(item)
    if not _loadgroup(config):
        return
    seconds = {}
    if os.path.exists(DURATIONS):
        with open(DURATIONS) as f:
            seconds = json.load(f)
    group_of = {id(item): name for name, members in groups.items() for item in members}
    cost = {name: sum(seconds.get(i.nodeid, QUICK) for i in members) for name, members in groups.items()}
    first = {}  # each group's tests stay together, in their own order, where its first one was
    for n, item in enumerate(items):
        first.setdefault(group_of.get(id(item), id(item)), n)

    def longest_first(item) -> tuple[float, int]:
        group = group_of.get(id(item))
        if group:
            return -cost[group], first[group]
        return -seconds.get(item.nodeid, QUICK), first[id(item)]
    items.sort(key=longest_first)


def _loadgroup(config) -> bool:
    """`--dist loadgroup`: as the controller's option, or on a worker (which collects, and whose own
    `dist` xdist sets to "no") as xdist's `loadgroup` flag."""
    return config.getoption("dist", None) == "loadgroup" or bool(getattr(config.option, "loadgroup", False))


def pytest_configure(config):
    # The suite starts snap thousands of times: with PYTHONDONTWRITEBYTECODE each start compiled its ~90
    # modules again (~0.1 s of CPU, a quarter of the suite on 2 cores). Their bytecode goes to pytest's
    # cache dir instead, not beside the sources the setting keeps clean.
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        os.environ.setdefault("PYTHONPYCACHEPREFIX", str(config.cache.mkdir("pycache")))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if config.getoption("record_durations"):
        config.pluginmanager.register(DurationRecorder(), "record-durations")
    if config.option.basetemp is None:  # read by pytest's own configure (tmpdir.py), called after a conftest's
        config.option.basetemp = config.snap_run_folder = memtemp.run_folder()


def pytest_sessionfinish(session, exitstatus):
    folder = getattr(session.config, "snap_run_folder", None)
    if folder:
        memtemp.end_run(folder, exitstatus)


class DurationRecorder:
    """Sums each test's phases as the reports come in (from every worker), and writes them at the end."""

    def __init__(self):
        self.seconds = {}

    def pytest_runtest_logreport(self, report):
        # xdist's suffix for a test's group ("@test_docker.py", "@recipe_test_docker.py"): a test's own
        # id never ends in one, since a group's name holds no "/", "::" or "]"
        head, at, group = report.nodeid.rpartition("@")
        nodeid = head if at and not any(c in group for c in ("/", "::", "]")) else report.nodeid
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self):
        noted = {}
        if os.path.exists(DURATIONS):
            with open(DURATIONS) as f:
                noted = json.load(f)
        noted.update({k: round(v, 1) for k, v in self.seconds.items()})
        with open(DURATIONS, "w") as f:
            json.dump({k: v for k, v in sorted(noted.items()) if v >= QUICK}, f, indent=0)
            f.write("\n")


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


@pytest.fixture(scope="session")
def keys(tmp_path_factory):
    """openssl-made key pairs (support/ocicrypt.py make_keys: rsa, ec, other: the wrong key) and a
    derivation secret, all 0600, for encrypted snapshots."""
    d = tmp_path_factory.mktemp("keys")
    make_keys(d)
    (d / "secret").write_bytes(os.urandom(32))
    for p in d.iterdir():
        p.chmod(0o600)
    return d


@pytest.fixture
def box(base_rootfs, tmp_path):
    return make_box(base_rootfs, str(tmp_path / "box"))


@pytest.fixture
def jail(tmp_path):
    """A root to restore into, with a sentinel directory next to it that nothing may touch."""
    return Jail(tmp_path)


@pytest.fixture
def tmpfs():
    """mount(path, size): a tmpfs at path (made if missing); kind="ramfs" for a ramfs (no size, no
    O_DIRECT); all unmounted afterwards, the last mounted first."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = []

    def mount(d, size: str = "2m", kind: str = "tmpfs"):
        d.mkdir(parents=True, exist_ok=True)
        options = ["-o", f"size={size}"] if kind == "tmpfs" else []
        r = subprocess.run(["mount", "-t", kind, *options, kind, str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a {kind} here: {r.stderr.strip()}")
        mounted.append(d)
        return d

    yield mount
    for d in reversed(mounted):
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def full_state_disk(tmp_path, tmpfs):
    """(state dir, fill): a 4 MiB tmpfs for SNAP_STATE_DIR (0700: snap's own); fill() leaves its disk no room."""
    state = tmpfs(tmp_path / "state", "4m")
    state.chmod(0o700)

    def fill() -> None:
        with open(state / "filler", "wb") as f:  # the rest of the disk
            try:
                while True:
                    f.write(bytes(1 << 16))
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC

    return state, fill
