"""Docker's config file (config.json, where `docker login` and `snap login` keep credentials), read
as input like any other: opened without blocking (a FIFO, a device or a directory refused), never
through a symlink another user owns or one in a directory they own, at most 4 MiB, every entry
snap uses checked for its type (a malformed one is one line, exit 4, as Docker refuses the file).
Written whole or not at all, 0600, and never into a directory another user owns nor through their
symlink."""

from __future__ import annotations

import base64
import binascii
import errno
import json
import os
import stat
from typing import Optional

from snapshotter.errors import AuthError, storage_error
from snapshotter.state import another_users, replace_file

from .credential_helper import FIX, is_program_name

CONFIG_LIMIT = 4 << 20  # bytes: Docker's own configs are a few KiB
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}


def config_path() -> str:
    """The config `docker login` writes: $DOCKER_CONFIG/config.json, else ~/.docker/config.json."""
    return os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json")


def load_for_reading() -> Optional[dict]:
    """The config credentials are read from, checked; None if there is none. Where the docker SDK
    looks: $DOCKER_CONFIG/config.json (only there when it is set, as Docker), else
    ~/.docker/config.json, else the legacy ~/.dockercfg (a JSON object of auths)."""
    config = load(config_path())
    if config is not None or os.environ.get("DOCKER_CONFIG"):
        return config
    legacy_path = os.path.expanduser("~/.dockercfg")
    legacy = load(legacy_path, legacy=True)
    if legacy is None:
        return None
    check({"auths": legacy}, legacy_path)
    return {"auths": legacy}


def load(path: str, legacy: bool = False) -> Optional[dict]:
    """The config at `path` as a checked dict; {} for an empty file, None if there is none."""
    text = _read(path)
    if text is None:
        return None
    if not text.strip():
        return {}  # an empty file, as some tools leave: Docker takes it as no config
    try:
        config = json.loads(text)
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise AuthError(f"Docker's config {path!r} is not a JSON object: not touching it", FIX)
    if not legacy:
        check(config, path)
    return config


def _read(path: str) -> Optional[bytes]:
    """The bytes of `path`; None if it does not exist. Its directory is opened first and the file
    below that handle, so that the owner checked is the directory's the file is in."""
    directory, name = os.path.split(path)
    try:
        dfd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise AuthError(f"cannot read Docker's config {path!r}: {e.strerror or e}", FIX) from None
    try:
        fd = _open_below(dfd, name, path)
    except FileNotFoundError:
        return None  # also a dangling symlink: no config, as Docker reads it
    except OSError as e:
        raise AuthError(f"cannot read Docker's config {path!r}: {e.strerror or e}", FIX) from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AuthError(f"Docker's config {path!r} is {_KINDS.get(stat.S_IFMT(st.st_mode), 'no file')}, "
                            "not a file: not reading it", FIX)
        with open(fd, "rb", closefd=False) as f:
            data = f.read(CONFIG_LIMIT + 1) if st.st_size <= CONFIG_LIMIT else b""
    finally:
        os.close(fd)
    if st.st_size > CONFIG_LIMIT or len(data) > CONFIG_LIMIT:
        raise AuthError(f"Docker's config {path!r} is larger than {CONFIG_LIMIT >> 20} MiB: not reading it", FIX)
    return data


def _open_below(dfd: int, name: str, path: str) -> int:
    """`name` in the directory `dfd`, opened for reading without blocking (a FIFO is opened at once,
    then refused, never waited on); not followed if it is a symlink another user owns or one in a
    directory another user owns (they may point it anywhere): refused, one line."""
    owner = os.fstat(dfd).st_uid
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    if another_users(owner):
        try:
            return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise AuthError(f"Docker's config {path!r} is a symlink in a directory uid {owner} owns: "
                            "not following it", FIX) from None
    link = os.lstat(name, dir_fd=dfd)  # the directory is ours or root's: no one else can swap it after this
    if stat.S_ISLNK(link.st_mode) and another_users(link.st_uid):
        raise AuthError(f"Docker's config {path!r} is a symlink uid {link.st_uid} owns: not following it", FIX)
    return os.open(name, flags, dir_fd=dfd)


