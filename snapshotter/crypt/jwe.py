"""JWE (RFC 7516) in the JSON serialization, as ocicrypt's JWE key wrapper writes it through go-jose:
one content key, A256GCM over the payload, wrapped for each recipient with RSA-OAEP (an RSA key) or
ECDH-ES+A256KW (an EC key). One recipient: the flattened form, its header merged into the protected
one; several: a `recipients` list, the protected header holding only `enc` (and, as go-jose writes,
the first recipient's key also at the top). Read back: either form, RSA-OAEP(-256) and ECDH-ES+A*KW."""

from __future__ import annotations

import base64
import binascii
import json
import os
import struct
from typing import Iterable, Optional

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import InvalidUnwrap, aes_key_unwrap, aes_key_wrap
from cryptography.hazmat.primitives.kdf.concatkdf import ConcatKDFHash

from snapshotter import jsontext
from snapshotter.crypt.keys import KeyMismatch, PrivateKey, PublicKey
from snapshotter.errors import IntegrityError

ENC = "A256GCM"
RSA_OAEP = {"RSA-OAEP": hashes.SHA1, "RSA-OAEP-256": hashes.SHA256}  # JWA: OAEP's hash and MGF1's are one
ECDH_KW = {"ECDH-ES+A128KW": 16, "ECDH-ES+A192KW": 24, "ECDH-ES+A256KW": 32}  # the key-wrapping key's size
CURVE_NAMES = {"P-256": ec.SECP256R1, "P-384": ec.SECP384R1, "P-521": ec.SECP521R1}


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text) -> bytes:
    if not isinstance(text, str):
        raise ValueError("not a base64url string")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def compact_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def ecdh_kek(private: ec.EllipticCurvePrivateKey, public: ec.EllipticCurvePublicKey, alg: str) -> bytes:
    """The key-wrapping key of ECDH-ES+AxxxKW: Concat KDF over the shared secret, with the algorithm's
    name and no party info (JWA 4.6.2; go-jose sends no apu/apv)."""
    size = ECDH_KW[alg]
    other = struct.pack(">I", len(alg)) + alg.encode() + struct.pack(">II", 0, 0) + struct.pack(">I", size * 8)
    shared = private.exchange(ec.ECDH(), public)
    return ConcatKDFHash(hashes.SHA256(), size, other).derive(shared)


def epk_jwk(public: ec.EllipticCurvePublicKey) -> dict:
    """An ephemeral EC public key as a JWK, coordinates padded to the curve's size (go-jose's order)."""
    size = (public.curve.key_size + 7) // 8
    nums = public.public_numbers()
    crv = next(name for name, curve in CURVE_NAMES.items() if isinstance(public.curve, curve))
    x, y = (b64url(n.to_bytes(size, "big")) for n in (nums.x, nums.y))
    return {"kty": "EC", "crv": crv, "x": x, "y": y}


def wrap_cek(cek: bytes, key: PublicKey) -> tuple[dict, bytes]:
    """A recipient's header and encrypted key: ocicrypt picks RSA-OAEP for RSA, ECDH-ES+A256KW for EC."""
    if isinstance(key, rsa.RSAPublicKey):
        oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA1()), algorithm=hashes.SHA1(), label=None)
        return {"alg": "RSA-OAEP"}, key.encrypt(cek, oaep)
    ephemeral = ec.generate_private_key(key.curve)
    kek = ecdh_kek(ephemeral, key, "ECDH-ES+A256KW")
    return {"alg": "ECDH-ES+A256KW", "epk": epk_jwk(ephemeral.public_key())}, aes_key_wrap(kek, cek)


def encrypt(payload: bytes, recipients: Iterable[PublicKey]) -> bytes:
    """The JWE JSON of `payload` for every recipient, in the bytes ocicrypt writes."""
    cek = os.urandom(32)
    wrapped = [wrap_cek(cek, key) for key in recipients]
    if not wrapped:
        raise ValueError("a JWE needs at least one recipient")
    if len(wrapped) == 1:
        header, encrypted_key = wrapped[0]
        protected = b64url(compact_json(dict(sorted({**header, "enc": ENC}.items()))))
        doc = {"protected": protected, "encrypted_key": b64url(encrypted_key)}
    else:
        protected = b64url(compact_json({"enc": ENC}))
        doc = {"protected": protected,
               "recipients": [{"header": h, "encrypted_key": b64url(k)} for h, k in wrapped],
               "encrypted_key": b64url(wrapped[0][1])}
    iv = os.urandom(12)
    sealed = AESGCM(cek).encrypt(iv, payload, protected.encode())
    doc.update(iv=b64url(iv), ciphertext=b64url(sealed[:-16]), tag=b64url(sealed[-16:]))
    return compact_json(doc)


