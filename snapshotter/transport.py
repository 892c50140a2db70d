"""HTTP to a registry: where it is (http or https, probed), who we are (Basic credentials, bearer
tokens and their scopes, Docker's credentials), and how a request survives a registry that restarts
(timeouts, retries with backoff). registry.py speaks the distribution protocol over this.

oras-py gives the HTTP session, the token dance and the docker-config credential helpers; this
module calls past its retry decorator (which sleeps minutes per request) and adds our own.
"""

from __future__ import annotations

import dataclasses
import email.utils
import ipaddress
import json
import os
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Callable, Optional

import oras.auth
import oras.auth.utils
import oras.provider
import oras.utils
import requests

from .errors import AuthError, RegistryError, RegistryUnreachable
from .reference import DOCKER_HUB_NAMES, api_host

PING_TIMEOUT = 10
TIMEOUT = (10, 300)  # connect, read: a registry that hangs is an error, not a wait forever
RETRY_DELAYS = (0.5, 1, 2, 4, 8)  # ~15 s for a registry to come back before we give up
RETRY_STATUSES = (429, 500, 502, 503, 504)  # busy, throttling or restarting: worth asking again
MAX_RETRY_AFTER = 60  # seconds: a longer Retry-After is waited this long, then asked again
# oras's request function without its retry decorator (which sleeps up to minutes per request).
_do_request = oras.provider.Registry.do_request.__wrapped__

DOCKER_HUB_LOGIN = "https://index.docker.io/v1/"  # the key `docker login` stores Docker Hub's credentials under


@dataclass
class Credentials:
    username: Optional[str] = None
    password: Optional[str] = None


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
        self.oras = oras.provider.Registry(
            self.host, insecure=self.scheme == "http", tls_verify=verify, auth_backend=backend
        )
        self.oras.session.mount("http://", _TimeoutAdapter())
        self.oras.session.mount("https://", _TimeoutAdapter())
        creds = self.options.credentials
        if self.options.explicit_credentials_for(registry):
            self.oras.auth.set_basic_auth(creds.username, creds.password or "")
        else:
            load_docker_credentials(self.oras.auth, registry)
        self.has_credentials = bool(getattr(self.oras.auth, "_basic_auth", None))
        self._token_lock = threading.Lock()  # layers upload in threads that share one token
        self._scopes: dict[str, set[str]] = {}  # "repository:box" -> actions, of every token asked for
        if backend == "basic" and self.has_credentials:
            # Send Basic credentials up front: saves a 401 round trip per request.
            self.oras.headers["Authorization"] = f"Basic {self.oras.auth._basic_auth}"
        elif not self.has_credentials:
            self.oras.auth._basic_auth = None  # oras expects the attribute; unset it means anonymous

    def _probe(self) -> str:
        """Ping /v2/ to pick http or https and learn the auth scheme; fail fast when down."""
        host = self.host
        verify = self.options.ca_bundle or self.options.tls_verify
        schemes = ["https"]
        if self.options.plain_http:
            schemes = ["http"]
        elif self.options.plain_http is None and _is_loopback(host):
            schemes = ["https", "http"]
        first_error: Optional[Exception] = None
        for scheme in schemes:
            try:
                r = requests.get(f"{scheme}://{host}/v2/", timeout=PING_TIMEOUT, verify=verify)
            except requests.exceptions.SSLError as e:
                first_error = first_error or e
                continue
            except requests.exceptions.RequestException as e:
                first_error = first_error or e
                continue
            if r.status_code == 400 and scheme == "http" and first_error is not None:
                break  # an https server answering plain http: the TLS error is the real cause
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
        """One registry request through oras (auth, token refresh), retried by us with a short
        backoff: a registry that restarts or throttles (429/5xx, its Retry-After honoured) is
        waited for, one that is down fails in seconds.
        (oras's own retry decorator waits minutes per request, so we call past it.)
        `resend=False` for a streamed body, which cannot be sent twice: a broken connection or an
        expired token is then a RegistryError, for the caller to start its upload over."""
        headers = dict(self.oras.headers)
        headers.update(kw.pop("headers", {}) or {})
        registry = self.registry
        refreshed = False
        for delay in (*RETRY_DELAYS, None) if resend else (None,):
            try:
                r = _do_request(self.oras, url, method, headers=dict(headers), **kw)
                if r.status_code == 401 and not refreshed and self._needs_new_token(r):
                    refreshed = True  # once: a token the server scopes down again is a refusal
                    if not resend:
                        raise RegistryError(f"registry {registry} asked for a new token during an upload")
                    r = _do_request(self.oras, url, method, headers=dict(headers), **kw)
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
            except (oras.auth.AuthenticationException, ValueError):
                # oras could not answer the registry's auth challenge (no token for us)
                if self.has_credentials:
                    raise AuthError(f"registry {registry} refused the credentials for {self.repository}",
                                    "check the username/password or the token's permissions")
                raise AuthError(f"registry {registry} asks for credentials we do not have",
                                "log in with `docker login`, or pass --username and --password-stdin")
            if r.status_code in RETRY_STATUSES and delay is not None:
                self.backoff(retry_delay(r, delay))
                r.close()
                continue
            break
        if r.status_code in (401, 403):
            if not self.has_credentials:
                raise AuthError(f"registry {registry} asks for credentials we do not have",
                                "log in with `docker login`, or pass --username and --password-stdin")
            raise AuthError(
                f"registry {registry} refused the credentials for {method} on {self.repository} (HTTP {r.status_code})",
                "check the username/password or the token's permissions",
            )
        return r

    def backoff(self, seconds: float) -> None:
        """Wait before asking again. $SNAP_RETRY_SCALE scales every wait (tests make them short)."""
        self.sleep(seconds * _retry_scale())

    def _needs_new_token(self, r: requests.Response) -> bool:
        """A 401 with a Bearer challenge after oras sent its token: the token lacks the scope this
        request needs (a pull token on a push: error="insufficient_scope") or it expired. oras
        keeps one token and would send it again. Get a new one for the challenge's scope (e.g.
        repository:box:pull,push) joined with the scopes of the tokens before it, so that it
        replaces the old one for every later request, pulls included. True if there is a new
        token to try (ours, or one another thread got meanwhile)."""
        auth = self.oras.auth
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


