"""Weights from the origin (snapshotter/origin/): hub caches made by the real huggingface_hub client
(hf_hub_download against tests/support/hub.py, a loopback hub with a CDN on a second loopback address)
are recognised as references, and fetched back into an exact hub cache: verified, resumed with a
Range after kill -9, the token kept from the CDN, redirects only to checked hosts."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

from snapshotter.errors import (
    IntegrityError,
    NotFound,
    OriginAuthError,
    RegistryError,
    RegistryUnreachable,
    StorageError,
    UsageError,
    exit_code_of,
)
from snapshotter.origin.fetch import PART_SUFFIX, Origin, fetch, fetch_all
from snapshotter.origin.hubcache import default_candidates, recognise
from snapshotter.origin.layout import cache_layout, complete_layout
from snapshotter.origin.references import References

from support.hub import HubServer, Repo, hub_download, sha256_hex
from support.run import free_port
from support.trees import flip_byte

pytest.importorskip("huggingface_hub")


def _bytes(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


C_MODEL, C_DATA, C_SPACE, C_GATED = (f"{i:x}" * 40 for i in (10, 11, 12, 13))
TOKEN = "hf_gated_test_token"
BIG = 3 * (1 << 20) + 123  # over three of fetch's 1 MiB chunks: a kill after two leaves a part to resume
REPOS = {
    ("model", "acme/tiny"): Repo(C_MODEL, {"config.json": b'{"hidden": 8}\n', "model.safetensors": _bytes(1, BIG),
                                           "sub/dir/extra.bin": _bytes(2, 5000)}, {"main": C_MODEL}),
    ("dataset", "acme/corpus"): Repo(C_DATA, {"README.md": b"# corpus\n", "data/train.parquet": _bytes(3, 20000)}),
    ("space", "acme/demo"): Repo(C_SPACE, {"app.bin": _bytes(4, 3000)}, {"main": C_SPACE}),
    ("model", "acme/gated"): Repo(C_GATED, {"w.bin": _bytes(5, 4000)}, {"main": C_GATED}, token=TOKEN),
}
# (repo type, repo id, revision asked, file, token): the dataset by commit (no refs file), the rest by branch
DOWNLOADS = [("model", "acme/tiny", "main", f, None) for f in ("config.json", "model.safetensors", "sub/dir/extra.bin")]
DOWNLOADS += [("dataset", "acme/corpus", C_DATA, f, None) for f in ("README.md", "data/train.parquet")]
DOWNLOADS += [("space", "acme/demo", "main", "app.bin", None), ("model", "acme/gated", "main", "w.bin", TOKEN)]
HF_HOME = "root/.cache/huggingface"
CACHE = f"{HF_HOME}/hub"


@pytest.fixture(scope="module")
def hub():
    with HubServer(REPOS) as server:
        yield server


@pytest.fixture(scope="module")
def box(hub, tmp_path_factory):
    """A box root whose hub cache huggingface_hub made, with the login token file beside it."""
    root = str(tmp_path_factory.mktemp("box"))
    os.makedirs(os.path.join(root, CACHE))
    with open(os.path.join(root, HF_HOME, "token"), "w") as f:
        f.write(TOKEN)
    hub_download(hub.url, os.path.join(root, HF_HOME), DOWNLOADS)
    return root


def copy_box(box: str, dest: str) -> str:
    shutil.copytree(box, dest, symlinks=True)
    return dest


def tree(root: str, top: str) -> dict:
    """Every entry below root/top: a symlink's target, a file's bytes and mode, a folder."""
    found = {}
    for folder, dirs, files in os.walk(os.path.join(root, top)):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                found[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                found[rel] = ("dir",)
            else:
                with open(path, "rb") as f:
                    found[rel] = ("file", f.read(), os.stat(path).st_mode)
    return found


def lfs_files() -> set:
    return {(kind, repo_id, r.commit, path, sha256_hex(data)) for (kind, repo_id), r in REPOS.items()
            for path, data in r.files.items() if len(data) >= 1024}


def test_recognises_what_the_hub_client_cached(box, hub):
    found = recognise(box, default_candidates(box), endpoint=hub.url)
    assert {(r.repo_type, r.repo_id, r.revision, r.path, r.sha256) for r in found.references} == lfs_files()
    for r in found.references:
        link = os.path.join(box, r.link_path)
        assert os.readlink(link) == r.link_target and os.path.getsize(link) == r.size and r.endpoint == hub.url
    left = dict(found.left)
    small = [p for p in left if "models--acme--tiny/blobs/" in p or "datasets--acme--corpus/blobs/" in p]
    assert len(small) == 2 and all("git" in left[p] for p in small)  # config.json, README.md stay in layers
    assert {(r.repo_type, r.repo_id, r.name, r.revision) for r in found.refs} == {
        ("model", "acme/tiny", "main", C_MODEL), ("space", "acme/demo", "main", C_SPACE),
        ("model", "acme/gated", "main", C_GATED)}  # the dataset was asked for by commit: no ref
    assert found.secrets == [f"{HF_HOME}/token"]


def test_a_memo_of_hashed_blobs_is_not_trusted_once_a_blob_is_written(box, hub, tmp_path):
    """A watcher recognises with a memo (blobs hashed with the same stat data are not hashed again):
    a blob written since, even to its old size and mtime, is hashed again and left in the layers."""
    root = copy_box(box, str(tmp_path / "box"))
    memo: dict = {}
    first = recognise(root, default_candidates(root), endpoint=hub.url, memo=memo)
    assert len(first.references) == len(lfs_files()) and len(memo) == len(lfs_files())
    weights = sha256_hex(REPOS[("model", "acme/tiny")].files["model.safetensors"])
    blob = os.path.join(root, CACHE, "models--acme--tiny", "blobs", weights)
    st = os.stat(blob)
    flip_byte(blob)
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = recognise(root, default_candidates(root), endpoint=hub.url, memo=memo)
    assert weights not in {r.sha256 for r in again.references}
    assert {r.sha256 for r in again.references} == {r.sha256 for r in first.references} - {weights}


def test_a_tampered_or_unnamed_blob_stays_in_the_layers(box, hub, tmp_path):
    root = copy_box(box, str(tmp_path / "box"))
    weights = sha256_hex(REPOS[("model", "acme/tiny")].files["model.safetensors"])
    blob = os.path.join(root, CACHE, "models--acme--tiny", "blobs", weights)
    flip_byte(blob)
    orphan = _bytes(9, 2000)
    with open(os.path.join(root, CACHE, "models--acme--tiny", "blobs", sha256_hex(orphan)), "wb") as f:
        f.write(orphan)
    found = recognise(root, default_candidates(root), endpoint=hub.url)
    assert weights not in {r.sha256 for r in found.references}
    assert sha256_hex(orphan) not in {r.sha256 for r in found.references}
    assert len(found.references) == len(lfs_files()) - 1
    left = dict(found.left)
    assert left[f"{CACHE}/models--acme--tiny/blobs/{weights}"] == "its content does not hash to its name"
    assert left[f"{CACHE}/models--acme--tiny/blobs/{sha256_hex(orphan)}"] == "no snapshot names it"


def test_a_hard_linked_blob_stays_in_the_layers(box, hub, tmp_path):
    root = copy_box(box, str(tmp_path / "box"))
    weights = sha256_hex(REPOS[("model", "acme/tiny")].files["model.safetensors"])
    blob = f"{CACHE}/models--acme--tiny/blobs/{weights}"
    os.link(os.path.join(root, blob), os.path.join(root, "weights.bin"))  # one inode, two names: the layers keep it
    found = recognise(root, default_candidates(root), endpoint=hub.url)
    assert {r.sha256 for r in found.references} == {f[4] for f in lfs_files()} - {weights}
    assert dict(found.left)[blob] == "hard-linked to other names"


def test_every_token_file_is_a_secret(box, hub, tmp_path):
    root = copy_box(box, str(tmp_path / "box"))
    for path in (f"{HF_HOME}/stored_tokens", "etc/hf/token-file"):
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as f:
            f.write(TOKEN)
    found = recognise(root, default_candidates(root), endpoint=hub.url, token_path="/etc/hf/token-file")
    assert sorted(found.secrets) == sorted([f"{HF_HOME}/token", f"{HF_HOME}/stored_tokens", "etc/hf/token-file"])


def test_the_origin_comes_from_the_environment(hub):
    assert Origin.from_env({}) == Origin("https://huggingface.co", None)
    configured = Origin.from_env({"HF_ENDPOINT": hub.url + "/", "HF_TOKEN": TOKEN})
    assert (configured.endpoint, configured.token) == (hub.url, TOKEN) and TOKEN not in repr(configured)
    for bad in ("ftp://mirror.example", "http://169.254.169.254", "not a url"):
        with pytest.raises(UsageError):
            Origin.from_env({"HF_ENDPOINT": bad})


def test_the_reference_list_round_trips_and_refuses_a_hostile_one(box, hub):
    doc = recognise(box, default_candidates(box), endpoint=hub.url).document()
    data = doc.to_json()
    back = References.from_json(data)
    assert set(back.references) == set(doc.references) and set(back.refs) == set(doc.refs)
    assert back.to_json() == data
    assert doc.descriptor()["mediaType"] == "application/vnd.boxsnap.origin.references.v1+json"
    raw = json.loads(data)
    for field, value in (("path", "../../../etc/passwd"), ("cache", "/etc"), ("sha256", "0" * 63),
                         ("repo_type", "bucket"), ("size", "12"), ("repo_id", "a--b"),
                         ("mode", 0o4755), ("endpoint", "file:///etc"), ("mtime_ns", 10**30), ("uid", 2**40),
                         ("gid", 2**32 - 1), ("size", 2**63)):
        hostile = json.loads(data)
        hostile["references"][0][field] = value
        with pytest.raises(IntegrityError):
            References.from_json(json.dumps(hostile).encode())
    with pytest.raises(IntegrityError):
        References.from_json(json.dumps({**raw, "schemaVersion": 2}).encode())


def layers_share(box: str, dest: str, doc: References) -> None:
    """What the layers of a snapshot with references restore: the box's tree less the referenced blobs."""
    copy_box(box, dest)
    for blob in cache_layout(doc).blobs:
        os.unlink(os.path.join(dest, blob))


