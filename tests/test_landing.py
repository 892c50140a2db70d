"""`snap restore --then CMD` starts the app once every layer but the weights is applied, while a
weight is still on its way (held by a proxy until the test lets it go); `snap restore --wait PATH`
returns once that weight has landed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

from snapshotter.restore.priority import WEIGHTS_NICE
from support.images import push_annotated
from support.run import SNAP, TIMEOUT, assert_one_line_error, snap
from support.tars import tar_of_files
from support.trees import NOT_CAPTURED, SMALL_WEIGHTS, snapshot_of_tree

WEIGHT = "opt/app/models/checkpoints/sd15.safetensors"  # 2 MB: a layer of its own with SMALL_WEIGHTS


def _snap_proc(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*SNAP, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_fifo(fifo: str, got: list, done: threading.Event) -> None:
    with open(fifo) as f:  # blocks until the app opens it: no timing
        got.append(f.read())
    done.set()


def test_then_starts_the_app_before_the_weight_lands_and_wait_returns_when_it_has(registry, proxy, base_ref, box,
                                                                                  tmp_path):
    profile = tmp_path / "small-weights.yaml"
    profile.write_text(SMALL_WEIGHTS)
    snap("commit", f"{registry.host}/then:v1", "--base", base_ref, "--root", box, "--profile", str(profile), check=True)
    layers = registry.manifest("then", "v1")["layers"]
    names = [d.get("annotations", {}).get("dev.snap.layer") for d in layers]
    first_weight = names.index("models")
    assert set(names[first_weight:]) == {"models"}  # weights last
    weight_desc = next(d for d in layers if d.get("annotations", {}).get("dev.snap.content") == WEIGHT)
    proxy.hold_blob = weight_desc["digest"]

    root = tmp_path / "restored"
    fifo = tmp_path / "app-started"
    os.mkfifo(fifo)
    app = (f"if [ -e {root}/{WEIGHT} ]; then w=present; else w=absent; fi; "
           f"if [ -e {root}/opt/app/venv/lib/python3.11/site-packages/torch/_C.so ]; "
           "then v=present; else v=absent; fi; "
           f"echo weight=$w venv=$v > {fifo}")
    got: list[str] = []
    started = threading.Event()
    threading.Thread(target=_read_fifo, args=(str(fifo), got, started), daemon=True).start()
    restore = _snap_proc("restore", f"{proxy.host}/then:v1", "--root", str(root), "--then", app)
    waiter = None
    try:
        assert started.wait(TIMEOUT), "the app never started"
        assert got == ["weight=absent venv=present\n"]  # the app ran with its venv, before the weight
        # The app is in: the weight's download (held) no longer runs far below the unpacking, but below the app.
        assert proxy.holding.wait(TIMEOUT)  # its thread lowered itself before it asked for the weight
        assert max(_nices(str(restore.pid))) == max(WEIGHTS_NICE, os.getpriority(os.PRIO_PROCESS, 0))
        assert restore.poll() is None  # it cannot end: the weight is held
        r = snap("restore", "--wait", f"{root}/{WEIGHT}", "--root", str(root), "--timeout", "0")
        assert_one_line_error(r, 11, "timed out", "sd15.safetensors")
        waiter = _snap_proc("restore", "--wait", f"{root}/{WEIGHT}", "--root", str(root))
    finally:
        proxy.unhold.set()
    out, err = restore.communicate(timeout=TIMEOUT)
    assert restore.returncode == 0, err
    assert f"started {app!r}" in err
    assert waiter.wait(TIMEOUT) == 0, waiter.communicate()
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)

    # Done: any file of the image has landed; one it lacks, or a root nothing restored into, is one line.
    assert snap("restore", "--wait", f"{root}/opt/app/config.yaml", "--root", str(root)).returncode == 0
    r = snap("restore", "--wait", f"{root}/opt/app/nope.bin", "--root", str(root))
    assert_one_line_error(r, 5, "nope.bin", "not in the image")
    r = snap("restore", "--wait", f"{tmp_path}/elsewhere/x", "--root", str(tmp_path / "elsewhere"))
    assert_one_line_error(r, 2, "no restore")


def _nice(tid: str, pid: str = "self") -> int:
    """The nice value of a thread of process `pid` (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[16])
    except (OSError, IndexError, ValueError):
        return 0


