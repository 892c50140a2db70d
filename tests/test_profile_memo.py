"""Parsed profiles kept in the state dir (profile.py): a command whose profile was parsed before
takes its document from there and does not import PyYAML; what it gets is what PyYAML gives for
the text it reads now (an edit, a damaged file, a dir that is not snap's: parsed again)."""

import json
import os
import subprocess
import sys

import pytest

# One process per load: PyYAML imported or not, and the state dir's checks, are per process.
LOAD = r"""
import json, sys
from snapshotter.profile import load_profile
from snapshotter.snapshot.kept import _profile_rules
p = load_profile(sys.argv[1])
print(json.dumps({"rules": _profile_rules(p), "yaml": "yaml" in sys.modules}))
"""

PROFILE = """name: mine
exclude: ["/scratch/**"]
layers:
  - name: models
    paths: ["/models/**"]
    min_size: 1MiB
"""


def load(state: str, profile: str = "default") -> dict:
    env = dict(os.environ, SNAP_STATE_DIR=state)
    r = subprocess.run([sys.executable, "-c", LOAD, profile], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def state(tmp_path):
    """A state dir snap made (marked as its own)."""
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    (d / ".snap-state-dir").touch(mode=0o600)
    return str(d)


def test_a_profile_parsed_before_is_read_without_pyyaml(state, tmp_path):
    prof = tmp_path / "mine.yaml"
    prof.write_text(PROFILE)
    for name in ("default", str(prof)):
        first, again = load(state, name), load(state, name)
        assert first["yaml"] and not again["yaml"]
        assert again["rules"] == first["rules"]
    assert load(state, str(prof))["rules"][2] == ["/scratch/**"]  # `exclude` as the file says


def test_an_edited_profile_is_parsed_again(state, tmp_path):
    prof = tmp_path / "mine.yaml"
    prof.write_text(PROFILE)
    load(state, str(prof))
    prof.write_text(PROFILE.replace("/scratch/**", "/tmp/**"))
    edited = load(state, str(prof))
    assert edited["yaml"] and edited["rules"][2] == ["/tmp/**"]


@pytest.mark.parametrize("damage", ["cut", "flip", "garbage"])
def test_a_damaged_memo_is_parsed_again_and_written_whole(state, damage):
    want = load(state, "default")["rules"]
    path = os.path.join(state, "parsed-profiles")
    data = open(path, "rb").read()
    bad = {"cut": data[:-7], "flip": data[:-1] + bytes([data[-1] ^ 1]), "garbage": b"x" * 200}[damage]
    open(path, "wb").write(bad)
    got = load(state, "default")
    assert got["yaml"] and got["rules"] == want
    assert not load(state, "default")["yaml"]  # written whole again


def test_no_state_dir_is_made_or_claimed_for_a_parsed_profile(tmp_path):
    state = tmp_path / "none-yet"
    assert load(str(state), "default")["yaml"]
    assert not state.exists()
    # One that exists but is not marked as snap's yet: not claimed, tightened or written to.
    state.mkdir(mode=0o755)
    state.chmod(0o755)
    for _ in range(2):
        assert load(str(state), "default")["yaml"]
    assert os.listdir(state) == [] and state.stat().st_mode & 0o777 == 0o755


def test_a_memo_in_a_state_dir_that_is_not_snaps_is_not_read(state, tmp_path):
    """A profile decides what is captured: a memo planted where the state dir is a symlink (refused
    by state.py) must not be used."""
    load(state, "default")
    link = tmp_path / "link"
    link.symlink_to(state)
    planted = os.path.join(state, "parsed-profiles")
    before = os.path.getsize(planted)
    # The planted memo is the real one: a state dir taken through a symlink still parses the text.
    assert load(str(link), "default")["yaml"]
    assert os.path.getsize(planted) == before
