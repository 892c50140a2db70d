"""ocicrypt's layer cipher, streamed: AES-256-CTR over the layer blob, HMAC-SHA256 (keyed with the same
symmetric key, as ocicrypt does) over the ciphertext. The key and nonce go in the private options
JSON, wrapped per recipient with JWE (annotation `org.opencontainers.image.enc.keys.jwe`); the HMAC in
the public options (`org.opencontainers.image.enc.pubopts`). Both JSONs are byte for byte what
ocicrypt's Go structs marshal to. Memory stays flat: one chunk at a time, however big the layer.

A layer key is random by default; `derived_key` makes it a function of a secret and the layer, so the
same layer encrypted twice gives the same blob (dedup; docs/encryption.md says what that reveals)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
from dataclasses import dataclass, field
from typing import BinaryIO, Iterable, Iterator, Optional

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from snapshotter import jsontext
from snapshotter.crypt import jwe
from snapshotter.crypt.keys import KeyMismatch, PrivateKey, PublicKey
from snapshotter.digests import DIGEST, hasher_digest
from snapshotter.errors import IntegrityError
from snapshotter.oci.mediatypes import ENCRYPTED_SUFFIX, LAYER_GZIP, LAYER_TAR, LAYER_ZSTD

CIPHER = "AES_256_CTR_HMAC_SHA256"
KEYS_JWE = "org.opencontainers.image.enc.keys.jwe"
PUBOPTS = "org.opencontainers.image.enc.pubopts"
ENC_PREFIX = "org.opencontainers.image.enc."  # every ocicrypt annotation: keys.jwe/pkcs7/pgp/pkcs11, pubopts
CHUNK = 1 << 20
DERIVATION_SALT = b"snap ocicrypt layer key v1"  # versions the derivation: a change gives other blobs
PLAIN_TYPES = (LAYER_TAR, LAYER_GZIP, LAYER_ZSTD)  # the layer types ocicrypt has an encrypted form of


@dataclass(frozen=True)
class LayerKey:
    """A layer's AES-256 key and 16-byte CTR nonce (the initial counter block, as Go's cipher.NewCTR)."""

    symkey: bytes = field(repr=False)
    nonce: bytes = field(repr=False)


@dataclass(frozen=True)
class Encrypted:
    """What encrypting a layer gives its descriptor: the encrypted blob's digest and size, and the
    annotations that let a recipient decrypt it."""

    digest: str
    size: int
    annotations: dict


@dataclass(frozen=True)
class Opened:
    """A layer's options once a private key unwrapped them: its key, the HMAC its ciphertext must have,
    and the digest of the plain blob (as ocicrypt records it; the caller checks the bytes against it)."""

    key: LayerKey = field(repr=False)
    hmac: bytes
    plain_digest: str
    private_options: bytes = field(repr=False)  # as unwrapped: what add_recipients wraps again


def random_key() -> LayerKey:
    return LayerKey(os.urandom(32), os.urandom(16))


def derived_key(secret: bytes, diff_id: str, plain_digest: str) -> LayerKey:
    """The key and nonce of a layer as HKDF-SHA256 of a secret, the layer's diff_id and the digest of
    the blob encrypted: one layer gives one blob under one secret. The blob's digest is in it so two
    blobs of one tar (gzip and zstd) never share a CTR key stream."""
    for digest in (diff_id, plain_digest):
        if not DIGEST.fullmatch(digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
    okm = HKDF(hashes.SHA256(), 48, DERIVATION_SALT, f"{diff_id}\n{plain_digest}".encode()).derive(secret)
    return LayerKey(okm[:32], okm[32:])


def encrypted_media_type(media_type: str) -> str:
    """ocicrypt's type for an encrypted layer: the plain OCI layer type with `+encrypted`."""
    if media_type not in PLAIN_TYPES:
        raise ValueError(f"no encrypted form of the layer type {media_type!r}")
    return media_type + ENCRYPTED_SUFFIX


def is_encrypted(media_type: str) -> bool:
    return media_type.endswith(ENCRYPTED_SUFFIX)


