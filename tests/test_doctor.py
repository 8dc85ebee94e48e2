"""`python -m toolkit doctor` (toolkit/doctor.py) on the CPU: the versions and device lines, one line per
check (NAME PASS|FAIL|SKIP VALUE DETAIL), the GPU-only checks skipped with the reason, exit code 0; `--json`
prints one JSON object of the same checks. A planted wrong kernel is a FAIL with exit code 1, and a check
that raises fails alone (the others still run)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit import cli, doctor

PY = sys.executable
LINE = re.compile(r"^(?P<name>[a-z0-9_]+) +(?P<status>PASS|FAIL|SKIP)  (?P<value>-|0|nan|\d\.\de[+-]\d\d|\d+\.\d{3}ms)"
                  r" +(?P<detail>\S.*)$")
SUMMARY = re.compile(r"^doctor: (\d+) passed, (\d+) failed, (\d+) skipped in \d+\.\d s$")
GPU_ONLY = {"kernel_compile", "device_vs_cpu", "graphs_vs_eager", "decode_b1_graphs", "decode_b16_graphs"}
CHECK_KEYS = {"name", "status", "value", "unit", "detail", "seconds"}

# one worker runs the module: its fixture (two doctor processes) runs once, not once per xdist worker
pytestmark = pytest.mark.xdist_group("doctor")
on_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the doctor's CPU subset (gpu_check.sh runs it on a GPU)")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The text and the --json run, side by side, as a user runs them: from another folder (not the
    repository root, which `python -m` would put on sys.path), TRITON_INTERPRET unset (the doctor's
    engine sets it on a CPU), one torch thread (as conftest: CI's 2 cores are shared)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"OMP_NUM_THREADS": "1"}
    cwd = tmp_path_factory.mktemp("doctor")
    procs = {kind: subprocess.Popen([PY, "-m", "toolkit", "doctor", *extra], cwd=cwd, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for kind, extra in (("text", []), ("json", ["--json"]))}
    out = {}
    for kind, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[kind] = (proc.returncode, stdout, stderr)
    return out


@on_cpu
def test_text_has_versions_device_one_line_per_check_and_exit_0(cli_runs):
    rc, stdout, stderr = cli_runs["text"]
    assert rc == 0, stdout + stderr[-3000:]
    lines = stdout.splitlines()
    assert lines[0].startswith("versions  python ") and all(
        f"| {name} " in lines[0] for name in ("torch", "CUDA", "triton", "transformers"))
    assert lines[1].startswith("device    cpu: ") and "no CUDA GPU" in lines[1]
    checks = [LINE.match(line) for line in lines[2:-1]]
    assert all(checks), [line for line, m in zip(lines[2:-1], checks, strict=True) if not m]
    assert [m["name"] for m in checks] == list(doctor.CHECKS)
    statuses = {m["name"]: m["status"] for m in checks}
    for m in checks:
        if m["name"] in GPU_ONLY:
            assert m["status"] == "SKIP" and m["value"] == "-" and m["detail"].startswith("skipped: needs a GPU (")
        else:   # the CPU subset really runs (triton is a dependency on Linux)
            assert m["status"] == "PASS" and m["value"] != "-", m.string
    assert statuses["triton_vs_torch"] == "PASS" and "Triton interpreter" in lines[3]
    assert all(m["value"].endswith("ms") for m in checks if m["name"].startswith("decode") and m["status"] == "PASS")
    summary = SUMMARY.match(lines[-1])
    assert summary and summary.groups() == ("6", "0", "5")


@on_cpu
def test_json_is_one_object_with_the_same_checks(cli_runs):
    rc, stdout, stderr = cli_runs["json"]
    assert rc == 0, stderr[-3000:]
    report = json.loads(stdout)                           # nothing else on stdout
    assert set(report) == {"versions", "device", "checks", "passed", "failed", "skipped", "ok", "seconds"}
    assert set(report["versions"]) == {"python", "torch", "cuda", "triton", "transformers"}
    assert report["versions"]["torch"] == torch.__version__
    assert report["device"]["type"] == "cpu" and report["device"]["capability"] is None
    assert [c["name"] for c in report["checks"]] == list(doctor.CHECKS)
    for c in report["checks"]:
        assert set(c) == CHECK_KEYS and c["status"] in ("PASS", "SKIP") and c["detail"]
        if c["status"] == "SKIP":
            assert c["name"] in GPU_ONLY and c["value"] is None and "needs a GPU" in c["detail"]
        else:
            assert isinstance(c["value"], float) and c["value"] >= 0
            assert c["unit"] == ("ms" if c["name"].startswith("decode") else "")
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["triton_vs_torch"]["value"] <= doctor.LOGIT_ATOL
    assert by_name["padded_decode_vs_eager"]["value"] <= doctor.PAD_ATOL
    assert (report["passed"], report["failed"], report["skipped"], report["ok"]) == (6, 0, 5, True)


def test_a_wrong_kernel_is_a_fail_and_exit_1(monkeypatch, capsys):
    """The Triton RMS norm planted to be 1% off: triton_vs_torch fails, naming the preset and what differs."""
    pytest.importorskip("triton")
    from toolkit.kernels import rms_norm as kn
    from toolkit.kernels import rms_norm_ref
    monkeypatch.setattr(kn, "rms_norm", lambda *a, **kw: rms_norm_ref.rms_norm(*a, **kw) * 1.01)
    rc = doctor.main(["--json", "--check", "triton_vs_torch", "--presets", "tiny-llama"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 1 and report["ok"] is False and report["failed"] == 1
    (c,) = report["checks"]
    assert c["name"] == "triton_vs_torch" and c["status"] == "FAIL"
    assert c["detail"].startswith("tiny-llama, fp32 on ")
    assert re.search(r"token \d+: (logits differ|token)", c["detail"]), c["detail"]


def test_a_check_that_raises_fails_alone(monkeypatch, capsys):
    def boom(ctx):
        raise RuntimeError("planted\nsecond line")
    monkeypatch.setitem(doctor.CHECKS, "kernel_compile", boom)
    monkeypatch.setitem(doctor.CHECKS, "device_vs_cpu", lambda ctx: (True, 0.5, "", "planted pass"))
    rc = doctor.main(["--check", "kernel_compile", "--check", "device_vs_cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 1
    failed, passed = LINE.match(lines[2]), LINE.match(lines[3])
    assert (failed["name"], failed["status"], failed["detail"]) == ("kernel_compile", "FAIL", "RuntimeError: planted")
    assert (passed["name"], passed["status"], passed["value"]) == ("device_vs_cpu", "PASS", "5.0e-01")
    assert SUMMARY.match(lines[4]).groups() == ("1", "1", "0")


def test_compare_applies_the_tie_rule():
    def run(tokens, logits):
        return doctor.Run([tokens], [[torch.tensor(row) for row in logits]], [])
    ref = run([1, 0], [[0.0, 0.5, 0.2], [0.9, 0.1, 0.0]])
    assert doctor.compare(ref, run([1, 0], [[0.0, 0.5, 0.2], [0.9, 0.1, 0.0]]), 1e-4) == (0.0, None)
    # a tie in the reference's logits (1 and 2): both right; the runs diverge, the rest is not compared
    tie_ref, tie_ours = run([2, 0], [[0.0, 0.5, 0.5], [0.9, 0.1, 0.0]]), run([1, 2], [[0.0, 0.5, 0.5], [0.0, 0.0, 0.9]])
    assert doctor.compare(tie_ref, tie_ours, 1e-4) == (0.0, None)
    diff, problem = doctor.compare(ref, run([2, 0], [[0.0, 0.5, 0.2], [0.9, 0.1, 0.0]]), 1e-4)
    assert problem == "request 0, token 0: token 2 vs 1 (logit gap 3.0e-01)"
    diff, problem = doctor.compare(ref, run([1, 0], [[0.0, 0.5, 0.2], [0.9, 0.3, 0.0]]), 1e-4)
    assert problem.startswith("request 0, token 1: logits differ by 2.0e-01")
    diff, problem = doctor.compare(ref, run([1, 0], [[0.0, float("nan"), 0.2], [0.9, 0.1, 0.0]]), 1e-4)
    assert problem == "request 0, token 0: NaN in the logits"


def test_an_unknown_check_is_a_one_line_error(capsys):
    assert cli.main(["doctor", "--check", "no_such_check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --check 'no_such_check': no such check")


def test_docs_show_the_doctor_output_of_today():
    """The install guide's pasted CPU run has every check, in order, in the format the doctor prints."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "install.md").read_text()
    block = readme.split("python -m toolkit doctor`, ", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    assert lines[0].startswith("versions  ") and lines[1].startswith("device    ") and SUMMARY.match(lines[-1])
    checks = [LINE.match(line) for line in lines[2:-1]]
    assert all(checks) and [m["name"] for m in checks] == list(doctor.CHECKS)
