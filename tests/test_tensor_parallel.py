"""Tensor parallelism (issue 27), first slice: a model sharded over 2 ranks on gloo equals the
unsharded one, with every rank running the same engine on the same requests (vLLM's external-launcher
mode: what torchrun starts). The ranks are spawned processes (torch.multiprocessing, a fresh
`file://` rendezvous per run, a 60 s group timeout); each writes its tokens and every step's logits,
and the test compares rank with rank (bitwise: the logits are all-gathered, so every rank samples
from the same numbers) and TP=2 with TP=1 (logits within 1e-4 in fp32, never bitwise: the
row-parallel sums add in another order).

The parts are also checked in one process: a layer's shards reassemble the full weights."""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from toolkit import LLM, SamplingParams
from toolkit.distributed import TPGroup
from toolkit.errors import NotSupportedYetError
from toolkit.layers.parallel import padded_vocab
from toolkit.models import load_model
from toolkit.models.tensor_parallel import check_tensor_parallel, shard_model

LOGITS_ATOL = 1e-4
_rng = np.random.default_rng(27)
PROMPTS = [_rng.integers(3, 300, n).tolist() for n in (21, 9, 14)]
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
# a chunked mixed batch: the 21-token prompt runs in chunks next to decodes and the other prefills
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, inspect="metadata")


def run_engine(preset: str, tp: int, **engine) -> dict:
    """One engine's tokens (per request) and logits (per step) for PROMPTS."""
    llm = LLM(preset, tensor_parallel_size=tp, **{**ENGINE, **engine})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    attn = llm.model_runner.model.model.layers[0].self_attn
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "logits": [r.logits.clone() for r in llm.trace if r.logits is not None and not r.is_warmup],
              "heads": (attn.num_heads, attn.num_kv_heads), "rank": llm.tp.rank}
    llm.shutdown()
    return result


def _rank_main(rank: int, world: int, store: str, out: str, preset: str, engine: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        torch.save(run_engine(preset, world, **engine), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, preset: str, world: int = 2, **engine) -> list[dict]:
    """Spawn `world` ranks, each running the same engine sharded; their results in rank order."""
    mp.start_processes(_rank_main, args=(world, str(tmp_path / "store"), str(tmp_path), preset, engine),
                       nprocs=world, start_method="spawn", join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("preset", ["tiny-llama"])
def test_two_ranks_equal_one(tmp_path, preset):
    single = run_engine(preset, 1)
    ranks = run_ranks(tmp_path, preset)
    assert [r["rank"] for r in ranks] == [0, 1] and single["heads"] == (4, 2)
    assert all(r["heads"] == (2, 1) for r in ranks)                      # each rank ran its half
    assert ranks[0]["tokens"] == ranks[1]["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["logits"], ranks[1]["logits"], strict=True))
    assert ranks[0]["tokens"] == single["tokens"]
    assert len(ranks[0]["logits"]) == len(single["logits"])
    for step, (a, b) in enumerate(zip(ranks[0]["logits"], single["logits"])):
        diff = (a - b).abs().max().item()
        assert diff <= LOGITS_ATOL, f"step {step}: TP=2 logits differ from TP=1 by {diff:.3g}"


def cpu_model(preset: str):
    return load_model(preset, dtype=torch.float32, device=torch.device("cpu"), seed=0).model


def test_shards_reassemble_the_full_layers():
    """In one process: rank r's slices of each projection, put back in rank order (columns: output
    features; rows: input features), are the full weights; the vocabulary rows too, padded with zeros."""
    full = cpu_model("tiny-llama")
    shards = [shard_model(cpu_model("tiny-llama"),
                          TPGroup(r, 2)) for r in range(2)]
    attn = [s.model.layers[0].self_attn for s in shards]
    assert torch.equal(torch.cat([a.q_proj.weight for a in attn]), full.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(torch.cat([a.k_proj.weight for a in attn]), full.model.layers[0].self_attn.k_proj.weight)
    assert torch.equal(torch.cat([a.o_proj.weight for a in attn], dim=1), full.model.layers[0].self_attn.o_proj.weight)
    assert [a.num_heads for a in attn] == [2, 2] and [a.num_kv_heads for a in attn] == [1, 1]
    mlp = [s.model.layers[0].mlp for s in shards]
    assert torch.equal(torch.cat([m.down_proj.weight for m in mlp], dim=1), full.model.layers[0].mlp.down_proj.weight)
    vocab = full.config.vocab_size
    embed = torch.cat([s.get_input_embeddings().weight for s in shards])
    assert embed.shape[0] == padded_vocab(vocab)
    assert torch.equal(embed[:vocab], full.get_input_embeddings().weight) and not embed[vocab:].any()


def test_kv_heads_replicated_when_fewer_than_ranks():
    """4 ranks, 2 KV heads: each rank keeps one KV head, ranks 0-1 head 0 and ranks 2-3 head 1 (the
    head its q heads read)."""
    full = cpu_model("tiny-llama")
    k = full.model.layers[0].self_attn.k_proj.weight
    d = full.model.layers[0].self_attn.head_dim
    for r in range(4):
        model = shard_model(cpu_model("tiny-llama"),
                            TPGroup(r, 4))
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        assert torch.equal(attn.k_proj.weight, k[(r // 2) * d:(r // 2 + 1) * d])


def test_configurations_that_cannot_shard_are_refused():
    model = cpu_model("tiny-llama")
    with pytest.raises(ValueError, match=r"attention heads \(4\) must be divisible by tensor parallel size \(3\)"):
        check_tensor_parallel(model, 3)
    check_tensor_parallel(model, 4)
    with pytest.raises(NotSupportedYetError, match="sharding is built for LlamaForCausalLM so far, not"):
        check_tensor_parallel(cpu_model("tiny-bamba"), 2)
    with pytest.raises(NotSupportedYetError, match="torchrun"):
        LLM("tiny-llama", device="cpu", tensor_parallel_size=2)          # no process group: no ranks
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM("tiny-llama", device="cpu", tensor_parallel_size=0)
