"""Errors a user can act on. Each kind has its own exit code so scripts can branch on it."""

import errno


class SnapError(Exception):
    """Base class: the message is one line that names the cause and what to do."""

    exit_code = 1
    meaning = 'unexpected'

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:
        msg = super().__str__()
        return f"{msg} ({self.hint})" if self.hint else msg


class UsageError(SnapError):
    """Bad input: a missing root, a malformed reference, a bad profile."""

    exit_code = 2
    meaning = 'bad input'


class RegistryUnreachable(SnapError):
    exit_code = 3
    meaning = 'registry unreachable'


# Every auth error names them: a box started by a provider has no `docker login`, but secret env vars.
CREDENTIAL_WAYS = ("credentials come from --username with --password-stdin, SNAP_USERNAME and SNAP_PASSWORD, "
                   "or Docker's config as `snap login REGISTRY` (or `docker login`) writes it")


class AuthError(SnapError):
    exit_code = 4
    meaning = 'auth'

    def __str__(self) -> str:
        return f"{super().__str__()}; {CREDENTIAL_WAYS}"


class OriginAuthError(AuthError):
    """The origin of weights (Hugging Face) refused a gated or private file: HF_TOKEN is what it
    takes, not a registry's credentials."""

    def __str__(self) -> str:
        return SnapError.__str__(self)


class NotFound(SnapError):
    """An image, tag or blob the registry does not have."""

    exit_code = 5
    meaning = 'not found'


class IntegrityError(SnapError):
    """A digest mismatch, or a hostile or corrupt layer: refused."""

    exit_code = 6
    meaning = "integrity (digest mismatch, hostile layer, or a snapshot that deletes a live root's system)"


class StorageError(SnapError):
    """The local disk failed us: full, read-only, unreadable file."""

    exit_code = 7
    meaning = 'local disk'


class DiskFull(StorageError):
    """No room left on a local disk (or in its quota): what can go on without writing there does."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class EngineUnavailable(SnapError):
    """No Docker engine to talk to."""

    exit_code = 8
    meaning = 'no Docker engine'


class VerifyFailed(SnapError):
    """`snap verify` found files that differ from the snapshot."""

    exit_code = 9
    meaning = 'verify found differences'


class RegistryError(SnapError):
    """The registry answered, but with an error we cannot recover from."""

    exit_code = 10
    meaning = 'registry error'


class WaitTimeout(SnapError):
    """A wait gave up: `snap restore --wait`'s file had not landed, or `snap watch --stop`'s watcher
    had not ended, in time."""

    exit_code = 11
    meaning = 'a wait timed out (`restore --wait`, `watch --stop`)'


INTERRUPTED = 130  # Ctrl-C (SIGINT), as a shell reports it
TERMINATED = 143  # SIGTERM


def exit_codes() -> list[tuple[int, str]]:
    """Every exit code snap ends with and what it means, in order: the one table the help text and
    the README's are made from or checked against."""
    kinds = (SnapError, UsageError, RegistryUnreachable, AuthError, NotFound, IntegrityError, StorageError,
             EngineUnavailable, VerifyFailed, RegistryError, WaitTimeout)
    return sorted([(0, "ok"), *((k.exit_code, k.meaning) for k in kinds),
                   (INTERRUPTED, "interrupted (Ctrl-C)"), (TERMINATED, "terminated (SIGTERM)")])


def exit_code_of(error: BaseException) -> int:
    """The one mapping from an exception to the exit code snap ends with: a SnapError's own code,
    130/143 for an interrupt, 7 for a local I/O failure no closer handler knew, 1 for a bug."""
    if isinstance(error, SnapError):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return TERMINATED if getattr(error, "terminated", False) else INTERRUPTED
    if isinstance(error, OSError):
        return StorageError.exit_code
    return 1


def quoted_path(rel: str) -> str:
    """A root-relative path from an image or a tree, for a message: '/a/b', quoted and escaped like
    repr, so that a newline or a control character in a name cannot forge lines of output."""
    return repr("/" + rel.lstrip("/"))


def printable(text: str) -> str:
    """`text` (from the image: annotations, paths) fit for a one-line message: control characters escaped."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def storage_error(e: OSError, place: str, what: str = "", hint: str = "") -> StorageError:
    """A one-line StorageError for an OSError met while writing in `place` (`what`: doing what)."""
    if e.errno in DISK_FULL:
        return DiskFull(f"disk full in {place}{what}", hint or "free space and run the restore again: it resumes")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return StorageError(f"cannot write in {place}{what}: {e.strerror}", hint or "check permissions, or run as root")
    return StorageError(f"cannot write in {place}{what}: {e.strerror or e}")
