"""Failures of the local machine (state dir, profile file, restore target) are one line, not a traceback."""

from support import assert_one_line_error, snap


def test_state_dir_that_cannot_be_created(registry, base_ref, box, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    r = snap("commit", f"{registry.host}/x:v1", "--base", base_ref, "--root", box,
             env={"SNAP_STATE_DIR": str(blocker / "state")})
    assert_one_line_error(r, 7, str(blocker))


def test_profile_file_that_is_not_text(registry, base_ref, box, tmp_path):
    prof = tmp_path / "binary.yaml"
    prof.write_bytes(b"\xff\xfe\x00layers: []\n")
    r = snap("commit", f"{registry.host}/x:v1", "--base", base_ref, "--root", box, "--profile", str(prof))
    assert_one_line_error(r, 2, "profile")


def test_restore_root_that_cannot_be_created(registry, base_ref, tmp_path):
    r = snap("restore", base_ref, "--root", "/proc/snap-cannot-be-here")
    assert r.returncode in (2, 7), r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("snap: error:")
