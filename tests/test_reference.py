"""Image references read as Docker reads them: a table of the examples in distribution/reference's own
tests (normalize_test.go, reference_test.go), each with what `docker pull` would fetch."""

import pytest

from snapshotter.errors import UsageError
from snapshotter.oci.reference import Reference

from support.run import assert_one_line_error, snap

D64 = "sha256:" + "f" * 64
REDIS = "sha256:dbcc1c35ac38df41fd2f5e4130b32ffdb93ebae8b3dbe638c23575912276fc9c"
SHA512 = "sha512:" + "f" * 128

# text -> (registry, repository, tag, digest, canonical string)
VALID = {
    # familiar names: docker.io, library/ for one component, latest by default
    "ubuntu:22.04": ("docker.io", "library/ubuntu", "22.04", None, "docker.io/library/ubuntu:22.04"),
    "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04": (
        "docker.io", "runpod/pytorch", "2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04", None,
        "docker.io/runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"),
    "debian": ("docker.io", "library/debian", "latest", None, "docker.io/library/debian:latest"),
    "library/debian": ("docker.io", "library/debian", "latest", None, "docker.io/library/debian:latest"),
    "docker/docker": ("docker.io", "docker/docker", "latest", None, "docker.io/docker/docker:latest"),
    "docker.io/debian": ("docker.io", "library/debian", "latest", None, "docker.io/library/debian:latest"),
    "docker.io/library/debian": ("docker.io", "library/debian", "latest", None, "docker.io/library/debian:latest"),
    "docker.io/docker/docker": ("docker.io", "docker/docker", "latest", None, "docker.io/docker/docker:latest"),
    "index.docker.io/debian": ("docker.io", "library/debian", "latest", None, "docker.io/library/debian:latest"),
    "index.docker.io/library/debian": ("docker.io", "library/debian", "latest", None,
                                       "docker.io/library/debian:latest"),
    "index.docker.io/docker/docker": ("docker.io", "docker/docker", "latest", None, "docker.io/docker/docker:latest"),
    "docker.io/library/foo/bar": ("docker.io", "library/foo/bar", "latest", None, "docker.io/library/foo/bar:latest"),
    "store/foo/bar": ("docker.io", "store/foo/bar", "latest", None, "docker.io/store/foo/bar:latest"),
    "other/library": ("docker.io", "other/library", "latest", None, "docker.io/other/library:latest"),
    "test_com/foo": ("docker.io", "test_com/foo", "latest", None, "docker.io/test_com/foo:latest"),
    "ubuntu-12.04-base": ("docker.io", "library/ubuntu-12.04-base", "latest", None,
                          "docker.io/library/ubuntu-12.04-base:latest"),
    "thisisthesongthatneverendsitgoesonandonandonthisisthesongthatnev": (
        "docker.io", "library/thisisthesongthatneverendsitgoesonandonandonthisisthesongthatnev", "latest", None,
        "docker.io/library/thisisthesongthatneverendsitgoesonandonandonthisisthesongthatnev:latest"),
    "docker.io/1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a": (
        "docker.io", "library/1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a", "latest", None,
        "docker.io/library/1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a:latest"),
    "docker-rules/docker": ("docker.io", "docker-rules/docker", "latest", None, "docker.io/docker-rules/docker:latest"),
    "docker---rules/docker": ("docker.io", "docker---rules/docker", "latest", None,
                              "docker.io/docker---rules/docker:latest"),
    "dock__er/docker": ("docker.io", "dock__er/docker", "latest", None, "docker.io/dock__er/docker:latest"),
    "d/docker": ("docker.io", "d/docker", "latest", None, "docker.io/d/docker:latest"),
    "jess/t": ("docker.io", "jess/t", "latest", None, "docker.io/jess/t:latest"),
    "lowercase:Uppercase": ("docker.io", "library/lowercase", "Uppercase", None,
                            "docker.io/library/lowercase:Uppercase"),
    # a first component with a dot (or a port) is a registry, even where it could be a tag
    "test.com:tag": ("docker.io", "library/test.com", "tag", None, "docker.io/library/test.com:tag"),
    "test.com:5000": ("docker.io", "library/test.com", "5000", None, "docker.io/library/test.com:5000"),
    "192.168.1.1:5000": ("docker.io", "library/192.168.1.1", "5000", None, "docker.io/library/192.168.1.1:5000"),
    "foo_bar.com:8080": ("docker.io", "library/foo_bar.com", "8080", None, "docker.io/library/foo_bar.com:8080"),
    "test.com/repo:tag": ("test.com", "repo", "tag", None, "test.com/repo:tag"),
    "test:5000/repo": ("test:5000", "repo", "latest", None, "test:5000/repo:latest"),
    "test-com:8080/foo": ("test-com:8080", "foo", "latest", None, "test-com:8080/foo:latest"),
    "192.168.1.1/repo": ("192.168.1.1", "repo", "latest", None, "192.168.1.1/repo:latest"),
    "192.168.1.1:5000/repo:5050": ("192.168.1.1:5000", "repo", "5050", None, "192.168.1.1:5000/repo:5050"),
    "127.0.0.1:5000/debian": ("127.0.0.1:5000", "debian", "latest", None, "127.0.0.1:5000/debian:latest"),
    "127.0.0.1:8000/private/moonbase": ("127.0.0.1:8000", "private/moonbase", "latest", None,
                                        "127.0.0.1:8000/private/moonbase:latest"),
    "example.com:8000/privatebasee": ("example.com:8000", "privatebasee", "latest", None,
                                      "example.com:8000/privatebasee:latest"),
    "sub-dom1.foo.com/bar/baz/quux:some-long-tag": ("sub-dom1.foo.com", "bar/baz/quux", "some-long-tag", None,
                                                    "sub-dom1.foo.com/bar/baz/quux:some-long-tag"),
    "b.gcr.io/test.example.com/my-app:test.example.com": ("b.gcr.io", "test.example.com/my-app", "test.example.com",
                                                          None, "b.gcr.io/test.example.com/my-app:test.example.com"),
    "xn--n3h.com/myimage:xn--n3h.com": ("xn--n3h.com", "myimage", "xn--n3h.com", None,
                                        "xn--n3h.com/myimage:xn--n3h.com"),
    "localhost/debian": ("localhost", "debian", "latest", None, "localhost/debian:latest"),
    "localhost:5000/box:v1": ("localhost:5000", "box", "v1", None, "localhost:5000/box:v1"),
    "LOCALDOMAIN/debian": ("LOCALDOMAIN", "debian", "latest", None, "LOCALDOMAIN/debian:latest"),
    "Docker/docker": ("Docker", "docker", "latest", None, "Docker/docker:latest"),
    "FOO/bar": ("FOO", "bar", "latest", None, "FOO/bar:latest"),
    "[2001:db8::1]/repo": ("[2001:db8::1]", "repo", "latest", None, "[2001:db8::1]/repo:latest"),
    "[fc00::1]:5000/docker/docker": ("[fc00::1]:5000", "docker/docker", "latest", None,
                                     "[fc00::1]:5000/docker/docker:latest"),
    "[::1]:5000/repo": ("[::1]:5000", "repo", "latest", None, "[::1]:5000/repo:latest"),
    # registry-1.docker.io is Docker Hub's API host; Docker keeps the name as written
    "registry-1.docker.io/library/ubuntu:22.04": ("registry-1.docker.io", "library/ubuntu", "22.04", None,
                                                  "registry-1.docker.io/library/ubuntu:22.04"),
    # digests, with and without a tag (the digest is what is fetched)
    f"redis@{REDIS}": ("docker.io", "library/redis", None, REDIS, f"docker.io/library/redis@{REDIS}"),
    f"dmcgowan/myapp@{REDIS}": ("docker.io", "dmcgowan/myapp", None, REDIS, f"docker.io/dmcgowan/myapp@{REDIS}"),
    f"busybox:latest@{REDIS}": ("docker.io", "library/busybox", "latest", REDIS,
                                f"docker.io/library/busybox:latest@{REDIS}"),
    f"test:5000/repo@{D64}": ("test:5000", "repo", None, D64, f"test:5000/repo@{D64}"),
    f"test:5000/repo:tag@{D64}": ("test:5000", "repo", "tag", D64, f"test:5000/repo:tag@{D64}"),
    f"[2001:db8::1]:5000/repo:tag@{D64}": ("[2001:db8::1]:5000", "repo", "tag", D64,
                                           f"[2001:db8::1]:5000/repo:tag@{D64}"),
    f"xn--7o8h.com/myimage:xn--7o8h.com@{SHA512}": ("xn--7o8h.com", "myimage", "xn--7o8h.com", SHA512,
                                                     f"xn--7o8h.com/myimage:xn--7o8h.com@{SHA512}"),
}

