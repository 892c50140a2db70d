"""The state file of encrypted snapshots (snapshot/encryption.py, docs/encryption.md): what one snap
process saves there survives another's save (a watcher keeps one Encryption for its life), each tag's
last snapshot keeps its seal, and the layers' threads note blobs while others read the mapping."""

import json
import os
import threading

from support.run import snap
from support.trees import SMALL_WEIGHTS, write_tree
from snapshotter import CommitOptions, commit_box
from snapshotter.commit.model import CommitHooks
from snapshotter.profile import load_profile
from snapshotter.snapshot.encryption import load_encryption
from snapshotter.snapshot.encryption_state import SNAPSHOTS_KEPT, kept_seal

WEIGHT = "opt/app/models/checkpoints/held.safetensors"


def _rewriting(box, path):
    """An after_read hook that changes `path` after each read of it: the commit holds it back."""
    def hook(rel, attempt):
        if rel == path:
            with open(os.path.join(box, path), "r+b") as f:
                f.write(os.urandom(64))
    return hook


def _options(box, keys, tmp_path, encryption=None):
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    return CommitOptions(root=box, profile=load_profile(str(prof)),
                         encryption=encryption or load_encryption([str(keys / "rsa.pub")], None, print))


def test_a_watchers_save_keeps_the_seal_another_commit_saved(registry, base_ref, box, keys, tmp_path):
    """A watcher's Encryption read the state file before a `snap commit` (another process: its own
    Encryption) saved its snapshot's seal; the watcher's next save keeps it. So the next commit to that
    tag reads its last snapshot's files, and a weight torn while read keeps its last version (carried)."""
    watcher = load_encryption([str(keys / "rsa.pub")], None, print)  # loaded once for its life
    write_tree(box, {"opt/app/a.txt": "1"})
    commit_box(f"{registry.host}/enc-state:auto-1", base_ref, _options(box, keys, tmp_path, watcher))
    v1 = os.urandom(2 << 20)
    write_tree(box, {WEIGHT: v1})
    commit_box(f"{registry.host}/enc-state:manual", base_ref, _options(box, keys, tmp_path))
    write_tree(box, {"opt/app/a.txt": "2"})
    commit_box(f"{registry.host}/enc-state:auto-2", base_ref, _options(box, keys, tmp_path, watcher))
    with open(os.path.join(box, WEIGHT), "r+b") as f:
        f.write(os.urandom(1 << 20))
    result = commit_box(f"{registry.host}/enc-state:manual", base_ref, _options(box, keys, tmp_path),
                        CommitHooks(after_read=_rewriting(box, WEIGHT)))
    assert result.carried == [WEIGHT], (result.held, result.carried)
    out = tmp_path / "out"
    snap("restore", f"{registry.host}/enc-state:manual", "--root", str(out), "--decryption-key",
         str(keys / "rsa.pem"), check=True)
    assert (out / WEIGHT).read_bytes() == v1


def test_each_tags_last_snapshot_keeps_its_seal(registry, base_ref, box, keys, tmp_path, state_dir):
    """More than SNAPSHOTS_KEPT snapshots pushed to another tag (a watcher's) leave the seal of the
    user's tag's snapshot in the state dir: the next commit to that tag still reads its files."""
    write_tree(box, {"opt/app/a.txt": "0"})
    manual = commit_box(f"{registry.host}/enc-evict:manual", base_ref, _options(box, keys, tmp_path))
    for n in range(SNAPSHOTS_KEPT + 1):
        write_tree(box, {"opt/app/a.txt": str(n + 1)})
        commit_box(f"{registry.host}/enc-evict:auto", base_ref, _options(box, keys, tmp_path))
    [kept] = (state_dir / "encrypted-layers").iterdir()
    recipients = load_encryption([str(keys / "rsa.pub")], None, print).id
    assert kept_seal(recipients, manual.manifest_digest) is not None
    assert len(json.loads(kept.read_text())["snapshots"]) == SNAPSHOTS_KEPT + 1  # 4 of auto's, manual's


class _NotingSet(set):
    """`made` that, asked of its first member during may_hold's walk over the mapping, has another
    thread note a new blob (as a layer's upload thread does) and waits for it: deterministic."""

    def __init__(self, enc):
        super().__init__()
        self.enc, self.noted = enc, False

    def __contains__(self, item):
        if not self.noted:
            self.noted = True
            other = threading.Thread(target=self.enc.note, args=("sha256:" + "f" * 64, _descriptor(1)))
            other.start()
            other.join(60)
        return super().__contains__(item)


def _descriptor(size: int) -> dict:
    return {"mediaType": "application/vnd.oci.image.layer.v1.tar+encrypted", "digest": "sha256:" + "e" * 64,
            "size": size, "annotations": {}}


def test_may_hold_reads_the_mapping_while_a_thread_notes_a_blob(keys, state_dir):
    """may_hold walks the blobs known while another thread notes one: it reads one whole version of
    the mapping (no `dictionary changed size during iteration`), and the note is kept."""
    enc = load_encryption([str(keys / "rsa.pub")], None, print)
    enc.note("sha256:" + "a" * 64, _descriptor(10))
    enc.note("sha256:" + "b" * 64, _descriptor(20))
    enc.made = noting = _NotingSet(enc)
    assert enc.may_hold(20) is True
    assert noting.noted and "sha256:" + "f" * 64 in enc.known
