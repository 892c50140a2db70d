"""The keys layers are encrypted to and decrypted with, read from files: RSA and EC public keys (PEM, or
an X.509 certificate) for recipients, private keys (PEM, optionally behind a password file) for
decryption, and the secret deterministic layer keys are derived from. A key's bytes never reach a
message: errors name the file, never its contents, and carry no chained cryptography error."""

from __future__ import annotations

import os
import stat
from typing import Optional, Union

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from snapshotter.errors import AuthError, SnapError, UsageError

PublicKey = Union[rsa.RSAPublicKey, ec.EllipticCurvePublicKey]
PrivateKey = Union[rsa.RSAPrivateKey, ec.EllipticCurvePrivateKey]

MAX_KEY_FILE = 1 << 20  # a PEM key or certificate is a few KiB: a bigger file is not one
MIN_SECRET = 32  # bytes: a derivation secret must not be guessable offline (see docs/encryption.md)
CURVES = (ec.SECP256R1, ec.SECP384R1, ec.SECP521R1)  # the curves JWE's ECDH-ES names (P-256/384/521)


class KeyMismatch(AuthError):
    """None of the private keys given opens the layer (or a key file's password is wrong): the data is
    intact, the reader is not one of its recipients. Exit 4, as any refused credential."""

    def __str__(self) -> str:  # not AuthError's: the registry's credential ways do not apply to a key
        return SnapError.__str__(self)


def file_name(path: str, origin: Optional[str]) -> str:
    """How a message names a key file: its path, quoted; but where it came from the environment
    (`origin` "$NAME"), the setting alone: a value there may be the key itself, pasted in."""
    return f"the file {origin} names" if origin and origin.startswith("$") else repr(path)


def read_key_file(path: str, what: str, origin: Optional[str] = None) -> bytes:
    """A key file's bytes, bounded; a missing or unreadable file is bad input naming the file
    (file_name). A value that names no file, given by `origin` (the option or setting it came from),
    is not repeated: it may be a key or a password ("key.pem:password", base64 of a key)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE + 1)
    except OSError as e:
        if origin and not os.path.lexists(path):
            raise UsageError(f"{origin}: no such file (the value is not shown: it may be a key or a password)",
                             f"give {origin} the path of a file that holds the {what}") from None
        raise UsageError(f"cannot read the {what} {file_name(path, origin)}: {e.strerror}") from None
    if len(data) > MAX_KEY_FILE:
        raise UsageError(f"the {what} {file_name(path, origin)} is too big to be one")
    return data


def exposure_warning(path: str, origin: Optional[str] = None) -> Optional[str]:
    """A warning line when a secret file (private key, password, derivation secret) can be read by
    group or others, as ssh warns; the caller prints it. None when it is private."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # reading it reports the failure
    if stat.S_IMODE(mode) & 0o044:
        return (f"warning: {file_name(path, origin)} is readable by group or others (mode {stat.S_IMODE(mode):04o}); "
                "chmod 600 it")
    return None


def checked_public(key, name: str) -> PublicKey:
    if isinstance(key, rsa.RSAPublicKey):
        return key
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, CURVES):
        return key
    raise UsageError(f"{name} is not an RSA or EC (P-256, P-384, P-521) public key: JWE cannot encrypt to it")


def load_public_key(path: str, origin: Optional[str] = None) -> PublicKey:
    """A recipient's public key from a PEM public key or an X.509 certificate (PEM or DER), as
    skopeo's `--encryption-key jwe:FILE` takes it. `origin`: as read_key_file's."""
    data, name = read_key_file(path, "public key", origin), file_name(path, origin)
    for parse in (serialization.load_pem_public_key, serialization.load_der_public_key):
        try:
            return checked_public(parse(data), name)
        except (ValueError, TypeError):
            pass
    for parse in (x509.load_pem_x509_certificate, x509.load_der_x509_certificate):
        try:
            return checked_public(parse(data).public_key(), name)
        except (ValueError, TypeError):
            pass
    raise UsageError(f"{name} is not a PEM public key or X.509 certificate")


def read_password(password_file: Optional[str], origin: Optional[str] = None) -> Optional[bytes]:
    """The password in a file, without its final newline (as `echo pw > file` writes it)."""
    if password_file is None:
        return None
    data = read_key_file(password_file, "password", origin)
    return data[:-1] if data.endswith(b"\n") else data


def load_private_key(path: str, password_file: Optional[str] = None, password_origin: Optional[str] = None,
                     origin: Optional[str] = None) -> tuple[PrivateKey, list[str]]:
    """A private key (PEM: PKCS#8, PKCS#1 or SEC1, encrypted or not) and the warnings to print about
    the files it came from. The password (in `password_file`) opens an encrypted key; a clear one
    needs none (one password file serves several keys). A wrong password is a KeyMismatch (exit 4).
    `origin`, `password_origin`: as read_key_file's."""
    data, name = read_key_file(path, "private key", origin), file_name(path, origin)
    warnings = [w for w in (exposure_warning(path, origin),
                            password_file and exposure_warning(password_file, password_origin)) if w]
    try:
        try:
            key = serialization.load_pem_private_key(data, None)
        except TypeError:  # encrypted
            password = read_password(password_file, password_origin)
            if password is None:
                raise UsageError(f"the private key {name} is encrypted", "give its password's file with "
                                 "--decryption-key-password-file (or $SNAP_DECRYPTION_KEY_PASSWORD_FILE)") from None
            try:
                key = serialization.load_pem_private_key(data, password)
            except (TypeError, ValueError):
                raise KeyMismatch(f"the password does not open the private key {name}") from None
    except ValueError:
        raise UsageError(f"{name} is not a PEM private key") from None
    if isinstance(key, rsa.RSAPrivateKey) or (isinstance(key, ec.EllipticCurvePrivateKey)
                                               and isinstance(key.curve, CURVES)):
        return key, warnings
    raise UsageError(f"{name} is not an RSA or EC (P-256, P-384, P-521) private key")


def load_secret(path: str, origin: Optional[str] = None) -> tuple[bytes, list[str]]:
    """The secret deterministic layer keys are derived from, and the warnings about its file.
    `origin`: as read_key_file's."""
    data, name = read_key_file(path, "secret", origin), file_name(path, origin)
    if len(data) < MIN_SECRET:
        raise UsageError(f"the secret {name} holds {len(data)} bytes: at least {MIN_SECRET} are needed",
                         f"make one with `openssl rand -out FILE {MIN_SECRET}`")
    return data, [w for w in (exposure_warning(path, origin),) if w]
