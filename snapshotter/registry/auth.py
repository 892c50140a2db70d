"""Who we are to a registry, on each request: Basic credentials sent up front, or a bearer token
for the scopes the requests need (asked for with our credentials, or anonymously). The transport
sends every request through one of these; nothing else sets an Authorization header.

The bearer side is oras-py's public auth API (`oras.auth`: not `oras.provider`, whose import of
jsonschema cost every restore's start ~0.1 s): its answer to a 401 challenge
(`authenticate_request`) and its token requests (`request_token`)."""

from __future__ import annotations

import threading
from typing import Callable, Optional, Union

import oras.auth
import oras.auth.utils
import requests

from snapshotter.errors import AuthError

Send = Callable[[dict], requests.Response]  # one request with these headers


class _Auth:
    def __init__(self, registry: str, repository: str, credentials: Optional[tuple[str, str]]):
        self.registry, self.repository = registry, repository
        self.has_credentials = credentials is not None

    def refusal(self, request: str = "") -> AuthError:
        """The registry turned us away (`request`: what it refused; default, the repository)."""
        if not self.has_credentials:
            return AuthError(f"registry {self.registry} asks for credentials we do not have")
        return AuthError(f"registry {self.registry} refused the credentials for {request or self.repository}",
                         "check the username/password or the token's permissions")


class Basic(_Auth):
    """Basic credentials, sent with every request (saves a 401 round trip per request): a 401
    is a refusal."""

    def __init__(self, registry: str, repository: str, credentials: Optional[tuple[str, str]]):
        super().__init__(registry, repository, credentials)
        self.header = {"Authorization": f"Basic {oras.auth.utils.get_basic_auth(*credentials)}"} if credentials else {}

    def send(self, send: Send, headers: dict) -> requests.Response:
        return send({**self.header, **headers})

    def refresh(self, r: requests.Response) -> bool:
        return False  # no token to renew


class Bearer(_Auth):
    """A bearer token, shared by the threads that upload layers. A 401 is answered once with a
    token for the challenge's scope, as oras's do_request does but without its retry decorator
    (whose waits are minutes: retries are retry.py's)."""

    def __init__(self, registry: str, repository: str, credentials: Optional[tuple[str, str]],
                 session: requests.Session, insecure: bool, verify: Union[bool, str]):
        super().__init__(registry, repository, credentials)
        self.backend = oras.auth.get_auth_backend("token", session, insecure, tls_verify=verify)
        if credentials is not None:
            self.backend.set_basic_auth(*credentials)  # sent to the token realm
        self._lock = threading.Lock()
        self._scopes: dict[str, set[str]] = {}  # "repository:box" -> actions, of every token asked for

    def send(self, send: Send, headers: dict) -> requests.Response:
        headers.update(self.backend.get_auth_header())  # the token we hold, if any
        r = send(headers)
        if r.status_code != 401:
            return r
        try:
            headers, changed = self.backend.authenticate_request(r, headers)
        except oras.auth.AuthenticationException:
            changed = False
        if not changed:
            raise self.refusal()
        r.close()
        return send(headers)

    def refresh(self, r: requests.Response) -> bool:
        """A 401 with a Bearer challenge after oras sent its token: the token lacks the scope this
        request needs (a pull token on a push: error="insufficient_scope") or it expired. oras
        keeps one token and would send it again. Get a new one for the challenge's scope (e.g.
        repository:box:pull,push) joined with the scopes of the tokens before it, so that it
        replaces the old one for every later request, pulls included. True if there is a new
        token to try (ours, or one another thread got meanwhile)."""
        backend = self.backend
        challenge = r.headers.get("Www-Authenticate", "")
        if not challenge.lower().startswith("bearer"):
            return False
        sent = r.request.headers.get("Authorization") if r.request is not None else None
        r.close()
        with self._lock:
            if backend.token and sent != f"Bearer {backend.token}":
                return True  # another thread replaced the token after this request was sent
            h = oras.auth.utils.parse_auth_header(challenge)
            for one in (h.scope or "").split():
                resource, _, actions = one.rpartition(":")
                self._scopes.setdefault(resource, set()).update(a for a in actions.split(",") if a)
            if self._scopes:
                h.scope = " ".join(f"{res}:{','.join(sorted(acts))}" for res, acts in sorted(self._scopes.items()))
            # What oras's authenticate_request(refresh=True) does, without a moment with no token:
            # other threads keep sending the old one until the new one is set.
            try:
                token = backend.request_token(h)
            except oras.auth.AuthenticationException:
                raise self.refusal() from None
            if not token:
                return False
            backend.token = token
            return True


def authenticator(kind: str, registry: str, repository: str, credentials: Optional[tuple[str, str]],
                  session: requests.Session, insecure: bool, verify: Union[bool, str]) -> Union[Basic, Bearer]:
    """How to say who we are to a registry whose ping answered `kind` ("basic" or "token")."""
    if kind == "basic":
        return Basic(registry, repository, credentials)
    return Bearer(registry, repository, credentials, session, insecure, verify)
