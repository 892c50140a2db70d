"""Where a registry listens and how it wants us to say who we are: a GET of /v2/ picks https or
plain http (a loopback registry may speak either, as Docker allows) and reads the auth scheme
from its challenge. A registry that does not answer fails here, in seconds."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional, Union

import requests

from snapshotter.errors import RegistryUnreachable

from .answers import short_error
from .destinations import GuardedSession

PING_TIMEOUT = 10


@dataclass(frozen=True)
class Ping:
    scheme: str  # "http" or "https"
    auth_kind: str  # "basic" (its challenge says Basic) or "token" (Bearer, or no challenge)


def ping(host: str, plain_http: Optional[bool], verify: Union[bool, str]) -> Ping:
    """Ping `host`'s /v2/. `plain_http` None: https, or for a loopback host plain http first;
    `verify`: requests' (a CA bundle's path, or whether to check the certificate)."""
    schemes = ["https"]
    if plain_http:
        schemes = ["http"]
    elif plain_http is None and is_loopback(host):
        # Plain http first: what a loopback registry usually speaks, and a TLS attempt costs
        # ~50 ms of CPU (the CA bundle); a TLS registry answers it 400, and https is tried next.
        schemes = ["http", "https"]
    first_error: Optional[Exception] = None
    for scheme in schemes:
        try:
            with GuardedSession() as s:  # streamed: only the status and headers are read, never the body
                r = s.get(f"{scheme}://{host}/v2/", timeout=PING_TIMEOUT, verify=verify, stream=True)
                r.close()
        except requests.exceptions.SSLError as e:
            # The TLS error is the real cause, whatever plain http said; but a TLS hello answered in
            # plain http (a loopback proxy whose registry is down) says the server speaks no TLS: then
            # plain http's failure is.
            if first_error is None or not _answered_in_plain_http(e):
                first_error = e
            continue
        except requests.exceptions.RequestException as e:
            first_error = first_error or e
            continue
        if r.status_code == 400 and scheme == "http" and len(schemes) > 1:
            continue  # an https server answering plain http
        challenge = r.headers.get("Www-Authenticate", "")
        return Ping(scheme, "basic" if challenge.lower().startswith("basic") else "token")
    if isinstance(first_error, requests.exceptions.SSLError):
        raise RegistryUnreachable(
            f"TLS to registry {host} failed: {short_error(first_error)}",
            "pass --ca-cert FILE for a private CA, or --plain-http for a registry without TLS",
        )
    raise RegistryUnreachable(
        f"registry {host} is not reachable: {short_error(first_error)}",
        "check the host and port, and that the registry is running",
    )


_PLAIN_HTTP_ANSWER = ("wrong version number", "record layer failure", "packet length too long")  # OpenSSL's words


def _answered_in_plain_http(e: Exception) -> bool:
    text = str(e).lower()
    return any(words in text for words in _PLAIN_HTTP_ANSWER)


def is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0].strip("[]") if host.count(":") <= 1 or host.startswith("[") else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
