"""Where a registry request may go, and which requests carry who we are. A registry's answers
name URLs (a token realm, a redirect, an upload's Location, a next page): they are followed over
http(s) only and never to a link-local, metadata or unspecified address, so that a hostile
registry cannot make snap read a cloud's metadata service (the box's own credentials). Our
credentials go only to the registry's own scheme, host and port, as Docker's per-host authorizer.

Literal addresses, in any form the resolver takes, and the metadata services' well-known names are
refused before a request is sent; a name is resolved when its connection is made, every address
checked, and the connection made to a checked address, never to a second lookup's answer (a name
that rebinds would answer differently)."""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from typing import Optional, Union

import requests
import urllib3
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError

from snapshotter.errors import RegistryError, SnapError

# Metadata services outside 169.254.0.0/16 (link-local, refused as a whole): AWS's IPv6 one, Alibaba's.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200"))
METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                            "instance-data.ec2.internal"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_INET_ATON = re.compile(r"[0-9a-fx.]+", re.I)  # 2852039166, 0xa9fea9fe, 0251.0376.0251.0376: what inet_aton reads


def _address(host: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    try:
        a = ipaddress.ip_address(host)
    except ValueError:
        if not _INET_ATON.fullmatch(host):
            return None
        try:
            a = ipaddress.ip_address(socket.inet_aton(host))
        except OSError:
            return None
    return (a.ipv4_mapped or a) if isinstance(a, ipaddress.IPv6Address) else a  # ::ffff:169.254.169.254 too


def forbidden(host: str) -> str:
    """Why requests may not go to `host` (a URL's hostname), or "" if they may."""
    name = host.strip("[]").rstrip(".").lower()
    if name in METADATA_NAMES:
        return "a cloud metadata service's name"
    a = _address(name)
    if a is None:
        return ""
    if a in METADATA_ADDRESSES:
        return "a cloud metadata service's address"
    if a.is_link_local:
        return "a link-local address (where cloud metadata services answer)"
    if a.is_unspecified:
        return "an unspecified address"
    return ""


def check_destination(url: str, error: type[SnapError] = RegistryError) -> None:
    """Refuse (`error`), before connecting, a URL that is not http(s) or whose host is forbidden."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # e.g. "https://[x": no URL at all
        raise error(f"refusing to follow {url[:200]!r}: not a URL",
                    "a registry's answer pointed there; only a registry's own hosts are reached") from None
    if parts.scheme not in _DEFAULT_PORTS:
        raise error(f"refusing to follow {url[:200]!r}: only http and https URLs are followed")
    host = parts.hostname or ""
    why = forbidden(host)
    if why or not host:
        raise error(f"refusing to connect to {host!r}: {why or 'no host'}",
                    "a registry's answer pointed there; only a registry's own hosts are reached")


def origin(url: str) -> tuple[str, str, Optional[int]]:
    """(scheme, host, port) of a URL, the port filled in from the scheme; no host for no URL."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "", "", -1  # not a URL: matches no registry
    try:
        port = parts.port
    except ValueError:
        port = -1  # not a port: matches no registry
    return parts.scheme.lower(), (parts.hostname or "").lower(), port or _DEFAULT_PORTS.get(parts.scheme.lower())


class GuardedSession(requests.Session):
    """A session whose every request, redirects included (requests sends each hop through send),
    is refused before connecting if check_destination refuses its URL. Redirects to another
    origin lose the Authorization header (requests' rebuild_auth)."""

    def __init__(self):
        super().__init__()
        for scheme in _DEFAULT_PORTS:
            self.mount(f"{scheme}://", CheckedAdapter())

    def send(self, request, **kw):
        check_destination(request.url)
        return super().send(request, **kw)


def checked_addresses(host: str, port: int) -> list[str]:
    """The addresses a name resolves to, in the resolver's order, each checked: RegistryError if
    one is forbidden. A literal address is itself (check_destination has judged it); a name the
    resolver does not know is left to the connection, which says so."""
    if not host or _address(host) is not None:
        return [host]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return [host]
    addresses: list[str] = []
    for *_, sockaddr in infos:
        why = forbidden(sockaddr[0])
        if why:
            raise RegistryError(f"refusing to connect to {host!r}: it resolves to {why}",
                                "a registry's answer pointed there; only a registry's own hosts are reached")
        if sockaddr[0] not in addresses:
            addresses.append(sockaddr[0])
    return addresses


class _CheckedConnect:
    """Connects only to the checked addresses of its host (checked_addresses), in order."""

    def _new_conn(self):
        host = self._dns_host
        addresses = checked_addresses(host, self.port)
        try:
            for address in addresses[:-1]:
                self._dns_host = address
                try:
                    return super()._new_conn()
                except (NewConnectionError, ConnectTimeoutError):
                    continue  # the next address, as the resolver's order says
            self._dns_host = addresses[-1]
            return super()._new_conn()
        finally:
            self._dns_host = host


class _CheckedHTTPConnection(_CheckedConnect, urllib3.connection.HTTPConnection):
    pass


class _CheckedHTTPSConnection(_CheckedConnect, urllib3.connection.HTTPSConnection):
    pass


class _CheckedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _CheckedHTTPConnection


class _CheckedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _CheckedHTTPSConnection


class CheckedAdapter(requests.adapters.HTTPAdapter):
    """An adapter whose connections go only to addresses checked_addresses allows."""

    def init_poolmanager(self, *args, **kw) -> None:
        super().init_poolmanager(*args, **kw)
        self.poolmanager.pool_classes_by_scheme = {"http": _CheckedHTTPPool, "https": _CheckedHTTPSPool}
