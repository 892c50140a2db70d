"""How a command reaches registries, as its command line says it (containers/image's SystemContext):
plain http or TLS (a CA bundle, or no verification) and who we are. RegistryOptions holds the flags;
its transport() is the one place they become the TransportOptions every registry call takes, the
credentials resolved then (credentials.py: the given ones, else Docker's config per registry)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, TextIO

from snapshotter.errors import UsageError

from .credentials import Credentials, given_credentials
from .transport import TransportOptions


@dataclass(frozen=True)
class RegistryOptions:
    plain_http: bool = False  # --plain-http; else loopback registries try http first, then https
    ca_cert: Optional[str] = None  # --ca-cert: a PEM bundle to verify the registry's certificate with
    insecure_tls: bool = False  # --insecure-tls: no verification at all
    username: Optional[str] = None  # --username
    password_stdin: bool = False  # --password-stdin: the password is standard input's first line

    def transport(self, stdin: Optional[TextIO] = None) -> TransportOptions:
        """TransportOptions with the credentials given: --username with --password-stdin (or
        SNAP_PASSWORD), else SNAP_USERNAME with SNAP_PASSWORD; none, and the transport reads Docker's
        config. Asked for only by a command that talks to a registry (not `restore --wait`)."""
        credentials = given_credentials(self.username, self.password_stdin, stdin)
        return reach(self.plain_http, self.ca_cert, self.insecure_tls, credentials)


def reach(plain_http: bool = False, ca_cert: Optional[str] = None, insecure_tls: bool = False,
          credentials: Optional[Credentials] = None) -> TransportOptions:
    """TransportOptions for how to talk to the registry (`snap login` brings its own credentials)."""
    if ca_cert and not os.path.isfile(ca_cert):
        what = "is not a file" if os.path.lexists(ca_cert) else "does not exist"
        raise UsageError(f"CA certificate {ca_cert!r} {what}", "--ca-cert takes the PEM file of the registry's CA")
    return TransportOptions(
        plain_http=True if plain_http else None,  # None: auto
        ca_bundle=ca_cert,
        tls_verify=not insecure_tls,
        credentials=credentials or Credentials(),
    )
