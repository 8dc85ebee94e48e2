"""Tensor parallelism (issue 27): a model sharded over 2 ranks on gloo equals the unsharded one.

Two ways to run the ranks:
- external launcher (what torchrun starts): the test spawns the ranks (torch.multiprocessing, a fresh
  `file://` rendezvous per run, a 60 s group timeout), every rank runs the same engine on the same
  requests and writes its tokens and every step's logits; the test compares rank with rank (bitwise:
  the logits are all-gathered, so every rank samples from the same numbers) and TP=2 with TP=1
  (logits within 1e-4 in fp32, never bitwise: the row-parallel sums add in another order);
- the engine starts its workers (`LLM(tensor_parallel_size=2)` in this process, rank 0): tokens equal
  TP=1; a worker that raises or is killed makes the next step raise naming the rank; shutdown leaves
  no process behind, and a second engine starts in the same process; the workers start from a fork
  server or spawned (RUNNERSCOPE_WORKER_MULTIPROC_METHOD) and see the caller's environment of the
  moment they start.

The parts are also checked in one process: a layer's shards reassemble the full weights; a Mamba2
mixer's sections are sliced each on its own, its single group replicated."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import toolkit.llm
from toolkit import LLM, SamplingParams, TensorParallelError
from toolkit.distributed import TPGroup
from toolkit.errors import NotSupportedYetError
from toolkit.layers.parallel import padded_vocab
from toolkit.models import load_model
from toolkit.models.registry import MODEL_REGISTRY
from toolkit.models.tensor_parallel import SHARDABLE, check_tensor_parallel, shard_model
from toolkit.runner.executor import ASK, START_METHOD_VAR, TPExecutor, start_context

from harness import ScriptedProposer

LOGITS_ATOL = 1e-4
_rng = np.random.default_rng(27)
PROMPTS = [_rng.integers(3, 260, n).tolist() for n in (21, 9, 14)]     # within every vocabulary (264+)
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)]
# a chunked mixed batch: the 21-token prompt runs in chunks next to decodes and the other prefills
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, inspect="metadata")


def run_engine(preset: str, tp: int, **engine) -> dict:
    """One engine's tokens (per request) and logits (per step) for PROMPTS as a chunked mixed batch,
    then for the first prompt alone."""
    llm = LLM(preset, tensor_parallel_size=tp, **{**ENGINE, **engine})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    outs += llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS[0])
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "logits": [r.logits.clone() for r in llm.trace if r.logits is not None and not r.is_warmup],
              "params": sum(p.numel() for p in llm.model_runner.model.parameters()), "rank": llm.tp.rank}
    llm.shutdown()
    return result


def _rank_main(rank: int, world: int, store: str, out: str, presets: list[str], engine: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for preset in presets:        # one pair of processes for every preset (a spawn costs seconds)
            try:
                result = run_engine(preset, world, **engine)
            except Exception as err:      # the preset's test reports it
                result = {"error": f"{type(err).__name__}: {err}"}
            torch.save(result, f"{out}/{preset}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path: Path, presets: list[str], world: int = 2, **engine) -> dict[str, list[dict]]:
    """Spawn `world` ranks, each running the same engine sharded for each preset in turn; per preset,
    the ranks' results in rank order."""
    mp.start_processes(_rank_main, args=(world, str(tmp_path / "store"), str(tmp_path), presets, engine),
                       nprocs=world, start_method="spawn", join=True)
    return {p: [torch.load(tmp_path / f"{p}-rank{r}.pt") for r in range(world)] for p in presets}


