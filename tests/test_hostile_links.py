"""A restore onto a live root cannot plant links to what the image does not hold: a hardlink may only
name a file this restore wrote (its layers in order; for a resumed restore, those of its earlier
runs too, as its journal says), never one already on the box (its /root/.ssh/id_rsa, which the next
commit would push under the link's name). Part files joined at restore keep their other names. A
`.snap-staging-*` name that is a symlink, or a directory this restore did not make, is never
written through."""

from __future__ import annotations

import json
import os

import pytest

from snapshotter.errors import IntegrityError
from snapshotter.layer.staging import STAGING_PREFIX, StagingDirs
from snapshotter.restore.applier import ExtractWorker
from snapshotter.restore.restore import RestoreOptions, restore_image

from support.images import part_ann, push, push_annotated, repo_for
from support.registry import digest_of
from support.tars import member, tar_bytes
from support.trees import snapshot_of_tree

KEY = b"-----BEGIN OPENSSH PRIVATE KEY-----\nthe box's own\n"


def plant_key(root) -> None:
    (root / "root/.ssh").mkdir(parents=True)
    (root / "root/.ssh/id_rsa").write_bytes(KEY)
    os.chmod(root / "root/.ssh/id_rsa", 0o600)


# ---- hardlinks name only what the image wrote ---------------------------------------------------------

def test_a_hardlink_to_a_file_already_in_the_root_is_refused(registry, jail, request):
    plant_key(jail.root)
    before = snapshot_of_tree(str(jail.root), exact=True)  # type, mode, link count, owner, mtime, content of each path
    ref = push(registry, request,
               tar_bytes(member("data/", "dir"), member("data/k", "hardlink", linkname="root/.ssh/id_rsa")))
    line = jail.refused(jail.restore(ref))
    assert "'root/.ssh/id_rsa'" in line and "the image did not write" in line, line
    assert os.lstat(jail.root / "root/.ssh/id_rsa").st_nlink == 1, "a second name for the box's key"
    after = snapshot_of_tree(str(jail.root), exact=True)
    assert {k: v for k, v in after.items() if k != "data"} == before  # only the layer's own directory came
    assert os.listdir(jail.root / "data") == []


def test_a_hardlink_to_a_file_an_earlier_layer_wrote_is_made(registry, jail, request):
    """A base image's layers may link to files of its lower layers: the image wrote them."""
    plant_key(jail.root)
    ref = push(registry, request,
               tar_bytes(member("usr/", "dir"), member("usr/bin/", "dir"), member("usr/bin/python3.11", data=b"py\n")),
               tar_bytes(member("usr/bin/python3", "hardlink", linkname="usr/bin/python3.11")),
               tar_bytes(member("root/.ssh/id_rsa", data=b"the image's key\n"),
                         member("root/.ssh/copy", "hardlink", linkname="root/.ssh/id_rsa")))
    jail.ok(jail.restore(ref))
    assert os.lstat(jail.root / "usr/bin/python3").st_ino == os.lstat(jail.root / "usr/bin/python3.11").st_ino
    # A file the image wrote over one of the box's may be linked: it is the image's now.
    assert (jail.root / "root/.ssh/copy").read_bytes() == b"the image's key\n"


class Interrupted(Exception):
    """Stands for a kill of the restore after its first layer."""


def test_a_resumed_restore_links_to_what_its_earlier_run_wrote_but_not_to_the_box(registry, jail, request,
                                                                                 monkeypatch):
    plant_key(jail.root)
    ref = push(registry, request,
               tar_bytes(member("app/", "dir"), member("app/lib.so", data=b"lib\n")),
               tar_bytes(member("app/lib.so.1", "hardlink", linkname="app/lib.so")))
    apply = ExtractWorker.apply

    def interrupting(self, job, on_bytes):
        if job.label == "base layer 2":
            raise Interrupted()
        return apply(self, job, on_bytes)

    monkeypatch.setattr(ExtractWorker, "apply", interrupting)
    with pytest.raises(Interrupted):
        restore_image(ref, str(jail.root), RestoreOptions(seed_stat_cache=False))
    monkeypatch.setattr(ExtractWorker, "apply", apply)
    assert (jail.root / "app/lib.so").exists() and not (jail.root / "app/lib.so.1").exists()

    r = jail.restore(ref, "--json")
    jail.ok(r)
    assert json.loads(r.stdout)["resumed"] == 1
    assert os.lstat(jail.root / "app/lib.so.1").st_ino == os.lstat(jail.root / "app/lib.so").st_ino

    # What the journal lists is only what the image wrote: a resumed run links to nothing else.
    other = push_annotated(registry, repo_for(request) + "-key", [
        (tar_bytes(member("app/", "dir"), member("app/lib.so", data=b"lib\n")), {}),
        (tar_bytes(member("app/id", "hardlink", linkname="root/.ssh/id_rsa")), {}),
    ])
    monkeypatch.setattr(ExtractWorker, "apply", interrupting)
    with pytest.raises(Interrupted):
        restore_image(other, str(jail.root), RestoreOptions(seed_stat_cache=False))
    monkeypatch.setattr(ExtractWorker, "apply", apply)
    line = jail.refused(jail.restore(other))
    assert "the image did not write" in line, line
    assert not os.path.lexists(jail.root / "app/id") and os.lstat(jail.root / "root/.ssh/id_rsa").st_nlink == 1


