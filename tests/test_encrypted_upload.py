"""An encrypted layer under a random key goes up in one pass, its blob's digest known at its end
(registry/upload.py's deferred digest): read once more than measured, not twice; an attempt that
starts again takes a new key; plain bytes that are not the ones measured are never committed; a
registry that takes no chunked uploads gets the layer counted first. Real registry, FaultProxy."""

import hashlib
import io
import os

import pytest

from snapshotter import CommitOptions, commit_box
from snapshotter.commit.model import CommitHooks
from snapshotter.crypt import layer
from snapshotter.crypt.keys import load_private_key
from snapshotter.errors import IntegrityError
from snapshotter.oci.mediatypes import LAYER_TAR
from snapshotter.profile import load_profile
from snapshotter.registry import upload as upload_mod
from snapshotter.registry.remote import Reference, Remote
from snapshotter.registry.upload import DigestFirst
from snapshotter.snapshot.encryption import load_encryption
from support.registry import blobs_in
from support.run import snap
from support.trees import SMALL_WEIGHTS, rewrite_on_read, snapshot_of_tree, write_tree

MiB = 1 << 20
WEIGHT = "opt/app/models/checkpoints/one-pass.safetensors"
NOT_RESTORED = ("tmp", "proc", "sys", "dev", "run")


def sealing(keys, remote, plain: bytes, digest: str = ""):
    """Encryption.upload_sealing of `plain` (named `digest`, its own by default): the descriptor."""
    enc = load_encryption([str(keys / "rsa.pub")], None, print)
    digest = digest or "sha256:" + hashlib.sha256(plain).hexdigest()
    return enc.upload_sealing(remote, lambda out: out.write(plain), LAYER_TAR, len(plain), plain_digest=digest,
                              diff_id=digest)[1]


def decrypted(keys, desc: dict, blob: bytes) -> bytes:
    key, _ = load_private_key(str(keys / "rsa.pem"))
    out = io.BytesIO()
    layer.decrypt_layer(io.BytesIO(blob), out, layer.open_layer(desc["annotations"], [key]))
    return out.getvalue()


def commit_counting_reads(registry_host, base_ref, box, keys, tmp_path, repo, weight=None, rewrite_at=None,
                          force=False):
    """An encrypted commit of `box` with a 2 MiB weight (a layer stored as is; `weight`: its bytes, else
    random ones; b"": left as it is), the weight rewritten after its read number `rewrite_at`: (its
    reads, result)."""
    if weight != b"":
        write_tree(box, {WEIGHT: weight if weight is not None else os.urandom(2 * MiB)})
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    reads, after_read = rewrite_on_read(box, WEIGHT, rewrite_at)

    opts = CommitOptions(root=box, profile=load_profile(str(prof)), force=force,
                         encryption=load_encryption([str(keys / "rsa.pub")], None, print))
    result = commit_box(f"{registry_host}/{repo}:v1", base_ref, opts, CommitHooks(after_read=after_read))
    return reads, result


def restored_equals_box(registry, repo, box, keys, tmp_path, skip=()):
    root = tmp_path / f"r-{repo}"
    snap("restore", f"{registry.host}/{repo}:v1", "--root", str(root), "--decryption-key", str(keys / "rsa.pem"),
         check=True)
    return snapshot_of_tree(str(root), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED + skip)


def test_a_weight_is_read_once_as_it_is_encrypted_and_sent(registry, base_ref, box, keys, tmp_path):
    """Under a random key no blob of the layer can be in the registry: it is surveyed (headers and
    sizes, unread), then read once as it is encrypted and sent (it was measured first, then read
    again, and before that a third time to learn the encrypted blob's digest); it restores."""
    reads, _ = commit_counting_reads(registry.host, base_ref, box, keys, tmp_path, "onepass")
    assert reads == [WEIGHT]
    assert restored_equals_box(registry, "onepass", box, keys, tmp_path)


