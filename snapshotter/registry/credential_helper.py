"""Docker's credential helpers (`docker-credential-NAME get|store|erase`, the helper protocol),
run with bounds: the name a program on PATH, never a path; a bounded wait
($SNAP_CREDENTIAL_HELPER_TIMEOUT seconds, default 30) and bounded output (1 MiB), past either
the helper and what it started killed. What a helper prints never reaches snap's output: a
failing one may echo the secret it was given, so a failure is said by its name and exit code."""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import time
from typing import Optional

from snapshotter import jsontext
from snapshotter import settings
from snapshotter.errors import AuthError

PREFIX = "docker-credential-"
TIMEOUT_ENV = "SNAP_CREDENTIAL_HELPER_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0
OUTPUT_LIMIT = 1 << 20
FIX = "check ~/.docker/config.json (or $DOCKER_CONFIG) and its credential helpers"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # no "/", no leading "-", no space or control character
TOKEN_USERNAME = "<token>"  # a helper's answer holding an OAuth identity token, which snap does not speak


def is_program_name(name: object) -> bool:
    """Whether `name` (from Docker's config) may name a helper: a program name on PATH, never a path or an option."""
    return isinstance(name, str) and len(name) <= 200 and _NAME.fullmatch(name) is not None


def get(name: str, server: str) -> Optional[tuple[str, str]]:
    """(username, secret) the helper keeps for `server`; None if it holds none (or an identity token)."""
    code, out = _run(name, "get", server.encode())
    if code != 0:
        if b"credentials not found" in out:  # the protocol's answer for none, on stdout
            return None
        raise _failed(name, "get", server, code)
    try:
        answer = jsontext.loads(out)
    except ValueError:
        answer = None
    if not (isinstance(answer, dict) and isinstance(answer.get("Username"), str)
            and isinstance(answer.get("Secret"), str)):
        raise AuthError(f"credential helper {PREFIX}{name} answered no credentials for {server!r} "
                        "(not a JSON object with a Username and a Secret)", FIX)
    username, secret = answer["Username"], answer["Secret"]
    if username == TOKEN_USERNAME or not (username or secret):
        return None  # "<token>": an identity token; "" and "": none (docker-credential-pass says so)
    return username, secret


def store(name: str, server: str, username: str, secret: str) -> None:
    data = json.dumps({"ServerURL": server, "Username": username, "Secret": secret}).encode()
    code, _ = _run(name, "store", data)
    if code != 0:
        raise _failed(name, "store", server, code)


def erase(name: str, server: str) -> bool:
    """Forget `server`'s credentials; False if the helper held none."""
    if get(name, server) is None:
        return False
    code, _ = _run(name, "erase", server.encode())
    if code != 0:
        raise _failed(name, "erase", server, code)
    return True


def _failed(name: str, action: str, server: str, code: int) -> AuthError:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return AuthError(f"credential helper {PREFIX}{name} failed to {action} the credentials for {server!r}: it {how} "
                     "(its output is not shown: it may hold the secret)", FIX)


def timeout_s() -> float:
    """How long a helper may take: $SNAP_CREDENTIAL_HELPER_TIMEOUT seconds, else 30."""
    return settings.seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S, "unset it for 30 s", above_zero=True)


def _program(name: str) -> str:
    """The helper's absolute path on PATH. Refused: a name that is no program name (a config may say
    "/tmp/x" or "../x"), one found only relative to the current directory ("." in PATH, as Go's
    exec.LookPath refuses it), one not found."""
    if not is_program_name(name):
        raise AuthError(f"Docker's config names a credential helper that is no program name: {str(name)[:100]!r}", FIX)
    exe = shutil.which(PREFIX + name)
    if exe is None:
        raise AuthError(f"credential helper {PREFIX}{name} is not on PATH", f"install it, or {FIX}")
    if not os.path.isabs(exe):
        raise AuthError(f"credential helper {PREFIX}{name} is found only in the current directory ({exe!r}): "
                        "not running it", "put its directory on PATH as an absolute path")
    return exe


def _run(name: str, action: str, data: bytes) -> tuple[int, bytes]:
    """`docker-credential-NAME ACTION` given `data` on stdin: (its exit code, its stdout). Its stderr
    goes nowhere; in a session of its own, so that a kill reaches what it started."""
    exe, limit = _program(name), timeout_s()
    deadline = time.monotonic() + limit
    try:
        proc = subprocess.Popen([exe, action], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        raise AuthError(f"cannot run credential helper {PREFIX}{name}: {e.strerror or e}", FIX) from None
    try:
        out = _exchange(proc, data, deadline)
        return proc.wait(max(0.0, deadline - time.monotonic())), out
    except subprocess.TimeoutExpired:
        raise AuthError(f"credential helper {PREFIX}{name} did not {action} within {limit:g} s: killed it",
                        f"check the helper (it may wait for a prompt or a keyring), or set {TIMEOUT_ENV}") from None
    except _TooMuch:
        raise AuthError(f"credential helper {PREFIX}{name} answered more than {OUTPUT_LIMIT >> 20} MiB to {action}: "
                        "killed it", FIX) from None
    finally:
        if proc.poll() is None:
            _kill(proc)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


class _TooMuch(Exception):
    pass


def _exchange(proc: subprocess.Popen, data: bytes, deadline: float) -> bytes:
    """Write `data` to the helper's stdin and read its stdout to the end, neither blocking past
    `deadline` (then TimeoutExpired); more than OUTPUT_LIMIT bytes of it is _TooMuch."""
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None
    os.set_blocking(stdin.fileno(), False)
    os.set_blocking(stdout.fileno(), False)
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(stdout, selectors.EVENT_READ)
        if data:
            sel.register(stdin, selectors.EVENT_WRITE)
        else:
            stdin.close()
        while sel.get_map():
            left = deadline - time.monotonic()
            ready = sel.select(left) if left > 0 else []
            if not ready:
                raise subprocess.TimeoutExpired(proc.args, left)
            for key, _ in ready:
                if key.fileobj is stdin:
                    data = _feed(stdin, data)
                    if not data:
                        sel.unregister(stdin)
                        stdin.close()
                    continue
                piece = os.read(stdout.fileno(), 65536)
                if not piece:
                    sel.unregister(stdout)
                out += piece
                if len(out) > OUTPUT_LIMIT:
                    raise _TooMuch()
    return bytes(out)


def _feed(stdin, data: bytes) -> bytes:
    """Write what the pipe takes now; what is left. A helper that closed its stdin gets no more."""
    try:
        return data[os.write(stdin.fileno(), data):]
    except BrokenPipeError:
        return b""
    except BlockingIOError:
        return data


def _kill(proc: subprocess.Popen) -> None:
    """Kill the helper and everything in its session (it may have started a keyring's client)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
