"""The shipped demo models: they load (ours and HF's), write readable text, match HF greedy for
64 tokens, and score held-out bytes the same through the runner and through HF."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from toolkit import LLM
from toolkit.models import DEMO_MODELS, model_folder

from harness import assert_matches_hf, load_hf, run_by_hand

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
DEMOS = list(DEMO_MODELS)
PROMPTS = ["The ", "A class ", "def "]
NEW_TOKENS = 64


def printable_share(text: str) -> float:
    return sum(32 <= ord(c) < 127 or c in "\n\t" for c in text) / max(len(text), 1)


@pytest.mark.parametrize("name", DEMOS)
def test_shipped_folder_is_small_and_documented(name):
    folder = model_folder(name)
    assert folder is not None and folder.is_relative_to(REPO / "toolkit" / "models" / "demo")
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert (folder / "model.safetensors").stat().st_size <= 10 * 2**20 and size <= 11 * 2**20
    info = json.loads((folder / "training.json").read_text())
    for split in ("train", "heldout_topics", "heldout_docstrings"):
        assert info["corpus"]["splits"][split]["bytes"] > 0
        assert len(info["corpus"]["splits"][split]["sha256_of_token_ids_int16"]) == 64
    assert (folder / "loss.png").stat().st_size > 0 and (folder / "loss.csv").read_text().startswith("step,")


@pytest.mark.parametrize("name", DEMOS)
def test_greedy_text_is_readable_and_matches_hf(name):
    hf = load_hf(model_folder(name))
    with LLM(name, device="cpu", dtype="float32", max_num_seqs=3, max_num_batched_tokens=16) as llm:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        res = run_by_hand(llm, prompts, NEW_TOKENS)
        for rid, prompt in zip(res.tokens, prompts):
            text = llm.tokenizer.decode(res.tokens[rid])
            assert printable_share(text) >= 0.9, f"{name}: {text!r}"
            assert_matches_hf(hf, prompt, res.tokens[rid], res.logits[rid], NEW_TOKENS)


@pytest.mark.parametrize("name", DEMOS)
def test_heldout_bits_per_byte_agree_with_hf(name):
    from demo_corpus import build_corpus
    from eval_demo_models import hf_bpb, runner_bpb, windows_of
    windows = windows_of(build_corpus()["heldout_topics"].tokens(), 256, 0)     # all 42 windows
    ours, ref = runner_bpb(name, windows), hf_bpb(model_folder(name), windows)
    assert abs(ours - ref) < 1e-3 and ours <= 2.2, (ours, ref)


def test_demo_command_uses_demo_hybrid_and_prints_text():
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "toolkit", "demo", "--device", "cpu", "--max-tokens", "16"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "model demo-hybrid: Lfm2ForCausalLM" in proc.stdout and "prefill/decode" in proc.stdout
    texts = [line.split(" -> ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("request ")]
    assert len(texts) == 4 and all(printable_share(t) >= 0.9 for t in texts)


def test_hf_loads_the_shipped_folder_directly():
    from transformers import AutoModelForCausalLM
    for name in DEMOS:
        hf = AutoModelForCausalLM.from_pretrained(str(model_folder(name)), dtype=torch.float32)
        assert type(hf).__name__ == {"demo-hybrid": "Lfm2ForCausalLM", "demo-mamba": "Mamba2ForCausalLM"}[name]
