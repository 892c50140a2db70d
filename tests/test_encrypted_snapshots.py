"""`snap commit --encrypt-to` and `snap restore/verify --decryption-key` on the suite's real registry,
with openssl-made keys: layers in ocicrypt's format, nothing of a file's name or content in any blob
the registry stores (read from its storage directory, decompressed), dedup kept, keys kept secret."""

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import uuid
from types import SimpleNamespace

import zstandard

from support.ocicrypt import skopeo_copy
from support.registry import blobs_in
from support.run import assert_one_line_error, snap
from support.tars import gzip_bytes, tar_of_files
from snapshotter import CommitOptions, commit_box
from snapshotter.commit.model import CommitHooks
from snapshotter.crypt import keys as crypt_keys
from snapshotter.crypt import layer
from snapshotter.oci.image import Image
from snapshotter.oci.mediatypes import LAYER_GZIP, LAYER_TAR
from snapshotter.oci.reference import Reference
from snapshotter.profile import load_profile
from snapshotter.registry.remote import Remote
from snapshotter.snapshot.decryption import open_image
from snapshotter.snapshot.encryption import load_encryption
from support.trees import SMALL_WEIGHTS, rewrite_on_read, snapshot_of_tree, write_tree
from support.watch import WatchProcess

ENCRYPTED_TYPES = ("application/vnd.oci.image.layer.v1.tar+zstd+encrypted",
                   "application/vnd.oci.image.layer.v1.tar+gzip+encrypted",
                   "application/vnd.oci.image.layer.v1.tar+encrypted")
NOT_RESTORED = ("tmp", "proc", "sys", "dev", "run")


def marked_box(box, marker: str) -> str:
    """The suite's box with a file whose name and content hold `marker`, one cut into part layers
    (bigger than --max-layer-size 1MiB), and a marked name in a deletion."""
    write_tree(box, {f"opt/app/notes/{marker}-name.txt": f"content-{marker}\n",
                     f"opt/app/models/{marker}-big.bin": (f"weights-{marker}".encode() + os.urandom(64)) * 20_000})
    return box


def registry_texts(registry):
    """Every blob of the registry's storage, as stored and decompressed (gzip members, zstd frames)."""
    top = os.path.join(registry.storage, "docker/registry/v2/blobs/sha256")
    for hexdigest in blobs_in(registry):
        with open(os.path.join(top, hexdigest[:2], hexdigest, "data"), "rb") as f:
            data = f.read()
        yield data
        if data[:2] == b"\x1f\x8b":
            yield _readable_part(gzip.GzipFile(fileobj=io.BytesIO(data)))
        elif data[:4] == b"\x28\xb5\x2f\xfd":
            yield _readable_part(zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True))


def _readable_part(stream) -> bytes:
    """What a decompressing stream gives up to its end or its first error: the worker's registry also
    holds the corrupt and truncated blobs other files' tests push (hostile images)."""
    parts = []
    try:
        while chunk := stream.read(1 << 16):
            parts.append(chunk)
    except (OSError, EOFError, zstandard.ZstdError):
        pass
    return b"".join(parts)


def assert_nowhere(registry, *needles: str | bytes):
    for text in registry_texts(registry):
        for needle in needles:
            assert (needle if isinstance(needle, bytes) else needle.encode()) not in text, \
                f"{needle!r} is in clear in a blob of the registry"