def test_fetch_restores_the_hub_cache_exactly(box, hub, tmp_path):
    doc = References.from_json(recognise(box, default_candidates(box), endpoint=hub.url).document().to_json())
    restored = str(tmp_path / "restored")
    layers_share(box, restored, doc)
    report = fetch_all(restored, list(doc.references), Origin(hub.url, TOKEN), workers=3)
    assert not report.failed and len(report.fetched) == len(lfs_files())
    assert tree(restored, CACHE) == tree(box, CACHE)  # bytes, modes, symlinks, refs: the box's
    before = len(hub.seen_all)
    again = fetch_all(restored, list(doc.references), Origin(hub.url, TOKEN))
    assert not again.fetched and len(again.present) == len(lfs_files()) and len(hub.seen_all) == before

    alone = str(tmp_path / "alone")  # from the references alone: blobs, symlinks and refs as the hub writes them
    os.makedirs(alone)
    fetch_all(alone, list(doc.references), Origin(hub.url, TOKEN)).raise_first()
    complete_layout(alone, doc)
    layout = cache_layout(doc)
    expected = {p: e for p, e in tree(box, CACHE).items() if p in layout.links or p in layout.blobs or "/refs/" in p}
    assert len(expected) == len(layout.links) + len(layout.blobs) + len(layout.refs)
    got = {p: e for p, e in tree(alone, CACHE).items() if e[0] != "dir"}
    assert got == expected


