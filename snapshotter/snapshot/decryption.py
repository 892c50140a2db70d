"""Restoring and verifying encrypted images (docs/encryption.md): crypt/'s ocicrypt core on the way in.
An image with encrypted layers (snap's, or one skopeo or podman encrypted) is opened with the private
keys given before anything is written: every layer's wrapped key and snap's sealed annotations
(encryption.py's SEALED). What the rest of restore sees is the plain image (each layer's plain media
type, digest and annotations) and a Remote whose blobs of those digests are the encrypted ones,
decrypted as they stream: each checked when it ends, against its HMAC (an uncompressed one against its
plain digest instead, which is its diff_id), so a tampered blob fails as a corrupt one does (exit 6), before
its last byte is kept; and, as any layer, its tar against the config's diff_id as it is applied."""

from __future__ import annotations

import binascii
import hashlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from snapshotter import jsontext
from snapshotter.digests import DIGEST, hasher_digest
from snapshotter.errors import IntegrityError
from snapshotter.oci.image import Image, annotations_of, canonical, descriptor
from snapshotter.oci.mediatypes import ENCRYPTED_SUFFIX, LAYER_TAR
from snapshotter.registry.remote import ProgressFn, Remote

from .encryption import ENCRYPTED_LABEL, LAYER_CLEAR, RECIPIENTS, SEALED, setting_paths

if TYPE_CHECKING:  # crypt/ (and the cryptography package) is imported once an image is encrypted
    from snapshotter.crypt.keys import PrivateKey
    from snapshotter.crypt.layer import Opened

DECRYPTION_KEY_ENV = "SNAP_DECRYPTION_KEY"  # private key files, separated by os.pathsep: as --decryption-key
PASSWORD_FILE_ENV = "SNAP_DECRYPTION_KEY_PASSWORD_FILE"  # as --decryption-key-password-file


def load_decryption_keys(paths: Optional[list[str]], log: Callable[[str], None],
                         password_file: Optional[str] = None) -> list[PrivateKey]:
    """The private keys of `--decryption-key` (else $SNAP_DECRYPTION_KEY, which names files: a key's
    own text there is refused), an encrypted one opened with the password in `password_file`
    (--decryption-key-password-file, else $SNAP_DECRYPTION_KEY_PASSWORD_FILE: a file, never the
    password itself). A file others may read gets a warning line."""
    origin = "--decryption-key" if paths else f"${DECRYPTION_KEY_ENV}"
    paths = paths or setting_paths(DECRYPTION_KEY_ENV)
    password = (password_file, "--decryption-key-password-file") if password_file else \
        (next(iter(setting_paths(PASSWORD_FILE_ENV)), None), f"${PASSWORD_FILE_ENV}")
    if not paths:
        return []
    from snapshotter.crypt import keys

    found = []
    for path in paths:
        key, warnings = keys.load_private_key(path, *password, origin=origin)
        for w in warnings:
            log(w)
        found.append(key)
    return found


class DecryptingRemote(Remote):
    """`remote`, but a blob of a decrypted layer's plain digest is its encrypted blob, decrypted."""

    def __init__(self, remote: Remote, opened: dict[str, tuple[str, Opened, bool]]):
        self.__dict__.update(remote.__dict__)  # the same connection, credentials and counters
        self._opened = opened

    def iter_blob(self, digest: str, progress: ProgressFn = None, size: Optional[int] = None) -> Iterator[bytes]:
        if digest not in self._opened:
            return super().iter_blob(digest, progress, size)
        return self._decrypted(digest, progress, size)

    def _decrypted(self, digest: str, progress: ProgressFn, size: Optional[int]) -> Iterator[bytes]:
        from snapshotter.crypt import layer

        encrypted, opened, exact = self._opened[digest]
        h = hashlib.sha256()
        # One check of every byte, at the end, as cheap as the format allows (docs/encryption.md): a
        # layer whose decrypted bytes are hashed here against the plain digest its wrapped options
        # name (`exact`: an uncompressed one, its diff_id) needs no HMAC, which is keyed by those same
        # options; any other, its HMAC. The encrypted blob's digest is hashed only where the layer is
        # known by it (skopeo's, whose options name no decrypted byte): a blob staged under that name
        # is its. Each pass more costs a restore of weights a third more CPU.
        known_by_it = digest == encrypted
        src = super().iter_blob if known_by_it else self.iter_blob_unhashed
        for chunk in layer.decrypt_chunks(src(encrypted, progress, size), opened, check_hmac=not exact):
            if exact:
                h.update(chunk)
            yield chunk
        if exact and hasher_digest(h) != digest:
            raise IntegrityError(f"the decrypted layer {encrypted[:19]} is not the {digest} its key names "
                                 "(tampered or truncated)")


