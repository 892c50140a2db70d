"""Where snap keeps local state: built layers, copied base blobs, cached base indexes, journals
(a restore downloads into staging dirs in its own root, not here); the lock that gives one
snap process at a time the state dir; and the rules its files share: a box root's files are
named by the root's key, and every format names its version, so that a file of another version
is never misread. The state dir is the user's alone, as ~/.ssh is (see private()), and snap's
alone: a dir of the user's files is refused, never swept (see _check_claim())."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import marshal
import os
import re
import shutil
import stat
import threading
import time
from contextlib import contextmanager
from typing import IO, Callable, Iterator, Optional

from . import jsontext
from .errors import DISK_FULL, StorageError

LOCK_NAME = "lock"
MARKER = ".snap-state-dir"  # in a state dir snap made or claimed: only such a dir is swept and tightened
BUILT_LAYERS = "layers"  # the state dir's folder of built layers, each removed by its user once sent
RESERVE = "reserve"  # room kept for the notes a next commit needs (snapshot/reserve.py)
# A built layer's name (layer/generate.py: "<digest hex>-<pid>-<n>"; an older snap's, the hex alone).
BUILT_NAME = re.compile(r"[0-9a-f]{64}(-[0-9]+-[0-9]+)?")
# Every name snap gives what it keeps at the top of its state dir: sub()'s first part, and its files
# there. Only these are snap's to sweep and tighten; a dir without MARKER that holds only these is an
# older snap's state dir, claimed as it is (see _check_claim()).
OWN_NAMES = frozenset({
    MARKER, LOCK_NAME, "blob-sources.json", BUILT_LAYERS, "blobs", "base-index", "stat-cache", "last-commit",
    "walk-memo", "record-memo", "plan-memo", "skeletons", "containers", "restored", "restore-journal",
    "restore-in-place", "restore-progress", "encrypted-layers", "origin-run", "watch", "parsed-profiles", RESERVE})
_held = 0  # how deep this process is in exclusive() (a commit from a container commits inside)
_held_guard = threading.Lock()
_checked: dict[str, str] = {}  # state dirs this process found private: as configured -> real path


def configured_state_dir() -> str:
    """The state dir as configured (not checked, perhaps not made yet)."""
    return os.environ.get("SNAP_STATE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "snap")


def state_dir() -> str:
    """$SNAP_STATE_DIR, else $XDG_CACHE_HOME/snap, else ~/.cache/snap; its real path (commit
    compares it with the box root to leave it out). Checked by private() once per process."""
    d = configured_state_dir()
    if d in _checked:
        return _checked[d]
    if not os.path.lexists(d):
        return os.path.realpath(d)  # nothing to check yet: sub() makes it, then checks it
    marked = _check_claim(d)  # a user's dir is refused before anything in it is changed
    real = private(d)
    if not marked:
        _mark(d)
    _checked[d] = real
    return real


def _own(name: str) -> bool:
    """Whether a name at the top of the state dir is one snap gives (OWN_NAMES), or a temp file of one."""
    return name.partition(".tmp.")[0] in OWN_NAMES


def _check_claim(top: str) -> bool:
    """Refuse the existing dir `top` if it is the user's, not snap's; return whether it is marked as
    snap's already. One not marked is snap's to claim if it is empty (a new disk's lost+found aside)
    or an older snap's (only names snap gives, its lock among them); any other is refused in one
    line, before snap removes what looks half-made in it or makes it private."""
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            return True  # nothing to claim: private() refuses a symlink; a file fails where it is used
        names = os.listdir(top)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable: private() or the first use says so
    if MARKER in names:
        return True
    names = sorted(n for n in names if n != "lost+found")  # a new disk's: empty, the filesystem's own
    foreign = [n for n in names if not _own(n)]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        why = f"it holds {foreign[0]!r}{more}, which snap never made"
    elif names and LOCK_NAME not in names:  # an older snap's holds the lock its commands take: not "layers" alone
        why = f"it holds {names[0]!r} but not snap's {LOCK_NAME!r}"
    else:
        return False
    raise StorageError(f"{top!r} is not snap's state dir: {why}",
                       "point SNAP_STATE_DIR at a new empty directory, or at snap's own")


def _mark(top: str) -> None:
    """Mark `top` as snap's state dir (an empty file, made once, never through a symlink)."""
    try:
        os.close(os.open(os.path.join(top, MARKER), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))
    except OSError:
        pass  # claimed by another snap process meanwhile, or read-only: its first write says why


def sub(*parts: str) -> str:
    """A directory in the state dir, made private (it holds layer blobs of the box). Its first part
    is one of OWN_NAMES: only those are swept and tightened."""
    if parts and parts[0] not in OWN_NAMES:
        raise ValueError(f"{parts[0]!r} is not in state.OWN_NAMES")  # a new folder: name it there
    if not os.path.lexists(configured_state_dir()):
        os.makedirs(configured_state_dir(), mode=0o700, exist_ok=True)
    path = os.path.join(state_dir(), *parts)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def private(top: str) -> str:
    """Check that the state dir at `top` is ours alone, as ssh checks ~/.ssh: it holds layers built
    from root-only files, and what snap reads back from it (stat cache, base indexes, journals, the
    watcher's pid) decides what a commit leaves out and what a restore or `watch --stop` trusts.
    Refused (one line): `top` itself a symlink; the dir, or what snap keeps in it (OWN_NAMES and
    one level in them: no more is snap's own; deeper is a container's mirror), owned by another
    uid or writable by group or others; a symlink, hard link or special file there. What is ours
    but readable by others (an older snap's 0755 dirs and 0644 files) is tightened to 0700 / 0600.
    Returns the real path."""
    me = os.geteuid()

    def check(path: str, depth: int) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # another snap process swept it meanwhile
        where = f"snap's state dir {top!r}" if path == top else f"{path!r} in snap's state dir"
        if stat.S_ISLNK(st.st_mode) and path == top:
            raise StorageError(f"{where} is a symlink", "set SNAP_STATE_DIR to the real directory, one of your own")
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a hard link" if stat.S_ISREG(st.st_mode) else "no file"
            raise StorageError(f"{where} is {kind}, which snap never makes there",
                               "someone may have planted it: remove it")
        if st.st_uid != me:
            raise StorageError(f"{where} belongs to uid {st.st_uid}, not to uid {me} that snap runs as",
                               f"chown -R {me} the state dir, or set SNAP_STATE_DIR to a directory of your own")
        if st.st_mode & 0o022:  # not what any snap made: someone else may have written there
            raise StorageError(f"{where} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
                               "check it, then chmod -R go-rwx the state dir, or set SNAP_STATE_DIR to a new directory")
        if st.st_mode & 0o077:
            try:
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
            except FileNotFoundError:
                pass
        if stat.S_ISDIR(st.st_mode) and depth < 2:
            try:
                names = os.listdir(path)
            except FileNotFoundError:
                return
            for name in names:
                if depth or _own(name):  # the top's other names are the user's: never checked nor tightened
                    check(os.path.join(path, name), depth + 1)

    check(top, 0)
    return os.path.realpath(top)


def another_users(uid: int) -> bool:
    """Whether `uid` is neither ours nor root's. Whoever owns a directory may swap any name in it
    (for a symlink to a file of ours, a FIFO) between our check and our use: in such a directory
    snap follows no symlink and, as root, writes nothing of its own (private() asks more of its own
    state dir: that it be ours alone)."""
    return uid not in (os.geteuid(), 0)


def open_own(path: str, mode: str = "r") -> IO:
    """open() for a file in the state dir: never through a symlink; made 0600."""
    return open(path, mode, opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))


