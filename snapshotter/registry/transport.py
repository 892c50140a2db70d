"""HTTP to one repository of a registry: the session (no cookies, a timeout on every request) and
the request loop, composed of where the registry listens (ping.py), who we are (credentials.py,
auth.py), how a request survives a registry that restarts or throttles (retry.py) and what a
failed answer says (answers.py). remote.py speaks the distribution protocol over this.

oras-py's do_request is not used: it retries every error with sleeps of up to minutes.
"""

from __future__ import annotations

import dataclasses
import time
import urllib.parse
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from typing import Callable, Optional

import requests

from snapshotter.errors import RegistryError, RegistryUnreachable
from snapshotter.oci.reference import api_host

from .answers import read_answer, short_error
from .auth import authenticator
from .credentials import Credentials, docker_credentials
from .destinations import CheckedAdapter, GuardedSession, origin
from .ping import ping
from .retry import RETRY_DELAYS, retry_delay, scaled, worth_retrying

TIMEOUT = (10, 300)  # connect, read: a registry that hangs is an error, not a wait forever


@dataclass
class TransportOptions:
    """How to reach registries. Loopback hosts default to plain http (as Docker does for them)
    unless they answer TLS; other hosts always use https."""

    plain_http: Optional[bool] = None  # None: auto
    ca_bundle: Optional[str] = None
    tls_verify: bool = True
    credentials: Credentials = field(default_factory=Credentials)
    # The registry the explicit `credentials` are for; other registries get only the docker config's.
    # None: every registry (a command that talks to one registry only).
    credentials_registry: Optional[str] = None

    def credentials_only_for(self, registry: str) -> "TransportOptions":
        return dataclasses.replace(self, credentials_registry=registry)

    def explicit_credentials_for(self, registry: str) -> bool:
        return self.credentials.username is not None and (
            self.credentials_registry is None or api_host(self.credentials_registry) == api_host(registry))

    def credentials_for(self, registry: str) -> Optional[tuple[str, str]]:
        """(username, password) for `registry`: the explicit ones if they are for it, else Docker's."""
        if self.explicit_credentials_for(registry):
            return self.credentials.username, self.credentials.password or ""
        return docker_credentials(registry)