def retry_delay(r: requests.Response, default: float) -> float:
    """How long to wait before asking again: the registry's Retry-After (seconds or an HTTP date,
    at most MAX_RETRY_AFTER), else our own backoff step."""
    value = r.headers.get("Retry-After", "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            return default
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def _retry_scale() -> float:
    try:
        return max(0.0, float(os.environ.get("SNAP_RETRY_SCALE") or 1))
    except ValueError:
        return 1.0


def load_docker_credentials(auth: oras.auth.AuthBackend, registry: str) -> bool:
    """Credentials for `registry` from $DOCKER_CONFIG/config.json (else ~/.docker/config.json) into
    `auth`: inline auths, credHelpers and credsStore, the helpers run by oras. (oras itself ignores
    $DOCKER_CONFIG.) Docker Hub's are found under any of its names. True if some were found."""
    path = os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")
    if not os.path.exists(path):
        return False
    try:
        with open(path) as f:
            cfg = json.load(f)
        auths = {_auth_key(k): v for k, v in (cfg.get("auths") or {}).items()}
        auth._auth_config = {
            "auths": auths, "credsStore": cfg.get("credsStore"), "credHelpers": cfg.get("credHelpers") or {},
        }
        if registry in DOCKER_HUB_NAMES:
            for key in DOCKER_HUB_NAMES:  # inline auths, whichever of its names docker used
                if (auths.get(key) or {}).get("auth"):
                    auth._basic_auth = auths[key]["auth"]
                    return True
            return auth._load_auth(DOCKER_HUB_LOGIN)  # the helpers, asked with the key docker gives them
        for host in oras.utils.iter_localhosts(registry):
            if auth._load_auth(host):
                return True
        return False
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise AuthError(f"cannot read registry credentials from {path}: {short_error(e)}")


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """oras passes no timeout to requests; this gives every request one."""

    def send(self, request, **kw):
        if kw.get("timeout") is None:
            kw["timeout"] = TIMEOUT
        return super().send(request, **kw)


def _auth_key(key: str) -> str:
    """Docker config auths may be keyed "https://host/v1/": reduce to "host"."""
    return key.split("://", 1)[-1].split("/", 1)[0]


def check(r: requests.Response, what: str) -> None:
    """A RegistryError with the registry's own error codes, for an answer that is not a success."""
    if r.status_code < 300:
        return
    detail = ""
    try:
        errors = r.json().get("errors", [])
        detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors if isinstance(e, dict))
    except ValueError:
        detail = r.text[:200].strip()
    raise RegistryError(f"{what} failed: HTTP {r.status_code} {detail}".strip())


def short_error(e: Optional[BaseException]) -> str:
    """The last, most specific line of a requests/urllib3 error chain."""
    if e is None:
        return "no answer"
    text = str(e)
    for key in ("Connection refused", "Name or service not known", "timed out", "certificate verify failed",
                "No route to host", "Temporary failure in name resolution"):
        if key in text:
            return key
    return text.splitlines()[0][:200]