FETCH_ONE = """
import sys
from snapshotter.origin.fetch import Origin, fetch
from snapshotter.origin.references import References
root, endpoint, doc, sha = sys.argv[1:5]
ref = next(r for r in References.from_json(open(doc, "rb").read()).references if r.sha256 == sha)
total = 0
def told(n):
    global total
    total += n
    print(total, flush=True)
fetch(root, ref, Origin(endpoint), on_bytes=told)
"""


def test_kill_9_mid_fetch_then_a_rerun_resumes_with_a_range(box, hub, tmp_path):
    doc = recognise(box, default_candidates(box), endpoint=hub.url).document()
    sha = sha256_hex(REPOS[("model", "acme/tiny")].files["model.safetensors"])
    ref = next(r for r in doc.references if r.sha256 == sha)
    (tmp_path / "doc.json").write_bytes(doc.to_json())
    restored = str(tmp_path / "restored")
    os.makedirs(restored)
    cut = 2 << 20
    hub.cdn.pause[sha] = cut
    hub.cdn.reached.clear()
    hub.cdn.release.clear()
    child = subprocess.Popen([sys.executable, "-c", FETCH_ONE, restored, hub.url, str(tmp_path / "doc.json"), sha],
                             stdout=subprocess.PIPE, text=True)
    try:
        for line in child.stdout:  # the child says what it wrote; the CDN holds the rest back
            if int(line) >= cut:
                break
        assert hub.cdn.reached.wait(60)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        del hub.cdn.pause[sha]
        hub.cdn.release.set()
        child.kill()
        child.stdout.close()
    blob = os.path.join(restored, ref.blob_path)
    assert not os.path.exists(blob) and os.path.getsize(blob + PART_SUFFIX) == cut
    seen = len(hub.seen_all)
    assert fetch(restored, ref, Origin(hub.url)) is True
    cdn_gets = [s for s in hub.seen_all[seen:] if s.server == "cdn"]
    assert [s.headers.get("range") for s in cdn_gets] == [f"bytes={cut}-"]
    with open(blob, "rb") as f:
        assert sha256_hex(f.read()) == sha
    assert not os.path.exists(blob + PART_SUFFIX)


