"""The `snap` command: a thin typer shell over the library (commit, restore, verify, run, watch,
log, status, tag, login, logout). Each command parses its flags, builds the library's options (the
registry's in registry/options.py), calls the library and prints (output.py); app.py turns every
exception into one line and its exit code (errors.exit_code_of)."""

from __future__ import annotations

import gc

# Imported with the cycle collector off: typer, click and requests make some 100k objects and no
# garbage, and its passes over them as they grew cost ~0.02 CPU s of every command's start. They are
# frozen before it is on again: its first pass after would walk them all (~9 ms), for nothing.
_collecting = gc.isenabled()
gc.disable()
try:
    from .app import app, command, main
    from .capture import commit, status, watch
    from .images import restore, run_image, verify
    from .repository import list_profiles, log_, login, logout, tag_
finally:
    if _collecting:
        gc.freeze()
        gc.enable()

# Registered in the order `snap --help` lists them.
for _name, _fn in (("commit", commit), ("restore", restore), ("run", run_image), ("verify", verify),
                   ("watch", watch), ("log", log_), ("status", status), ("tag", tag_),
                   ("profiles", list_profiles), ("login", login), ("logout", logout)):
    app.command(_name)(command(_fn))

__all__ = ["app", "main"]