def plain_media_type(media_type: str) -> str:
    """The layer type an encrypted layer decrypts to; a type that is not one of ocicrypt's is refused."""
    plain = media_type[:-len(ENCRYPTED_SUFFIX)] if is_encrypted(media_type) else ""
    if plain not in PLAIN_TYPES:
        raise IntegrityError(f"unsupported encrypted layer media type {media_type!r}")
    return plain


def b64(data: bytes) -> str:
    """Standard base64 with padding: how Go's encoding/json writes []byte, and how ocicrypt's annotations are."""
    return base64.b64encode(data).decode()


def go_json(obj) -> bytes:
    """JSON as Go's encoding/json marshals ocicrypt's structs: compact, fields in struct order."""
    return json.dumps(obj, separators=(",", ":")).encode()


def private_options(key: LayerKey, plain_digest: str) -> bytes:
    """PrivateLayerBlockCipherOptions (blockcipher.go): symkey, digest, cipheroptions{nonce},
    previouslayersdigest (ocicrypt leaves it empty)."""
    return go_json({"symkey": b64(key.symkey), "digest": plain_digest,
                    "cipheroptions": {"nonce": b64(key.nonce)}, "previouslayersdigest": ""})


def public_options(mac: bytes) -> bytes:
    """PublicLayerBlockCipherOptions: cipher, hmac, cipheroptions (empty, as ocicrypt's finalizer leaves it)."""
    return go_json({"cipher": CIPHER, "hmac": b64(mac), "cipheroptions": {}})


def read_chunks(src: BinaryIO) -> Iterator[bytes]:
    while True:
        chunk = src.read(CHUNK)
        if not chunk:
            return
        yield chunk


class LayerEncryptor:
    """The layer cipher as the bytes come (`update`), for a writer that cannot hand over a stream:
    `finish` gives the descriptor's part once the plain blob's digest is known."""

    def __init__(self, key: Optional[LayerKey] = None):
        self._key = key or random_key()
        self._cipher = Cipher(algorithms.AES(self._key.symkey), modes.CTR(self._key.nonce)).encryptor()
        self._mac, self._hash, self.size = hmac.new(self._key.symkey, digestmod=hashlib.sha256), hashlib.sha256(), 0

    def update(self, chunk: bytes) -> bytes:
        sealed = self._cipher.update(chunk)
        self._mac.update(sealed)
        self._hash.update(sealed)
        self.size += len(sealed)
        return sealed

    @property
    def digest(self) -> str:
        """The encrypted blob's digest so far (all of it once the plain bytes have ended)."""
        return hasher_digest(self._hash)

    def finish(self, recipients: Iterable[PublicKey], plain_digest: str) -> Encrypted:
        """The encrypted blob's digest, size and annotations: its key wrapped for every recipient."""
        recipients = list(recipients)
        if not recipients:
            raise ValueError("encrypting a layer needs at least one recipient")
        annotations = {KEYS_JWE: b64(jwe.encrypt(private_options(self._key, plain_digest), recipients)),
                       PUBOPTS: b64(public_options(self._mac.digest()))}
        return Encrypted(self.digest, self.size, annotations)


def encrypt_layer(src: BinaryIO, dst: BinaryIO, recipients: Iterable[PublicKey], plain_digest: str,
                  key: Optional[LayerKey] = None) -> Encrypted:
    """Encrypt the blob read from `src` (whose sha256 is `plain_digest`) into `dst` for every recipient:
    the encrypted blob's digest, size and annotations. `key`: derived_key's for dedup, else random."""
    recipients = list(recipients)
    if not recipients:
        raise ValueError("encrypting a layer needs at least one recipient")
    encryptor = LayerEncryptor(key)
    for chunk in read_chunks(src):
        dst.write(encryptor.update(chunk))
    return encryptor.finish(recipients, plain_digest)


def decode_b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise IntegrityError(f"the layer's {what} is not base64") from None


