"""Keys made by openssl and skopeo runs, for the tests of encrypted layers (test_ocicrypt.py) and
snapshots (test_encrypted_snapshots.py)."""

import shutil
import subprocess

import pytest


def need(tool):
    if not shutil.which(tool):
        pytest.skip(f"{tool} is not installed")


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_keys(d) -> None:
    """In folder `d`: RSA 2048 pairs rsa and other (the wrong key), and an EC P-256 pair ec (its
    private key PKCS#8: skopeo 1.9's ocicrypt reads no other EC form), as NAME.pem and NAME.pub."""
    need("openssl")
    for name in ("rsa", "other"):
        openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(d / f"{name}.pem"))
        openssl("pkey", "-in", str(d / f"{name}.pem"), "-pubout", "-out", str(d / f"{name}.pub"))
    openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(d / "ec.pem"))
    openssl("ec", "-in", str(d / "ec.pem"), "-pubout", "-out", str(d / "ec.pub"))


def skopeo_copy(workdir, src: str, dst: str, *flags: str) -> None:
    """`skopeo copy` with an accept-all policy (written into `workdir`), over plain http for docker://."""
    need("skopeo")
    policy = workdir / "policy.json"
    policy.write_text('{"default":[{"type":"insecureAcceptAnything"}]}')
    tls = [f for f, ref in (("--src-tls-verify=false", src), ("--dest-tls-verify=false", dst))
           if ref.startswith("docker://")]
    done = subprocess.run(["skopeo", "--policy", str(policy), "copy", "-q", *tls, *flags, src, dst],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
