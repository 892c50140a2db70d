"""`python -m snapshotter`, and the `snap` and `boxsnap` commands (pyproject.toml's scripts): the CLI
imported with the cycle collector off, then what the imports made frozen before it is on again."""

import gc


def run() -> None:
    # typer, click and requests make some 100k objects and no garbage: the collector's passes over
    # them as they grew, and its first pass after (~9 ms), would cost every command's start for
    # nothing. Frozen here, where the process is snap's, not in a library user's import.
    gc.disable()
    from .cli import main

    gc.freeze()
    gc.enable()
    main()


if __name__ == "__main__":
    run()