def root_key(root: str, length: int = 32) -> str:
    """The name a box root's files in the state dir go by: the sha256 of its real path (the same
    root however it is spelt), in hex, cut to `length` digits."""
    return hashlib.sha256(os.fsencode(os.path.realpath(root))).hexdigest()[:length]


class RootFiles:
    """The files snap keeps for one box root, each named by the root's key (root_key): worked out
    once, where a command starts, and handed down to each module that keeps such a file."""

    def __init__(self, root: str):
        self.root = root  # as the user spelt it: for messages
        self.real = os.path.realpath(root)
        self.key = root_key(self.real)

    def file_in(self, directory: str) -> str:
        """The root's JSON file in `directory`."""
        return os.path.join(directory, self.key + ".json")


def versioned(doc: object, version: int) -> Optional[dict]:
    """`doc` (a parsed JSON document or header line) if it is an object of format `version`, else None."""
    return doc if isinstance(doc, dict) and doc.get("version") == version else None


def read_versioned(path: str, version: int) -> Optional[dict]:
    """The JSON document at `path` if it is of format `version`; None if it is missing, unreadable,
    damaged or of another version."""
    try:
        with open_own(path) as f:
            return versioned(jsontext.loads(f.read()), version)
    except (OSError, ValueError):
        return None


def write_versioned(path: str, version: int, fields: dict) -> None:
    """Write {"version": version, **fields} as the JSON document at `path`, whole or not at all."""
    replace_file(path, lambda f: json.dump({"version": version, **fields}, f))