INVALID = [
    "", ":justtag", f"@{D64}", "https://github.com/docker/docker", "docker/Docker", "docker.io/docker/Docker",
    "Uppercase:tag", "test:5000/Uppercase/lowercase:tag", "-docker", "-docker/docker", "-docker.io/docker/docker",
    "docker-/docker", "-docker-/docker", "docker///docker", "docker.io/docker///docker", "____/____",
    "_docker/_docker", "dock..er/docker", "dock_.er/docker", "dock-.er/docker", "docker/", "aa/asdf$$^/aa",
    "[fc00::1]", "[fc00::1]:5000", "fc00::1:5000/debian", "[fe80::1%eth0]:5000/debian",
    "[2001:db8:3:4::192.0.2.33]:5000/debian", "[2001:db8::1]:tag", "[fe80::1%@invalidzone]:5000/repo",
    "1a3f5e7d9c1b3a5f7e9d1c3b5a7f9e1d3c5b7a9f1e3d5d7c9b1a3f5e7d9c1b3a",  # an image ID, not a name
    "repo@sha256:ffffffffffffffffffffffffffffffffff",  # too short
    "validname@invaliddigest:" + "f" * 64,  # unknown algorithm
    "this_is_not_a_valid_namespace_because_its_lenth_is_greater_than_255_" * 4 + "/docker",
    "a/" * 128 + "a:tag",  # name over 255 characters
    "a/" * 127 + "a:tag-puts-this-over-max",  # 255 as written, over once docker.io/ is in front
    "box:" + "t" * 129,  # tag over 128
    "my_host.com/box",  # a dotted first component that is no valid host
    "box\nsnap: error: forged",
]