def _nices(pid: str = "self") -> list[int]:
    return [_nice(tid, pid) for tid in os.listdir(f"/proc/{pid}/task")]


def _note_blocked_streams(monkeypatch, blocked: threading.Event) -> None:
    """Set `blocked` when a download stream of an in-process restore blocks, waiting for the app's
    blobs before it takes a weight (download.AppFirst)."""
    from snapshotter.restore import download

    class NotedGate(threading.Event):
        def wait(self, timeout=None):
            if not self.is_set():
                blocked.set()
            return super().wait(timeout)

    real_init = download.AppFirst.__init__

    def init(self, *args):
        real_init(self, *args)
        gate = NotedGate()
        if self._open.is_set():
            gate.set()
        self._open = gate

    monkeypatch.setattr(download.AppFirst, "__init__", init)


def test_no_weight_is_requested_before_the_apps_blobs_are_in(registry, proxy, base_ref, box, tmp_path, monkeypatch):
    """On a link the downloads share, the app's blobs go first: while the venv's blob is on its way
    (held by the proxy), a free download stream waits its turn instead of taking part of the link
    for a weight. The venv is let go once a weight waits (or, out of order, is requested)."""
    from snapshotter.restore import restore
    profile = tmp_path / "small-weights.yaml"
    profile.write_text(SMALL_WEIGHTS)
    snap("commit", f"{registry.host}/order-dl:v1", "--base", base_ref, "--root", box, "--profile", str(profile),
         check=True)
    layers = registry.manifest("order-dl", "v1")["layers"]
    named = {d["digest"]: d.get("annotations", {}).get("dev.snap.layer") for d in layers}
    weights = {digest for digest, name in named.items() if name == "models"}
    assert len(weights) >= 2 and named[layers[-1]["digest"]] == "models"
    proxy.hold_blob = next(digest for digest, name in named.items() if name == "venv")

    went_on = threading.Event()  # a weight waits its turn, or is requested
    requested_while_held: list[bool] = []

    lowered: list[bool] = []  # whether a thread of the restore is below the app's unpacking as a weight is requested

    def lie(method, path):
        if method == "GET" and path.rsplit("/", 1)[-1] in weights:
            requested_while_held.append(not proxy.unhold.is_set())
            lowered.append(max(_nices()) >= WEIGHTS_NICE)
            went_on.set()
        return None  # forwarded

    proxy.lie = lie
    _note_blocked_streams(monkeypatch, went_on)
    done: list = []
    root = tmp_path / "restored"
    worker = threading.Thread(target=lambda: done.append(restore.restore_image(f"{proxy.host}/order-dl:v1", str(root))))
    worker.start()
    try:
        assert proxy.holding.wait(TIMEOUT) and went_on.wait(TIMEOUT), "the restore got nowhere"
    finally:
        proxy.unhold.set()
        worker.join(TIMEOUT)
    assert done, "the restore failed"
    assert requested_while_held == [False] * len(weights)  # each weight once, after the venv
    assert lowered and all(lowered)  # a weight downloads below the app's unpacking
    assert snapshot_of_tree(str(root), skip=NOT_CAPTURED) == snapshot_of_tree(box, skip=NOT_CAPTURED)


def test_a_bad_app_blob_stops_the_restore_with_weights_waiting_their_turn(registry, proxy, base_ref, box, tmp_path,
                                                                          monkeypatch):
    """The venv's blob is forged, and sent only once a download stream waits for it before taking a
    weight: its digest check fails, and the waiting stream is let go (else the restore waits for it
    for ever). No weight was requested."""
    from snapshotter.errors import IntegrityError
    from snapshotter.restore import restore
    profile = tmp_path / "small-weights.yaml"
    profile.write_text(SMALL_WEIGHTS)
    snap("commit", f"{registry.host}/forged:v1", "--base", base_ref, "--root", box, "--profile", str(profile),
         check=True)
    layers = registry.manifest("forged", "v1")["layers"]
    venv = next(d for d in layers if d.get("annotations", {}).get("dev.snap.layer") == "venv")
    weights = {d["digest"] for d in layers if d.get("annotations", {}).get("dev.snap.layer") == "models"}
    blocked = threading.Event()
    _note_blocked_streams(monkeypatch, blocked)

    def lie(method, path):
        if method == "GET" and path.endswith(venv["digest"]):
            assert blocked.wait(TIMEOUT)
            return 200, {"Content-Type": "application/octet-stream"}, [b"x" * venv["size"]]
        return None

    proxy.lie = lie
    failed: list = []

    def run():
        try:
            restore.restore_image(f"{proxy.host}/forged:v1", str(tmp_path / "restored"))
        except IntegrityError as e:
            failed.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(TIMEOUT)
    assert not worker.is_alive(), "the restore waits for a stream that waits for the forged blob"
    assert failed and venv["digest"] in str(failed[0])
    assert not any(path.rsplit("/", 1)[-1] in weights for _, path, _ in proxy.log)


