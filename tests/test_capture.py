"""What a commit captures from a live box, and what it deliberately leaves out: files bind-mounted
by the container runtime (GPU driver files), secrets, files that change while they are read."""

import glob
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import replace

import pytest
import zstandard

from snapshotter import CommitOptions, commit_box
from snapshotter.cli import output as cli_output
from snapshotter.commit.model import CommitHooks
from snapshotter.index.entry import entry_from_stat
from snapshotter.layer import generate as layer
from snapshotter.layer.generate import build_layer, measure_layer, write_layer
from snapshotter.layer.plan import LayerPlan
from snapshotter.profile import holds_private_key, load_profile

from support.images import snap_layer_files
from support.run import have_wheels, make_venv, pip_install_offline, snap
from support.trees import SMALL_WEIGHTS, write_tree

CUDA_DIR = "usr/lib/x86_64-linux-gnu"
CUDA_LIB = f"{CUDA_DIR}/libcuda.so.555.42.06"


@pytest.fixture
def bind_mounts():
    """`mount --bind SRC DST`, undone at teardown."""
    done = []

    def mount(src, dst):
        subprocess.run(["mount", "--bind", src, dst], check=True)
        done.append(dst)

    yield mount
    for dst in reversed(done):
        subprocess.run(["umount", dst], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
def test_gpu_driver_files_bind_mounted_by_the_runtime_are_left_out(registry, base_ref, box, tmp_path, bind_mounts):
    # What the NVIDIA container toolkit does: an empty file in the container's rootfs, the host's
    # driver library mounted over it, and its ldconfig hook's symlinks to it.
    host = tmp_path / "host-driver"
    host.mkdir()
    (host / "libcuda.so.555.42.06").write_bytes(b"\x7fELF host driver 555.42.06")
    (host / "data").mkdir()
    (host / "data" / "dataset.txt").write_text("a volume's content is the user's\n")
    write_tree(box, {
        CUDA_LIB: "",
        f"{CUDA_DIR}/libcuda.so.1": "->libcuda.so.555.42.06",
        f"{CUDA_DIR}/libcuda.so": "->libcuda.so.1",  # a chain of links
        "usr/lib/libcuda-abs.so": f"->/{CUDA_LIB}",  # an absolute link, seen from inside the box
        f"{CUDA_DIR}/libfoo.so.1": "->libfoo.so.1.0",
        f"{CUDA_DIR}/libfoo.so.1.0": "a library of the box\n",
        "workspace/data/.keep": "",
    })
    bind_mounts(str(host / "libcuda.so.555.42.06"), os.path.join(box, CUDA_LIB))
    bind_mounts(str(host / "data"), os.path.join(box, "workspace/data"))  # a directory: kept

    r = snap("commit", f"{registry.host}/gpu:v1", "--base", base_ref, "--root", box, check=True)
    names = snap_layer_files(registry, "gpu", "v1")
    gone = [CUDA_LIB, f"{CUDA_DIR}/libcuda.so.1", f"{CUDA_DIR}/libcuda.so", "usr/lib/libcuda-abs.so"]
    for path in gone:
        assert path not in names
    assert f"{CUDA_DIR}/libfoo.so.1" in names and f"{CUDA_DIR}/libfoo.so.1.0" in names
    assert "workspace/data/dataset.txt" in names
    line = next(x for x in r.stderr.splitlines() if "bind-mounted" in x)
    assert line.startswith("left out 4 file(s) bind-mounted from the host")
    for path in gone:
        assert repr("/" + path) in line


PRIVATE_KEY = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC-KEY-MATERIAL\n-----END PRIVATE KEY-----\n"
CERTIFICATE = "-----BEGIN CERTIFICATE-----\nMIIDdzCCAl+gAwIBAgIEAgAAuTANBgkq-PUBLIC-CERT\n-----END CERTIFICATE-----\n"


def _make_venv(path):
    """A real venv with requests (and so certifi's CA bundle, cacert.pem), installed offline."""
    make_venv(path)
    r = pip_install_offline(path, "requests")
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not have_wheels("requests", "certifi"),
                    reason="no requests/certifi wheels in .ci/wheels (run .ci/setup)")