def test_a_weight_rewritten_while_read_once_is_held_back_not_pushed(registry, base_ref, box, keys, tmp_path):
    """Rewritten in place while it is read (after its bytes, before its re-stat): the upload is never
    committed, the weight is held back as changed while read, and the rest restores."""
    reads, result = commit_counting_reads(registry.host, base_ref, box, keys, tmp_path, "rewritten", rewrite_at=1)
    assert result.held.get(WEIGHT) == "changed while read", result.held
    assert restored_equals_box(registry, "rewritten", box, keys, tmp_path, skip=(WEIGHT,))


def test_a_weight_of_a_known_size_is_measured_first_and_kept_if_unchanged(registry, base_ref, box, keys, tmp_path,
                                                                           monkeypatch):
    """A blob of the same size is known (the tag's snapshot): the layer may be it, so it is measured
    first. Unchanged, committed from a new state dir (no stat cache): its encrypted blob is kept,
    nothing sent, one read. Rewritten with other bytes of that size: measured, then sent in one pass
    (two reads), and it restores."""
    commit_counting_reads(registry.host, base_ref, box, keys, tmp_path, "known")
    monkeypatch.setenv("SNAP_STATE_DIR", str(tmp_path / "another-state-dir"))
    reads, result = commit_counting_reads(registry.host, base_ref, box, keys, tmp_path, "known", b"", force=True)
    assert reads == [WEIGHT] and not [x for x in result.layers if x.status == "uploaded"]
    assert result.uploaded_bytes < 64 << 10  # a new config and manifest at most (its seal is a new JWE)
    reads, _ = commit_counting_reads(registry.host, base_ref, box, keys, tmp_path, "known")
    assert reads == [WEIGHT, WEIGHT]
    assert restored_equals_box(registry, "known", box, keys, tmp_path)


def test_a_registry_without_chunked_uploads_gets_the_layer_counted_first(registry, proxy, base_ref, box, keys,
                                                                         tmp_path):
    """A monolithic PUT names the digest before its body: the layer is encrypted once to learn it,
    then sent (after a first try in one pass, unless another blob's upload met the refusal first),
    and the snapshot restores."""
    proxy.answer = lambda method, path: (405, {}) if method == "PATCH" else None
    reads, _ = commit_counting_reads(proxy.host, base_ref, box, keys, tmp_path, "nopatch")
    assert reads in ([WEIGHT] * 3, [WEIGHT] * 4)
    assert not [s for m, _, s in proxy.log if m == "PATCH" and s != 405]
    root = tmp_path / "r"
    snap("restore", f"{registry.host}/nopatch:v1", "--root", str(root), "--decryption-key", str(keys / "rsa.pem"),
         check=True)
    assert snapshot_of_tree(str(root), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED)


def test_a_one_pass_upload_cut_mid_way_is_digest_first_and_cancelled(registry, proxy, keys):
    """The link cut mid-way: the one pass cannot resume (its digest is not known to resume by, and
    its bytes again would be under a new key), so it says DigestFirst, the upload is cancelled, and
    the bar goes back to zero; a new one-pass upload uses another key stream over the same bytes."""
    plain = os.urandom(3 * MiB)
    proxy.uploads, proxy.cut_upload_after = {}, MiB
    remote = Remote(Reference.parse(f"{proxy.host}/cut:x"))
    remote.transport.sleep = lambda seconds: None
    with pytest.raises(DigestFirst):
        sealing(keys, remote, plain)
    assert any(m == "DELETE" and "/blobs/uploads/" in p for m, p, _ in proxy.log)
    desc = sealing(keys, remote, plain)
    first, second = list(proxy.uploads.values())[:2]
    assert len(first) >= 4096 and first[:4096] != second[:4096]  # the same plain bytes, another key stream
    assert decrypted(keys, desc, registry.blob("cut", desc["digest"])) == plain