def manifest_of(registry, repo, tag):
    r = registry.session().get(f"{registry.url}/v2/{repo}/manifests/{tag}",
                               headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_encrypted_snapshot_holds_nothing_in_clear_and_restores_with_its_key(registry, base_ref, box, keys,
                                                                                  tmp_path):
    """(1, 2, 3) Layers pushed as ocicrypt's `+encrypted` types with its annotations; no blob in the
    registry holds the marker file's name or content, raw or decompressed (no headers blob, no base
    index, no path annotation, no layer name in the config); restore with the key (EC, PKCS#8) gives
    the tree byte for byte, part files joined; verify with it says equal."""
    marker = uuid.uuid4().hex
    marked_box(box, marker)
    target = f"{registry.host}/enc1:v1"
    r = snap("commit", target, "--base", base_ref, "--root", box, "--max-layer-size", "1MiB",
             "--encrypt-to", str(keys / "rsa.pub"), "--encrypt-to", f"jwe:{keys / 'ec.pub'}")
    assert r.returncode == 0, r.stderr
    manifest = manifest_of(registry, "enc1", "v1")
    own = manifest["layers"][int(manifest["annotations"]["dev.snap.base-layers"]):]
    assert own and all(d["mediaType"] in ENCRYPTED_TYPES for d in own)
    assert all({"org.opencontainers.image.enc.keys.jwe", "org.opencontainers.image.enc.pubopts"}
               <= set(d["annotations"]) for d in own)
    assert_nowhere(registry, marker)
    root = tmp_path / "restored"
    r = snap("restore", target, "--root", str(root), "--decryption-key", str(keys / "ec.pem"))
    assert r.returncode == 0, r.stderr
    assert snapshot_of_tree(str(root), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED)
    r = snap("verify", target, "--root", str(root), env={"SNAP_DECRYPTION_KEY": str(keys / "rsa.pem")})
    assert r.returncode == 0, r.stdout + r.stderr


def test_without_the_key_or_with_a_wrong_one_nothing_is_written(registry, base_ref, box, keys, tmp_path):
    """(2) No key, a key no layer is for: one line, exit 4, and the target not even created; a key's
    text in SNAP_DECRYPTION_KEY is refused without echoing it (exit 2)."""
    target = f"{registry.host}/enc2:v1"
    snap("commit", target, "--base", base_ref, "--root", box, "--encrypt-to", str(keys / "rsa.pub"), check=True)
    root = tmp_path / "never"
    assert_one_line_error(snap("restore", target, "--root", str(root)), 4, "encrypted", "decryption key")
    assert_one_line_error(snap("restore", target, "--root", str(root), "--decryption-key", str(keys / "other.pem")),
                          4, "recipient")
    assert_one_line_error(snap("verify", target, "--root", str(tmp_path)), 4, "encrypted")
    assert not root.exists()
    pem = (keys / "rsa.pem").read_text()
    r = snap("restore", target, "--root", str(root), env={"SNAP_DECRYPTION_KEY": pem})
    assert_one_line_error(r, 2, "SNAP_DECRYPTION_KEY")
    assert pem.splitlines()[1] not in r.stderr + r.stdout
    assert not root.exists()


def test_a_tampered_layer_is_exit_6_and_leaves_nothing(registry, base_ref, box, keys, tmp_path):
    """(2) One flipped byte in an encrypted layer's blob (the biggest: the weights), in the registry's
    storage: the restore fails its check (a weight's: its decrypted bytes against the plain digest its
    wrapped options name), exit 6, and nothing of that layer is in the root."""
    target = f"{registry.host}/enc3:v1"
    snap("commit", target, "--base", base_ref, "--root", box, "--encrypt-to", str(keys / "rsa.pub"),
         "--compression", "gzip", check=True)
    manifest = manifest_of(registry, "enc3", "v1")
    victim = max((d for d in manifest["layers"] if d["mediaType"] in ENCRYPTED_TYPES), key=lambda d: d["size"])
    assert victim["mediaType"] == LAYER_TAR + "+encrypted"  # a weight, stored as is: checked by its plain digest
    hexdigest = victim["digest"].split(":", 1)[1]
    path = os.path.join(registry.storage, "docker/registry/v2/blobs/sha256", hexdigest[:2], hexdigest, "data")
    with open(path, "rb") as f:
        original = f.read()
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0x01
    try:
        with open(path, "wb") as f:
            f.write(tampered)
        root = tmp_path / "root"
        r = snap("restore", target, "--root", str(root), "--decryption-key", str(keys / "rsa.pem"))
        assert_one_line_error(r, 6)
        # the layers before it may be applied (the next restore resumes); not one byte of this one
        assert not (root / "opt/app/models/checkpoints/sd15.safetensors").exists()
        # verify reads the layers as restore does: the same check refuses the same byte
        assert_one_line_error(snap("verify", target, "--root", box, "--decryption-key", str(keys / "rsa.pem")), 6)
    finally:
        with open(path, "wb") as f:
            f.write(original)


def test_an_unchanged_layer_keeps_its_encrypted_blob(registry, base_ref, box, keys, tmp_path, state_dir):
    """(4) A second commit of an unchanged box pushes nothing (the same sealed annotation: the tag's
    snapshot already); a changed
    file re-sends only its own layer (the state dir then maps this snapshot's layers, the old one's
    gone); a new state dir with the derivation secret pushes no layer again (its derived keys give the
    same blobs), one without it re-keys them all (random keys: no blob of the secret's is reused)."""
    target = f"{registry.host}/enc4:v1"
    flags = ("--base", base_ref, "--root", box, "--encrypt-to", str(keys / "rsa.pub"),
             "--encrypt-secret", str(keys / "secret"), "--json")
    first = json.loads(snap("commit", target, *flags, check=True).stdout)
    before = blobs_in(registry)
    again = json.loads(snap("commit", target, *flags, check=True).stdout)
    assert [(x["digest"], x["size"]) for x in again["layers"]] == [(x["digest"], x["size"]) for x in first["layers"]]
    assert again["current"] and blobs_in(registry) == before  # the tag's snapshot already: nothing pushed
    write_tree(box, {"etc/app.conf": "threads = 16\n"})
    changed = json.loads(snap("commit", target, *flags, check=True).stdout)
    sent = [x for x in changed["layers"] if x["status"] == "uploaded"]
    assert len(sent) == 1 and sent[0]["digest"] not in {x["digest"] for x in first["layers"]}
    [kept] = (state_dir / "encrypted-layers").iterdir()  # what the state dir maps: this snapshot's layers only
    assert sorted(d["digest"] for d in json.loads(kept.read_text())["layers"].values()) == \
        sorted(x["digest"] for x in changed["layers"])
    for extra in ((), ("--encrypt-secret", str(keys / "secret"))):
        state = tmp_path / f"state-{len(extra)}"
        fresh = json.loads(snap("commit", target, *flags[:-3], *extra, "--json", "--force",
                                env={"SNAP_STATE_DIR": str(state)}, check=True).stdout)
        if extra:
            assert [x["digest"] for x in fresh["layers"]] == [x["digest"] for x in changed["layers"]]
            assert not [x for x in fresh["layers"] if x["status"] == "uploaded"]
        else:
            assert not {x["digest"] for x in fresh["layers"]} & {x["digest"] for x in changed["layers"]}
            assert all(x["status"] == "uploaded" for x in fresh["layers"])


def test_skopeo_decrypts_a_snapshot_and_snap_restores_what_skopeo_encrypted(registry, base_ref, box, keys, tmp_path):
    """(6) The ecosystem's own tool both ways, through the registry: `skopeo copy --decryption-key`
    turns snap's encrypted snapshot into a clear image whose restore (its sealed annotations opened
    with the key) is the box, byte for byte; a clear snapshot that `skopeo copy --encryption-key
    jwe:` encrypted, every layer (the base's too), is restored by snap with the private key."""
    host = registry.host
    snap("commit", f"{host}/enc6:v1", "--base", base_ref, "--root", box, "--encrypt-to", str(keys / "ec.pub"),
         check=True)
    skopeo_copy(tmp_path, f"docker://{host}/enc6:v1", f"docker://{host}/enc6-clear:v1",
                "--decryption-key", str(keys / "ec.pem"))
    assert not any(d["mediaType"] in ENCRYPTED_TYPES for d in manifest_of(registry, "enc6-clear", "v1")["layers"])
    want = snapshot_of_tree(box, skip=NOT_RESTORED)
    snap("restore", f"{host}/enc6-clear:v1", "--root", str(tmp_path / "a"), "--decryption-key",
         str(keys / "ec.pem"), check=True)
    assert snapshot_of_tree(str(tmp_path / "a"), skip=NOT_RESTORED) == want

    snap("commit", f"{host}/enc6-plain:v1", "--base", base_ref, "--root", box, check=True)
    skopeo_copy(tmp_path, f"docker://{host}/enc6-plain:v1", f"docker://{host}/enc6-skopeo:v1",
                "--encryption-key", f"jwe:{keys / 'rsa.pub'}")
    assert all(d["mediaType"] in ENCRYPTED_TYPES for d in manifest_of(registry, "enc6-skopeo", "v1")["layers"])
    assert_one_line_error(snap("restore", f"{host}/enc6-skopeo:v1", "--root", str(tmp_path / "b")), 4)
    snap("restore", f"{host}/enc6-skopeo:v1", "--root", str(tmp_path / "b"), "--decryption-key",
         str(keys / "rsa.pem"), check=True)
    assert snapshot_of_tree(str(tmp_path / "b"), skip=NOT_RESTORED) == want


def test_keys_stay_secret_and_an_exposed_private_key_is_warned_about(registry, base_ref, box, keys, tmp_path,
                                                                     state_dir):
    """(5) The derivation secret and the private key appear in no blob of the registry, no state
    file (those of the encrypted layers are 0600) and no output; a private key file others may read
    gets one warning line naming it, and still opens the image."""
    target = f"{registry.host}/enc5:v1"
    r = snap("commit", target, "--base", base_ref, "--root", box, "--encrypt-to", str(keys / "rsa.pub"),
             "--encrypt-secret", str(keys / "secret"), check=True)
    exposed = tmp_path / "exposed.pem"
    shutil.copy(keys / "rsa.pem", exposed)
    exposed.chmod(0o644)
    r2 = snap("restore", target, "--root", str(tmp_path / "root"), "--decryption-key", str(exposed))
    assert r2.returncode == 0, r2.stderr
    warned = [line for line in r2.stderr.splitlines() if "readable by group or others" in line]
    assert len(warned) == 1 and repr(str(exposed)) in warned[0]
    secret, pem = (keys / "secret").read_bytes(), (keys / "rsa.pem").read_text()
    body = [line.encode() for line in pem.splitlines()[1:-1]]
    assert_nowhere(registry, secret, *body)
    cached = []
    for folder, _, names in os.walk(state_dir):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                data = f.read()
            assert secret not in data and not any(line in data for line in body), path
            if "encrypted-layers" in folder:
                cached.append(stat.S_IMODE(os.stat(path).st_mode))
    assert cached and all(mode == 0o600 for mode in cached)
    for out in (r.stdout + r.stderr, r2.stdout + r2.stderr):
        assert pem.splitlines()[1] not in out


def test_a_watcher_pushes_encrypted_snapshots(registry, base_ref, box, keys, tmp_path):
    """(1) `snap watch --encrypt-to`: its snapshots, the final one too, are encrypted, hold no marker
    in clear, and restore with the key."""
    marker = uuid.uuid4().hex
    marked_box(box, marker)
    p = WatchProcess(f"{registry.host}/encw:v2", "--base", base_ref, "--root", box, "--every", "1h",
                     "--encrypt-to", str(keys / "rsa.pub"), env={"SNAP_WATCH_QUIET": "3600"})
    p.wait_for(" moved to it")
    write_tree(box, {f"opt/app/notes/{marker}-late.txt": f"late-{marker}\n"})
    p.proc.send_signal(signal.SIGTERM)
    assert p.finish() == 0, "".join(p.seen)
    manifest = manifest_of(registry, "encw", "v2")
    own = manifest["layers"][int(manifest["annotations"]["dev.snap.base-layers"]):]
    assert own and all(d["mediaType"] in ENCRYPTED_TYPES for d in own)
    assert_nowhere(registry, marker)
    snap("restore", f"{registry.host}/encw:v2", "--root", str(tmp_path / "r"), "--decryption-key",
         str(keys / "rsa.pem"), check=True)
    assert snapshot_of_tree(str(tmp_path / "r"), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED)


def test_a_weight_rewritten_while_it_is_encrypted_is_held_back_not_pushed(registry, base_ref, box, keys, tmp_path):
    """A weights file (a layer stored as is, streamed from the box: no copy of it on the box's disk)
    is read three times in a commit with derived keys: measured, encrypted to learn the blob's digest
    (it may be in the registry already), then encrypted as it is sent. Rewritten in place during the
    2nd read, it is held back as changed while read (never pushed with bytes its diff_id is not), and
    the rest restores with the key. (Random keys: test_encrypted_upload.py.)"""
    big = "opt/app/models/checkpoints/rewritten.safetensors"
    write_tree(box, {big: os.urandom(2 << 20)})
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    reads, after_read = rewrite_on_read(box, big, 2)
    target = f"{registry.host}/enc7:v1"
    opts = CommitOptions(root=box, profile=load_profile(str(prof)),
                         encryption=load_encryption([str(keys / "rsa.pub")], str(keys / "secret"), print))
    result = commit_box(target, base_ref, opts, CommitHooks(after_read=after_read))
    assert len(reads) >= 3 and result.held.get(big) == "changed while read", (reads, result.held)
    snap("restore", target, "--root", str(tmp_path / "r"), "--decryption-key", str(keys / "rsa.pem"), check=True)
    assert not (tmp_path / "r" / big).exists()
    want = snapshot_of_tree(box, skip=NOT_RESTORED + (big,))
    assert snapshot_of_tree(str(tmp_path / "r"), skip=NOT_RESTORED) == want


def test_only_the_snapshot_onto_its_base_with_the_key(registry, base_ref, base_rootfs, box, keys, tmp_path):
    """An encrypted snapshot's own layers restored onto a copy of its base (`--only-snapshot`, a live
    root: its deletions are counted from the decrypted layers' headers, none pushed in clear) give
    the box; verify with the key agrees."""
    target = f"{registry.host}/enc8:v1"
    snap("commit", target, "--base", base_ref, "--root", box, "--encrypt-to", str(keys / "ec.pub"), check=True)
    root = tmp_path / "live"
    subprocess.run(["cp", "-a", base_rootfs, str(root)], check=True)  # hard links kept
    snap("restore", target, "--root", str(root), "--only-snapshot", "--decryption-key", str(keys / "ec.pem"),
         check=True)
    assert snapshot_of_tree(str(root), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED)
    r = snap("verify", target, "--root", str(root), "--decryption-key", str(keys / "ec.pem"))
    assert r.returncode == 0, r.stdout + r.stderr


WEIGHT = "opt/app/models/checkpoints/model.safetensors"


def _keep_rewriting(box: str, *paths: str):
    """An after_read hook: each of `paths` changes during every read (as test_reclaim.py's torn cases)."""
    def rewrite(path, attempt):
        if path in paths:
            with open(os.path.join(box, path), "r+b") as f:
                f.write(os.urandom(64))
    return rewrite


def _commit_held_weight(registry, base_ref, box, keys, tmp_path, repo: str, first_encrypted: bool,
                        then_encrypted: bool = True):
    """v1 of a weight committed (clear or encrypted), the weight changed, then rewritten during
    every read of a commit (encrypted or clear) to the same tag: (result, v1, target)."""
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    v1 = os.urandom(2 << 20)
    write_tree(box, {WEIGHT: v1})
    target = f"{registry.host}/{repo}:v1"
    encryption = load_encryption([str(keys / "rsa.pub")], None, print)
    commit_box(target, base_ref, CommitOptions(root=box, profile=load_profile(str(prof)),
                                               encryption=encryption if first_encrypted else None))
    with open(os.path.join(box, WEIGHT), "r+b") as f:
        f.write(os.urandom(1 << 20))
    encryption = load_encryption([str(keys / "rsa.pub")], None, print) if then_encrypted else None
    opts = CommitOptions(root=box, profile=load_profile(str(prof)), encryption=encryption)
    result = commit_box(target, base_ref, opts, CommitHooks(after_read=_keep_rewriting(box, WEIGHT)))
    return result, v1, target


def test_a_held_file_of_a_clear_snapshot_is_carried_encrypted(registry, proxy, base_ref, box, keys, tmp_path):
    """A weight rewritten during every read, whose last snapshot (clear) holds it: the encrypted commit
    to the same tag keeps that version, its layer encrypted from the registry's clear blob (a clear
    layer never goes into an encrypted snapshot) as it downloads, once (a random key's blob needs no
    digest before its upload), and the restore with the key has it."""
    via = SimpleNamespace(host=proxy.host)
    result, v1, target = _commit_held_weight(via, base_ref, box, keys, tmp_path, "enc-carry", False)
    assert result.held == {WEIGHT: "changed while read"} and result.carried == [WEIGHT]
    assert len(v1) <= proxy.blob_bytes_sent < 2 * len(v1)
    target = target.replace(proxy.host, registry.host)
    manifest = manifest_of(registry, "enc-carry", "v1")
    own = manifest["layers"][int(manifest["annotations"]["dev.snap.base-layers"]):]
    assert own and all(d["mediaType"] in ENCRYPTED_TYPES for d in own)
    out = tmp_path / "out"
    snap("restore", target, "--root", str(out), "--decryption-key", str(keys / "rsa.pem"), check=True)
    assert (out / WEIGHT).read_bytes() == v1


def test_a_held_file_of_an_encrypted_snapshot_keeps_its_version(registry, base_ref, box, keys, tmp_path, state_dir):
    """Encrypted both times: the last snapshot's annotations that name files are sealed (a commit
    holds only public keys), so the commit reads them from what its state dir kept of the seal when it
    pushed that snapshot (0600): the weight rewritten during every read keeps v1."""
    result, v1, target = _commit_held_weight(registry, base_ref, box, keys, tmp_path, "enc-carry2", True)
    assert result.held == {WEIGHT: "changed while read"} and result.carried == [WEIGHT]
    out = tmp_path / "out"
    snap("restore", target, "--root", str(out), "--decryption-key", str(keys / "rsa.pem"), check=True)
    assert (out / WEIGHT).read_bytes() == v1
    kept = list((state_dir / "encrypted-layers").iterdir())
    assert kept and all(stat.S_IMODE(os.stat(p).st_mode) == 0o600 for p in kept)


def test_a_clear_commit_after_an_encrypted_one_never_carries_an_encrypted_layer(registry, base_ref, box, keys,
                                                                                tmp_path, state_dir):
    """Encrypted, then clear to the same tag with the weight rewritten during every read: its last
    version sits in an encrypted layer, which would make the clear snapshot unrestorable (no seal);
    the weight is left out (held, not claimed kept), and the snapshot restores without a key."""
    result, v1, target = _commit_held_weight(registry, base_ref, box, keys, tmp_path, "enc-to-clear", True, False)
    assert result.held == {WEIGHT: "changed while read"} and result.carried == []
    manifest = manifest_of(registry, "enc-to-clear", "v1")
    assert not any(d["mediaType"] in ENCRYPTED_TYPES for d in manifest["layers"])
    out = tmp_path / "out"
    snap("restore", target, "--root", str(out), check=True)
    assert not (out / WEIGHT).exists()


def test_key_material_given_where_a_file_name_goes_is_never_echoed(registry, base_ref, box, keys, tmp_path):
    """A secret pasted into SNAP_ENCRYPT_SECRET (`$(openssl rand -base64 32)`), a private key's base64
    DER in SNAP_DECRYPTION_KEY, a password tacked onto --decryption-key (skopeo's `key.pem:password`):
    each is one line, exit 2, naming the setting or option, never a byte of the value."""
    import base64

    from cryptography.hazmat.primitives import serialization

    secret = base64.b64encode(os.urandom(32)).decode()
    r = snap("commit", f"{registry.host}/enc-echo:v1", "--base", base_ref, "--root", box,
             "--encrypt-to", str(keys / "rsa.pub"), env={"SNAP_ENCRYPT_SECRET": secret})
    assert_one_line_error(r, 2, "SNAP_ENCRYPT_SECRET")
    assert secret not in r.stdout + r.stderr
    key = serialization.load_pem_private_key((keys / "rsa.pem").read_bytes(), None)
    der = base64.b64encode(key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())).decode()
    root = tmp_path / "never"
    r = snap("restore", f"{registry.host}/enc-echo:v1", "--root", str(root), env={"SNAP_DECRYPTION_KEY": der})
    assert_one_line_error(r, 2, "SNAP_DECRYPTION_KEY")
    assert der[:40] not in r.stdout + r.stderr and der[-40:] not in r.stdout + r.stderr
    r = snap("restore", f"{registry.host}/enc-echo:v1", "--root", str(root),
             "--decryption-key", f"{keys / 'rsa.pem'}:hunter2")
    assert_one_line_error(r, 2, "--decryption-key", "no such file")
    assert "hunter2" not in r.stdout + r.stderr
    assert not root.exists()


