"""HTTP to a registry: where it is (http or https, probed), who we are (Basic credentials, bearer
tokens and their scopes, Docker's credentials), and how a request survives a registry that restarts
(timeouts, retries with backoff). registry.py speaks the distribution protocol over this.

What oras-py does here, through its public API only (`oras.auth`: not `oras.provider`, whose
import of jsonschema cost every restore's start ~0.1 s): the answer to a registry's 401 (`auth.authenticate_request`: Basic, or a
bearer token asked for with our credentials or anonymously) and bearer token requests
(`auth.request_token`). What it does not do here: find credentials (the docker SDK reads
$DOCKER_CONFIG or ~/.docker/config.json, Docker Hub's legacy key and credential helpers:
`docker.auth.load_config` and `resolve_authconfig`); retry (its `do_request` retries every error
with sleeps of up to minutes, so requests go through its session and our own short backoff); and
(registry.py, upload.py) uploads and downloads: its upload reads a whole blob into memory and its
download does not check the digest.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Optional

from http.cookiejar import DefaultCookiePolicy

import oras.auth
import oras.auth.utils
import requests

from snapshotter.errors import AuthError, RegistryError, RegistryUnreachable
from snapshotter.oci.reference import api_host
from .answers import short_error
from .credentials import Credentials, docker_credentials
from .retry import RETRY_DELAYS, retry_delay, scaled, worth_retrying

PING_TIMEOUT = 10
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


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0].strip("[]") if host.count(":") <= 1 or host.startswith("[") else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Transport:
    """Requests to one repository on one registry. Kept per repository because token auth scopes
    are per repository. `registry` is the name the user wrote (in messages); requests go to its
    API host."""

    def __init__(self, registry: str, repository: str, options: Optional[TransportOptions] = None):
        self.registry, self.repository = registry, repository
        self.options = options or TransportOptions()
        self.host = api_host(registry)  # where requests go; `registry` stays the name in messages
        self.sleep: Callable[[float], None] = time.sleep  # tests swap it to see the waits
        self.scheme = self._probe()
        verify = self.options.ca_bundle or self.options.tls_verify
        backend = self._auth_kind
        self.session = requests.Session()
        # No cookies, as oras's Registry: some registries set one and then take us for a browser (CSRF).
        self.session.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        self.auth = oras.auth.get_auth_backend(backend, self.session, self.scheme == "http", tls_verify=verify)
        self.headers: dict[str, str] = {}  # sent with every request
        if not verify:
            requests.packages.urllib3.disable_warnings()  # --insecure-tls was asked for: no warning per request
        self.verify = verify
        self.session.mount("http://", _TimeoutAdapter())
        self.session.mount("https://", _TimeoutAdapter())
        creds = self.options.credentials
        if self.options.explicit_credentials_for(registry):
            found: Optional[tuple[str, str]] = (creds.username, creds.password or "")
        else:
            found = docker_credentials(registry)
        self.has_credentials = found is not None
        self._token_lock = threading.Lock()  # layers upload in threads that share one token
        self._scopes: dict[str, set[str]] = {}  # "repository:box" -> actions, of every token asked for
        if found is not None:
            self.auth.set_basic_auth(*found)  # what the token backend sends to the token realm
            if backend == "basic":
                # Send Basic credentials up front: saves a 401 round trip per request.
                self.headers["Authorization"] = f"Basic {oras.auth.utils.get_basic_auth(*found)}"

    def _probe(self) -> str:
        """Ping /v2/ to pick http or https and learn the auth scheme; fail fast when down."""
        host = self.host
        verify = self.options.ca_bundle or self.options.tls_verify
        schemes = ["https"]
        if self.options.plain_http:
            schemes = ["http"]
        elif self.options.plain_http is None and _is_loopback(host):
            # Plain http first: what a loopback registry usually speaks, and a TLS attempt costs
            # ~50 ms of CPU (the CA bundle); a TLS registry answers it 400, and https is tried next.
            schemes = ["http", "https"]
        first_error: Optional[Exception] = None
        for scheme in schemes:
            try:
                r = requests.get(f"{scheme}://{host}/v2/", timeout=PING_TIMEOUT, verify=verify)
            except requests.exceptions.SSLError as e:
                first_error = e  # the TLS error is the real cause, whatever plain http said
                continue
            except requests.exceptions.RequestException as e:
                first_error = first_error or e
                continue
            if r.status_code == 400 and scheme == "http" and len(schemes) > 1:
                continue  # an https server answering plain http
            challenge = r.headers.get("Www-Authenticate", "")
            self._auth_kind = "basic" if challenge.lower().startswith("basic") else "token"
            return scheme
        if isinstance(first_error, requests.exceptions.SSLError):
            raise RegistryUnreachable(
                f"TLS to registry {host} failed: {short_error(first_error)}",
                "pass --ca-cert FILE for a private CA, or --plain-http for a registry without TLS",
            )
        raise RegistryUnreachable(
            f"registry {host} is not reachable: {short_error(first_error)}",
            "check the host and port, and that the registry is running",
        )

    def request(self, method: str, url: str, resend: bool = True, **kw) -> requests.Response:
        """One registry request over oras's session (auth, token refresh), retried by us with a short
        backoff: a registry that restarts or throttles (429/5xx, its Retry-After honoured) is
        waited for, one that is down fails in seconds.
        (oras's do_request retries with waits of minutes, so it is not used.)
        `resend=False` for a streamed body, which cannot be sent twice: a broken connection or an
        expired token is then a RegistryError, for the caller to start its upload over."""
        headers = dict(self.headers)
        headers.update(kw.pop("headers", {}) or {})
        registry = self.registry
        refreshed = False
        for delay in (*RETRY_DELAYS, None) if resend else (None,):
            try:
                r = self._send(method, url, dict(headers), **kw)
                if r.status_code == 401 and not refreshed and self._needs_new_token(r):
                    refreshed = True  # once: a token the server scopes down again is a refusal
                    if not resend:
                        raise RegistryError(f"registry {registry} asked for a new token during an upload")
                    r = self._send(method, url, dict(headers), **kw)
            except requests.exceptions.SSLError as e:
                raise RegistryUnreachable(f"TLS to registry {registry} failed: {short_error(e)}")
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as e:
                if not resend:
                    raise RegistryError(f"upload to registry {registry} broke: {short_error(e)}")
                if delay is None:
                    raise RegistryUnreachable(f"registry {registry} stopped answering: {short_error(e)}",
                                              "run the command again when it is back: what was pushed stays pushed")
                self.backoff(delay)
                continue
            except requests.exceptions.RequestException as e:
                raise RegistryUnreachable(f"registry {registry} failed: {short_error(e)}")
            except oras.auth.AuthenticationException:
                raise self._no_token()
            if worth_retrying(r) and delay is not None:
                self.backoff(retry_delay(r, delay))
                r.close()
                continue
            break
        if r.status_code in (401, 403):
            if not self.has_credentials:
                raise AuthError(f"registry {registry} asks for credentials we do not have")
            raise AuthError(
                f"registry {registry} refused the credentials for {method} on {self.repository} (HTTP {r.status_code})",
                "check the username/password or the token's permissions",
            )
        return r

    def backoff(self, seconds: float) -> None:
        """Wait before asking again (scaled: retry.py)."""
        self.sleep(scaled(seconds))

    def _send(self, method: str, url: str, headers: dict, **kw) -> requests.Response:
        """One request; a 401 answered once by oras's auth backend (a bearer token for the
        challenge's scope), as oras's do_request does but without its retry decorator."""
        auth = self.auth
        if isinstance(auth, oras.auth.TokenAuth):
            headers.update(auth.get_auth_header())  # the token we hold, if any
        r = self.session.request(method, url, headers=headers, verify=self.verify, **kw)
        if r.status_code != 401 or self._auth_kind == "basic":
            return r  # Basic credentials went with the request: a 401 is a refusal
        headers, changed = auth.authenticate_request(r, headers)
        if not changed:
            raise self._no_token()
        r.close()
        return self.session.request(method, url, headers=headers, verify=self.verify, **kw)

    def _no_token(self) -> AuthError:
        """oras could not answer the registry's auth challenge: no token for us."""
        if self.has_credentials:
            return AuthError(f"registry {self.registry} refused the credentials for {self.repository}",
                             "check the username/password or the token's permissions")
        return AuthError(f"registry {self.registry} asks for credentials we do not have")

    def _needs_new_token(self, r: requests.Response) -> bool:
        """A 401 with a Bearer challenge after oras sent its token: the token lacks the scope this
        request needs (a pull token on a push: error="insufficient_scope") or it expired. oras
        keeps one token and would send it again. Get a new one for the challenge's scope (e.g.
        repository:box:pull,push) joined with the scopes of the tokens before it, so that it
        replaces the old one for every later request, pulls included. True if there is a new
        token to try (ours, or one another thread got meanwhile)."""
        auth = self.auth
        challenge = r.headers.get("Www-Authenticate", "")
        if not isinstance(auth, oras.auth.TokenAuth) or not challenge.lower().startswith("bearer"):
            return False
        sent = r.request.headers.get("Authorization") if r.request is not None else None
        r.close()
        with self._token_lock:
            if auth.token and sent != f"Bearer {auth.token}":
                return True  # another thread replaced the token after this request was sent
            h = oras.auth.utils.parse_auth_header(challenge)
            for one in (h.scope or "").split():
                resource, _, actions = one.rpartition(":")
                self._scopes.setdefault(resource, set()).update(a for a in actions.split(",") if a)
            if self._scopes:
                h.scope = " ".join(f"{res}:{','.join(sorted(acts))}" for res, acts in sorted(self._scopes.items()))
            # What oras's authenticate_request(refresh=True) does, without a moment with no token:
            # other threads keep sending the old one until the new one is set.
            token = auth.request_token(h)
            if not token:
                return False
            auth.token = token
            return True

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.host}/v2/{self.repository}/{path}"

    def absolute(self, location: str) -> str:
        return urllib.parse.urljoin(f"{self.scheme}://{self.host}/", location)


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """oras passes no timeout to requests; this gives every request one."""

    def send(self, request, **kw):
        if kw.get("timeout") is None:
            kw["timeout"] = TIMEOUT
        return super().send(request, **kw)