def test_bytes_that_are_not_the_ones_measured_are_never_committed(registry, keys):
    """The plain bytes written do not hash to the digest measured (a file rewritten since): nothing
    is committed in the registry (the PUT never comes), and the error names the layer."""
    other = os.urandom(MiB)
    before = blobs_in(registry)
    remote = Remote(Reference.parse(f"{registry.host}/changed:x"))
    with pytest.raises(IntegrityError, match="changed while it was encrypted"):
        sealing(keys, remote, other, digest="sha256:" + hashlib.sha256(b"what was measured").hexdigest())
    assert blobs_in(registry) == before


def test_a_one_pass_upload_that_fails_goes_up_counted_and_resumes(registry, proxy, base_ref, box, keys, tmp_path,
                                                                  monkeypatch):
    """The 2nd PATCH of every upload fails (a token that expires, a link that breaks): the one-pass
    upload cannot resume (its key is gone with it), so it is cancelled (DELETE: its bytes freed now)
    and the layer goes up counted first, which resumes where the registry stands; the snapshot
    restores. (Starting the one pass again would meet the same failure every time.)"""
    monkeypatch.setattr(upload_mod, "CHUNK_SIZE", MiB)
    monkeypatch.setenv("SNAP_RETRY_SCALE", "0")
    patches: dict[str, int] = {}

    def answer(method, path):
        if method == "PATCH":
            session = path.split("/blobs/uploads/", 1)[1].split("?", 1)[0]
            patches[session] = patches.get(session, 0) + 1
            return (500, {}) if patches[session] == 2 else None
        return None

    proxy.answer = answer
    reads, _ = commit_counting_reads(proxy.host, base_ref, box, keys, tmp_path, "flaky")
    assert len(reads) >= 3  # measured, the one pass that failed, then counted and sent
    # one one-pass attempt per weight (the box's two: sd15 and this one), cancelled; each is then
    # counted first, not tried in one pass again
    assert len([p for m, p, _ in proxy.log if m == "DELETE" and "/blobs/uploads/" in p]) == 2
    root = tmp_path / "r"
    snap("restore", f"{registry.host}/flaky:v1", "--root", str(root), "--decryption-key", str(keys / "rsa.pem"),
         check=True)
    assert snapshot_of_tree(str(root), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED)


def test_the_parts_of_a_big_file_are_each_read_once(registry, base_ref, box, keys, tmp_path):
    """A file cut into parts (all of one size): no part is measured first because another part of
    this commit has that size (a known blob of it is one the tag or the state dir had before)."""
    write_tree(box, {WEIGHT: os.urandom(8 * MiB)})
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    reads = []
    opts = CommitOptions(root=box, profile=load_profile(str(prof)), max_layer_size=MiB,
                         encryption=load_encryption([str(keys / "rsa.pub")], None, print))
    commit_box(f"{registry.host}/enc-parts:v1", base_ref, opts,
               CommitHooks(after_read=lambda rel, attempt: reads.append(rel) if WEIGHT in rel else None))
    assert len(set(reads)) == 8 and len(reads) == 8  # eight parts, each read once
    assert restored_equals_box(registry, "enc-parts", box, keys, tmp_path)


def test_other_bytes_at_the_registry_of_a_one_pass_upload_go_up_counted(registry, proxy, base_ref, box, keys,
                                                                          tmp_path):
    """The registry saw other bytes than the ones hashed as they were sent (DIGEST_INVALID at the final
    PUT of a one-pass upload: the link, not the box, changed them): the layer goes up counted first,
    the commit does not fail nor hold the weight back, and the snapshot restores."""
    commit_box(f"{proxy.host}/lied:clear", base_ref, CommitOptions(root=box))  # the base's layers copied there
    lied: list[str] = []

    def lie(method, path):
        if method == "PUT" and "/blobs/uploads/" in path and "digest=" in path and not lied:
            lied.append(path)
            return 400, {"Content-Type": "application/json"}, [
                b'{"errors":[{"code":"DIGEST_INVALID","message":"provided digest did not match uploaded content"}]}']
        return None

    proxy.lie = lie
    _, result = commit_counting_reads(proxy.host, base_ref, box, keys, tmp_path, "lied")
    assert lied and not result.held, result.held
    assert restored_equals_box(registry, "lied", box, keys, tmp_path)