def test_an_encrypted_private_key_opens_with_its_password_file(registry, base_ref, box, keys, tmp_path):
    """(4) A private key openssl encrypted (`genpkey -aes256 -pass file:`) opens with
    --decryption-key-password-file (or $SNAP_DECRYPTION_KEY_PASSWORD_FILE), the password only ever in
    a file; without it: one line, exit 2, nothing written; a wrong one: exit 4, never shown."""
    pw, locked, pub = tmp_path / "pw", tmp_path / "locked.pem", tmp_path / "locked.pub"
    pw.write_text("correct horse\n")
    pw.chmod(0o600)
    subprocess.run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-aes256",
                    "-pass", f"file:{pw}", "-out", str(locked)], check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(locked), "-passin", f"file:{pw}", "-pubout", "-out", str(pub)],
                   check=True, capture_output=True)
    target = f"{registry.host}/enc-locked:v1"
    snap("commit", target, "--base", base_ref, "--root", box, "--encrypt-to", str(pub), check=True)
    root = tmp_path / "root"
    assert_one_line_error(snap("restore", target, "--root", str(root), "--decryption-key", str(locked)), 2,
                          "encrypted", "--decryption-key-password-file")
    wrong = tmp_path / "wrong"
    wrong.write_text("not it\n")
    r = snap("restore", target, "--root", str(root), "--decryption-key", str(locked),
             "--decryption-key-password-file", str(wrong))
    assert_one_line_error(r, 4, "password")
    assert "not it" not in r.stderr + r.stdout and not root.exists()
    snap("restore", target, "--root", str(root), "--decryption-key", str(locked), "--decryption-key-password-file",
         str(pw), check=True)
    assert snapshot_of_tree(str(root), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED)
    r = snap("verify", target, "--root", str(root), "--decryption-key", str(locked),
             env={"SNAP_DECRYPTION_KEY_PASSWORD_FILE": str(pw)})
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_new_secret_encrypts_every_layer_again(registry, base_ref, box, keys, tmp_path, state_dir):
    """(5) A leaked secret rotated: after a commit with S1, a changed file and a commit with S2 to
    the same tag (same state dir, and a new one reading the tag's snapshot) reuse no blob of S1: every
    layer is encrypted again under S2. With S2 again, nothing is sent: dedup under the new secret."""
    s2 = tmp_path / "s2"
    s2.write_bytes(os.urandom(32))
    s2.chmod(0o600)
    target = f"{registry.host}/enc-rekey:v1"
    flags = ("--base", base_ref, "--root", box, "--encrypt-to", str(keys / "rsa.pub"), "--json")
    first = json.loads(snap("commit", target, *flags, "--encrypt-secret", str(keys / "secret"), check=True).stdout)
    old = {x["digest"] for x in first["layers"]}
    manifest = manifest_of(registry, "enc-rekey", "v1")
    ids = [d["annotations"]["dev.snap.key-id"] for d in manifest["layers"] if d["mediaType"] in ENCRYPTED_TYPES]
    assert len(ids) > 1 and len(set(ids)) == len(ids)  # no key id relates two different layers
    write_tree(box, {"etc/app.conf": "threads = 32\n"})
    fresh = {"SNAP_STATE_DIR": str(tmp_path / "fresh-state")}
    for env in ({}, fresh):
        rotated = json.loads(snap("commit", target, *flags, "--encrypt-secret", str(s2), "--force", env=env,
                                  check=True).stdout)
        assert not old & {x["digest"] for x in rotated["layers"]}, (first["layers"], rotated["layers"])
    again = json.loads(snap("commit", target, *flags, "--encrypt-secret", str(s2), "--force", check=True).stdout)
    assert again["current"] or not [x for x in again["layers"] if x["status"] == "uploaded"]


