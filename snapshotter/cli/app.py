"""The typer app and its ways out: every exception a command raises becomes one line on stderr and
the exit code errors.exit_code_of gives it; a command line click refuses, one `snap: error:` line."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import signal
import sys

import typer

try:
    from typer import _click as click  # typer 0.2x vendors click; before, it depends on it
except ImportError:  # pragma: no cover
    import click

from snapshotter import progress
from snapshotter.errors import SnapError, exit_code_of, exit_codes
from snapshotter.registry.credentials import take_secret_env
from snapshotter.version import __version__

from .output import drop_stdout, out, say

app = typer.Typer(
    help="snap: capture a rented GPU box as an OCI image in any registry, and get it back anywhere.\n\n"
    "Exit codes: " + ", ".join(f"{code} {meaning}" for code, meaning in exit_codes()) + ".\n\n"
    "Registry credentials: --username with --password-stdin, else SNAP_USERNAME with SNAP_PASSWORD, else Docker's "
    "config as `snap login REGISTRY` (or `docker login`) wrote it, its credential helpers included.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(asked: bool) -> None:
    if asked:
        out(f"snap {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print snap's version and exit.")) -> None:
    pass  # options for snap itself, before the command


# typer's own exits; newer typers vendor click and no longer export click's exception classes.
_TYPER_WAYS_OUT = tuple({typer.Exit, typer.Abort, getattr(typer, "TyperException", typer.Exit)})


class Terminated(KeyboardInterrupt):
    """SIGTERM, stopped as Ctrl-C is: transfers in flight given up, the journal left as it was; exit 143."""

    terminated = True  # errors.exit_code_of: 143, not 130


@contextlib.contextmanager
def sigterm_stops():
    """Within the block SIGTERM stops the command the way Ctrl-C does, instead of killing it outright."""

    def stop(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def command(fn):
    """A command whose every exception ends it with one line on stderr and exit_code_of's code;
    never a traceback for bad input (a bug's with SNAP_DEBUG=1). SIGTERM stops any command as Ctrl-C
    does (one line, exit 143): each may wait on a registry or a restore, and what writes is made to
    stop cleanly on Ctrl-C already. `snap watch` takes SIGTERM over for its final snapshot."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with sigterm_stops():
                progress.check_settings()
                return fn(*args, **kwargs)
        except _TYPER_WAYS_OUT:
            raise  # typer's own ways out (an exit code chosen by the command, a usage error)
        except (Exception, KeyboardInterrupt) as e:
            if os.environ.get("SNAP_DEBUG") and not isinstance(e, (SnapError, KeyboardInterrupt)):
                raise
            say(error_line(e))
            raise typer.Exit(exit_code_of(e))

    return wrapper


def error_line(e: BaseException) -> str:
    """The one line a command that failed with `e` ends with."""
    if isinstance(e, SnapError):
        return f"snap: error: {e}"
    if isinstance(e, KeyboardInterrupt):
        how = "terminated" if isinstance(e, Terminated) else "interrupted"
        return f"snap: {how} (run the command again: a commit re-sends only what is missing, a restore resumes)"
    if isinstance(e, OSError):  # the local machine failed us somewhere no closer handler knew
        where = "".join(f": {os.fsdecode(name)!r}" for name in (e.filename, e.filename2)
                        if isinstance(name, (str, bytes)))
        return f"snap: error: local I/O failed{where}: {e.strerror or e} (check the disk, the path and its permissions)"
    return f"snap: internal error: {type(e).__name__}: {e} (run again with SNAP_DEBUG=1 for the traceback)"


def main() -> None:
    take_secret_env()  # before anything can start a process (what the imports made: frozen in __main__.run)
    try:
        code = app(standalone_mode=False)
    except click.exceptions.ClickException as e:
        sys.exit(_usage_error(e))
    except typer.Abort:  # Ctrl-C at a prompt (snap login's)
        say("snap: interrupted")
        sys.exit(exit_code_of(KeyboardInterrupt()))
    except OSError as e:  # outside a command only --help or --version writes: stdout refused it
        drop_stdout()
        if isinstance(e, BrokenPipeError):  # its reader has gone (`snap --help | head -1`): as stdout() does
            sys.exit(0)
        say(error_line(e))  # /dev/full, an I/O error: said, not a traceback
        sys.exit(exit_code_of(e))
    finally:
        # The process ends here: the cycle collector's passes over every object still alive (typer's,
        # click's and requests' modules) while the interpreter tears down cost ~0.07 CPU s, a tenth
        # of a nothing-changed commit. Reference counts still free them.
        gc.freeze()
    sys.exit(code if isinstance(code, int) else 0)


def _usage_error(e) -> int:
    """A command line click refuses (an unknown option, a missing argument, a bad value): one
    `snap: error:` line, as any other bad input, instead of click's usage panel. `snap` alone
    still shows the help."""
    if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):
        if text := e.format_message():  # typer's rich help has printed itself already (to stdout): ""
            out(text)
        return e.exit_code
    ctx = getattr(e, "ctx", None)
    command = f"snap {ctx.info_name}" if ctx is not None and ctx.parent is not None else "snap"
    say(f"snap: error: {e.format_message()} (see `{command} --help`)")
    return e.exit_code
