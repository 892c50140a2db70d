"""Files that change while a commit reads them, in layers stored as is (weights): the parts of a big
file, and a bundle of small weights, in clear and encrypted commits. The file is held back (its last
version kept, or left out of a first snapshot) and the rest is pushed; the commit never fails for it."""

import os

import pytest

from snapshotter import CommitOptions, commit_box
from snapshotter.commit.model import CommitHooks
from snapshotter.profile import load_profile
from snapshotter.snapshot.encryption import load_encryption
from support.run import snap
from support.trees import SMALL_WEIGHTS, snapshot_of_tree, write_tree

MiB = 1 << 20
NOT_RESTORED = ("tmp", "proc", "sys", "dev", "run")
BIG = "opt/app/models/checkpoints/cut.safetensors"


def commit_and_restore(registry, base_ref, box, tmp_path, repo, after_read, keys=None, **options):
    """Commit `box` (small-weights profile; encrypted to `keys` if given) with the after_read hook,
    then restore it: (the commit's result, the restored root)."""
    prof = tmp_path / "small.yaml"
    prof.write_text(SMALL_WEIGHTS)
    encryption = load_encryption([str(keys / "rsa.pub")], None, print) if keys else None
    opts = CommitOptions(root=box, profile=load_profile(str(prof)), encryption=encryption, **options)
    result = commit_box(f"{registry.host}/{repo}:v1", base_ref, opts, CommitHooks(after_read=after_read))
    root = tmp_path / "restored"
    snap("restore", f"{registry.host}/{repo}:v1", "--root", str(root),
         *(("--decryption-key", str(keys / "rsa.pem")) if keys else ()), check=True)
    return result, root


@pytest.mark.parametrize("encrypted", [False, True], ids=["clear", "encrypted"])
def test_a_big_file_rewritten_while_its_parts_are_read_is_held_back(registry, base_ref, box, keys, tmp_path,
                                                                    encrypted):
    """Rewritten after the first read of one of its parts: every part sees it changed (while read,
    or since the scan), and it is the file that is held back, not its part names (which no hold
    knows: the commit failed, 'files kept changing')."""
    write_tree(box, {BIG: os.urandom(3 * MiB)})
    done = []

    def rewrite_once(rel, attempt):
        if BIG in rel and not done:
            done.append(rel)
            with open(os.path.join(box, BIG), "r+b") as f:
                f.write(b"REWRITTEN")

    result, root = commit_and_restore(registry, base_ref, box, tmp_path, f"cut-{int(encrypted)}", rewrite_once,
                                      keys if encrypted else None, max_layer_size=MiB)
    assert done and set(result.held) == {BIG}, result.held
    assert not (root / BIG).exists()
    assert snapshot_of_tree(str(root), skip=NOT_RESTORED) == snapshot_of_tree(box, skip=NOT_RESTORED + (BIG,))


def test_a_weight_deleted_between_measuring_and_sending_is_held_back(registry, base_ref, box, tmp_path):
    """Two small weights in one bundle stored as is (clear: measured, then read again as sent): the
    second deleted as the first is read for the upload. The bundle is built again without it and
    the commit goes on (it failed: 'changed while it was uploaded')."""
    first, second = "opt/app/models/checkpoints/a.safetensors", "opt/app/models/checkpoints/b.safetensors"
    write_tree(box, {first: os.urandom(200_000), second: os.urandom(200_000)})
    reads = []

    def delete_at_upload(rel, attempt):
        if rel == first:
            reads.append(rel)
            if len(reads) == 2 and os.path.exists(os.path.join(box, second)):
                os.unlink(os.path.join(box, second))

    result, root = commit_and_restore(registry, base_ref, box, tmp_path, "deleted", delete_at_upload)
    assert len(reads) >= 2 and second in result.held, result.held
    assert (root / first).read_bytes() == open(os.path.join(box, first), "rb").read()
    assert not (root / second).exists()
