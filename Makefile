# `make demo`: the main job on the shipped demo-hybrid model (no download). `make test`: the whole test suite
# (`make test-fast`: its 3-minute tier for iteration). `make docs`: the documentation site, into site/.
# All create .venv if it is missing (pip takes a CPU torch wheel on disk when there is one: see
# docs/guides/install.md).
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

.PHONY: demo test test-setup test-fast lint bench browser-setup notebooks docs docs-serve
demo: $(VENV)/.installed
	$(PY) -m toolkit demo

# `bin/pytest`, not `python -m pytest`: -m would put the repo root (and its kernels/ folder) on sys.path.
# browser-setup: chromium (apt) and the widget JS (npm, into .browser/) for tests/test_browser.py, if missing.
# -n: pytest-xdist, one worker per core (at most 4); loadgroup keeps the Triton recordings and their
# compile test in one worker; --durations: the 15 slowest tests, printed at the end of every run
PYTEST := TRITON_INTERPRET=1 $(VENV)/bin/pytest -n auto --maxprocesses 4 --dist loadgroup --durations=15
# the setup side by side (a sub-make with -j): chromium and the widget JS download while pip installs, then
# the lint and the docs build together; each target's output kept in one piece
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target test-setup
	$(PYTEST) tests

test-setup: $(VENV)/.installed lint browser-setup docs

# the iteration tier (under 3 minutes on 2 cores): the core's unit tests, the per-family parity files,
# the model-parametrized suites on tiny-llama and tiny-mamba2 only; no notebooks, browser, Triton engines,
# tensor-parallel ranks, subprocess CLIs or property programs (the `slow` marker: tests/conftest.py)
test-fast: $(VENV)/.installed
	$(PYTEST) -m "not slow" tests

# ruff (the rule set in pyproject.toml) and the import floors (import-linter contracts in pyproject.toml;
# the repository root on PYTHONPATH lets lint-imports read kernels/ as a package of its own)
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports

browser-setup:
	bash scripts/setup_browser_test.sh

bench: $(VENV)/.installed
	$(PY) benchmarks/decode_throughput.py

# JupyterLab on the tutorials (notebooks/README.md); --allow-root only when run as root (containers)
notebooks: $(VENV)/.installed
	$(VENV)/bin/jupyter lab notebooks/ $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# The documentation site (mkdocs.yml, docs/): built strictly (a warning, a broken link or anchor fails it),
# with nothing fetched from the network; `make test` builds it too. NO_MKDOCS_2_WARNING: Material's banner
# about its successor, printed on every build, is not a build warning.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: $(VENV)/.installed
	$(MKDOCS) build --strict --quiet

# http://127.0.0.1:8000, rebuilt on every change (docs/, notebooks/, benchmarks/RESULTS.md, toolkit/)
docs-serve: $(VENV)/.installed
	$(MKDOCS) serve
