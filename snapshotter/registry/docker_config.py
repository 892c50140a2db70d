"""Docker's config file (config.json, where `docker login` and `snap login` keep credentials), read
as input like any other: opened without blocking (a FIFO, a device or a directory refused), never
through a symlink another user owns or one in a directory they own, at most 4 MiB, every entry
snap uses checked for its type (a malformed one is one line, exit 4, as Docker refuses the file).
Written whole or not at all, 0600, and never below a directory another user owns nor through a
symlink of theirs or one in their directory, anywhere on the path (each name on it is checked)."""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import json
import os
import stat
from typing import Optional

from snapshotter import jsontext
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
        config = jsontext.loads(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise AuthError(f"Docker's config {path!r} is not a JSON object: not touching it", FIX)
    if not legacy:
        check(config, path)
    return config


def _read(path: str) -> Optional[bytes]:
    """The bytes of `path`; None if it does not exist. Its directory is walked to (see _walk) and the
    file opened below that handle, never followed: what _walk checked is what is opened."""
    try:
        dfd, directory, name = _walk(path, write=False)
    except FileNotFoundError:
        return None  # also a dangling symlink: no config, as Docker reads it
    except OSError as e:
        raise AuthError(f"cannot read Docker's config {path!r}: {e.strerror or e}", FIX) from None
    try:  # without blocking: a FIFO is opened at once, then refused, never waited on
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # made a symlink since _walk looked: only the directory's owner could
            raise _not_following(os.path.join(directory, name), "in a directory", os.fstat(dfd).st_uid) from None
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


def _walk(path: str, write: bool, make: bool = False, leaf: bool = True) -> tuple[int, str, str]:
    """(a handle of the directory `path`'s last name is in, that directory's real path, the name),
    walked one name at a time from / without the kernel following anything: a symlink is followed
    here, and only if neither it nor the directory it is in belongs to another user (they could
    point it anywhere, or swap it after we looked). For a `write`, no directory on the way, nor the
    file, may be theirs at all: they could swap what is in it. Whether the last name exists is the
    caller's to find out (`leaf`=False: it is a directory too, opened; name ""); a missing
    directory on the way is FileNotFoundError, or made 0700 (`make`) and then checked as found."""
    todo = [n for n in reversed(os.path.join(os.getcwd(), path).split("/")) if n not in ("", ".")]
    dfd, real, links = os.open("/", _DIRECTORY), "/", 0
    try:
        _check_directory(dfd, real, write)
        while todo:
            name = todo.pop()
            last = leaf and not todo
            try:
                st = os.lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                if last:
                    return dfd, real, name
                if not make:
                    raise
                with contextlib.suppress(FileExistsError):  # made meanwhile: checked as found
                    os.mkdir(name, 0o700, dir_fd=dfd)
                st = os.lstat(name, dir_fd=dfd)
            shown = os.path.join(real, name)
            if stat.S_ISLNK(st.st_mode):
                _check_symlink(st.st_uid, os.fstat(dfd).st_uid, shown)
                links += 1
                if links > 40:  # the kernel's own bound
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink(name, dir_fd=dfd)
                if target.startswith("/"):
                    os.close(dfd)
                    dfd, real = os.open("/", _DIRECTORY), "/"
                todo.extend(n for n in reversed(target.split("/")) if n not in ("", "."))
                continue
            if last:
                if write and another_users(st.st_uid):
                    raise _not_writing(shown, "file", st.st_uid)
                return dfd, real, name
            next_fd = os.open(name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)
            os.close(dfd)
            dfd, real = next_fd, os.path.dirname(real) if name == ".." else shown
            _check_directory(dfd, real, write)
        return dfd, real, ""
    except BaseException:
        os.close(dfd)
        raise


# O_PATH: a directory we may only search (0711) is walked through as the kernel would
_DIRECTORY = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC


def _check_directory(dfd: int, real: str, write: bool) -> None:
    """For a write, refuse a directory another user owns (by its handle: what was opened)."""
    owner = os.fstat(dfd).st_uid
    if write and another_users(owner):
        raise _not_writing(real, "directory", owner)


def _check_symlink(owner: int, directory_owner: int, shown: str) -> None:
    """Refuse (one line) to follow a symlink another user owns, or one in a directory they own."""
    if another_users(directory_owner):
        raise _not_following(shown, "in a directory", directory_owner)
    if another_users(owner):
        raise _not_following(shown, "", owner)


def _not_following(path: str, where: str, owner: int) -> AuthError:
    where = f" {where}" if where else ""
    return AuthError(f"Docker's config {path!r} is a symlink{where} uid {owner} owns: not following it", FIX)


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
    made if missing (one name at a time, each checked as writable_target checks what it finds);
    written where a symlink of ours points, as Docker does."""
    directory = os.path.dirname(config_path())
    try:
        os.close(_walk(directory, write=True, make=True, leaf=False)[0])
    except OSError as e:
        raise storage_error(e, directory, " (Docker's config)") from None
    target = writable_target()
    try:
        replace_file(target, lambda f: f.write(json.dumps(config, indent="\t") + "\n"), durable=True)
    except OSError as e:
        raise storage_error(e, os.path.dirname(target), " (Docker's config)") from None


def writable_target() -> str:
    """Where the config may be written: refused (one line) when any directory on its way, the file,
    or a symlink on its way or the directory that symlink is in belongs to another user (neither us
    nor root): they could swap in a symlink that has us write over a file of ours. Every directory
    the returned path goes through is then ours or root's. Checked before anything is stored, and
    again when it is written."""
    path = config_path()
    try:
        dfd, directory, name = _walk(path, write=True)
    except FileNotFoundError:
        return path  # no directory yet (save makes it, ours), or a symlink into none: replaced, as Docker
    except OSError as e:
        raise storage_error(e, os.path.dirname(path), " (Docker's config)") from None
    os.close(dfd)
    return os.path.join(directory, name)


def _not_writing(path: str, what: str, owner: int) -> AuthError:
    return AuthError(f"Docker's config {what} {path!r} belongs to uid {owner}, not to uid {os.geteuid()} that snap "
                     "runs as: not writing credentials there",
                     f"run snap login as uid {owner}, or set DOCKER_CONFIG to a directory of your own")


def _short(value: object) -> str:
    return repr(value if not isinstance(value, str) else value[:100])
