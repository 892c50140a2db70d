"""snap's version: the one place it is written (pyproject.toml reads it at build time, `snap --version`
prints it), so an installed snap and a source tree never disagree about what they are."""

__version__ = "0.1.0"