def _put_manifest(registry, repo, tag, manifest):
    r = registry.session().put(f"{registry.url}/v2/{repo}/manifests/{tag}", data=json.dumps(manifest).encode(),
                               headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert r.status_code == 201, r.text


def test_a_tampered_or_stripped_seal_is_exit_6_and_nothing_is_written(registry, base_ref, box, keys, tmp_path):
    """(6, 7) snap's sealed annotation with a field of the wrong JSON type (`"aad": 5`), or stripped
    from a manifest whose layers carry dev.snap.recipients (a file cut into parts would be left
    unjoined): one line, exit 6, the root not even created."""
    import base64

    marked_box(box, uuid.uuid4().hex)  # a file cut into part layers: what the seal says how to join
    target = f"{registry.host}/enc-seal:v1"
    snap("commit", target, "--base", base_ref, "--root", box, "--max-layer-size", "1MiB",
         "--encrypt-to", str(keys / "rsa.pub"), check=True)
    manifest = manifest_of(registry, "enc-seal", "v1")
    jwe = json.loads(base64.b64decode(manifest["annotations"]["dev.snap.sealed"]))
    forged = {**manifest, "annotations": {**manifest["annotations"], "dev.snap.sealed":
                                          base64.b64encode(json.dumps({**jwe, "aad": 5}).encode()).decode()}}
    stripped = {**manifest, "annotations": {k: v for k, v in manifest["annotations"].items()
                                            if k != "dev.snap.sealed"}}
    for tag, doc in (("stripped", stripped), ("aad", forged)):
        _put_manifest(registry, "enc-seal", tag, doc)
        root = tmp_path / tag
        r = snap("restore", f"{registry.host}/enc-seal:{tag}", "--root", str(root),
                 "--decryption-key", str(keys / "rsa.pem"))
        assert_one_line_error(r, 6, "dev.snap.sealed")
        assert not root.exists()


def test_a_key_stream_never_covers_bytes_it_was_not_made_for(registry, proxy, base_ref, box, keys, tmp_path,
                                                              state_dir):
    """(8) With --encrypt-secret a weight's key is a function of the layer measured; rewritten after the
    read that learns the encrypted digest, the upload's read gets other bytes. Those must never go out
    under that key (the registry, which sees even a refused upload, would hold two plaintexts' XOR
    once the right blob is pushed): every upload the registry received, decrypted with each key
    the commit made (read back from its state dir with the private key), holds none of the new bytes."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from snapshotter.crypt import layer as crypt_layer
    from snapshotter.crypt.keys import load_private_key

    big = "opt/app/models/checkpoints/rewritten.safetensors"
    write_tree(box, {big: os.urandom(3 << 20)})
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    new_bytes, reads = os.urandom(64 << 10), []

    def after_read(rel, attempt):
        if rel == big:
            reads.append(attempt)
            if len(reads) == 2:  # read to learn the encrypted digest: the upload's read is next
                with open(os.path.join(box, big), "r+b") as f:
                    f.seek(3 << 19)
                    f.write(new_bytes)

    proxy.uploads = {}
    opts = CommitOptions(root=box, profile=load_profile(str(prof)),
                         encryption=load_encryption([str(keys / "rsa.pub")], str(keys / "secret"), print))
    result = commit_box(f"{proxy.host}/enc-stream:v1", base_ref, opts, CommitHooks(after_read=after_read))
    assert result.held.get(big) == "changed while read", (reads, result.held)
    private = load_private_key(str(keys / "rsa.pem"))[0]
    [kept] = (state_dir / "encrypted-layers").iterdir()
    made = [crypt_layer.open_layer(d["annotations"], [private]).key
            for d in json.loads(kept.read_text())["layers"].values()]
    assert made and proxy.uploads
    for key in made:
        for body in proxy.uploads.values():
            plain = Cipher(algorithms.AES(key.symkey), modes.CTR(key.nonce)).decryptor().update(bytes(body))
            assert plain.find(new_bytes[:4096]) < 0, "the new bytes went out under a layer's key"


def test_a_watcher_keeps_a_torn_weight_at_its_last_encrypted_version(registry, base_ref, box, keys, tmp_path):
    """(2) `snap watch --encrypt-to`: the watcher knows its last snapshot's file layers from what it
    pushed (the seal's clear view), not from the sealed manifest: a weight that tears during every
    read of the next snapshot keeps the version the last one holds."""
    import threading

    from snapshotter.watch.options import WatchOptions
    from snapshotter.watch.watcher import Watcher
    from support.watch import FakeClock

    write_tree(box, {WEIGHT: os.urandom(2 << 20)})
    v1 = open(os.path.join(box, WEIGHT), "rb").read()
    poking = threading.Event()

    def poke(path, attempt):
        if poking.is_set() and path == WEIGHT:
            with open(os.path.join(box, WEIGHT), "r+b") as f:
                f.write(os.urandom(16))

    lines, clock = [], FakeClock()
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    commit = CommitOptions(root=box, profile=load_profile(str(prof)),
                           encryption=load_encryption([str(keys / "rsa.pub")], None, print))
    w = Watcher(f"{registry.host}/enc-watch-torn:v2", base_ref,
                WatchOptions(commit=commit, log=lines.append, clock=clock, every=0, stable=5, after_read=poke))
    clock.advance(10)
    w.tick()
    with open(os.path.join(box, WEIGHT), "r+b") as f:
        f.write(os.urandom(1 << 20))
    clock.advance(10)
    poking.set()
    w.tick()
    assert any(f"held back: '/{WEIGHT}' (changed while read); kept the last snapshot's version" in line
               for line in lines), lines
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/enc-watch-torn:v2", "--root", str(out), "--decryption-key",
         str(keys / "rsa.pem"), check=True)
    assert (out / WEIGHT).read_bytes() == v1


def test_a_plain_digest_two_layers_name_is_read_checked(registry, keys):
    """(hostile image) A tar layer and, after it, a compressed one whose wrapped options claim the
    tar's plain digest: the blob a restore reads for that digest is the one checked against it (the
    tar's, decrypted and hashed), not the later layer's bytes under the tar's name unchecked."""
    def sha(b: bytes) -> str:
        return "sha256:" + hashlib.sha256(b).hexdigest()

    tar, other = tar_of_files({"weights.bin": b"w" * 4096}), tar_of_files({"evil.bin": b"e" * 4096})
    pub = crypt_keys.load_public_key(str(keys / "rsa.pub"))
    repo, descs = "enc-same-digest", []
    for blob, media_type in ((tar, LAYER_TAR), (gzip_bytes(other), LAYER_GZIP)):
        out = io.BytesIO()
        done = layer.encrypt_layer(io.BytesIO(blob), out, [pub], sha(tar))  # both claim the tar's digest
        registry.push_blob(repo, out.getvalue())
        descs.append({"mediaType": media_type + "+encrypted", "digest": done.digest, "size": done.size,
                      "annotations": done.annotations})
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": [sha(tar), sha(other)]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": registry.push_blob(repo, config), "size": len(config)},
                           "layers": descs}).encode()
    ref = Reference.parse(f"{registry.host}/{repo}:v1")
    image = Image(ref, manifest, sha(manifest), config)
    private = crypt_keys.load_private_key(str(keys / "rsa.pem"))[0]
    _, remote = open_image(image, Remote(ref), [private])
    assert b"".join(remote.iter_blob(sha(tar))) == tar