def open_image(image: Image, remote: Remote, private_keys: list[PrivateKey]) -> tuple[Image, Remote]:
    """`image` and `remote` as the rest of a restore reads them: unchanged for a clear image; for an
    encrypted one, its plain view and a DecryptingRemote. No key given, or none that opens it:
    KeyMismatch (exit 4); a malformed or tampered key annotation: IntegrityError (exit 6)."""
    doc = image.manifest
    layers = doc.get("layers") if isinstance(doc.get("layers"), list) else []
    ann = annotations_of(doc, f"image {image.ref}")
    encrypted = [i for i, d in enumerate(layers) if isinstance(d, dict) and isinstance(d.get("mediaType"), str)
                 and d["mediaType"].endswith(ENCRYPTED_SUFFIX)]
    if not encrypted and SEALED not in ann:
        return image, remote
    from snapshotter.crypt import layer
    from snapshotter.crypt.keys import KeyMismatch

    if not private_keys:
        raise KeyMismatch(f"{image.ref} is encrypted and no decryption key was given",
                          "pass --decryption-key FILE (or set SNAP_DECRYPTION_KEY to the key file's path)")
    if SEALED not in ann and _made_by_snap(image, ann, [layers[i] for i in encrypted]):
        raise IntegrityError(f"{image.ref} is a snapshot snap encrypted, but its {SEALED} annotation is gone "
                             "(tampered): its files' parts and paths cannot be known")
    sealed = _unseal(ann.get(SEALED), private_keys)
    diff_ids = image.config.get("rootfs", {}).get("diff_ids", [])
    opened: dict[str, tuple[str, Opened, bool]] = {}
    for i in encrypted:
        d = layers[i]
        key = layer.open_layer(annotations_of(d, f"layer {i + 1} of {image.ref}"), private_keys)
        plain_type = layer.plain_media_type(d["mediaType"])
        # skopeo records the digest of the blob it read, not of the one it encrypted when it
        # compressed on the way (a tar pushed as tar+gzip): that digest names no decrypted byte, and
        # the layer is known by its encrypted blob's, checked by its HMAC and its diff_id alone.
        exact = bool(DIGEST.fullmatch(key.plain_digest)) and (
            (i < len(diff_ids) and key.plain_digest == diff_ids[i]) == (plain_type == LAYER_TAR))
        digest = key.plain_digest if exact else d["digest"]
        # Hashed again only where the download's digest is the one check of the tar (an uncompressed
        # layer is kept split, never read again: download.py); any other tar is checked against its
        # diff_id as it is applied, and a second hash of its blob costs a restore ~10% more CPU.
        # A digest two layers name (a hostile image's compressed layer claiming a tar's) keeps the
        # layer whose bytes are hashed against it: whichever blob is read for it is then checked.
        if not (digest in opened and opened[digest][2]):
            opened[digest] = (d["digest"], key, exact and plain_type == LAYER_TAR)
        clear = {k: v for k, v in d.get("annotations", {}).items()
                 if not k.startswith(layer.ENC_PREFIX) and k not in LAYER_CLEAR}
        layers[i] = descriptor(plain_type, digest, d.get("size"), clear)
    for i, hidden in sealed["layers"].items():
        if i.isdigit() and int(i) < len(layers) and isinstance(layers[int(i)], dict):
            layers[int(i)]["annotations"] = {**layers[int(i)].get("annotations", {}), **hidden}
    doc["annotations"] = {**{k: v for k, v in ann.items() if k != SEALED}, **sealed["manifest"]}
    view = Image(image.ref, canonical(doc), image.manifest_digest, image.config_bytes)
    return view, DecryptingRemote(remote, opened)


def _made_by_snap(image: Image, ann: dict, encrypted: list[dict]) -> bool:
    """Whether an encrypted image is one snap encrypted, which always seals its annotations (SEALED):
    its recipients' fingerprint on the manifest or a layer, or its layers' name in the config's
    history. (skopeo's images have none of these, nor a seal.)"""
    history = image.config.get("history") if isinstance(image.config.get("history"), list) else []
    label = f"snap commit: {ENCRYPTED_LABEL} layer"
    return (RECIPIENTS in ann or any(RECIPIENTS in annotations_of(d, "a layer") for d in encrypted)
            or any(isinstance(h, dict) and h.get("created_by") == label for h in history))


def _unseal(value: Optional[str], private_keys: list[PrivateKey]) -> dict:
    """snap's sealed annotations ({"manifest": {...}, "layers": {index: {...}}}); empty ones for an
    image without (skopeo's)."""
    if value is None:
        return {"manifest": {}, "layers": {}}
    from snapshotter.crypt import jwe

    try:
        payload = jwe.decrypt(binascii.a2b_base64(value.encode()), private_keys)
        doc = jsontext.loads(payload)
    except (binascii.Error, ValueError):
        raise IntegrityError(f"the image's {SEALED} annotation is malformed") from None
    except IntegrityError as e:  # jwe's words are a layer's: this JWE is the manifest's
        raise IntegrityError(f"the image's {SEALED} annotation is malformed or tampered ({e})") from None
    layers = doc.get("layers") if isinstance(doc, dict) else None
    maps = [doc.get("manifest"), *layers.values()] if isinstance(layers, dict) else [None]
    if not all(isinstance(m, dict) and all(isinstance(v, str) for v in m.values()) for m in maps):
        raise IntegrityError(f"the image's {SEALED} annotation is malformed")
    return doc