def gated_reference(box, hub):
    doc = recognise(box, default_candidates(box), endpoint=hub.url).document()
    return next(r for r in doc.references if r.repo_id == "acme/gated")


def test_a_gated_file_needs_the_token_and_the_token_never_reaches_the_cdn(box, hub, tmp_path):
    ref = gated_reference(box, hub)
    with pytest.raises(OriginAuthError) as e:
        fetch(str(tmp_path), ref, Origin(hub.url))
    assert exit_code_of(e.value) == 4 and "\n" not in str(e.value)
    assert "'w.bin'" in str(e.value) and hub.url in str(e.value) and "HF_TOKEN" in str(e.value)
    assert not os.path.exists(os.path.join(tmp_path, ref.blob_path))
    assert not os.path.lexists(os.path.join(tmp_path, ref.blob_path + PART_SUFFIX))  # no empty part to capture
    seen = len(hub.seen_all)
    assert fetch(str(tmp_path), ref, Origin.from_env({"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN})) is True
    asked = hub.seen_all[seen:]
    assert [s.headers.get("authorization") for s in asked if s.server == "hub"] == [f"Bearer {TOKEN}"]
    assert [s.headers.get("authorization") for s in asked if s.server == "cdn"] == [None]


def test_not_found_mismatch_and_unreachable_are_one_line_errors(box, hub, tmp_path):
    doc = recognise(box, default_candidates(box), endpoint=hub.url).document()
    ref = next(r for r in doc.references if r.repo_id == "acme/corpus")
    gone = type(ref)(**{**ref.__dict__, "path": "data/deleted.parquet"})
    with pytest.raises(NotFound) as e:
        fetch(str(tmp_path), gone, Origin(hub.url))
    assert exit_code_of(e.value) == 5 and "'data/deleted.parquet'" in str(e.value) and hub.url in str(e.value)
    assert not os.path.lexists(os.path.join(tmp_path, gone.blob_path + PART_SUFFIX))
    hub.cdn.corrupt.add(ref.sha256)
    blob = os.path.join(tmp_path, ref.blob_path)
    os.utime(os.path.dirname(blob), ns=(1_600_000_000 * 10**9,) * 2)  # as a restore's layers set it
    try:
        with pytest.raises(IntegrityError) as e:
            fetch(str(tmp_path), ref, Origin(hub.url))
    finally:
        hub.cdn.corrupt.discard(ref.sha256)
    assert exit_code_of(e.value) == 6 and "'data/train.parquet'" in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(blob) and not os.path.exists(blob + PART_SUFFIX)
    assert os.stat(os.path.dirname(blob)).st_mtime_ns == 1_600_000_000 * 10**9  # the part removed, its times kept
    closed = f"http://127.0.0.1:{free_port()}"
    report = fetch_all(str(tmp_path), [ref], Origin(closed))
    with pytest.raises(RegistryUnreachable) as e:
        report.raise_first()
    assert exit_code_of(e.value) == 3 and closed in str(e.value) and "'data/train.parquet'" in str(e.value)
    assert fetch(str(tmp_path), ref, Origin(hub.url)) is True  # and a rerun with the origin back completes


def test_a_folder_at_the_blobs_path_is_one_line_and_leaves_no_part(box, hub, tmp_path):
    ref = gated_reference(box, hub)
    os.makedirs(os.path.join(tmp_path, ref.blob_path))
    with pytest.raises(StorageError) as e:
        fetch(str(tmp_path), ref, Origin(hub.url, TOKEN))
    assert exit_code_of(e.value) == 7 and repr(ref.blob_path) in str(e.value) and "\n" not in str(e.value)
    assert not os.path.lexists(os.path.join(tmp_path, ref.blob_path + PART_SUFFIX))


def test_a_rate_limited_origin_says_to_rerun(box, hub, tmp_path):
    ref = gated_reference(box, hub)
    hub.cdn.refuse[ref.sha256] = 429
    try:
        with pytest.raises(RegistryError) as e:
            fetch(str(tmp_path), ref, Origin(hub.url, TOKEN))
    finally:
        del hub.cdn.refuse[ref.sha256]
    assert exit_code_of(e.value) == 10 and "HTTP 429" in str(e.value) and "rerun" in str(e.value)
    assert not os.path.lexists(os.path.join(tmp_path, ref.blob_path + PART_SUFFIX))


def test_a_redirect_to_a_forbidden_host_or_scheme_is_refused(box, hub, tmp_path):
    doc = recognise(box, default_candidates(box), endpoint=hub.url).document()
    ref = next(r for r in doc.references if r.repo_id == "acme/demo")
    hub.redirect_to[ref.sha256] = "http://169.254.169.254/latest/meta-data/"
    seen = len(hub.seen_all)
    try:
        with pytest.raises(RegistryError) as e:
            fetch(str(tmp_path), ref, Origin(hub.url))
    finally:
        del hub.redirect_to[ref.sha256]
    assert "169.254.169.254" in str(e.value) and "link-local" in str(e.value) and "'app.bin'" in str(e.value)
    assert [s.server for s in hub.seen_all[seen:]] == ["hub"]
    https = Origin("https://huggingface.co")
    assert https.may_follow("http://cdn.example/x") and not https.may_follow("https://cdn.example/x")
    assert not Origin(hub.url).may_follow("http://127.0.0.2:1/x")
    assert https.url(ref) == f"https://huggingface.co/spaces/acme/demo/resolve/{C_SPACE}/app.bin"


def test_a_symlinked_refs_or_snapshot_folder_is_not_followed(box, hub, tmp_path):
    """At commit a refs/ or snapshots/COMMIT that is a symlink is no hub layout (it could lead out of
    the root): what it holds stays in the layers; at restore one the layers put there stays, and the
    rest of the layout is made around it, rerun after rerun."""
    root = copy_box(box, str(tmp_path / "box"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "foreign").write_text(C_DATA)
    tiny, demo = os.path.join(root, CACHE, "models--acme--tiny"), os.path.join(root, CACHE, "spaces--acme--demo")
    shutil.rmtree(os.path.join(tiny, "refs"))
    os.symlink(str(outside), os.path.join(tiny, "refs"))
    os.rename(os.path.join(demo, "snapshots", C_SPACE), os.path.join(demo, "snapshots", "real"))
    os.symlink("real", os.path.join(demo, "snapshots", C_SPACE))
    found = recognise(root, default_candidates(root), endpoint=hub.url)
    assert {(r.repo_id, r.name) for r in found.refs} == {("acme/demo", "main"), ("acme/gated", "main")}
    assert {r.sha256 for r in found.references} == {f[4] for f in lfs_files() if f[1] != "acme/demo"}
    restored = copy_box(box, str(tmp_path / "restored"))
    refs = os.path.join(restored, CACHE, "models--acme--tiny", "refs")
    os.rename(refs, refs + "-real")
    os.symlink("refs-real", refs)
    doc = recognise(box, default_candidates(box), endpoint=hub.url).document()
    for _ in range(2):
        assert complete_layout(restored, doc) == []
    assert os.readlink(refs) == "refs-real" and open(os.path.join(refs, "main")).read() == C_MODEL
