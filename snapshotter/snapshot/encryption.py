"""Encrypted snapshots (docs/encryption.md): commit's side of crypt/'s ocicrypt core. Each of snap's
layers is pushed encrypted (`+encrypted`, ocicrypt's annotations and cipher) to the recipients' public
keys; snap's own annotations that name paths are sealed into one JWE on the manifest (SEALED); the
blobs snap pushes beside the layers (headers, base index, any other side blob) are not pushed at all
(side_blobs). What stays clear: the config (the base's, with diff_ids), the base's layers, sizes.

Dedup: an unchanged layer keeps its encrypted blob. The state dir maps each plain blob to the
encrypted descriptor pushed for it (per set of recipients: encryption_state.py, 0600, wrapped keys only);
a new state dir reuses the target tag's snapshot's descriptor of the same diff_id and recipients;
with a secret (`--encrypt-secret`) the layer key is derived (crypt/layer.py's derived_key), so the
same layer is the same blob on any box that has the secret."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from snapshotter import jsontext
from snapshotter.errors import IntegrityError, SnapError, UsageError
from snapshotter.oci.image import (BASE_DIGEST, BASE_NAME, CREATED, SNAP_BASE_LAYERS, SNAP_HEADERS, SNAP_MAX_LAYER,
                                   SNAP_PROFILE, Layer, NewImage, annotations_of)
from snapshotter.registry.blobsources import BlobSources, in_registry
from snapshotter.registry.remote import Remote
from snapshotter.registry.upload import DigestFirst
from snapshotter.state import replace_file

from .encryption_state import VERSION, merged, read_state, state_path, well_formed

if TYPE_CHECKING:  # crypt/ (and the cryptography package) is imported where a key is used: a clear
    from snapshotter.crypt.keys import PublicKey  # commit or restore does not pay for it

ENCRYPT_TO_ENV = "SNAP_ENCRYPT_TO"  # public key files, separated by os.pathsep: as --encrypt-to
ENCRYPT_SECRET_ENV = "SNAP_ENCRYPT_SECRET"  # a secret file: as --encrypt-secret
SEALED = "dev.snap.sealed"  # manifest annotation: base64 JWE of snap's annotations that name paths
RECIPIENTS = "dev.snap.recipients"  # manifest and layer annotation: which set of keys (see recipients_id)
# Layer annotation: which layer key made the blob (key_id): a blob is reused only under the same one.
KEY_ID = "dev.snap.key-id"
RANDOM_KEY_ID = "random"  # a random key per blob: no secret to rotate
LAYER_CLEAR = frozenset({RECIPIENTS, KEY_ID})  # snap's layer annotations left clear (none names a path)
KEY_ID_INFO = b"snap layer key id v1"
# Manifest annotations left clear: none names a path; commit and restore read them before any key.
CLEAR = frozenset({BASE_NAME, BASE_DIGEST, CREATED, SNAP_BASE_LAYERS, SNAP_PROFILE, SNAP_MAX_LAYER, RECIPIENTS})
ENCRYPTED_LABEL = "encrypted"  # each snap layer's name in the config's history: its real name is sealed
CHECK_BLOCK = 1 << 20  # plain bytes checked at once when a stream is read a second time (SealingWriter)


def jwe_path(value: str) -> str:
    """A recipient as skopeo names one (`jwe:FILE`) or a plain FILE."""
    return value[4:] if value.startswith("jwe:") else value


def setting_paths(name: str) -> list[str]:
    """The files an environment setting names (os.pathsep between them). A key's own text there is
    refused without a word of it: the setting names files, never holds keys (crypt/keys.py's
    messages then name the setting, never its value: "$NAME" as their origin)."""
    value = os.environ.get(name, "").strip()
    if "-----BEGIN" in value or "\n" in value:
        raise UsageError(f"${name} holds a key, not a file name: put the key in a file and name that file",
                         f"unset {name} now: an environment value is visible to other processes of yours")
    return [p for p in value.split(os.pathsep) if p]


def recipients_id(recipients: list[PublicKey]) -> str:
    """The sha256 of the recipients' public keys (DER, sorted): equal for the same set of keys, in
    any order. Public, as the keys are: it tells a later commit whether a layer is for the same keys."""
    from cryptography.hazmat.primitives import serialization

    ders = sorted(k.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
                  for k in recipients)
    return "sha256:" + hashlib.sha256(b"".join(hashlib.sha256(d).digest() for d in ders)).hexdigest()


@dataclass
class Encryption:
    """A commit's encryption: recipients, optional derivation secret, and what the state dir and the
    target's last snapshot say was pushed encrypted for them ({plain blob digest: descriptor})."""

    recipients: list[PublicKey]
    secret: Optional[bytes] = field(default=None, repr=False)
    known: dict[str, dict] = field(default_factory=dict)
    previous: dict[tuple[str, str], dict] = field(default_factory=dict)  # (diff_id, media type): descriptor
    # The last seal made, by the sha256 of what it sealed: a commit of an unchanged box seals the same
    # JWE again, so its manifest is the tag's (push.py's _as_tagged) and nothing is pushed.
    sealed: dict[str, str] = field(default_factory=dict)
    used: set[str] = field(default_factory=set)  # the plain blobs this commit looked up or pushed
    made: set[str] = field(default_factory=set)  # the plain blobs this commit encrypted (may_hold)
    unsealed: Optional[dict] = None  # what the last seal sealed (SEALED's payload)
    # Those of the last snapshots pushed from here, by manifest digest: kept_seal
    snapshots: dict[str, dict] = field(default_factory=dict)
    loaded: bool = False
    # The layers' threads look up and note at once while others read: known, used and made are
    # replaced whole under this lock, never changed in place, so a reader walks one whole version.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _seen: dict[str, dict] = field(default_factory=dict, repr=False)  # the file's layers when last read or written

    @functools.cached_property
    def id(self) -> str:
        return recipients_id(self.recipients)

    def key_id(self, diff_id: str, plain_digest: str) -> str:
        """Which key this commit makes for a layer: an HMAC under the secret of what the key is derived
        from (equal only for the same secret and the same blob, which equal blobs reveal already; no
        id relates two different layers), or RANDOM_KEY_ID. A rotated secret reuses no old blob."""
        if self.secret is None:
            return RANDOM_KEY_ID
        what = KEY_ID_INFO + f" {diff_id} {plain_digest}".encode()
        return "hmac-sha256:" + hmac.new(self.secret, what, hashlib.sha256).hexdigest()

    def _load(self) -> None:
        """Read the state file once. Under the lock: one thread that noted a new blob must not see
        the file's older entry put over it."""
        with self._lock:
            if not self.loaded:
                doc = read_state(self.id)
                self._seen = doc.get("layers", {})
                self.known = {**self._seen, **self.known}
                self.sealed.update(doc.get("sealed", {}))
                self.snapshots.update(doc.get("snapshots", {}))
                self.loaded = True

    def save(self, manifest_digest: Optional[str] = None, tag: Optional[str] = None) -> None:
        """Keep what this commit used (the mapping holds descriptors and wrapped keys, no key): as the
        stat cache, the layers gone from the box fall out, and a watcher's file does not grow forever.
        And what the snapshot pushed (`manifest_digest`, to `tag`) sealed: the next commit reads its
        files' layers there (snapshot/files.py), as it holds no private key to unseal them. Called under
        the state dir's lock (commit_box, the watcher's snapshots): the file is read again and what
        other processes saved since this one read it is kept (encryption_state.merged)."""
        self._load()
        pushed = (manifest_digest, tag, self.unsealed) if manifest_digest and self.unsealed is not None else None
        with self._lock:
            doc = merged(read_state(self.id), self._seen, self.known, self.used, self.snapshots, self.sealed, pushed)
            self.known, self.used, self.made, self._seen = dict(doc["layers"]), set(), set(), doc["layers"]
            self.sealed, self.snapshots = dict(doc["sealed"]), dict(doc["snapshots"])
        replace_file(state_path(self.id), lambda f: json.dump({"version": VERSION, **doc}, f))  # 0600

    def lookup(self, plain_digest: str, diff_id: str, media_type: str) -> Optional[dict]:
        """The encrypted descriptor already pushed for this plain blob (or, from the target's last
        snapshot, for a blob of the same tar and compression), if any, made with this commit's kind
        of key (key_id): after a new secret, every layer is encrypted again."""
        from snapshotter.crypt import layer

        self._load()
        found = self.known.get(plain_digest)
        if not self._same_key(found, diff_id, plain_digest):
            plain = media_type in layer.PLAIN_TYPES
            found = self.previous.get((diff_id, layer.encrypted_media_type(media_type))) if plain else None
            if not self._same_key(found, diff_id, plain_digest):
                return None
        self._remember(plain_digest, found, made=False)
        return found

    def may_hold(self, size: int) -> bool:
        """Whether an encrypted blob the state dir or the tag's snapshot has could be that of a plain
        blob of `size` bytes (CTR keeps the length): only such a layer is measured before it is sent.
        Not one this commit made (the parts of one big file are all of one size, and no two layers of
        one snapshot are one blob)."""
        self._load()
        with self._lock:
            known, made = self.known, self.made  # whole versions (_remember): other threads note meanwhile
        earlier = [d for k, d in known.items() if k not in made]
        return any(d.get("size") == size for d in (*earlier, *self.previous.values()))

    def _same_key(self, desc: Optional[dict], diff_id: str, plain_digest: str) -> bool:
        return desc is not None and desc["annotations"].get(KEY_ID) == self.key_id(diff_id, plain_digest)

    def layer_key(self, diff_id: str, plain_digest: str):
        """A layer's key: derived from the secret (the same layer, the same blob), else random."""
        from snapshotter.crypt import layer

        return layer.derived_key(self.secret, diff_id, plain_digest) if self.secret else layer.random_key()

    def encrypt_in_place(self, path: str, plain_digest: str, diff_id: str, media_type: str) -> dict:
        """Encrypt the blob file at `path` over itself (CTR keeps its length: no second copy on a full
        disk) and return its descriptor, noted for this plain blob."""
        with open(path, "rb") as src, open(path, "r+b") as dst:  # each chunk written where it was read
            writer = SealingWriter(dst, self.layer_key(diff_id, plain_digest), hash_plain=False)  # hashed as built
            while chunk := src.read(1 << 20):
                writer.write(chunk)
        return self.descriptor_of(writer, plain_digest, diff_id, media_type)

    def upload_sealing(self, remote: Remote, write_plain: Callable[[SealingWriter], None], media_type: str,
                       size: int, progress=None, *, plain_digest: Optional[str] = None,
                       diff_id: Optional[str] = None, settled: Callable[[], bool] = lambda: True) -> tuple[str, dict]:
        """Upload a layer encrypted as `write_plain` writes its plain bytes: one pass under a random key,
        the encrypted blob's digest known at its end (registry/upload.py), where a derived key's blob
        (which may be in the registry) needs its digest first. One attempt: a registry that takes no
        chunked uploads, or a failed attempt (which cannot resume: its key is gone with it, and a key
        stream must never cover other bytes) is DigestFirst, for the caller to count the layer first.
        The plain bytes must be `plain_digest`'s (as measured) or, for a layer read only now (None:
        stored as is, its diff_id the same), whatever they hash to once `settled()` says its files held
        still; else IntegrityError before the PUT (never committed). (plain digest, descriptor)."""
        if self.secret is not None:
            raise ValueError("a derived key's layer is encrypted and counted before it is sent")
        writers: list[SealingWriter] = []

        def produce(out) -> None:
            writers[:] = [SealingWriter(out, self.layer_key(diff_id or "", plain_digest or ""))]
            write_plain(writers[0])

        def digest() -> str:
            got = writers[0].plain_digest
            if got != (plain_digest or got) or not settled():
                raise IntegrityError(f"layer {plain_digest or got} changed while it was encrypted and sent")
            return writers[0].encryptor.digest

        remote.upload_from(produce, digest, size, progress, what="layers")
        got = writers[0].plain_digest
        return got, self.descriptor_of(writers[0], got, diff_id or got, media_type)

    def descriptor_of(self, writer: SealingWriter, plain_digest: str, diff_id: str, media_type: str) -> dict:
        """The descriptor of the blob `writer` encrypted (`plain_digest`'s), noted for that plain blob."""
        from snapshotter.crypt import layer

        writer.end_block()
        done = writer.encryptor.finish(self.recipients, plain_digest)
        desc = {"mediaType": layer.encrypted_media_type(media_type), "digest": done.digest, "size": done.size,
                "annotations": {**done.annotations, RECIPIENTS: self.id,
                                KEY_ID: self.key_id(diff_id, plain_digest)}}
        self.note(plain_digest, desc)
        return desc

    def note(self, plain_digest: str, desc: dict) -> None:
        self._load()
        self._remember(plain_digest, desc, made=True)

    def _remember(self, plain_digest: str, desc: dict, made: bool) -> None:
        """`plain_digest`'s blob used by this commit (`made`: encrypted by it): known, used and made
        replaced by new versions (copy on write, a few hundred rows), as may_hold and save read them."""
        with self._lock:
            if self.known.get(plain_digest) is not desc:
                self.known = {**self.known, plain_digest: desc}
            self.used = self.used | {plain_digest}
            if made:
                self.made = self.made | {plain_digest}

    def learn_previous(self, remote: Remote, manifest: Optional[bytes]) -> None:
        """The encrypted layers of the target tag's snapshot made for these recipients, by diff_id (its
        config is clear): a commit from a new state dir reuses them instead of pushing new blobs."""
        try:
            doc = jsontext.loads(manifest) if manifest else None
            if not isinstance(doc, dict) or annotations_of(doc, "the tag's snapshot").get(RECIPIENTS) != self.id:
                return
            config = jsontext.loads(remote.fetch_bytes(doc["config"]["digest"], doc["config"]["size"]))
            for desc, diff_id in zip(doc["layers"], config["rootfs"]["diff_ids"]):
                if well_formed(desc) and annotations_of(desc, "a layer").get(RECIPIENTS) == self.id:
                    self.previous[(diff_id, desc["mediaType"])] = desc
        except (SnapError, ValueError, KeyError, TypeError):
            return  # an optimisation only: the layers are encrypted and pushed afresh

    def carry(self, remote: Remote, kept: Layer, sources: BlobSources) -> Optional[Layer]:
        """A layer of the last snapshot carried into this one (a file being written keeps that
        version): as it is if encrypted for these recipients; a clear one (the last snapshot was
        clear) encrypted for them, read back from the registry, its digest checked; None for one
        encrypted for other keys (it cannot be opened here: the caller leaves the file out)."""
        from snapshotter.crypt import layer

        if layer.is_encrypted(kept.media_type):
            return kept if kept.annotations.get(RECIPIENTS) == self.id else None
        if kept.media_type not in layer.PLAIN_TYPES:
            return None
        desc = self.lookup(kept.digest, kept.diff_id, kept.media_type)
        if desc is None or not in_registry(remote, desc["digest"], sources):
            desc = self._encrypt_from_registry(remote, kept, sources)
        # its headers blob is a side blob: an encrypted snapshot names none (side_blobs)
        ann = {k: v for k, v in kept.annotations.items() if k != SNAP_HEADERS}
        return Layer(kept.index, {**desc, "annotations": {**desc["annotations"], **ann}}, kept.diff_id)

    def _encrypt_from_registry(self, remote: Remote, kept: Layer, sources: BlobSources) -> dict:
        """A clear blob of the registry encrypted as it streams (no copy on the box's disk): once, under
        a random key (upload_sealing checks its plain digest); a derived key's (or where the registry
        takes no chunked upload) twice under one key, to learn the encrypted blob's digest, then as it
        is sent. The download checks the plain digest."""
        if self.secret is None:
            try:
                return self.upload_sealing(remote, lambda out: _copy_blob(remote, kept, out), kept.media_type,
                                           kept.size, plain_digest=kept.digest, diff_id=kept.diff_id)[1]
            except DigestFirst:
                pass
        key = self.layer_key(kept.diff_id, kept.digest)

        def stream(writer: SealingWriter) -> SealingWriter:
            for chunk in remote.iter_blob(kept.digest, size=kept.size):
                writer.write(chunk)
            return writer

        counted = stream(SealingWriter(None, key, hash_plain=False, record=True))
        desc = self.descriptor_of(counted, kept.digest, kept.diff_id, kept.media_type)
        if not in_registry(remote, desc["digest"], sources):
            remote.upload_from(lambda out: stream(SealingWriter(out, key, hash_plain=False, expect=counted)),
                               desc["digest"], desc["size"], what="layers")
        return desc

    def seal(self, image: NewImage) -> None:
        """Move every annotation of snap's that is not CLEAR (paths: a layer's file, its parts, the
        secrets left out, the deletions...) into one JWE on the manifest, for the recipients alone;
        each snap layer's history name becomes ENCRYPTED_LABEL. Restore unseals it (decryption.py)."""
        from snapshotter.crypt import jwe, layer

        sealed: dict = {"manifest": {}, "layers": {}}
        for k in [k for k in image.annotations if k not in CLEAR]:
            sealed["manifest"][k] = image.annotations.pop(k)
        for lay in image.layers:
            ann = lay.descriptor.get("annotations", {})
            hidden = {k: ann.pop(k) for k in [k for k in ann if not k.startswith(layer.ENC_PREFIX)
                                               and k not in LAYER_CLEAR]}
            if hidden:
                sealed["layers"][str(lay.index)] = hidden
        image.labels = [ENCRYPTED_LABEL] * len(image.labels)
        image.annotations[RECIPIENTS] = self.id
        payload = json.dumps(sealed, sort_keys=True).encode()
        self.unsealed = sealed
        self._load()
        fingerprint = hashlib.sha256(payload).hexdigest()
        value = self.sealed.get(fingerprint) or layer.b64(jwe.encrypt(payload, self.recipients))
        self.sealed = {fingerprint: value}
        image.annotations[SEALED] = value