def test_secrets_rules_keep_venvs_ca_bundles_and_directories(registry, base_ref, box, tmp_path):
    _make_venv(os.path.join(box, "workspace/proj/.env"))  # a venv called .env: a very common name
    _make_venv(os.path.join(box, "opt/venv"))
    site = next(glob.iglob(os.path.join(box, "opt/venv/lib/python3*/site-packages")))
    write_tree(box, {
        "workspace/chat_history/2026-12-01.json": '{"messages": []}\n',  # a directory matching *_history
        "workspace/other/.env": "HF_TOKEN=DOTENV-SECRET\n",
        "root/.bash_history": "export HF_TOKEN=HISTORY-SECRET\n",
        "root/.ssh/id_ed25519": "-----BEGIN OPENSSH PRIVATE KEY-----\nSSH-SECRET\n",
        "opt/app/certs/ca.pem": CERTIFICATE,
        "opt/app/certs/chain.pem": CERTIFICATE * 3 + PRIVATE_KEY.replace("KEY-MATERIAL", "CHAIN-SECRET"),
        "opt/app/certs/server.key": PRIVATE_KEY.replace("KEY-MATERIAL", "KEY-SECRET"),
        "opt/app/certs/client.ppk": "PuTTY-User-Key-File-3: ssh-ed25519\nPUTTY-SECRET\n",
        os.path.relpath(site, box) + "/fixtures/tests/test.key": PRIVATE_KEY,  # a package's public test key
    })
    secrets = ["opt/app/certs/chain.pem", "opt/app/certs/client.ppk", "opt/app/certs/server.key", "root/.bash_history",
               "root/.ssh", "workspace/other/.env"]

    r = snap("commit", f"{registry.host}/venvs:v1", "--base", base_ref, "--root", box, check=True)
    listed = [line.strip() for line in r.stderr.splitlines() if line.startswith("  '/")]
    assert listed == [repr("/" + p) for p in secrets]
    files = snap_layer_files(registry, "venvs", "v1")
    for kept in ("workspace/proj/.env/pyvenv.cfg", "workspace/chat_history/2026-12-01.json", "opt/app/certs/ca.pem",
                 os.path.relpath(site, box) + "/fixtures/tests/test.key"):
        assert kept in files
    assert [p for p in files if p.endswith("certifi/cacert.pem")]  # in both venvs
    assert not [p for p in secrets if p in files or any(f.startswith(p + "/") for f in files)]
    ann = registry.manifest("venvs", "v1")["annotations"]
    assert json.loads(ann["dev.snap.left-out.secrets"]) == secrets and ann["dev.snap.left-out.secrets-count"] == "6"

    out = tmp_path / "restored"
    snap("restore", f"{registry.host}/venvs:v1", "--root", str(out), check=True)
    for venv in ("workspace/proj/.env", "opt/venv"):
        # The restored venv makes TLS contexts from its CA bundle (its python links to this host's).
        r = subprocess.run([str(out / venv / "bin/python"), "-c",
                            "import certifi, ssl, requests; ssl.create_default_context(cafile=certifi.where()); "
                            "print(certifi.where())"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().startswith(str(out / venv))

    # verify lists what was left out, and does not call the tree a plain match (exit 0: no restore can do more).
    for root in (box, str(out)):
        r = snap("verify", f"{registry.host}/venvs:v1", "--root", root)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert [x for x in lines if x.startswith("left out")] == [f"left out (secret): {'/' + p!r}" for p in secrets]
        assert lines[-1].endswith("except 6 path(s) the commit left out as secrets (not in the image)")


@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl is not installed")
def test_private_keys_told_from_certificates_by_content(tmp_path):
    key_pem, key_der, cert_pem, cert_der = (tmp_path / n for n in ("k.pem", "k.der", "c.pem", "c.der"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-subj", "/CN=snap-test", "-keyout", str(key_pem), "-out", str(cert_pem)], check=True,
                    capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(key_pem), "-outform", "DER", "-out", str(key_der)], check=True)
    subprocess.run(["openssl", "x509", "-in", str(cert_pem), "-outform", "DER", "-out", str(cert_der)], check=True)
    rsa = subprocess.run(["openssl", "genrsa", "2048"], check=True, capture_output=True).stdout  # PKCS#1 or #8
    assert holds_private_key(key_pem.read_bytes()) and holds_private_key(key_der.read_bytes())
    assert holds_private_key(rsa)
    assert holds_private_key(cert_pem.read_bytes() * 2 + key_pem.read_bytes())  # a chain, then its key
    assert not holds_private_key(cert_pem.read_bytes()) and not holds_private_key(cert_der.read_bytes())
    assert not holds_private_key(b"-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n")


# ---- files that change while they are read -------------------------------------------------------


def _plan_of(root, *paths, compression="zstd", slices=None):
    entries = [entry_from_stat(p, os.lstat(os.path.join(root, p))) for p in paths]
    return LayerPlan("rest", compression, entries, slices=slices or {})


def _members(blob_bytes, compression):
    if compression == "zstd":
        blob_bytes = zstandard.ZstdDecompressor().stream_reader(blob_bytes).read()
    with tarfile.open(fileobj=io.BytesIO(blob_bytes)) as t:  # a well-formed tar, or this raises
        return {m.name: (m, t.extractfile(m).read() if m.isreg() else None) for m in t.getmembers()}


class Rewriter:
    """The test's writer: rewrites a file in place right after snap read it (the layer's after_read), for
    the first `times` reads; counts the reads."""

    def __init__(self, path, versions, times):
        self.path, self.versions, self.times, self.reads = path, versions, times, 0

    def __call__(self, rel, attempt):
        self.reads += 1
        if self.reads <= self.times:
            with open(self.path, "r+b") as f:  # in place: same inode, as SQLite or a checkpoint save does
                f.truncate(0)
                f.write(self.versions[self.reads % len(self.versions)])


@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
def test_a_file_rewritten_while_read_is_read_again(tmp_path, monkeypatch, streamed):
    old, new = b"A" * 100_000, b"B" * 120_000  # it grows as it is rewritten
    (tmp_path / "db.sqlite").write_bytes(old)
    (tmp_path / "other.txt").write_bytes(b"unchanged\n")
    if streamed:
        monkeypatch.setattr(layer, "BUFFERED_MAX", 1000)  # the path of files too big to hold: the layer restarts
    hook = Rewriter(str(tmp_path / "db.sqlite"), [new], times=1)
    plan = _plan_of(str(tmp_path), "db.sqlite", "other.txt")
    blob = build_layer(str(tmp_path), plan, str(tmp_path / "out"), after_read=hook)
    with open(blob.path, "rb") as f:
        data = f.read()
    assert blob.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    got = _members(data, "zstd")
    assert got["db.sqlite"][1] == new and got["db.sqlite"][0].size == len(new)  # the settled version, whole
    assert got["other.txt"][1] == b"unchanged\n"
    assert blob.changed_while_read == [] and blob.changed_since_scan == ["db.sqlite"]
    assert hook.reads == 3  # db.sqlite twice (streamed: the layer started again at the tear), other.txt once


@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
def test_a_file_that_never_settles_is_kept_as_last_read_and_reported(tmp_path, monkeypatch, streamed):
    versions = [b"v0" * 5000, b"v1" * 7000, b"v2" * 3000, b"v3" * 6000]
    (tmp_path / "ckpt.bin").write_bytes(versions[0])
    if streamed:
        monkeypatch.setattr(layer, "BUFFERED_MAX", 1000)
    hook = Rewriter(str(tmp_path / "ckpt.bin"), versions, times=100)
    plan = _plan_of(str(tmp_path), "ckpt.bin", compression="none")
    blob = measure_layer(str(tmp_path), plan, after_read=hook)
    assert blob.changed_while_read == ["ckpt.bin"] and hook.reads == layer.SETTLE_TRIES
    # The bytes: the version read last (before the last rewrite), whole, in a well-formed tar.
    buf = io.BytesIO()
    (tmp_path / "ckpt.bin").write_bytes(versions[(layer.SETTLE_TRIES - 1) % len(versions)])
    write_layer(buf, str(tmp_path), _plan_of(str(tmp_path), "ckpt.bin", compression="none"))
    assert _members(buf.getvalue(), "none")["ckpt.bin"][1] == versions[(layer.SETTLE_TRIES - 1) % len(versions)]


def test_a_part_cut_from_a_file_that_shrank_keeps_its_size(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"x" * 3000)
    part = "w.bin.snap-part-0002-of-0002"
    e = entry_from_stat("w.bin", os.lstat(tmp_path / "w.bin"))
    e.path, e.size = part, 2000  # the plan's second part: bytes 2000-3999 of a file that was 4000 long
    plan = LayerPlan("models", "none", [e], slices={part: ("w.bin", 2000)})
    buf = io.BytesIO()
    blob = layer._emit(buf, str(tmp_path), plan, 3, None)
    m, content = _members(buf.getvalue(), "none")[part]
    assert m.size == 2000 and content == b"x" * 1000 + bytes(1000)  # zeros where the file ended
    assert blob.changed_while_read == ["w.bin"]  # the file, which a hold knows, not the part's name


def commit_saying(target: str, base: str, opts: CommitOptions, capsys, after_read) -> str:
    """What `snap commit` says (stdout and stderr) as it commits the box with `after_read` in its reads
    (CommitHooks.after_read, which the command line has no flag for): the library's commit_box, then
    the lines cli/capture.py's commit prints of its result."""
    capsys.readouterr()
    result = commit_box(target, base, replace(opts, log=cli_output.say), CommitHooks(after_read=after_read))
    cli_output.commit_left_out(result)
    cli_output.commit_pushed(result)
    said = capsys.readouterr()
    return said.out + said.err


def test_a_file_that_never_settles_is_held_back_in_one_line_naming_it(registry, base_ref, box, capsys, tmp_path):
    """A file that changes during every read is never pushed as last read (it would be torn): it is
    held back, named in one line, and the snapshot has no version of it (none had one before)."""
    db = "var/lib/app/state\ndb"  # a name with a newline cannot forge a line
    ckpt = "opt/app/models/ckpt.safetensors"  # in an uncompressed layer: measured, then sent
    versions = {db: [b"s" * 4096, b"t" * 4096], ckpt: [bytes([i]) * 300_000 for i in range(7)]}
    write_tree(box, {db: versions[db][0], ckpt: versions[ckpt][0]})
    hooks = {p: Rewriter(os.path.join(box, p), v, times=100) for p, v in versions.items()}
    said = commit_saying(f"{registry.host}/torn:v1", base_ref, CommitOptions(root=box), capsys,
                         lambda rel, attempt: hooks[rel](rel, attempt) if rel in hooks else None)
    held = [line for line in said.splitlines() if line.startswith("held back:")]
    tail = ("(changed while read): never read half-written; left out (the base's version, if any, stays); "
            "commit again once it is written")
    assert held == [f"held back: '/opt/app/models/ckpt.safetensors' {tail}",
                    f"held back: '/var/lib/app/state\\ndb' {tail}"]
    out = tmp_path / "restored"
    snap("restore", f"{registry.host}/torn:v1", "--root", str(out), check=True)
    for p in versions:
        assert not (out / p).exists()
    assert (out / "etc/app.conf").read_text() == "threads = 8\n"  # the rest of the box is in


# A writer of the box's: appends to its file ("grow") or rewrites its first bytes in place
# ("rewrite") each time it is told, then says so; it holds the file open only while it writes.
WRITER = ("import sys\n"
          "for _ in sys.stdin:\n"
          "    with open(sys.argv[1], 'ab' if sys.argv[2] == 'grow' else 'r+b') as f:\n"
          "        f.write(b'another line\\n' if sys.argv[2] == 'grow' else b'REWRITTEN')\n"
          "    print('done', flush=True)\n")


@pytest.mark.parametrize("streamed", [False, True], ids=["in-memory", "streamed"])
@pytest.mark.parametrize("how", ["grow", "rewrite"])
def test_a_file_that_keeps_growing_while_sent_is_sent_as_first_seen_with_a_warning(registry, base_ref, box, tmp_path,
                                                                                   monkeypatch, capsys, how, streamed):
    """A weights layer (stored as is) is read twice: measured, then streamed to the registry. A log
    growing all along, written by another process after the measure and again during the send, is
    sent as first seen, with one warning line naming it (escaped). One rewritten in place is held
    back as changed while read: never pushed as neither version, and the commit goes on."""
    log, other = "opt/app/models/run\x1b[2J.log", "opt/app/models/zz.json"
    first = b"line 1\n" * 20
    write_tree(box, {log: first, other: b"{}"})
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, os.path.join(box, log), how], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    reads = {log: 0, other: 0}

    def write_now():
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "done\n"

    def after_read(rel, attempt):
        if rel in reads:
            reads[rel] += 1
            if (rel, reads[rel]) in ((other, 1), (log, 2)):  # after its measure (the next file's), and while sent
                write_now()

    if streamed:
        monkeypatch.setattr(layer, "BUFFERED_MAX", 64)  # the path of files too big to hold
    try:
        output = commit_saying(f"{registry.host}/growing-{how}-{int(streamed)}:v1", base_ref,
                               CommitOptions(root=box, profile=load_profile(str(prof))), capsys, after_read)
    finally:
        writer.communicate("", timeout=60)
    assert "\x1b" not in output
    said = [line for line in output.splitlines() if "run\\x1b[2J.log" in line]
    out = tmp_path / "restored"
    snap("restore", f"{registry.host}/growing-{how}-{int(streamed)}:v1", "--root", str(out), check=True)
    if how == "grow":
        assert said == [f"warning: '/{log.encode('unicode_escape').decode()}' kept growing while it was sent: the "
                        f"snapshot has it as first seen ({len(first)} bytes); the next commit takes the rest"]
        assert (out / log).read_bytes() == first and len(open(os.path.join(box, log), "rb").read()) > len(first)
    else:
        assert said == [f"held back: '/{log.encode('unicode_escape').decode()}' (changed while read): never read "
                        "half-written; left out (the base's version, if any, stays); commit again once it is written"]
        assert not (out / log).exists()
    assert (out / other).read_bytes() == b"{}"


def test_secret_globs_matched_by_last_name_give_the_verdicts_of_one_regex():
    """PathSet without `below` tries a glob only where it can match (by the path's last name): the
    same verdict as the one regex of all its globs over the whole path."""
    import re

    from snapshotter.profile import PathSet, glob_regex
    patterns = ["*.pem", ".env", "id_rsa", "/etc/ssh/ssh_host_*_key", "**/.docker/config.json", "a/**/c", "/x/*",
                "**/y/z?", "q/", "/r/**", "t", "**/.cache/huggingface/token", "a**/b", "run-**/key.json", "****/m"]
    paths = ["a.pem", "d/a.pem", "d/a.pem/x", ".env", "v/.env", "v/.envrc", "etc/ssh/ssh_host_rsa_key",
             "etc/ssh/x/ssh_host_rsa_key", "w/.docker/config.json", ".docker/config.json", "a.docker/config.json",
             "a/c", "a/b/c", "b/a/c", "x/y", "x/y/z", "k/y/z1", "y/z", "q", "w/q", "r", "r/s", "t", "u/t",
             "h/.cache/huggingface/token", ".cache/huggingface/token", "cache/huggingface/token", "config.json",
             "ab", "a/x/b", "run-key.json", "data/run-key.json", "run-x/key.json", "km", "m", "z/m"]
    one = re.compile("|".join(f"(?:{glob_regex(p, below=False)})" for p in patterns), re.S)
    grouped = PathSet(patterns, below=False)
    assert [grouped.match(p) for p in paths] == [bool(one.fullmatch(p)) for p in paths]
    assert sum(grouped.match(p) for p in paths) > 10
