# `make demo`: the main job on the shipped demo-hybrid model (no download). `make test`: the whole test suite
# (`make test-fast`: its 3-minute tier for iteration).
# Both create .venv if it is missing (pip takes a CPU torch wheel on disk when there is one: see README, Install).
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

.PHONY: demo test test-fast lint bench browser-setup notebooks
demo: $(VENV)/.installed
	$(PY) -m toolkit demo

# `bin/pytest`, not `python -m pytest`: -m would put the repo root (and its kernels/ folder) on sys.path.
# browser-setup: chromium (apt) and the widget JS (npm, into .browser/) for tests/test_browser.py, if missing.
# -n: pytest-xdist, one worker per core (at most 4); loadgroup keeps the Triton recordings and their
# compile test in one worker; --durations: the 15 slowest tests, printed at the end of every run
PYTEST := TRITON_INTERPRET=1 $(VENV)/bin/pytest -n auto --maxprocesses 4 --dist loadgroup --durations=15
test: $(VENV)/.installed lint browser-setup
	$(PYTEST) tests

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