def unwrap_cek(header: dict, encrypted_key: bytes, key: PrivateKey) -> Optional[bytes]:
    """The content key if this private key is the recipient's; None if it is not."""
    alg = header.get("alg")
    try:
        if alg in RSA_OAEP and isinstance(key, rsa.RSAPrivateKey):
            hash_ = RSA_OAEP[alg]()
            return key.decrypt(encrypted_key, padding.OAEP(mgf=padding.MGF1(hash_), algorithm=hash_, label=None))
        if alg in ECDH_KW and isinstance(key, ec.EllipticCurvePrivateKey):
            epk = header.get("epk") or {}
            curve = CURVE_NAMES.get(epk.get("crv"))
            if curve is None or not isinstance(key.curve, curve):
                return None
            x, y = (int.from_bytes(unb64url(epk.get(c)), "big") for c in ("x", "y"))
            public = ec.EllipticCurvePublicNumbers(x, y, curve()).public_key()
            return aes_key_unwrap(ecdh_kek(key, public, alg), encrypted_key)
    except (ValueError, TypeError, AttributeError, InvalidUnwrap, binascii.Error):
        return None  # not this key's (OAEP's padding and AES-KW's check fail for any other key)
    return None


def parse(document: bytes) -> tuple[str, dict, list[tuple[dict, bytes]], dict]:
    """The protected header (as sent, and parsed), each recipient's merged header and encrypted key,
    and the document; a malformed one is an IntegrityError."""
    try:
        doc = jsontext.loads(document)
        _check_types(doc)
        protected_b64 = doc.get("protected", "")
        protected = jsontext.loads(unb64url(protected_b64)) if protected_b64 else {}
        if not isinstance(protected, dict):
            raise ValueError("the protected header is not an object")
        shared = {**protected, **(doc.get("unprotected") or {})}
        flattened = {"header": doc.get("header") or {}, "encrypted_key": doc.get("encrypted_key", "")}
        listed = doc.get("recipients") or [flattened]
        recipients = [({**shared, **(r.get("header") or {})}, unb64url(r.get("encrypted_key", ""))) for r in listed]
        for header, _ in recipients:
            _check_fields(header, HEADER_FIELDS)
    except (ValueError, TypeError, AttributeError, binascii.Error):
        raise IntegrityError("the layer's JWE key annotation is malformed") from None
    return protected_b64, shared, recipients, doc


# The type of each field snap reads, where present: a tampered document of another shape is an
# IntegrityError here, never a TypeError deep in the decryption.
DOC_FIELDS = {"protected": str, "unprotected": dict, "header": dict, "encrypted_key": str, "recipients": list,
              "iv": str, "ciphertext": str, "tag": str, "aad": str}
RECIPIENT_FIELDS = {"header": dict, "encrypted_key": str}
HEADER_FIELDS = {"alg": str, "enc": str, "epk": dict}
EPK_FIELDS = {"crv": str, "x": str, "y": str}


def _check_fields(obj, fields: dict) -> None:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for name, kind in fields.items():
        if name in obj and obj[name] is not None and not isinstance(obj[name], kind):
            raise ValueError(f"{name} is not a {kind.__name__}")
    if isinstance(obj.get("epk"), dict):
        _check_fields(obj["epk"], EPK_FIELDS)


def _check_types(doc) -> None:
    _check_fields(doc, DOC_FIELDS)
    for r in doc.get("recipients") or []:
        _check_fields(r, RECIPIENT_FIELDS)


def decrypt(document: bytes, keys: Iterable[PrivateKey]) -> bytes:
    """The payload, opened with whichever private key is a recipient's. No key is: KeyMismatch (exit 4);
    a key opens the content key but the payload fails its tag: IntegrityError (tampered)."""
    protected_b64, shared, recipients, doc = parse(document)
    keys = list(keys)
    for header, encrypted_key in recipients:
        if header.get("enc") != ENC:
            raise IntegrityError(f"unsupported JWE content encryption {header.get('enc')!r}")
        for key in keys:
            cek = unwrap_cek(header, encrypted_key, key)
            if cek is not None:
                return open_payload(cek, protected_b64, doc)
    raise KeyMismatch("none of the decryption keys given is a recipient of this layer")


def open_payload(cek: bytes, protected_b64: str, doc: dict) -> bytes:
    aad = protected_b64 + ("." + doc["aad"] if doc.get("aad") else "")
    try:
        iv, ciphertext, tag = (unb64url(doc.get(f, "")) for f in ("iv", "ciphertext", "tag"))
        return AESGCM(cek).decrypt(iv, ciphertext + tag, aad.encode())
    except (InvalidTag, ValueError, binascii.Error):
        raise IntegrityError("the layer's wrapped key fails its authentication tag: tampered") from None