# attention + MLP; Mamba1 (tied embeddings; FalconMamba's weightless dt/B/C norms after the x_proj
# all-reduce); Mamba2 with its 2 groups split; Bamba: Mamba2 with 1 group replicated on both ranks
# (its gated norm's statistic all-reduced), attention and MLP
# LFM2: short conv by channels, attention with per-head q/k norms (whole on every rank), tied head
# Jamba: Mamba1 with weighted dt/B/C norms, attention without RoPE, MoE (every expert's intermediate
# split, the router whole) and dense MLP layers
# Granite: a scaled embedding, multipliers, MoE plus a shared MLP (each its own all-reduce), logits
# scaled; NemotronH: relu2 MLPs and MoE of non-gated experts with a shared expert, Mamba2 groups split;
# Falcon-H1: attention and Mamba2 in parallel (norm before gate, muP multipliers over the local sections);
# Zamba2: shared attention + MLP blocks with per-layer adapters (their second projections sharded);
# Qwen3-Next: Gated DeltaNet by key-head groups, gated attention ([q | gate] per head), MoE + shared expert;
# LFM2-MoE: LFM2's layers and a sigmoid-routed MoE (expert bias, router and bias whole on every rank);
# MiniMax: lightning attention by heads (its norm over every head's channels all-reduced), MoE;
# LFM3: sliding-window and full attention with per-head gates (g_proj by heads), 7-wide short convs;
# xLSTM: the mLSTM by heads (its three states; the per-head norm needs no communication);
# the trained demo models (HF folders; a vocabulary of 264 padded to 320)
EVERY_MODEL = ["tiny-llama", "tiny-mamba", "tiny-falcon-mamba", "tiny-mamba2", "tiny-bamba", "tiny-lfm2", "tiny-jamba",
               "tiny-granite-hybrid", "tiny-nemotron-h", "tiny-falcon-h1", "tiny-zamba2", "tiny-qwen3-next",
               "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-olmo-hybrid", "tiny-kimi-linear",
               "tiny-lfm2-moe", "tiny-minimax", "tiny-lfm3", "tiny-xlstm", "demo-hybrid", "demo-mamba"]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory) -> dict[str, list[dict]]:
    return run_ranks(tmp_path_factory.mktemp("ranks"), EVERY_MODEL)


@pytest.mark.xdist_group("tp-ranks")      # one worker runs them all: the ranks are spawned once
@pytest.mark.parametrize("preset", EVERY_MODEL)
def test_two_ranks_equal_one(sharded_runs, preset):
    ranks = sharded_runs[preset]
    assert not any("error" in r for r in ranks), [r.get("error") for r in ranks]
    single = run_engine(preset, 1)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["params"] < 0.7 * single["params"] for r in ranks)        # each rank holds its share
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
    assert set(SHARDABLE) == {cls.hf_architecture for cls in MODEL_REGISTRY.values()}   # every architecture
    mamba2 = cpu_model("tiny-mamba2")            # 8 heads, 2 groups
    check_tensor_parallel(mamba2, 2)
    with pytest.raises(ValueError, match=r"does not divide num_groups \(2\), then num_groups must equal 1"):
        check_tensor_parallel(mamba2, 4)
    with pytest.raises(ValueError, match=r"Tensor parallel world size \(3\) must divide num heads \(8\)"):
        check_tensor_parallel(mamba2, 3)
    with pytest.raises(ValueError, match="must be divisible by tensor parallel size"):   # before any worker starts
        LLM("tiny-llama", device="cpu", tensor_parallel_size=3)
    assert not mp.active_children()
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        LLM("tiny-llama", device="cpu", tensor_parallel_size=0)