def test_weights_layers_come_last_whatever_the_profile_order(registry, base_ref, box, tmp_path):
    # comfyui lists `outputs` after models: the weights still go last (and its ComfyUI-only custom_nodes is empty).
    profile = tmp_path / "comfy.yaml"
    profile.write_text(open(os.path.join(os.path.dirname(__file__), "..", "layers", "comfyui.yaml")).read()
                       .replace("**/ComfyUI/models/**", "**/models/**").replace("**/ComfyUI/output/**",
                                                                                "opt/app/out/**"))
    os.makedirs(os.path.join(box, "opt/app/out"))
    with open(os.path.join(box, "opt/app/out/img.png"), "wb") as f:
        f.write(b"png")
    r = snap("commit", f"{registry.host}/order:v1", "--base", base_ref, "--root", box, "--profile", str(profile),
             "--json",
             check=True)
    assert json.loads(r.stdout)
    names = [d["annotations"]["dev.snap.layer"] for d in registry.manifest("order", "v1")["layers"][2:]]
    assert names == ["venv", "outputs", "rest", "models", "models"], names


def test_restore_loads_no_commit_code_no_docker_sdk_and_no_jsonschema():
    """What `snap restore` imports is on the way to CMD's start (--then): no commit or watch code,
    no docker SDK (only read for a Docker config's credentials), no jsonschema (oras's provider)."""
    code = ("import sys, snapshotter.cli, snapshotter.restore, snapshotter.restore.landing, "
            "snapshotter.restore.applier\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('docker', 'jsonschema')\n"
            "                      or m.split('.')[:2] in (['snapshotter', 'commit'], ['snapshotter', 'watch'])\n"
            "                      or m == 'oras.provider')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == []


def test_the_package_still_gives_its_modules_and_verbs_by_attribute():
    """Loaded on first use, yet `import snapshotter` then `snapshotter.restore` (the package) and
    `snapshotter.commit_box` (the verb) work; a name that is neither is an AttributeError."""
    code = ("import snapshotter\n"
            "assert snapshotter.restore.__name__ == 'snapshotter.restore'\n"
            "assert callable(snapshotter.restore.restore_image)\n"
            "assert snapshotter.commit.__name__ == 'snapshotter.commit' and callable(snapshotter.commit_box)\n"
            "assert not hasattr(snapshotter, 'no_such_thing') and not hasattr(snapshotter, '_private')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wait_does_not_answer_from_the_last_runs_progress_file_while_a_restore_starts(registry, proxy, tmp_path):
    """Image A restored (its progress file says done), then a restore of image B held while it
    resolves B: `--wait` answers for B's run, never from A's file (a.txt there, b.txt not in A)."""
    a = push_annotated(registry, "wait-a", [(tar_of_files({"a.txt": b"a\n"}), {})])
    push_annotated(registry, "wait-b", [(tar_of_files({"b.txt": b"b\n"}), {})])
    root = tmp_path / "root"
    assert snap("restore", a, "--root", str(root)).returncode == 0
    proxy.hold_answer = lambda method, path: "/manifests/" in path
    restore = _snap_proc("restore", f"{proxy.host}/wait-b:v1", "--root", str(root))
    try:
        assert proxy.holding.wait(TIMEOUT), "the restore never asked for its manifest"
        for name in ("a.txt", "b.txt"):
            r = snap("restore", "--wait", f"{root}/{name}", "--root", str(root), "--timeout", "0")
            assert_one_line_error(r, 11, "timed out", name)
        waiter = _snap_proc("restore", "--wait", f"{root}/b.txt", "--root", str(root))
    finally:
        proxy.unhold.set()
    out, err = restore.communicate(timeout=TIMEOUT)
    assert restore.returncode == 0, err
    assert waiter.wait(TIMEOUT) == 0, waiter.communicate()
    assert (root / "b.txt").read_bytes() == b"b\n"