def open_layer(annotations: dict, keys: Iterable[PrivateKey]) -> Opened:
    """Unwrap a layer's options with whichever private key is a recipient's (ocicrypt tries each
    comma-separated JWE). No JWE annotation, or none opens: KeyMismatch; malformed: IntegrityError."""
    wrapped = annotations.get(KEYS_JWE, "")
    if not wrapped:
        others = sorted(k for k in annotations if k.startswith(ENC_PREFIX + "keys."))
        raise IntegrityError("the layer has no JWE-wrapped key" + (f" (only {others!r})" if others else ""))
    public = parse_options(decode_b64(annotations.get(PUBOPTS, ""), "public options"), "public")
    if public.get("cipher") != CIPHER:
        raise IntegrityError(f"unsupported layer cipher {public.get('cipher')!r}")
    keys, mismatch = list(keys), None
    if not keys:
        raise KeyMismatch("the layer is encrypted and no decryption key was given")
    for part in wrapped.split(","):
        try:
            data = jwe.decrypt(decode_b64(part, "JWE key annotation"), keys)
        except KeyMismatch as e:
            mismatch = e
            continue
        private = parse_options(data, "private")
        mac = decode_b64(public.get("hmac") or "", "HMAC")
        return Opened(layer_key(private), mac, str(private.get("digest", "")), data)
    raise mismatch


def add_recipients(annotations: dict, keys: Iterable[PrivateKey], recipients: Iterable[PublicKey]) -> dict:
    """A layer's annotations with its key also wrapped for `recipients`, the blob unchanged: as ocicrypt
    does for an encrypted layer, the options one of `keys` opens are wrapped in a new JWE, appended
    after a comma."""
    opened = open_layer(annotations, keys)
    added = b64(jwe.encrypt(opened.private_options, list(recipients)))
    return {**annotations, KEYS_JWE: f"{annotations[KEYS_JWE]},{added}"}


def parse_options(data: bytes, what: str) -> dict:
    try:
        options = jsontext.loads(data)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise IntegrityError(f"the layer's {what} options are not a JSON object")
    return options


def layer_key(private: dict) -> LayerKey:
    symkey = decode_b64(private.get("symkey") or "", "symmetric key")
    options = private.get("cipheroptions")
    nonce = decode_b64((options if isinstance(options, dict) else {}).get("nonce") or "", "nonce")
    if len(symkey) != 32 or len(nonce) != 16:
        raise IntegrityError("the layer's key or nonce has the wrong length for AES-256-CTR")
    return LayerKey(symkey, nonce)


def decrypted_chunks(src: BinaryIO, opened: Opened) -> Iterator[bytes]:
    """The plain blob, chunk by chunk. The HMAC is checked when the ciphertext ends, as ocicrypt does:
    the last step raises IntegrityError on a mismatch, so a caller keeps nothing it wrote until the
    iteration has finished."""
    return decrypt_chunks(read_chunks(src), opened)


def decrypt_chunks(chunks: Iterable[bytes], opened: Opened, check_hmac: bool = True) -> Iterator[bytes]:
    """decrypted_chunks over the encrypted blob's chunks as they come (a download's), uncopied.
    `check_hmac` False: for a caller that checks every decrypted byte against `opened.plain_digest`,
    which the same wrapped options name as the HMAC's key: a changed byte fails that check as surely."""
    cipher = Cipher(algorithms.AES(opened.key.symkey), modes.CTR(opened.key.nonce)).decryptor()
    if not check_hmac:
        for chunk in chunks:
            yield cipher.update(chunk)
        return
    mac = hmac.new(opened.key.symkey, digestmod=hashlib.sha256)
    for chunk in chunks:
        mac.update(chunk)
        yield cipher.update(chunk)
    if not hmac.compare_digest(mac.digest(), opened.hmac):
        raise IntegrityError("the encrypted layer fails its HMAC: tampered or truncated")


def decrypt_layer(src: BinaryIO, dst: BinaryIO, opened: Opened) -> str:
    """Decrypt `src` into `dst` and return the plain blob's digest. IntegrityError at the end if the HMAC
    does not match, or the bytes are not the digest the private options name (ocicrypt records it)."""
    h = hashlib.sha256()
    for chunk in decrypted_chunks(src, opened):
        h.update(chunk)
        dst.write(chunk)
    digest = hasher_digest(h)
    if opened.plain_digest and digest != opened.plain_digest:
        raise IntegrityError(f"the decrypted layer is {digest}, its key names {opened.plain_digest!r}")
    return digest