class SealingWriter:
    """A layer blob's plain bytes in, encrypted on to `out` (None: only counted), the plain bytes
    hashed (`hash_plain`): for a layer streamed from the box, which may have changed since it was measured.

    A stream read twice under one key (measured layers, carried ones: the digest must be known before
    the upload) must never put that key stream over other bytes: whoever sees both ciphertexts (the
    registry sees a refused upload too) would read their XOR. So the first pass records the sha256 of
    each CHECK_BLOCK of plain bytes (`record`), and the second (`expect`: the first's writer) holds
    each block until it hashes as recorded: from the first that does not, zeros go out in clear, the
    key stream never used, and the registry refuses the blob as it would any changed one."""

    def __init__(self, out, key, hash_plain: bool = True, record: bool = False,
                 expect: Optional[SealingWriter] = None):
        from snapshotter.crypt import layer

        self.out, self.encryptor = out, layer.LayerEncryptor(key)
        # a checked stream's bytes are checked block by block (and by the registry): no whole hash
        self._plain = hashlib.sha256() if hash_plain and expect is None else None
        self._blocked = record or expect is not None
        self.blocks: list[bytes] = []  # with record: each block's sha256
        self._block, self._filled, self._total = hashlib.sha256(), 0, 0
        self._expect, self._held, self.diverged = expect, [], False

    def write(self, data) -> int:
        if self._plain is not None:
            self._plain.update(data)
        if not self._blocked:
            self._seal(data)
            return len(data)
        view = memoryview(data)
        while view:
            take, view = view[:CHECK_BLOCK - self._filled], view[CHECK_BLOCK - self._filled:]
            self._block.update(take)
            self._filled, self._total = self._filled + len(take), self._total + len(take)
            if self._expect is None:
                self._seal(take)
            else:
                self._held.append(bytes(take))
            if self._filled == CHECK_BLOCK or (self._expect is not None and self._total == self._expect.encryptor.size):
                self.end_block()
        return len(data)

    def _seal(self, data) -> None:
        sealed = self.encryptor.update(data)
        if self.out is not None:
            self.out.write(sealed)

    def end_block(self) -> None:
        """The block so far ends (each CHECK_BLOCK; the last one when the bytes end): its hash is
        recorded, or checked and its bytes sent."""
        if not (self._blocked and self._filled):
            return
        self.blocks.append(self._block.digest())
        if self._expect is not None:
            at = len(self.blocks) - 1
            expected = self._expect.blocks[at] if at < len(self._expect.blocks) else None
            self.diverged = self.diverged or expected != self.blocks[-1]
            for piece in self._held:
                if self.diverged:
                    self.out.write(bytes(len(piece)))
                else:
                    self._seal(piece)
        self._block, self._filled, self._held = hashlib.sha256(), 0, []

    @property
    def plain_digest(self) -> str:
        return "sha256:" + self._plain.hexdigest()


