"""snapshotter/crypt against the ecosystem's own tools: keys made by openssl (RSA 2048, EC P-256), images
encrypted and decrypted by skopeo (`--encryption-key jwe:`, `--decryption-key`) between OCI layout
directories. Nothing is mocked; no registry is needed (skopeo copies oci: to oci:)."""

import base64
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from support.ocicrypt import make_keys, need, openssl
from support.ocicrypt import skopeo_copy as support_skopeo_copy

from snapshotter.crypt import keys, layer
from snapshotter.crypt.keys import KeyMismatch
from snapshotter.errors import IntegrityError, UsageError, exit_code_of

MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"


@pytest.fixture(scope="module")
def keydir(tmp_path_factory):
    """make_keys' pairs (rsa, other: the wrong key, ec), the EC key as SEC1 and as a certificate too,
    and a password-protected RSA key."""
    d = tmp_path_factory.mktemp("keys")
    make_keys(d)
    # skopeo 1.9's ocicrypt reads an EC private key in PKCS#8 only; snap reads SEC1 (ec-sec1.pem) too
    openssl("ec", "-in", str(d / "ec.pem"), "-out", str(d / "ec-sec1.pem"))
    openssl("req", "-new", "-x509", "-key", str(d / "ec.pem"), "-subj", "/CN=snap", "-days", "2",
            "-out", str(d / "ec.crt"))
    (d / "pw").write_text("correct horse\n")
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-aes256",
            "-pass", f"file:{d / 'pw'}", "-out", str(d / "locked.pem"))
    for p in d.iterdir():
        p.chmod(0o600)
    return d


def private(keydir, name):
    return keys.load_private_key(str(keydir / f"{name}.pem"))[0]