_DIGEST_LEN = 64  # a marshalled file's sha256, in hex, ahead of its body


def read_marshalled(path: str) -> tuple[object, Optional[str]]:
    """The value write_marshalled() stored at `path`, and the file's digest; (None, None) if there is
    none, or it is damaged or cut short (its sha256 is checked before it is loaded)."""
    try:
        with open_own(path, "rb") as f:
            data = f.read()
        body = data[_DIGEST_LEN:]
        digest = hashlib.sha256(body).hexdigest()
        if digest.encode() != data[:_DIGEST_LEN]:
            return None, None
        return marshal.loads(body), digest
    except (OSError, ValueError, EOFError, TypeError):
        return None, None


# A full disk, a quota, a read-only mount: what refuses a state dir's write, not the write's own fault.
_NO_ROOM = (*DISK_FULL, errno.EROFS)


def if_room(write: Callable[[], object], warn: Optional[Callable[[str], None]] = None, what: str = "") -> bool:
    """Run a state-dir write that only saves work later (a memo, a cache, the record of a push): where
    the state dir's disk refuses it (full: a model download filled the box), skipped, said with
    `warn`, and the command goes on (what it sends matters more). Whether it was written."""
    try:
        write()
        return True
    except OSError as e:
        if e.errno not in _NO_ROOM:
            raise
        if warn is not None:  # not "point SNAP_STATE_DIR elsewhere": a new one would not know what this box made
            warn(f"warning: {what} not kept in the state dir {state_dir()!r} ({os.strerror(e.errno)}): "
                 + ("make it writable" if e.errno == errno.EROFS else "free space there"))
        return False


def write_marshalled(path: str, value) -> str:
    """Store `value` at `path` (marshal's form, its sha256 ahead of it), whole or not at all; the digest."""
    body = marshal.dumps(value)
    digest = hashlib.sha256(body).hexdigest()
    replace_file(path, lambda f: f.write(digest.encode() + body), opener=open_own, mode="wb")
    return digest


def remove_if_there(path: str) -> None:
    """Unlink `path` (never what a symlink there points to); nothing if it is not there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def replace_file(path: str, write: Callable[[IO], None], opener: Callable[..., IO] = open, mode: str = "w",
                 durable: bool = False) -> None:
    """Write a file whole or not at all: `write` fills a temp file beside it, which then replaces
    `path`; on any failure the temp file is removed. `durable` also fsyncs the file and directory.
    The temp file is made here, 0600 and new (no symlink followed), before `opener` opens it."""
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"  # threads of one process may write the same file
    try:
        remove_if_there(tmp)  # a killed run's of the same pid and thread: the name is ours
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        with opener(tmp, mode) as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def exclusive(log: Callable[[str], None] = lambda msg: None) -> Iterator[None]:
    """Hold the state dir's lock for the block: a second snap process on the same state dir waits
    for the first (saying so in one line) and never touches its files. Once it is held, anything
    a killed run left half-made in snap's folders (`.building-*` layers, `*.part` downloads, temp
    files) or built and never sent (layers/) is swept; what a live process is still writing or
    sending without the lock stays (sweep_leftovers)."""
    global _held
    with _held_guard:
        nested = _held > 0
        _held += 1
    try:
        if nested:
            yield
            return
        try:
            root = sub()
            fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise StorageError(f"cannot use snap's state dir {state_dir()!r}: {e.strerror or e}",
                               "point SNAP_STATE_DIR at a writable directory") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                log(f"waiting for another snap process (pid {holder}) that is using the state dir {root!r}")
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # only for the message of a process that waits
            except OSError:
                pass  # a full disk: the lock holds all the same
            sweep_leftovers(root)
            yield
        finally:
            os.close(fd)  # releases the lock
    finally:
        with _held_guard:
            _held -= 1


def _writer_pid(name: str) -> Optional[int]:
    """The pid a leftover's name gives its writer: a replace_file temp ("NAME.tmp.PID.THREAD") or a
    layer being built (".building-PID-N", layer/generate.py); None for a name without one."""
    if name.startswith(".building-"):
        pid = name[len(".building-"):].partition("-")[0]
    elif ".tmp." in name:
        pid = name.rpartition(".tmp.")[2].partition(".")[0]
    else:
        return None
    return int(pid) if pid.isdigit() else None


def _writer_alive(name: str) -> bool:
    """Whether a leftover's name names a process that is still running (this one included)."""
    pid = _writer_pid(name)
    if pid is None:
        return False
    if pid == os.getpid():
        return True  # another thread's, writing now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