def check(config: dict, path: str) -> None:
    """Refuse (one line) a config whose auths, credsStore or credHelpers are of the wrong type,
    an inline auth that is no base64 of user:password, or a helper that is no program name:
    Docker refuses such a file whole; the helper names are what snap would run."""
    def bad(what: str, why: str) -> AuthError:
        return AuthError(f"Docker's config {path!r} has {what} that {why}", FIX)

    auths = config.get("auths")
    if auths is not None and not isinstance(auths, dict):
        raise bad('an "auths"', "is not an object")
    for key, entry in (auths or {}).items():
        if entry is not None and not isinstance(entry, dict):
            raise bad(f"an entry for {_short(key)}", "is not an object")
        decode_auth(entry or {}, key, path)
    store = config.get("credsStore")
    if store not in (None, "") and not is_program_name(store):
        raise bad(f'a "credsStore" {_short(store)}', "is no program name")
    helpers = config.get("credHelpers")
    if helpers is not None and not isinstance(helpers, dict):
        raise bad('a "credHelpers"', "is not an object")
    for key, name in (helpers or {}).items():
        if name != "" and not is_program_name(name):
            raise bad(f"a credential helper for {_short(key)}, {_short(name)},", "is no program name")


def decode_auth(entry: dict, key: str, path: str) -> Optional[tuple[str, str]]:
    """(username, password) of an auths entry's inline "auth"; None if it has none."""
    auth = entry.get("auth")
    if auth is None or auth == "":
        return None
    try:
        if not isinstance(auth, str):
            raise ValueError
        username, sep, password = base64.b64decode(auth, validate=True).decode().partition(":")
    except (ValueError, binascii.Error, UnicodeDecodeError):
        sep = ""
    if not sep:  # the secret itself is never printed
        raise AuthError(f"Docker's config {path!r} has an \"auth\" for {_short(key)} that is not the base64 of "
                        "user:password", FIX)
    return username, password


def helper_for(config: dict, key: str) -> Optional[str]:
    """The credential helper the (checked) config names for `key`: credHelpers', else credsStore."""
    return ((config.get("credHelpers") or {}).get(key) or config.get("credsStore")) or None


def save(config: dict) -> None:
    """Write `config` whole or not at all (a temp file renamed over it), 0600, in a 0700 directory
    made if missing; written where a symlink of ours points, as Docker does."""
    directory = os.path.dirname(config_path())
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        raise storage_error(e, directory, " (Docker's config)") from None
    target = writable_target()
    try:
        replace_file(target, lambda f: f.write(json.dumps(config, indent="\t") + "\n"), durable=True)
    except OSError as e:
        raise storage_error(e, os.path.dirname(target), " (Docker's config)") from None


def writable_target() -> str:
    """Where the config may be written: refused (one line) when its directory, or its symlink, or
    the directory the symlink leads to belongs to another user (neither us nor root): they could
    swap in a symlink that has us write over a file of ours. Checked before anything is stored,
    and again when it is written."""
    path = config_path()
    try:
        _refuse_another_users(os.path.dirname(path), "directory")
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            if another_users(st.st_uid):
                raise _not_writing(path, "symlink", st.st_uid)
            path = os.path.realpath(path)
            _refuse_another_users(os.path.dirname(path), "directory")
    except FileNotFoundError:
        return path  # no directory yet (save makes it, ours), no file, or a symlink to nowhere: replaced
    except OSError as e:
        raise storage_error(e, os.path.dirname(path), " (Docker's config)") from None
    return path


def _refuse_another_users(directory: str, what: str) -> None:
    owner = os.stat(directory).st_uid
    if another_users(owner):
        raise _not_writing(directory, what, owner)


def _not_writing(path: str, what: str, owner: int) -> AuthError:
    return AuthError(f"Docker's config {what} {path!r} belongs to uid {owner}, not to uid {os.geteuid()} that snap "
                     "runs as: not writing credentials there",
                     f"run snap login as uid {owner}, or set DOCKER_CONFIG to a directory of your own")


def _short(value: object) -> str:
    return repr(value if not isinstance(value, str) else value[:100])