@pytest.mark.parametrize("text", sorted(VALID))
def test_valid_reference(text):
    registry, repository, tag, digest, canonical = VALID[text]
    ref = Reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    assert str(ref) == canonical
    assert Reference.parse(str(ref)) == ref  # the canonical form reads back as itself
    assert ref.target == (digest or tag)


@pytest.mark.parametrize("text", INVALID)
def test_invalid_reference(text):
    with pytest.raises(UsageError) as e:
        Reference.parse(text)
    assert e.value.exit_code == 2
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,host", [
    ("ubuntu:22.04", "registry-1.docker.io"),
    ("docker.io/library/ubuntu:22.04", "registry-1.docker.io"),
    ("index.docker.io/library/ubuntu:22.04", "registry-1.docker.io"),
    ("registry-1.docker.io/library/ubuntu:22.04", "registry-1.docker.io"),
    ("ghcr.io/me/box:v1", "ghcr.io"),
    ("127.0.0.1:5000/box:v1", "127.0.0.1:5000"),
    ("localhost:5000/box:v1", "localhost:5000"),
    ("mydocker.io/box:v1", "mydocker.io"),
])
def test_api_host(text, host):
    assert Reference.parse(text).api_host == host


@pytest.mark.parametrize("text", ["docker/Docker", "box\nsnap: error: forged", "[fc00::1]:5000"])
def test_invalid_reference_on_the_command_line(text, tmp_path):
    r = snap("restore", text, "--root", str(tmp_path / "out"))
    assert_one_line_error(r, 2, "not valid")
    assert not (tmp_path / "out").exists()


def test_familiar_name_reaches_the_registry_it_names(registry, base_ref, tmp_path):
    """A name without a registry goes to Docker Hub; with `localhost:PORT` it goes to the local
    registry, found and restored like its 127.0.0.1 name."""
    port = registry.host.rsplit(":", 1)[1]
    out = tmp_path / "out"
    snap("restore", f"localhost:{port}/base:1", "--root", str(out), check=True)
    assert (out / "etc" / "os-release").exists()
