"""The `snap` command: a thin typer shell over the library (commit, restore, verify, run, watch,
log, status, tag, login, logout). Each command parses its flags, builds the library's options (the
registry's in registry/options.py), calls the library and prints (output.py); app.py turns every
exception into one line and its exit code (errors.exit_code_of)."""

from __future__ import annotations

from .app import app, command, main
from .capture import commit, status, watch
from .images import restore, run_image, verify
from .repository import list_profiles, log_, login, logout, tag_

# Registered in the order `snap --help` lists them.
for _name, _fn in (("commit", commit), ("restore", restore), ("run", run_image), ("verify", verify),
                   ("watch", watch), ("log", log_), ("status", status), ("tag", tag_),
                   ("profiles", list_profiles), ("login", login), ("logout", logout)):
    app.command(_name)(command(_fn))

__all__ = ["app", "main"]
