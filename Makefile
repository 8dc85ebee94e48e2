# `make demo`: the main job on the built-in tiny-bamba preset. `make test`: the whole test suite.
# Both create .venv if it is missing (pip takes a CPU torch wheel on disk when there is one: see README, Install).
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

.PHONY: demo test bench
demo: $(VENV)/.installed
	$(PY) -m toolkit demo

# `bin/pytest`, not `python -m pytest`: -m would put the repo root (and its kernels/ folder) on sys.path.
test: $(VENV)/.installed
	TRITON_INTERPRET=1 $(VENV)/bin/pytest tests

bench: $(VENV)/.installed
	$(PY) benchmarks/decode_throughput.py