BUILDING_QUIET = 60.0  # seconds a built layer may go unwritten, unlocked, and still be a live process's


def _in_use(path: str) -> bool:
    """Whether a built layer (in BUILT_LAYERS: `.building-*` while written, then named by its digest
    and build, layer/generate.py) is still a live process's: its writer holds a shared flock on it
    while it writes, its user (commit/sender.py) while it waits for and goes through its upload
    (holding()), or it was written within BUILDING_QUIET (the moments before either lock is taken
    and between them). A flock is let go when its process dies, whatever its pid now names (a
    restarted container's pid 1, this very process) and in whichever pid namespace: a killed run's
    layer is never kept for good."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_mtime > time.time() - BUILDING_QUIET:
            return True
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:  # BlockingIOError: a live writer or user holds it
        return True
    finally:
        os.close(fd)


@contextmanager
def holding(path: str) -> Iterator[None]:
    """Use a built layer for the block, then remove it: a shared flock on it all the while (taken
    at once after its build, let go only once it is gone) tells another snap process's sweep that
    a live process uses it (_in_use), however long its upload waits or takes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)  # after the unlink: no sweep finds it unlocked first


def _still_written(dirpath: str, name: str, layers_dir: Optional[str]) -> bool:
    if name.startswith(".building-") or dirpath == layers_dir:
        return _in_use(os.path.join(dirpath, name))
    return _writer_alive(name)


def is_leftover(name: str) -> bool:
    """A name snap gives only to what it is still making: built layers, downloads, temp files."""
    return name.startswith(".building-") or name.endswith(".part") or ".tmp." in name


def sweep_leftovers(root: str) -> int:
    """Remove what killed runs left half-made in the state dir, and the layers they built and never
    sent. Returns how many entries. What a process still running is making or using stays: some is
    written without the state lock, while another command that took it sweeps: the layers a
    watcher's background send of the hub weights builds in layers/ (origin_upload.py), in its
    threads or its packer processes, and sends, told by their writer's or user's flock (_in_use);
    a watcher's files (its exit code), by the pid their name carries (_writer_pid: a dead run's pid
    that a new process took keeps such a small file until that process ends). A name that carries
    neither (`*.part`) is written only under the lock. Only what snap names (OWN_NAMES) is looked
    at: what else a user put in the state dir stays."""
    removed = 0
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    for name in names:  # only what snap gives a name at the top (OWN_NAMES): the rest is the user's
        path = os.path.join(root, name)
        if name in OWN_NAMES and os.path.isdir(path) and not os.path.islink(path):
            removed += _sweep_folder(path, path if name == BUILT_LAYERS else None)
        elif _own(name) and is_leftover(name) and not _writer_alive(name):
            removed += _unlink(path)
    return removed


def _sweep_folder(top: str, layers_dir: Optional[str]) -> int:
    """sweep_leftovers() in one of snap's folders of the state dir (`layers_dir`: it is BUILT_LAYERS)."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [n for n in dirnames if is_leftover(n) and not _writer_alive(n)]:
            shutil.rmtree(os.path.join(dirpath, name), ignore_errors=True)
            dirnames.remove(name)
            removed += 1
        for name in filenames:
            built = dirpath == layers_dir and BUILT_NAME.fullmatch(name)
            if (is_leftover(name) or built) and not _still_written(dirpath, name, layers_dir):
                removed += _unlink(os.path.join(dirpath, name))
    return removed


def _unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:
        return 0  # another snap process swept it meanwhile
