"""How a command reaches registries, built in one place from what its command line says (as
containers/image's SystemContext): plain http or TLS (a CA bundle, or no verification) and who we
are (credentials.py: the given credentials, else Docker's config per registry). The result is the
transport's TransportOptions, which every registry call takes."""

from __future__ import annotations

import os
from typing import Optional, TextIO

from snapshotter.errors import UsageError

from .credentials import Credentials, given_credentials
from .transport import TransportOptions


def registry_options(plain_http: bool = False, ca_cert: Optional[str] = None, insecure_tls: bool = False,
                     username: Optional[str] = None, password_stdin: bool = False,
                     stdin: Optional[TextIO] = None) -> TransportOptions:
    """TransportOptions for a command's flags, with the credentials it was given: --username with
    --password-stdin (or SNAP_PASSWORD), else SNAP_USERNAME with SNAP_PASSWORD; none, and the
    transport reads Docker's config."""
    credentials = given_credentials(username, password_stdin, stdin)
    return reach(plain_http, ca_cert, insecure_tls, credentials)


def reach(plain_http: bool = False, ca_cert: Optional[str] = None, insecure_tls: bool = False,
          credentials: Optional[Credentials] = None) -> TransportOptions:
    """TransportOptions for how to talk to the registry (`snap login` brings its own credentials)."""
    if ca_cert and not os.path.isfile(ca_cert):
        raise UsageError(f"CA certificate {ca_cert} does not exist")
    return TransportOptions(
        plain_http=True if plain_http else None,  # else auto: loopback tries http first
        ca_bundle=ca_cert,
        tls_verify=not insecure_tls,
        credentials=credentials or Credentials(),
    )