def test_a_joined_part_file_gets_its_other_names(registry, jail, request):
    part = "m/big.snap-part-{:04d}-of-0002"
    last = dict(part_ann("m/big", "2/2"), **{"dev.snap.part-links": json.dumps(["m/alias", "n/other"])})
    ref = push_annotated(registry, repo_for(request), [
        (tar_bytes(member("m/", "dir"), member("n/", "dir")), {}),
        (tar_bytes(member(part.format(1), data=b"first\n")), part_ann("m/big", "1/2")),
        (tar_bytes(member(part.format(2), data=b"second\n")), last),
    ])
    jail.ok(jail.restore(ref))
    ino = os.lstat(jail.root / "m/big").st_ino
    assert (jail.root / "m/big").read_bytes() == b"first\nsecond\n"
    assert os.lstat(jail.root / "m/alias").st_ino == ino == os.lstat(jail.root / "n/other").st_ino


def test_part_links_to_a_file_no_part_was_joined_into_are_refused(registry, jail, request):
    """Part layers that name the box's key as their file but hold no part of it: nothing is joined,
    and its "other names" are not linked to the key."""
    plant_key(jail.root)

    def ann(part: str) -> dict:
        return dict(part_ann("root/.ssh/id_rsa", part), **{"dev.snap.part-links": json.dumps(["data/k"])})

    ref = push_annotated(registry, repo_for(request), [
        (tar_bytes(member("data/", "dir")), {}),
        (tar_bytes(member("data/a", data=b"a\n")), ann("1/2")),
        (tar_bytes(member("data/b", data=b"b\n")), ann("2/2")),
    ])
    line = jail.refused(jail.restore(ref))
    assert "the image did not write" in line, line
    assert not os.path.lexists(jail.root / "data/k") and os.lstat(jail.root / "root/.ssh/id_rsa").st_nlink == 1


# ---- staging dirs: only this restore's are written through ------------------------------------------

def _staging_name(registry, request) -> str:
    return STAGING_PREFIX + digest_of(registry, repo_for(request), "v1").split(":", 1)[1][:16]


def test_a_planted_staging_symlink_is_not_written_through(registry, jail, request):
    ref = push(registry, request, tar_bytes(member("f", data=b"f\n")))
    jail.root.mkdir()
    planted = jail.root / _staging_name(registry, request)
    planted.symlink_to(jail.outside / "sub")
    r = jail.restore(ref)
    jail.ok(r)  # nothing written outside the root (the sentinel dir's tree and times unchanged)
    assert (jail.root / "f").read_bytes() == b"f\n"
    assert "is a symlink, which this restore did not make: replaced" in r.stderr, r.stderr
    assert not os.path.lexists(planted)


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another uid needs root")
def test_a_planted_staging_dir_of_another_user_is_not_written_through(registry, jail, request):
    """Another user's staging dir, with a symlink where the download's temp file goes: a restore
    running as root would write the blob wherever it points."""
    ref = push(registry, request, tar_bytes(member("f", data=b"f\n")), gzip=True)  # downloaded to BLOB.part
    jail.root.mkdir()
    planted = jail.root / _staging_name(registry, request)
    planted.mkdir(mode=0o700)
    blob = registry.manifest(repo_for(request), "v1")["layers"][0]["digest"].split(":", 1)[1]
    (planted / f"{blob}.part").symlink_to(jail.outside / "secret")
    os.chown(planted, 1000, 1000)
    r = jail.restore(ref)
    jail.ok(r)  # the secret next to the root is untouched
    assert (jail.root / "f").read_bytes() == b"f\n"
    assert "a directory of uid 1000, which this restore did not make: replaced" in r.stderr, r.stderr
    assert not os.path.lexists(planted)


def test_a_path_the_restore_never_writes_is_not_written_through_a_symlink_either(registry, jail, request):
    """The profile's never-written paths (/etc/hostname: the new host's) and the staging dirs are
    kept by where a member lands, not by its name: a layer's symlink to /etc does not reach them."""
    (jail.root / "etc").mkdir(parents=True)
    (jail.root / "etc/hostname").write_bytes(b"this-box\n")
    ref = push(registry, request, tar_bytes(member("e", "symlink", linkname="/etc"),
                                            member("e/hostname", data=b"hostile\n"),
                                            member("e/motd", data=b"hello\n")))
    jail.ok(jail.restore(ref))
    assert (jail.root / "etc/hostname").read_bytes() == b"this-box\n"
    assert (jail.root / "etc/motd").read_bytes() == b"hello\n"  # what the profile lets through still lands


def test_a_staging_dir_is_known_by_its_identity_not_the_owner_a_filesystem_gives_it(tmp_path):
    """NFS squashes root's new directory to nobody, CIFS and FUSE fix its mode: the dir this
    restore made is still its own. A directory or symlink swapped in for it is not."""
    staging = StagingDirs(str(tmp_path), "sha256:" + "ab" * 32)
    path = staging.for_path(None)
    os.chown(path, 65534, 65534)
    os.chmod(path, 0o777)
    staging.check(path)  # the one it made
    os.rename(path, path + ".moved")
    os.symlink(str(tmp_path / "elsewhere"), path)
    with pytest.raises(IntegrityError, match="not the one this restore made"):
        staging.check(path)
    os.unlink(path)
    os.mkdir(path, 0o700)
    with pytest.raises(IntegrityError, match="not the one this restore made"):
        staging.check(path)
