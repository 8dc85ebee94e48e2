"""benchmarks/gpu_check.sh without a GPU: its bash syntax, and its dry run (checks what it can, prints each
part's commands and how many tests each test part selects, runs nothing): every part selects tests or
names scripts that exist, fits a 10-minute device command with margin, and no command stops at the first
failure. Also the rule that puts the kernel tests on the GPU when there is one (harness.kernel_test_device)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import kernel_test_device

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
PARTS = ["doctor", "kernels", "backend", "parity", "graphs", "bench", "tp"]
TEST_PARTS = {"kernels", "backend", "parity", "graphs"}
STOP_EARLY = {"-x", "--exitfirst", "--maxfail", "--sw", "--stepwise"}


def run_script(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHON": sys.executable}         # the test environment's python, torch and pytest
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_bash_syntax():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def dry_run():
    if sys.version_info < (3, 11):
        pytest.skip("the script needs Python >= 3.11 (PYTHONSAFEPATH), its dry run says so")
    proc = run_script("--dry-run", *PARTS, "first", "second")     # every part: one collection
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def parse_parts(out: str) -> dict[str, dict]:
    parts, current = {}, None
    for line in out.splitlines():
        if m := re.match(r"^part (\w+) \(~(\d+) min\):$", line):
            current = parts[m[1]] = {"minutes": int(m[2]), "commands": [], "selects": None}
        elif current is not None and line.startswith("  $ "):
            current["commands"].append(line[4:].split())
        elif current is not None and (m := re.match(r"^  selects (\d+) tests in (\d+) file\(s\)$", line)):
            current["selects"] = int(m[1])
    return parts


def test_dry_run_checks_prerequisites_and_selects_tests_in_every_part(dry_run):
    lines = [line for line in dry_run.splitlines() if not line.startswith("dry run: would install")]
    assert lines[0].startswith("python ") and "| torch " in lines[0] and "| transformers " in lines[0]
    assert "prerequisite:" not in dry_run and lines[-1] == "dry run: ok"
    parts = parse_parts(dry_run)
    assert list(parts) == PARTS + ["first", "second"]      # the doctor first
    del parts["first"], parts["second"]                    # their own test, below
    assert parts["doctor"]["commands"][0][1:] == ["-m", "toolkit", "doctor"]
    for name, part in parts.items():
        assert part["commands"], name
        assert 0 < part["minutes"] <= 7, f"{name}: ~{part['minutes']} min leaves no margin in 10"
        for cmd in part["commands"]:
            assert not STOP_EARLY & set(cmd), f"{name} stops early: {' '.join(cmd)}"
            assert cmd[0] == sys.executable
            for path in (a for a in cmd if a.endswith(".py")):
                assert (REPO / path).is_file(), f"{name}: {path} does not exist"
        if name in TEST_PARTS:
            (cmd,) = part["commands"]
            assert cmd[1:3] == ["-m", "pytest"] and part["selects"] > 0, name
            files = [a for a in cmd if a.endswith(".py")]
            assert files and all(f.startswith("tests/test_") for f in files)
    selected = {f for name in TEST_PARTS for f in parts[name]["commands"][0] if f.endswith(".py")}
    assert {f"tests/{p.name}" for p in REPO.glob("tests/test_kernel_*.py")} <= selected
    assert {f"tests/{p.name}" for p in REPO.glob("tests/test_parity_*.py")} <= selected
    assert parts["kernels"]["selects"] >= 150 and parts["parity"]["selects"] >= 150


def test_the_first_part_fits_one_lease_in_the_order_that_tells_most(dry_run):
    """`first` (issue 41): one device command; every command has its own limit (`@N`), the fixed ones
    add up to less than the part's budget, in the order doctor, the three presets' decode figures,
    the ten-cycle memory test, then the graphs and kernels tests."""
    part = parse_parts(dry_run)["first"]
    assert part["minutes"] <= 8 and part["selects"] > 200
    limits = [int(c[0][1:]) if c[0].startswith("@") else None for c in part["commands"]]
    cmds = [c[1:] if c[0].startswith("@") else c for c in part["commands"]]
    assert cmds[0][1:] == ["-m", "toolkit", "doctor", "--check", "kernel_compile", "--check", "device_vs_cpu",
                           "--check", "graphs_vs_eager"]
    presets = [c[c.index("--presets") + 1] for c in cmds if "benchmarks/gpu_decode.py" in c]
    assert presets == ["mamba2-130m-shape", "bamba-300m-shape", "lfm2-350m-shape"]
    assert "ten_cycles" in cmds[4] and "tests/test_warmup.py" in cmds[5] and "tests/test_kernel_mamba2.py" in cmds[6]
    fixed = [n for n in limits if n is not None]
    assert len(fixed) == 5 and sum(fixed) < 470
    for cmd in cmds:
        assert cmd[0] == sys.executable and not STOP_EARLY & set(cmd)
        for path in (a for a in cmd if a.endswith(".py")):
            assert (REPO / path).is_file(), path


def test_the_second_part_runs_what_the_first_lease_left(dry_run):
    """`second`: the GPU graph tests, HF parity on CUDA, speculative decoding's speed, recording's cost,
    then the Triton-vs-torch tests; the fixed limits under the budget, nothing stops at the first failure."""
    part = parse_parts(dry_run)["second"]
    limits = [int(c[0][1:]) for c in part["commands"] if c[0].startswith("@")]
    cmds = [c[1:] if c[0].startswith("@") else c for c in part["commands"]]
    assert len(limits) == 4 and sum(limits) < 470 and part["minutes"] <= 8
    assert cmds[0][-3:] == ["tests/test_cudagraph.py", "-k", "gpu"]
    assert {f"tests/{p.name}" for p in REPO.glob("tests/test_parity_*.py")} <= set(cmds[1])
    assert "benchmarks/spec_decode.py" in cmds[2] and "benchmarks/inspect_overhead.py" in cmds[3]
    assert cmds[4][-1] == "tests/test_backend_triton.py"
    for cmd in cmds:
        assert cmd[0] == sys.executable and not STOP_EARLY & set(cmd)


def test_benchmarks_find_their_table_helper_under_pythonsafepath():
    """gpu_check.sh runs the scripts with PYTHONSAFEPATH=1, which also keeps a script's own folder off
    sys.path: a script importing table.py must put its folder there itself (spec_decode.py did not,
    and failed on the H200)."""
    for script in sorted((REPO / "benchmarks").glob("*.py")):
        text = script.read_text()
        if re.search(r"^from table import", text, re.M):
            head = text[:text.index("from table import")]
            assert "sys.path.insert(0, os.path.dirname(__file__))" in head, script.name


def test_the_script_never_stops_at_the_first_failure():
    text = SCRIPT.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"pytest[^\n]*\s(-x|--exitfirst|--maxfail)\b", code)
    assert "PYTHONPATH=\"$PWD" not in code                # never the repository root on sys.path


def test_an_unknown_part_is_refused():
    proc = run_script("everything", timeout=30)
    assert proc.returncode == 2 and "unknown part 'everything'" in proc.stdout


def test_kernel_tests_run_on_the_gpu_where_the_kernels_compile():
    assert kernel_test_device("cpu", cuda=False, interpret="1") == "cpu"        # CI: the interpreter
    assert kernel_test_device("cpu", cuda=False, interpret="") == "cpu"
    assert kernel_test_device("cuda", cuda=True, interpret="") == "cuda"        # gpu_check.sh
    assert kernel_test_device("cpu", cuda=True, interpret="") == "cuda"         # compiled: CUDA tensors only
    assert kernel_test_device("cpu", cuda=True, interpret="1") == "cpu"         # `make test` on a GPU host
