"""Uploads and requests through a faulty link (a FaultProxy in front of the real registry): a
connection cut in mid-upload, a registry that throttles (429/503 with Retry-After), one that
refuses PATCH. In-process, so the waits are seen (and skipped) through the transport's sleep."""

import hashlib
import os

import pytest

from snapshotter.registry import upload as upload_mod
from snapshotter.registry.remote import Reference, Remote

MiB = 1024 * 1024


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(upload_mod, "CHUNK_SIZE", 4 * MiB)


def remote_via(proxy, repo, waits):
    remote = Remote(Reference.parse(f"{proxy.host}/{repo}:x"))
    remote.transport.sleep = waits.append
    return remote


def blob(size):
    data = os.urandom(size)
    return data, "sha256:" + hashlib.sha256(data).hexdigest()


def producer(data, runs):
    """Writes `data` in 1 MiB pieces, the same bytes each run (a reproducible layer stream)."""
    def produce(out):
        runs.append(1)
        for i in range(0, len(data), MiB):
            out.write(data[i:i + MiB])
    return produce


def test_broken_link_between_chunks_resumes_at_the_registry_offset(registry, proxy, small_chunks):
    data, digest = blob(10 * MiB)  # three PATCHes: 4 + 4 + 2 MiB
    patches = []
    waits, runs = [], []
    remote = remote_via(proxy, "resume", waits)

    # Cut the second PATCH before any of its bytes reach the registry: it holds the first 4 MiB.
    def cut_second(method, path):
        if method == "PATCH":
            patches.append(path)
            if len(patches) == 2:
                proxy.cut_upload_after = 0
        return None

    proxy.answer = cut_second
    remote.upload_from(producer(data, runs), digest, len(data))
    assert proxy.cut.is_set()
    assert registry.blob("resume", digest) == data
    assert len(runs) == 2  # the stream was made again...
    assert proxy.upload_bytes() == len(data)  # ...but nothing the registry held was sent again


def test_link_broken_mid_patch_sends_the_blob_again(registry, proxy, small_chunks):
    """distribution 2.8 drops an upload whose PATCH broke mid-way: the blob starts over, whole."""
    data, digest = blob(6 * MiB)
    proxy.cut_upload_after = 3 * MiB
    waits, runs = [], []
    remote_via(proxy, "restart", waits).upload_from(producer(data, runs), digest, len(data))
    assert proxy.cut.is_set()
    assert registry.blob("restart", digest) == data
    assert len(runs) == 2 and proxy.upload_bytes() == 3 * MiB + len(data)


def test_throttling_registry_is_waited_for_as_it_asks(registry, proxy):
    data, digest = blob(3 * MiB)
    answers = {("POST", 429): 1, ("PATCH", 503): 1, ("HEAD", 503): 1}

    def throttle(method, path):
        for (m, status), left in answers.items():
            if m == method and left:
                answers[(m, status)] = left - 1
                return status, {"Retry-After": "7"}
        return None

    proxy.answer = throttle
    waits, runs = [], []
    remote = remote_via(proxy, "throttled", waits)
    assert not remote.blob_exists(digest)  # after a 503: asked again
    remote.upload_from(producer(data, runs), digest, len(data))
    assert registry.blob("throttled", digest) == data
    assert waits == [7, 7, 7]  # HEAD, POST and the PATCH each waited what the registry asked
    assert [s for m, _, s in proxy.log if m == "PATCH"] == [503, 202]


def test_registry_that_refuses_patch_gets_one_streamed_put(registry, proxy):
    data, digest = blob(5 * MiB)
    proxy.answer = lambda method, path: (405, {}) if method == "PATCH" else None
    waits, runs = [], []
    remote_via(proxy, "nopatch", waits).upload_from(producer(data, runs), digest, len(data))
    assert registry.blob("nopatch", digest) == data
    puts = [(p, s) for m, p, s in proxy.log if m == "PUT"]
    assert len(puts) == 1 and "digest=" in puts[0][0] and puts[0][1] == 201
    assert proxy.body_bytes["PUT"] == len(data)
    assert waits == []  # a refusal is not a fault to wait out