class Transport:
    """Requests to one repository on one registry. Kept per repository because token auth scopes
    are per repository. `registry` is the name the user wrote (in messages); requests go to its
    API host."""

    def __init__(self, registry: str, repository: str, options: Optional[TransportOptions] = None):
        self.registry, self.repository = registry, repository
        self.options = options or TransportOptions()
        self.host = api_host(registry)  # where requests go; `registry` stays the name in messages
        self.sleep: Callable[[float], None] = time.sleep  # tests swap it to see the waits
        verify = self.options.ca_bundle or self.options.tls_verify
        found = ping(self.host, self.options.plain_http, verify)
        self.scheme = found.scheme
        self.origin = origin(f"{self.scheme}://{self.host}/")
        self.session = GuardedSession()  # no request to a metadata or link-local address (destinations.py)
        # No cookies, as oras's Registry: some registries set one and then take us for a browser (CSRF).
        self.session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        if not verify:
            requests.packages.urllib3.disable_warnings()  # --insecure-tls was asked for: no warning per request
        self.verify = verify
        self.session.mount("http://", _TimeoutAdapter())
        self.session.mount("https://", _TimeoutAdapter())
        self.auth = authenticator(found.auth_kind, registry, repository, self.options.credentials_for(registry),
                                  self.session, self.scheme, verify)
        self.chunks_refused = False  # the registry refused a PATCH: every later upload is one PUT (upload.py)

    def request(self, method: str, url: str, resend: bool = True, **kw) -> requests.Response:
        """One registry request, with who we are (a token renewed once if the registry asks),
        retried as retry.py says: a registry that restarts or throttles (429/5xx, its Retry-After
        honoured) is waited for, one that is down fails in seconds.
        `resend=False` for a streamed body, which cannot be sent twice: a broken connection or an
        expired token is then a RegistryError, for the caller to start its upload over.
        An answer not asked for as a stream is read here, within bounds (answers.read_answer)."""
        headers = dict(kw.pop("headers", {}) or {})
        stream = kw.pop("stream", False)
        own = origin(url) == self.origin  # another origin (a Location, a next page) gets no credentials
        registry = self.registry
        refreshed = False
        for delay in (*RETRY_DELAYS, None) if resend else (None,):
            try:
                r = self._send(method, url, dict(headers), own, **kw)
                if r.status_code == 401 and own and not refreshed and self.auth.refresh(r):
                    refreshed = True  # once: a token the server scopes down again is a refusal
                    if not resend:
                        raise RegistryError(f"registry {registry} asked for a new token during an upload")
                    r = self._send(method, url, dict(headers), own, **kw)
            except requests.exceptions.SSLError as e:
                raise RegistryUnreachable(f"TLS to {self._host_of(method, e)} failed: {short_error(e)}")
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
                if not resend:
                    raise RegistryError(f"upload to registry {registry} broke: {short_error(e)}")
                if delay is None:
                    writes = method not in ("GET", "HEAD")  # a restore or verify has pushed nothing
                    raise RegistryUnreachable(f"{self._host_of(method, e)} stopped answering: {short_error(e)}",
                                              "run the command again when it is back"
                                              + (": what was pushed stays pushed" if writes else ""))
                self.backoff(delay)
                continue
            except requests.exceptions.RequestException as e:
                raise RegistryUnreachable(f"registry {registry} failed: {short_error(e)}")
            if worth_retrying(r) and delay is not None:
                self.backoff(retry_delay(r, delay))
                r.close()
                continue
            break
        if r.status_code in (401, 403):
            raise self.auth.refusal(f"{method} on {self.repository} (HTTP {r.status_code})")
        if not stream:
            read_answer(r, f"the answer of registry {registry!r} to {method}")
        return r

    def _host_of(self, method: str, e: requests.exceptions.RequestException) -> str:
        """Who failed, for an error: the registry, or the host it redirected the request to (its object storage)."""
        failed = origin(e.request.url if e.request is not None else "")
        _, host, port = failed
        if not host or failed == self.origin:
            return f"registry {self.registry}"
        return f"{host}:{port} (where registry {self.registry} sent the {method})"

    def backoff(self, seconds: float) -> None:
        """Wait before asking again (scaled: retry.py)."""
        self.sleep(scaled(seconds))

    def _send(self, method: str, url: str, headers: dict, own: bool, **kw) -> requests.Response:
        """One request, streamed (its body read by request, bounded), with who we are (auth.py)
        if it goes to the registry's own origin."""
        def send(h: dict) -> requests.Response:
            return self.session.request(method, url, headers=h, verify=self.verify, stream=True, **kw)

        return self.auth.send(send, headers) if own else send(headers)

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.host}/v2/{self.repository}/{path}"

    def absolute(self, location: str) -> str:
        try:
            return urllib.parse.urljoin(f"{self.scheme}://{self.host}/", location)
        except ValueError:  # e.g. "https://[x"
            raise RegistryError(f"registry {self.host!r} sent a location that is not a URL: "
                                f"{location[:200]!r}") from None

    def location(self, r: requests.Response, what: str) -> str:
        """The absolute URL of an answer's Location header; a RegistryError if it has none."""
        location = r.headers.get("Location")
        if not location:
            raise RegistryError(f"registry {self.registry!r} answered {what} without a Location")
        return self.absolute(location)


class _TimeoutAdapter(CheckedAdapter):
    """Gives every request of the session a timeout, the token requests oras sends through it
    included; its connections go only to checked addresses (destinations.py)."""

    def send(self, request, **kw):
        if kw.get("timeout") is None:
            kw["timeout"] = TIMEOUT
        return super().send(request, **kw)
