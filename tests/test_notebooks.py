"""The tutorial notebooks (`notebooks/*.ipynb`) run top to bottom under nbval, with `make test`.

nbval runs in a subprocess of its own, one per notebook (`pytest --nbval-lax notebooks/NAME.ipynb`),
so that pytest-xdist runs the notebooks side by side. Why not collect the
notebooks in this pytest run: nbval's options are global (`--nbval-lax` would also collect
`tests/notebooks/`, which the browser tests drive), and `make test` runs `pytest tests` only. A
subprocess keeps the notebook run's options, sanitize file and environment apart from the unit
tests, and its JUnit report tells us how many cells really ran.

- `--nbval-lax`: every cell must run without error; only cells marked `# NBVAL_CHECK_OUTPUT`
  (token ids, metadata values, shapes, stats) are compared with their stored outputs, after
  `notebooks/sanitize.cfg` masks addresses, timings, progress bars and dates.
- `--nbval-current-env`: the kernel is this interpreter (the venv), whatever the notebook names.
- The notebooks set `device="cpu"`, `dtype="float32"` and seeds themselves; the environment adds
  `TRITON_INTERPRET=1` and keeps the hub offline, as `tests/conftest.py` does.

Stored outputs must be current: after changing a notebook (or code whose output a notebook checks),
execute it in place, as notebooks/README.md says, and commit the result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
SANITIZE = NOTEBOOKS / "sanitize.cfg"
CELL_TIMEOUT_S = 300          # one cell; a notebook takes ~15 s here, but CI's 2 cores may be busy
RUN_TIMEOUT_S = 900           # one notebook's nbval run
MIN_CELLS = 40                # 02, 03 and 05 alone have more code cells than this


def notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("*.ipynb"))


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_notebooks_exist():
    names = [p.name for p in notebook_paths()]
    for expected in ("01_quickstart.ipynb", "02_hybrid_warmup_and_inference.ipynb",
                     "03_attention_free_models.ipynb", "04_debugging_a_warmup_crash.ipynb",
                     "05_cuda_graphs_and_shutdown.ipynb", "06_compare_with_transformers.ipynb",
                     "07_prefix_caching_on_a_hybrid.ipynb", "08_speculative_decoding_on_a_hybrid.ipynb"):
        assert expected in names, f"notebooks/{expected} is missing (found {names})"
    assert SANITIZE.is_file()


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.name)
def test_stored_outputs_are_from_one_clean_run(path):
    """Committed notebooks are executed top to bottom in one kernel (execution counts 1..N), and no
    stored output is an error, so what a reader sees without running anything is a real run."""
    cells = code_cells(path)
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: execution counts {counts}; execute it in place (see notebooks/README.md)")
    errors = [source(c).splitlines()[:1] for c in cells
              if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert not errors, f"{path.name}: stored error outputs in cells starting {errors}"
    checked = [c for c in cells if "NBVAL_CHECK_OUTPUT" in source(c)]
    assert checked, f"{path.name}: no cell is marked # NBVAL_CHECK_OUTPUT"
    assert all(c.get("outputs") for c in checked), f"{path.name}: a checked cell has no stored output"


def _pytest_command() -> list[str]:
    # `bin/pytest` rather than `python -m pytest`, as in the Makefile: -m would put the repo root
    # (and its kernels/ folder) on sys.path
    script = Path(sys.executable).with_name("pytest")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pytest"]


def executed_cells(path: Path) -> int:
    """The code cells nbval runs in `path` (all but those marked # NBVAL_SKIP)."""
    return sum(1 for c in code_cells(path) if "NBVAL_SKIP" not in source(c))


def test_the_notebooks_have_enough_cells_to_run():
    assert sum(map(executed_cells, notebook_paths())) >= MIN_CELLS


@pytest.mark.parametrize("path", notebook_paths(), ids=lambda p: p.name)
def test_notebook_runs_under_nbval(path, tmp_path):
    """One notebook per test (each its own nbval run and kernel), so that pytest-xdist spreads the
    notebooks over the workers instead of running all of them in one test at the end."""
    pytest.importorskip("nbval", reason="nbval is a dev dependency: pip install -e '.[dev]'")
    pytest.importorskip("ipykernel", reason="ipykernel is a dev dependency: pip install -e '.[dev]'")
    expected = executed_cells(path)
    assert expected > 0, f"{path.name} has no code cell to run"
    report = tmp_path / "nbval.xml"
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYDEVD_DISABLE_FILE_VALIDATION="1", JUPYTER_PLATFORM_DIRS="1")
    cmd = _pytest_command() + [
        "--nbval-lax", "--nbval-current-env", f"--nbval-sanitize-with={SANITIZE}",
        f"--nbval-cell-timeout={CELL_TIMEOUT_S}", "-p", "no:cacheprovider", "-q",
        f"--junitxml={report}", "--rootdir", str(REPO), str(path)]
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"nbval failed on {path.name} (exit {run.returncode}):\n{tail}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    ran = int(suite.get("tests")) - int(suite.get("skipped", 0))
    bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    assert bad == 0, tail
    assert ran == expected, f"nbval ran {ran} cells of {path.name}, it has {expected}:\n{tail}"