def _copy_blob(remote: Remote, kept: Layer, out) -> None:
    """A blob of the registry written to `out` as it downloads, unhashed: upload_sealing checks it."""
    for chunk in remote.iter_blob_unhashed(kept.digest, size=kept.size):
        out.write(chunk)


def with_sealed(layers: list[Layer], sealed: dict) -> list[Layer]:
    """`layers` with the annotations `sealed` (a seal's payload) holds of them put back."""
    hidden = sealed.get("layers", {})
    return [Layer(lay.index, {**lay.descriptor, "annotations": {**lay.annotations, **hidden[str(lay.index)]}},
                  lay.diff_id) if str(lay.index) in hidden else lay for lay in layers]


def load_encryption(encrypt_to: list[str], secret_file: Optional[str],
                    log: Callable[[str], None]) -> Optional[Encryption]:
    """The Encryption of `--encrypt-to` (else $SNAP_ENCRYPT_TO) and `--encrypt-secret` (else
    $SNAP_ENCRYPT_SECRET); None when neither names a recipient. Bad keys: one line, exit 2."""
    to_origin, secret_origin = ("--encrypt-to" if encrypt_to else f"${ENCRYPT_TO_ENV}",
                                "--encrypt-secret" if secret_file else f"${ENCRYPT_SECRET_ENV}")
    paths = [jwe_path(p) for p in (encrypt_to or setting_paths(ENCRYPT_TO_ENV))]
    secret_file = secret_file or next(iter(setting_paths(ENCRYPT_SECRET_ENV)), None)
    if not paths:
        if secret_file:
            raise UsageError("--encrypt-secret needs --encrypt-to", "name the public key(s) to encrypt to")
        return None
    from snapshotter.crypt import keys  # here: a clear commit does not import the cryptography package

    recipients = [keys.load_public_key(p, to_origin) for p in paths]
    secret = None
    if secret_file:
        secret, warnings = keys.load_secret(secret_file, secret_origin)
        for w in warnings:
            log(w)
    return Encryption(recipients, secret)


def side_blobs(encryption: Optional[Encryption]) -> bool:
    """Whether a commit pushes the blobs it names beside its layers (each layer's headers, the base's
    index, weight references): they hold paths and sizes in clear, so an encrypted snapshot pushes
    none (a restore then downloads what it would have skipped; a new machine reads the base's layers)."""
    return encryption is None
