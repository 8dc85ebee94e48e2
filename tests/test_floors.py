"""The import floors (docs/architecture.md, the import-linter contracts in pyproject.toml): kernels
and their torch references load without the engine (and the references without triton), and the
contracts `make lint` checks really catch an upward import."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KERNELS = sorted(p.stem for p in (REPO / "kernels").glob("*.py") if p.stem != "__init__")
REFERENCES = [k for k in KERNELS if k.endswith("_ref")]

HIDE_TRITON = """
import importlib.abc, sys
class HideTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
sys.meta_path.insert(0, HideTriton())
"""


def python(code: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_importing_a_kernel_does_not_load_the_engine(tmp_path):
    # the acceptance command, run outside the repository (its root holds a kernels/ folder)
    out = python("import toolkit.kernels.rms_norm, sys; print('toolkit.llm' in sys.modules)", tmp_path)
    assert out == "False"
    loaded = python("import toolkit.kernels.rms_norm, toolkit.kernels.rms_norm_ref, sys; "
                    "print(sorted(m for m in sys.modules if m.startswith('toolkit')))", tmp_path)
    assert loaded == str(["toolkit", "toolkit.kernels", "toolkit.kernels.launcher_checks",
                          "toolkit.kernels.rms_norm", "toolkit.kernels.rms_norm_ref",
                          "toolkit.kernels.state_slots_ref"])


def test_references_import_without_triton_or_the_engine(tmp_path):
    modules = ", ".join(f"toolkit.kernels.{r}" for r in REFERENCES)
    out = python(HIDE_TRITON + f"import {modules}\n"
                 "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('toolkit.')}))", tmp_path)
    assert out == "['kernels']"
    assert len(REFERENCES) >= 11          # one reference per kernel family, and the state-slot helpers


def test_every_kernel_family_has_its_reference_beside_it():
    families = [k for k in KERNELS if not k.endswith("_ref") and k != "launcher_checks"]
    assert families and all(f"{k}_ref" in REFERENCES for k in families), families


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    env = os.environ | {"PYTHONPATH": str(root)}
    return subprocess.run([str(exe), "--no-cache"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


PLANTED = [   # (module, an upward import added to it, what lint-imports must say)
    ("toolkit/layers/mlp.py", "from toolkit.runner import block_table",
     "toolkit.layers is not allowed to import toolkit.runner"),
    ("toolkit/runner/model_runner.py", "import toolkit.inspect",
     "toolkit.runner is not allowed to import toolkit.inspect"),
    ("kernels/rms_norm.py", "import toolkit.errors", "kernels is not allowed to import toolkit"),
    ("kernels/rotary_ref.py", "import triton", "is not allowed to import triton"),
]


def test_planted_upward_imports_break_the_contracts(tmp_path):
    shutil.copytree(REPO / "toolkit", tmp_path / "toolkit",
                    ignore=shutil.ignore_patterns("__pycache__", "demo", "kernels"))
    shutil.copytree(REPO / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for module, planted, _ in PLANTED:
        target = tmp_path / module
        target.write_text(target.read_text() + f"\n{planted}\n")
    proc = lint_imports(tmp_path)
    assert proc.returncode != 0
    for module, _, message in PLANTED:
        assert message in proc.stdout, (module, proc.stdout[-3000:])