def test_json_nested_deeper_than_the_parser_goes_is_exit_6_in_every_field(registry, base_ref, box, keys, tmp_path):
    """Every JSON snap parses of an encrypted image's text, nested as deep as a hostile image likes
    ("[" * 100000, where the parser gives up with RecursionError): a layer's public options, its
    JWE, that JWE's protected header, the private options the JWE wraps (for the recipient's public
    key: anyone can make it), the manifest's seal and what the seal wraps. Each is exit 6 in one
    line, the root not even created (before: an internal error, exit 1)."""
    import base64

    from snapshotter.crypt import jwe

    target = f"{registry.host}/enc-deep:v1"
    snap("commit", target, "--base", base_ref, "--root", box, "--encrypt-to", str(keys / "rsa.pub"), check=True)
    manifest = manifest_of(registry, "enc-deep", "v1")
    deep = b"[" * 100_000
    recipient = [crypt_keys.load_public_key(str(keys / "rsa.pub"))]
    real_jwe = json.loads(base64.b64decode(manifest["annotations"]["dev.snap.sealed"]))
    deep_header = {**real_jwe, "protected": base64.urlsafe_b64encode(deep).decode().rstrip("=")}

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    layer_fields = {"pubopts": {layer.PUBOPTS: b64(deep)}, "jwe": {layer.KEYS_JWE: b64(deep)},
                    "protected": {layer.KEYS_JWE: b64(json.dumps(deep_header).encode())},
                    "private": {layer.KEYS_JWE: b64(jwe.encrypt(deep, recipient))}}
    manifest_fields = {"sealed": b64(deep), "sealed-payload": b64(jwe.encrypt(deep, recipient))}
    named = {"pubopts": "public options", "jwe": "JWE key", "protected": "JWE key", "private": "private options",
             "sealed": "dev.snap.sealed", "sealed-payload": "dev.snap.sealed"}
    victim = next(i for i, d in enumerate(manifest["layers"]) if d["mediaType"] in ENCRYPTED_TYPES)
    forged = {}
    for name, fields in layer_fields.items():
        layers = [dict(d) for d in manifest["layers"]]
        layers[victim]["annotations"] = {**layers[victim]["annotations"], **fields}
        forged[name] = {**manifest, "layers": layers}
    for name, sealed in manifest_fields.items():
        forged[name] = {**manifest, "annotations": {**manifest["annotations"], "dev.snap.sealed": sealed}}
    for name, doc in forged.items():
        _put_manifest(registry, "enc-deep", name, doc)
        root = tmp_path / name
        r = snap("restore", f"{registry.host}/enc-deep:{name}", "--root", str(root),
                 "--decryption-key", str(keys / "rsa.pem"))
        assert_one_line_error(r, 6, named[name])
        assert not root.exists(), name
