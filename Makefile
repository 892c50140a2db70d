# snap: `make demo` runs the whole round trip on a local registry; `make test` runs the suite.
# snap and its tests run from the virtualenv .ci/setup creates, never the machine's own Python.
VENV ?= .venv
PYTHON := $(VENV)/bin/python
SETUP_STAMP := $(VENV)/.setup.stamp  # inside the venv: removing the venv redoes the setup

.PHONY: setup demo test bench dist clean

$(SETUP_STAMP): .ci/setup pyproject.toml
	bash .ci/setup
	touch $@

setup: $(SETUP_STAMP)

demo: $(SETUP_STAMP)
	$(PYTHON) tests/demo.py

# The lint first (seconds), then the suite on 3 workers (pytest-xdist): most tests wait on registries
# and processes, so 3 fit 2 cores. loadgroup: the tests using a file's own module or session fixture
# (the dockerd of test_docker.py, ...) share a worker, where it starts once (conftest.py groups them);
# the rest go one by one to whichever worker is free, so no long file holds up the end. conftest.py
# puts the longest first (tests/durations.json); --no-loadscope-reorder: xdist keeps that order.
test: $(SETUP_STAMP)
	$(PYTHON) -m ruff check snapshotter tests
	$(PYTHON) -m pytest -q -n 3 --dist loadgroup --no-loadscope-reorder tests

# `make bench ARGS=--small` for a quick run, `make bench ARGS=--scale` for a real GPU box's sizes (not in CI).
bench: $(SETUP_STAMP)
	$(PYTHON) bench/bench.py $(ARGS)

# The sdist and the wheel a user installs (`pipx install dist/boxsnap-*.whl`), built offline from the
# venv's setuptools and checked as the package index would render them.
dist: $(SETUP_STAMP)
	rm -rf dist
	$(PYTHON) -m build --no-isolation --outdir dist .
	$(PYTHON) -m twine check --strict dist/*

clean:
	rm -rf $(VENV) .ci/wheels .demo bench/out .pytest_cache build dist *.egg-info