def test_mamba2_sections_sliced_each_on_its_own():
    """in_proj [gate | x | B | C | dt] and the conv's [x | B | C]: rank r keeps its heads' rows of each
    section; B and C by groups (tiny-mamba2: 2 groups, one per rank) or, with one group (tiny-bamba),
    the whole group on every rank."""
    for preset, layer, replicated in (("tiny-mamba2", 0, False), ("tiny-bamba", 0, True)):
        full = cpu_model(preset)
        mixer = full.body.layers[layer].mixer if preset == "tiny-mamba2" else full.body.layers[layer].mamba
        i, gn, h = mixer.intermediate_size, mixer.n_groups * mixer.state_size, mixer.num_heads
        w = mixer.in_proj.weight
        for r in range(2):
            model = shard_model(cpu_model(preset), TPGroup(r, 2))
            m = model.body.layers[layer].mixer if preset == "tiny-mamba2" else model.body.layers[layer].mamba
            half, bc = i // 2, (gn if replicated else gn // 2)
            b0 = 0 if replicated else r * bc
            want = torch.cat([w[r * half:(r + 1) * half], w[i + r * half:i + (r + 1) * half],
                              w[2 * i + b0:2 * i + b0 + bc], w[2 * i + gn + b0:2 * i + gn + b0 + bc],
                              w[2 * i + 2 * gn + r * h // 2:2 * i + 2 * gn + (r + 1) * h // 2]])
            assert torch.equal(m.in_proj.weight, want), (preset, r)
            assert m.conv1d.weight.shape[0] == m.conv_dim == half + 2 * bc
            assert m.state_shapes() == ((mixer.conv_kernel - 1, half + 2 * bc),
                                        (h // 2, mixer.head_dim, mixer.state_size))
            assert m.norm_across_ranks == replicated


# ---- the engine starts its workers (rank 0 is this process) ------------------------------------
def tokens_of(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]


@pytest.mark.parametrize("preset", ["tiny-mamba2", "tiny-lfm2"])
def test_the_engine_starts_its_workers(preset):
    engine = {k: v for k, v in ENGINE.items() if k != "inspect"}
    want = tokens_of(LLM(preset, inspect="off", **engine))
    for _ in range(2):                   # a second engine after shutdown, in the same process
        llm = LLM(preset, tensor_parallel_size=2, **engine)
        assert llm.tp.rank == 0 and len(mp.active_children()) == 1
        llm.warmup(progress=False)
        assert tokens_of(llm) == want
        assert all(not r.violations for r in llm.trace)
        # a step where nothing finishes sends the workers execute_model and sample_tokens only (the
        # inspection's own collectives aside): no remove_requests of an empty list
        sent, broadcast = [], llm._executor.broadcast
        llm._executor.broadcast = lambda message, sent=sent, broadcast=broadcast: (sent.append(message[0]),
                                                                                    broadcast(message))[1]
        llm.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=3, temperature=0.0))
        llm.step()
        llm.step()
        mirrored = [name for name in sent if not name.startswith(ASK)]
        assert mirrored == ["execute_model", "sample_tokens"] * 2, mirrored
        llm._executor.broadcast = broadcast
        while llm.has_unfinished_requests():
            llm.step()
        llm.shutdown()
        assert not mp.active_children() and not dist.is_initialized()


PROBE_VAR = "RUNNERSCOPE_TEST_WORKER_PROBE"


def _probe_context():
    """A worker context (runs in the worker, before it joins the group) that refuses to start unless
    the worker sees PROBE_VAR as the test set it just before the engine started."""
    if os.environ.get(PROBE_VAR) != "set after the first engine":
        raise RuntimeError(f"the worker sees {PROBE_VAR}={os.environ.get(PROBE_VAR)!r}")
    return contextlib.nullcontext()


class _ProbedExecutor(TPExecutor):
    def __init__(self, *args, worker_context=None, timeout_s=None, **kwargs):
        super().__init__(*args, worker_context=_probe_context, timeout_s=self.timeout, **kwargs)

    timeout = 30.0


class _ProbedQuickExecutor(_ProbedExecutor):
    timeout = 5.0             # the rendezvous a failed worker never joins: 5 s, not 30


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_workers_start_with_the_callers_environment_of_the_moment(method, monkeypatch):
    """The default start method is a fork server where the platform has one (the workers of a second
    engine fork from a process that imported the toolkit when the first one started, with the
    environment of that moment); spawn where asked. Either way a worker sees the caller's environment
    as it is when its engine starts, and the tokens equal TP=1's. A worker that raises before it joins
    the group is named with its error, and the next engine starts."""
    monkeypatch.delenv(START_METHOD_VAR, raising=False)
    has_server = "forkserver" in mp.get_all_start_methods()          # Linux, macOS; not Windows
    assert start_context().get_start_method() == ("forkserver" if has_server else "spawn")
    monkeypatch.setenv(START_METHOD_VAR, "fork")
    with pytest.raises(ValueError, match=f"{START_METHOD_VAR}='fork'.*forkserver, spawn"):
        start_context()
    if not has_server and method == "forkserver":
        pytest.skip("no fork server on this platform (Windows): the workers are spawned")
    monkeypatch.setenv(START_METHOD_VAR, method)
    assert start_context().get_start_method() == method
    monkeypatch.delenv(PROBE_VAR, raising=False)
    LLM("tiny-llama", tensor_parallel_size=2, **ENGINE).shutdown()      # a fork server runs from here on
    monkeypatch.setenv(PROBE_VAR, "set after the first engine")
    monkeypatch.setattr(toolkit.llm, "TPExecutor", _ProbedExecutor)
    with LLM("tiny-llama", tensor_parallel_size=2, **ENGINE) as llm:
        tokens = tokens_of(llm)
    assert tokens == tokens_of(LLM("tiny-llama", **ENGINE))
    if method == "spawn":     # a spawned worker imports for ~5 s before it can fail: the rest on a fork
        return
    monkeypatch.delenv(PROBE_VAR)       # a worker that raises before it joins: its own error, named
    monkeypatch.setattr(toolkit.llm, "TPExecutor", _ProbedQuickExecutor)
    with pytest.raises(TensorParallelError, match=rf"rank 1 \(exit code 1\) failed before joining the process "
                                                  rf"group: RuntimeError: the worker sees {PROBE_VAR}=None"):
        LLM("tiny-llama", tensor_parallel_size=2, **ENGINE)
    assert not mp.active_children() and not dist.is_initialized()
    monkeypatch.setattr(toolkit.llm, "TPExecutor", TPExecutor)     # and the next engine starts (torch's
    LLM("tiny-llama", tensor_parallel_size=2, **ENGINE).shutdown()  # group counter reset after the failure)


def test_a_worker_that_raises_is_named():
    llm = LLM("tiny-llama", tensor_parallel_size=2, **ENGINE)
    llm.add_request({"prompt_token_ids": PROMPTS[0]}, PARAMS[0])
    llm.step()
    llm._executor.broadcast(("no_such_method", (), {}))          # rank 1 raises AttributeError and exits
    with pytest.raises(TensorParallelError, match=r"rank 1 \(exit code 1\): AttributeError"):
        llm.step()
    with pytest.raises(TensorParallelError, match="failed earlier"):
        llm.step()
    llm.shutdown()
    assert not mp.active_children() and not dist.is_initialized()


def test_a_killed_worker_is_named_within_the_timeout():
    """A worker killed between steps: the next step raises naming it, at once when gloo sees the
    closed connection, at the group timeout at the latest (rank 0's broadcast can complete into the
    socket's buffer, and the next collective then waits for the dead rank: seen once in CI, 30.0 s),
    plus the second it takes to reap the worker. The engine is shut down whatever happens, so a
    failure here does not leave a group running for the next test."""
    llm = LLM("tiny-llama", tensor_parallel_size=2, **ENGINE)
    try:
        llm.add_request({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=50, ignore_eos=True))
        llm.step()
        worker = mp.active_children()[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(exit code -9\)"):
            llm.step()
        assert time.monotonic() - start < llm._executor.timeout_s + 5
    finally:
        llm.shutdown()
    assert not mp.active_children() and not dist.is_initialized()


def test_with_prefix_caching_and_speculation():
    """The engine's other features keep working sharded: prefix caching ("align", a second round
    hitting the first one's checkpoints) and n-gram speculation (verify rows) on Bamba, TP=2 == TP=1."""
    engine = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, inspect="metadata",
                  enable_prefix_caching=True, block_size=8,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    plain = LLM("tiny-bamba", device="cpu", dtype="float32", inspect="off")
    refs = [p + t for p, t in zip(PROMPTS, tokens_of(plain))]
    plain.shutdown()
    runs = []
    for tp in (1, 2):
        llm = LLM("tiny-bamba", tensor_parallel_size=tp, **engine)
        llm.model_runner.proposer = ScriptedProposer(refs, 3)       # rank 0's drafts go to every rank
        runs.append((tokens_of(llm), tokens_of(llm)[:2], llm.stats()))
        assert all(not r.violations for r in llm.trace)
        llm.shutdown()
    (a, a2, _), (b, b2, stats) = runs
    assert a == b and a2 == b2
    assert stats["prompt_tokens_skipped"] > 0 and stats["spec_accepted_drafts"] > 0
    with pytest.raises(NotSupportedYetError, match="inspect='full'"):
        LLM("tiny-bamba", tensor_parallel_size=2, **{**engine, "inspect": "full"})
    assert not mp.active_children()


def test_draft_model_with_tensor_parallelism():
    """method "draft_model" sharded: the draft (tiny-mamba2) runs whole in rank 0's process, its drafts
    reach rank 1 in the next SchedulerOutput; TP=2 keeps plain decoding's greedy tokens."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    plain = LLM("tiny-bamba", inspect="off", **engine)
    want = [list(o.outputs[0].token_ids) for o in plain.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)]
    plain.shutdown()
    llm = LLM("tiny-bamba", tensor_parallel_size=2, **engine,
              speculative_config={"method": "draft_model", "model": "tiny-mamba2", "num_speculative_tokens": 3})
    try:
        got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)]
        assert got == want
        assert llm.stats()["spec_draft_tokens"] > 0 and all(not r.violations for r in llm.trace)
    finally:
        llm.shutdown()
    assert not mp.active_children()