def a_layer(size=300_000) -> tuple[bytes, bytes]:
    """A gzip'd layer tar of random bytes, and the tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        info = tarfile.TarInfo("data/weights.bin")
        data = os.urandom(size)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return gzip.compress(buf.getvalue(), mtime=0), buf.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def write_layout(path, blob: bytes, media_type: str, diff_id: str, annotations=None):
    """An OCI image layout holding one single-layer image, tagged v1."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict:
        (blobs / hashlib.sha256(data).hexdigest()).write_bytes(data)
        return {"digest": sha(data), "size": len(data)}

    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
    descriptor = {"mediaType": media_type, **put(blob), **({"annotations": annotations} if annotations else {})}
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST, "config": {"mediaType": CONFIG, **put(config)},
                           "layers": [descriptor]}).encode()
    (path / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": MANIFEST, **put(manifest), "annotations": {"org.opencontainers.image.ref.name": "v1"}}]}))


def read_layout(path) -> tuple[dict, bytes, list]:
    """The single layer's descriptor and blob, and the config's diff_ids."""
    def blob(digest):
        return (path / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes()

    manifest = json.loads(blob(json.loads((path / "index.json").read_text())["manifests"][0]["digest"]))
    desc = manifest["layers"][0]
    return desc, blob(desc["digest"]), json.loads(blob(manifest["config"]["digest"]))["rootfs"]["diff_ids"]


def skopeo_copy(tmp_path, src, dst, *flags):
    support_skopeo_copy(tmp_path, f"oci:{src}:v1", f"oci:{dst}:v1", *flags)


def test_an_image_skopeo_encrypted_is_decrypted_to_the_original_layer(keydir, tmp_path):
    """(1) skopeo encrypts for an RSA and an EC recipient (one JWE, two recipients); each private key
    alone decrypts the layer to the exact original blob, whose tar is the config's diff_id."""
    need("skopeo")
    gz, tar = a_layer()
    write_layout(tmp_path / "plain", gz, "application/vnd.oci.image.layer.v1.tar+gzip", sha(tar))
    skopeo_copy(tmp_path, tmp_path / "plain", tmp_path / "enc",
                "--encryption-key", f"jwe:{keydir / 'rsa.pub'}", "--encryption-key", f"jwe:{keydir / 'ec.pub'}")
    desc, blob, diff_ids = read_layout(tmp_path / "enc")
    assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip+encrypted"
    assert layer.plain_media_type(desc["mediaType"]) == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert blob != gz and len(blob) == len(gz)
    for name in ("rsa", "ec", "ec-sec1"):
        opened = layer.open_layer(desc["annotations"], [private(keydir, name)])
        out = io.BytesIO()
        assert layer.decrypt_layer(io.BytesIO(blob), out, opened) == sha(gz) == opened.plain_digest
        assert out.getvalue() == gz
        assert sha(gzip.decompress(out.getvalue())) == diff_ids[0] == sha(tar)


@pytest.mark.parametrize("recipients", [("rsa",), ("ec",), ("rsa", "ec")])
def test_a_layer_snap_encrypted_is_decrypted_by_skopeo(keydir, tmp_path, recipients):
    """(2) A layer this module encrypted (one recipient: JWE's flattened form; two: its recipients list),
    written into an OCI layout with ocicrypt's media type and annotations, is decrypted by
    `skopeo copy --decryption-key` with each recipient's key to the original blob and type."""
    need("skopeo")
    gz, tar = a_layer()
    enc = io.BytesIO()
    pubs = [keys.load_public_key(str(keydir / f"{r}.pub")) for r in recipients]
    done = layer.encrypt_layer(io.BytesIO(gz), enc, pubs, sha(gz))
    assert done.digest == sha(enc.getvalue()) and done.size == len(gz)
    media_type = layer.encrypted_media_type("application/vnd.oci.image.layer.v1.tar+gzip")
    write_layout(tmp_path / "enc", enc.getvalue(), media_type, sha(tar), done.annotations)
    for r in recipients:
        skopeo_copy(tmp_path, tmp_path / "enc", tmp_path / f"dec-{r}", "--decryption-key", str(keydir / f"{r}.pem"))
        desc, blob, diff_ids = read_layout(tmp_path / f"dec-{r}")
        assert desc["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
        assert not any(k.startswith("org.opencontainers.image.enc.") for k in desc.get("annotations", {}))
        assert blob == gz and desc["digest"] == sha(gz)
        assert sha(gzip.decompress(blob)) == diff_ids[0]


def test_recipients_added_later_are_comma_joined_and_skopeo_reads_them(keydir, tmp_path):
    """ocicrypt's form for recipients added to an encrypted layer: a second JWE after a comma, the blob
    unchanged. The recipient added (from an X.509 certificate) decrypts with this module and with
    skopeo; a key that is in neither JWE still gets KeyMismatch."""
    need("skopeo")
    gz, tar = a_layer()
    done, blob = encrypted(keydir, gz)
    cert = keys.load_public_key(str(keydir / "ec.crt"))
    assert cert.public_numbers() == keys.load_public_key(str(keydir / "ec.pub")).public_numbers()
    annotations = layer.add_recipients(done.annotations, [private(keydir, "rsa")], [cert])
    assert annotations[layer.KEYS_JWE].startswith(done.annotations[layer.KEYS_JWE] + ",")
    assert annotations[layer.PUBOPTS] == done.annotations[layer.PUBOPTS]
    opened = layer.open_layer(annotations, [private(keydir, "ec")])
    assert layer.decrypt_layer(io.BytesIO(blob), io.BytesIO(), opened) == sha(gz)
    assert opened.key.symkey.hex() not in repr(opened) and opened.key.nonce.hex() not in repr(opened.key)
    with pytest.raises(KeyMismatch):
        layer.open_layer(annotations, [private(keydir, "other")])
    write_layout(tmp_path / "enc", blob, layer.encrypted_media_type("application/vnd.oci.image.layer.v1.tar+gzip"),
                 sha(tar), annotations)
    skopeo_copy(tmp_path, tmp_path / "enc", tmp_path / "dec", "--decryption-key", str(keydir / "ec.pem"))
    assert read_layout(tmp_path / "dec")[1] == gz


def encrypted(keydir, gz, key=None):
    enc = io.BytesIO()
    done = layer.encrypt_layer(io.BytesIO(gz), enc, [keys.load_public_key(str(keydir / "rsa.pub"))], sha(gz), key)
    return done, enc.getvalue()


@pytest.mark.parametrize("where", [0, 150_000, -1])
def test_a_tampered_byte_is_an_integrity_error(keydir, where):
    """(3) One flipped bit anywhere in the encrypted blob (first, middle, last byte) fails the HMAC at
    the end of the stream: IntegrityError, exit 6. The untampered blob decrypts."""
    gz, _ = a_layer()
    done, blob = encrypted(keydir, gz)
    opened = layer.open_layer(done.annotations, [private(keydir, "rsa")])
    assert layer.decrypt_layer(io.BytesIO(blob), io.BytesIO(), opened) == sha(gz)
    bad = bytearray(blob)
    bad[where] ^= 0x01
    with pytest.raises(IntegrityError, match="HMAC") as caught:
        layer.decrypt_layer(io.BytesIO(bytes(bad)), io.BytesIO(), opened)
    assert exit_code_of(caught.value) == 6


def test_a_wrong_key_is_a_clear_error_that_shows_no_key(keydir):
    """(4) A private key that is no recipient's: KeyMismatch, exit 4, one line naming the cause, no
    key material in it; so for no key at all. A locked key opens with its password file, and a wrong
    password is exit 4 too, the password never shown."""
    gz, _ = a_layer()
    done, _ = encrypted(keydir, gz)
    for given in ([private(keydir, "other")], [private(keydir, "ec")], []):
        with pytest.raises(KeyMismatch) as caught:
            layer.open_layer(done.annotations, given)
        message = str(caught.value)
        assert exit_code_of(caught.value) == 4 and "\n" not in message and "key" in message
        assert "credentials come from" not in message  # not the registry's login advice
    pem = (keydir / "other.pem").read_text()
    body = "".join(pem.splitlines()[1:-1])
    assert body[:40] not in message and body[-40:] not in message
    locked, warnings = keys.load_private_key(str(keydir / "locked.pem"), str(keydir / "pw"))
    assert warnings == []
    (keydir / "wrong-pw").write_text("not it\n")
    (keydir / "wrong-pw").chmod(0o600)
    with pytest.raises(KeyMismatch) as caught:
        keys.load_private_key(str(keydir / "locked.pem"), str(keydir / "wrong-pw"))
    assert "not it" not in str(caught.value) and exit_code_of(caught.value) == 4


def forged_jwe(doc: dict) -> str:
    return base64.b64encode(json.dumps(doc).encode()).decode()


@pytest.mark.parametrize("forge", [
    lambda a: {**a, layer.PUBOPTS: "not base64!"},
    lambda a: {**a, layer.PUBOPTS: base64.b64encode(b'{"cipher":"AES_256_CTR_HMAC_SHA256","hmac":7}').decode()},
    lambda a: {**a, layer.PUBOPTS: base64.b64encode(b'{"cipher":"ROT13"}').decode()},
    lambda a: {**a, layer.KEYS_JWE: base64.b64encode(b"[1, 2]").decode()},
    lambda a: {**a, layer.KEYS_JWE: forged_jwe({"protected": "e30", "recipients": [7]})},
    lambda a: {layer.PUBOPTS: a[layer.PUBOPTS]},
], ids=["pubopts-not-base64", "hmac-not-a-string", "other-cipher", "jwe-not-an-object", "recipient-not-an-object",
        "no-keys-annotation"])
def test_forged_annotations_are_one_line_integrity_errors(keydir, forge):
    """Annotations an attacker wrote (malformed base64, JSON of the wrong shape, another cipher, no
    wrapped key) are refused with one line and exit 6, never a traceback from deep in the parsing."""
    gz, _ = a_layer(1000)
    done, blob = encrypted(keydir, gz)
    with pytest.raises(IntegrityError) as caught:
        opened = layer.open_layer(forge(done.annotations), [private(keydir, "rsa"), private(keydir, "ec")])
        layer.decrypt_layer(io.BytesIO(blob), io.BytesIO(), opened)
    assert exit_code_of(caught.value) == 6 and "\n" not in str(caught.value)


def _retyped(jwe_b64: str, change) -> str:
    """A JWE annotation with one field given another JSON type (`change` edits the parsed document)."""
    doc = json.loads(base64.b64decode(jwe_b64))
    change(doc)
    return base64.b64encode(json.dumps(doc).encode()).decode()


def _set(path: tuple, value):
    def change(doc):
        for step in path[:-1]:
            doc = doc[step]
        doc[path[-1]] = value
    return change


@pytest.mark.parametrize("change", [
    _set(("aad",), 5), _set(("iv",), 5), _set(("ciphertext",), {}), _set(("tag",), []),
    _set(("protected",), 7), _set(("protected",), "WzFd"), _set(("unprotected",), "x"),
    _set(("recipients", 1, "encrypted_key"), 5), _set(("recipients", 0, "header"), [1]),
    _set(("recipients", 1, "header", "alg"), 5), _set(("recipients", 1, "header", "epk"), "x"),
    _set(("recipients", 1, "header", "epk", "x"), 5),
], ids=["aad", "iv", "ciphertext", "tag", "protected", "protected-a-list", "unprotected", "encrypted-key",
        "header", "alg", "epk", "epk-x"])
def test_a_jwe_field_of_the_wrong_type_is_an_integrity_error(keydir, change):
    """(6) A tampered JWE (a layer's keys.jwe, as snap's sealed annotation) whose field is of another
    JSON type (`"aad": 5`): IntegrityError, exit 6, one line; never a TypeError (exit 1)."""
    gz, _ = a_layer(1000)
    enc = io.BytesIO()
    recipients = [keys.load_public_key(str(keydir / f"{r}.pub")) for r in ("rsa", "ec")]
    done = layer.encrypt_layer(io.BytesIO(gz), enc, recipients, sha(gz))
    forged = {**done.annotations, layer.KEYS_JWE: _retyped(done.annotations[layer.KEYS_JWE], change)}
    with pytest.raises(IntegrityError) as caught:
        layer.open_layer(forged, [private(keydir, "ec")])
    assert exit_code_of(caught.value) == 6 and "\n" not in str(caught.value)


def test_a_private_key_others_can_read_gets_a_warning(keydir, tmp_path):
    """A private key file readable by group or others loads with a warning line naming it (the caller
    prints it); mode 600 gives none. A public key is not a private one: exit 2, the path quoted."""
    exposed = tmp_path / "exposed.pem"
    shutil.copy(keydir / "ec.pem", exposed)
    exposed.chmod(0o644)
    _, warnings = keys.load_private_key(str(exposed))
    assert len(warnings) == 1 and repr(str(exposed)) in warnings[0] and "0644" in warnings[0]
    exposed.chmod(0o600)
    assert keys.load_private_key(str(exposed))[1] == []
    with pytest.raises(UsageError, match="not a PEM private key") as caught:
        keys.load_private_key(str(keydir / "rsa.pub"))
    assert exit_code_of(caught.value) == 2


def test_derived_keys_give_identical_blobs(keydir, tmp_path):
    """(5) The same layer encrypted twice with the same secret is the same blob, byte for byte (and
    HMAC), though each push wraps its key afresh; another secret, or another blob of the same tar,
    gives another blob. The derived blob still decrypts with the recipient's key."""
    gz, tar = a_layer()
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    material, warnings = keys.load_secret(str(secret))
    assert warnings == []
    first, blob1 = encrypted(keydir, gz, layer.derived_key(material, sha(tar), sha(gz)))
    second, blob2 = encrypted(keydir, gz, layer.derived_key(material, sha(tar), sha(gz)))
    assert blob1 == blob2 and first.digest == second.digest
    assert first.annotations[layer.PUBOPTS] == second.annotations[layer.PUBOPTS]
    assert first.annotations[layer.KEYS_JWE] != second.annotations[layer.KEYS_JWE]
    _, other_secret = encrypted(keydir, gz, layer.derived_key(os.urandom(32), sha(tar), sha(gz)))
    _, random_key = encrypted(keydir, gz)
    _, other_blob = encrypted(keydir, gz, layer.derived_key(material, sha(tar), sha(gz + b"x")))
    assert len({blob1, other_secret, random_key, other_blob}) == 4
    opened = layer.open_layer(second.annotations, [private(keydir, "rsa")])
    assert layer.decrypt_layer(io.BytesIO(blob1), io.BytesIO(), opened) == sha(gz)
    secret.write_bytes(b"short")
    with pytest.raises(UsageError, match="at least 32"):
        keys.load_secret(str(secret))


MEMORY_CHILD = r"""
import hashlib, io, sys
from snapshotter.crypt import keys, layer

SIZE = 200 * 1024 * 1024

class Stream(io.RawIOBase):  # made as read, never held: only the code under test can hold it
    def __init__(self, size=SIZE):
        self.left = size
    def readable(self):
        return True
    def readinto(self, b):
        n = min(len(b), self.left, 1 << 16)
        b[:n] = bytes([self.left & 0xFF]) * n
        self.left -= n
        return n

class Sink(io.RawIOBase):
    def __init__(self):
        self.h = hashlib.sha256()
    def writable(self):
        return True
    def write(self, b):
        self.h.update(b)
        return len(b)

def peak_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])

pub = keys.load_public_key(sys.argv[1])
priv = keys.load_private_key(sys.argv[2])[0]
layer.encrypt_layer(Stream(1 << 20), Sink(), [pub], "sha256:" + "0" * 64)  # warm up, small: VmHWM is a peak
before = peak_kib()
done = layer.encrypt_layer(Stream(), Sink(), [pub], "sha256:" + "0" * 64)
assert done.size == SIZE
opened = layer.open_layer(done.annotations, [priv])
ends = []
try:
    for chunk in layer.decrypted_chunks(io.BufferedReader(Stream()), opened):
        pass
except Exception as e:  # the stream given is not the ciphertext: its HMAC fails, at the very end
    ends.append(type(e).__name__)
print(peak_kib() - before, ends)
"""


def test_memory_stays_flat_on_a_200_mb_stream(keydir, tmp_path):
    """(6) A child process encrypts a 200 MB stream and decrypts 200 MB: its peak RSS grows by far less
    than the data (a module holding the layer, or a whole chunk list, would add 200 MB)."""
    script = tmp_path / "child.py"
    script.write_text(MEMORY_CHILD)
    done = subprocess.run([sys.executable, str(script), str(keydir / "rsa.pub"), str(keydir / "rsa.pem")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    grown_kib, ends = done.stdout.split(" ", 1)
    assert ends.strip() == "['IntegrityError']"
    assert int(grown_kib) < 32 * 1024, f"peak RSS grew by {grown_kib} KiB"
