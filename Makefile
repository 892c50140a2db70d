# snap: `make demo` runs the whole round trip on a local registry; `make test` runs the suite.
PYTHON ?= python3
SETUP_STAMP := .setup.stamp

.PHONY: setup demo test bench clean

$(SETUP_STAMP): .ci/setup pyproject.toml
	bash .ci/setup
	touch $@

setup: $(SETUP_STAMP)

demo: $(SETUP_STAMP)
	$(PYTHON) tests/demo.py

test: $(SETUP_STAMP)
	$(PYTHON) -m pytest -q tests

bench: $(SETUP_STAMP)
	$(PYTHON) bench/bench.py

clean:
	rm -rf $(SETUP_STAMP) .demo bench/out .pytest_cache build *.egg-info
