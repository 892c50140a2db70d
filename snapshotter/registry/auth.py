"""Who we are to a registry, on each request: Basic credentials sent up front, or a bearer token
for the scopes the requests need (asked for with our credentials, or anonymously). The transport
sends every request to the registry's own origin through one of these; nothing else sets an
Authorization header.

oras-py's public auth API (`oras.auth.utils`: not `oras.provider`, whose import of jsonschema
cost every restore's start ~0.1 s) parses challenges and encodes Basic credentials, imported where
they are (~12 ms a command that meets neither); the token requests are ours, bounded and checked."""

from __future__ import annotations

import re
import threading
import urllib.parse
from typing import TYPE_CHECKING, Callable, Optional, Union

import requests

from snapshotter.errors import AuthError, RegistryError

from .answers import json_object, read_capped
from .destinations import check_destination

if TYPE_CHECKING:
    import oras.auth.utils

Send = Callable[[dict], requests.Response]  # one request with these headers
TOKEN_LIMIT = 1 << 20  # bytes of a token service's answer: its tokens are a few KiB
_TOKEN = re.compile(r"[\x21-\x7e]+")  # what an Authorization header can carry: no space, no newline


def _oras_auth():
    import oras.auth.utils

    return oras.auth.utils


class CredentialsRefused(AuthError):
    """The registry (or its token service) turned away the credentials we sent."""


class _Auth:
    def __init__(self, registry: str, repository: str, credentials: Optional[tuple[str, str]]):
        self.registry, self.repository = registry, repository
        self.has_credentials = credentials is not None

    def refusal(self, request: str = "") -> AuthError:
        """The registry turned us away (`request`: what it refused; default, the repository)."""
        if not self.has_credentials:
            return AuthError(f"registry {self.registry} asks for credentials we do not have")
        return CredentialsRefused(f"registry {self.registry} refused the credentials for {request or self.repository}",
                                  "check the username/password or the token's permissions")


class Basic(_Auth):
    """Basic credentials, sent with every request (saves a 401 round trip per request): a 401
    is a refusal."""

    def __init__(self, registry: str, repository: str, credentials: Optional[tuple[str, str]]):
        super().__init__(registry, repository, credentials)
        try:
            self.header = {"Authorization": f"Basic {_oras_auth().get_basic_auth(*credentials)}"} if credentials else {}
        except UnicodeEncodeError:  # a lone surrogate a helper's JSON escaped ("\udcff"): what is never UTF-8
            raise AuthError(f"the credentials for registry {registry} are not valid UTF-8",
                            "log in again: snap login REGISTRY") from None

    def send(self, send: Send, headers: dict) -> requests.Response:
        return send({**self.header, **headers})

    def refresh(self, r: requests.Response) -> bool:
        return False  # no token to renew


class Bearer(_Auth):
    """A bearer token, shared by the threads that upload layers. A 401 is answered once with a
    token for the challenge's scope, as oras's authenticate_request does, but asked for here: the
    realm is checked before it is reached (http(s) only, no metadata or link-local address; our
    credentials over plain http only to a plain http registry's realm), and its answer read
    within bounds and checked (oras reads any size and shape)."""

    def __init__(self, registry: str, repository: str, credentials: Optional[tuple[str, str]],
                 session: requests.Session, scheme: str, verify: Union[bool, str]):
        super().__init__(registry, repository, credentials)
        self.session, self.scheme, self.verify = session, scheme, verify
        self.basic = Basic(registry, repository, credentials).header  # sent to the token realm only
        self.token: Optional[str] = None
        self._lock = threading.Lock()
        self._scopes: dict[str, set[str]] = {}  # "repository:box" -> actions, of every token asked for

    def send(self, send: Send, headers: dict) -> requests.Response:
        token = self.token
        if token:
            headers["Authorization"] = f"Bearer {token}"
        r = send(headers)
        if r.status_code != 401 or token:
            return r  # a token the registry turns away: the transport refreshes it (refresh)
        challenge = r.headers.get("Www-Authenticate", "")
        r.close()
        if not challenge.lower().startswith("bearer"):
            raise self.refusal()
        token = self._request_token(_oras_auth().parse_auth_header(challenge))
        if not token:
            raise self.refusal()
        self.token = token
        headers["Authorization"] = f"Bearer {token}"
        return send(headers)

    def refresh(self, r: requests.Response) -> bool:
        """A 401 with a Bearer challenge after we sent a token: the token lacks the scope this
        request needs (a pull token on a push: error="insufficient_scope") or it expired. Get a
        new one for the challenge's scope (e.g. repository:box:pull,push) joined with the scopes
        of the tokens before it, so that it replaces the old one for every later request, pulls
        included. True if there is a new token to try (ours, or one another thread got meanwhile)."""
        challenge = r.headers.get("Www-Authenticate", "")
        if not challenge.lower().startswith("bearer"):
            return False
        sent = r.request.headers.get("Authorization") if r.request is not None else None
        r.close()
        with self._lock:
            if self.token and sent != f"Bearer {self.token}":
                return True  # another thread replaced the token after this request was sent
            h = _oras_auth().parse_auth_header(challenge)
            for one in (h.scope or "").split():
                resource, _, actions = one.rpartition(":")
                self._scopes.setdefault(resource, set()).update(a for a in actions.split(",") if a)
            if self._scopes:
                h.scope = " ".join(f"{res}:{','.join(sorted(acts))}" for res, acts in sorted(self._scopes.items()))
            # No moment without a token: other threads keep sending the old one until the new one is set.
            token = self._request_token(h)
            if not token:
                raise self.refusal()
            self.token = token
            return True

    def _request_token(self, h: oras.auth.utils.authHeader) -> Optional[str]:
        """A token from the challenge's realm for its service and scope (with our credentials if
        we have some); None if the realm turns us away. AuthError for a realm we may not reach or
        an answer that is no token."""
        if not h.realm:
            raise AuthError(f"registry {self.registry!r} asks for a token but its challenge names no realm")
        realm = h.realm if "://" in h.realm else f"{self.scheme}://{h.realm}"
        check_destination(realm, AuthError)
        host = repr(urllib.parse.urlsplit(realm).hostname)
        if self.basic and realm.lower().startswith("http://") and self.scheme == "https":
            raise AuthError(f"registry {self.registry!r} sends its token requests to {host} over plain http: "
                            "refusing to send the credentials there without TLS")
        params = {k: v for k, v in (("service", h.service), ("scope", h.scope)) if v}
        what = f"the answer of token service {host}"
        try:
            with self.session.get(realm, params=params, headers={"Accept": "application/json", **self.basic},
                                  verify=self.verify, stream=True) as r:
                if r.status_code != 200:
                    return None
                body = read_capped(r, TOKEN_LIMIT, what, AuthError)
        except RegistryError as e:  # a redirect of the realm that destinations.py refuses
            raise AuthError(str(e)) from None
        doc = json_object(body)
        if doc is None:
            raise AuthError(f"{what} is not a JSON object")
        token = doc.get("token") or doc.get("access_token")
        if token is None:
            return None
        if not isinstance(token, str) or not _TOKEN.fullmatch(token):
            raise AuthError(f"{what} holds no valid token")
        return token


def authenticator(kind: str, registry: str, repository: str, credentials: Optional[tuple[str, str]],
                  session: requests.Session, scheme: str, verify: Union[bool, str]) -> Union[Basic, Bearer]:
    """How to say who we are to a registry whose ping answered `kind` ("basic" or "token"), over `scheme`."""
    if kind == "basic":
        return Basic(registry, repository, credentials)
    return Bearer(registry, repository, credentials, session, scheme, verify)
