"""Encrypted layers in ocicrypt's format (containers/ocicrypt; skopeo's and podman's --encryption-key jwe:
and --decryption-key): the keys that encrypt to a recipient or decrypt, JWE key wrapping, and the layer
cipher itself (AES-256-CTR with HMAC-SHA256), streamed. No registry and no image I/O: the callers move
the bytes."""
