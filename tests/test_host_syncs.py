"""A decode step synchronises host and device once: the copy of the sampled token ids to the host.

On a GPU every host read of device data (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.cpu()`) and
every op whose output shape depends on the data (`nonzero`, boolean indexing, `unique`, ...) makes
the host wait for the device, and none of them may sit inside a captured CUDA graph. This test runs
on the CPU, so it records the ops that *would* synchronise on a GPU:

- through a TorchDispatchMode: `_local_scalar_dense`/`item` (item/int/bool/float of a tensor,
  `any()`/`all()` read on the host), `nonzero` (and `where(cond)`), `masked_select`,
  `index`/`index_put(_)` with a boolean index, `repeat_interleave` without `output_size`,
  `unique*`/`_unique2`, `equal`, `bincount`;
- by wrapping the Tensor methods that read a tensor on the host without going through the
  dispatcher on the CPU: `tolist()` and `cpu()` (and `.to("cpu")`).

`.numpy()` is not counted: it raises on a CUDA tensor, so it only ever reads host tensors. That is
the rule the code follows: host-side bookkeeping reads numpy arrays or `.numpy()` of the single host
copy, never `.tolist()`/`.item()` of a tensor.
"""
from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit import LLM, SamplingParams
from toolkit.inspect.spec_views import spec_step_html
from toolkit.models import PRESETS
from toolkit.models.presets import is_shape_preset

PRESET_NAMES = [p for p in PRESETS if not is_shape_preset(p)]
aten = torch.ops.aten

# Under torch.inference_mode (the runner's forward and sampler) a dispatch mode sees composite
# ops themselves (aten.item, aten.where.default, repeat_interleave.self_Tensor), outside it their
# decompositions (_local_scalar_dense, nonzero, repeat_interleave.Tensor): both are listed.
_ALWAYS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose,
           aten.nonzero, aten.nonzero_numpy, aten.argwhere, aten.masked_select, aten.bincount,
           aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
           aten.unique_dim_consecutive}
_BOOL_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# the output's size is the sum of `repeats`: read on the host unless output_size is given
_DATA_SIZED = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}


_REPO = Path(__file__).resolve().parents[1]
_SOURCES = (_REPO / "toolkit", _REPO / "kernels")


def _where() -> str:
    """The innermost frame of the project's code (toolkit/, kernels/) on the current Python stack,
    as file:line (function)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if any(path.is_relative_to(d) for d in _SOURCES):
            return f"{path.relative_to(_REPO)}:{frame.lineno} ({frame.name})"
    return "?"


def _is_sync(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet in _ALWAYS or func is aten.where.default:     # where(cond) = nonzero
        return True
    if packet in _BOOL_INDEXED:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if func in _DATA_SIZED:
        return kwargs.get("output_size") is None
    return False


class HostSyncRecorder(TorchDispatchMode):
    """Records (op, location) of everything in a step that would synchronise host and device."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.events.append((str(func), _where()))
        return func(*args, **kwargs)

    def count_host_reads(self, monkeypatch) -> None:
        """Tensor.tolist/.cpu/.to("cpu") do not dispatch anything on a CPU tensor: count the calls.
        (`.to(device)` with a device object is not counted: that is how code moves host data to
        the device; a copy to the host is written `.cpu()` or `.to("cpu")`.)"""
        def wrap(name, counts):
            original = getattr(torch.Tensor, name)

            def wrapper(t, *a, **kw):
                if counts(a, kw):
                    self.events.append((f"Tensor.{name}", _where()))
                return original(t, *a, **kw)
            monkeypatch.setattr(torch.Tensor, name, wrapper)

        def to_cpu(a, kw):
            dev = kw.get("device", a[0] if a else None)
            return isinstance(dev, str) and dev.startswith("cpu")
        wrap("tolist", lambda a, kw: True)
        wrap("cpu", lambda a, kw: True)
        wrap("to", to_cpu)


PARAMS = {
    "greedy": [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3,
    "sampled": [SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=1.0, top_k=5, seed=2, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, ignore_eos=True)],
    "mixed": [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, top_k=5, top_p=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)],
    # logprobs of the sampled tokens (top 5), prompt logprobs, the min_tokens mask (EOS and a stop
    # id, while the first 6 tokens come) and stop strings, beside a row that asks for none of them
    "logprobs": [SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, prompt_logprobs=3, ignore_eos=True),
                 SamplingParams(max_tokens=8, temperature=0.9, seed=4, logprobs=0, min_tokens=6,
                                stop_token_ids=[7], stop=["\n\n", "zz"]),
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)],
    # the logits processors: penalties (token counts on the device), min_p, bias, allowed ids, bad words
    "penalties": [SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                 logit_bias={5: 1.5}, bad_words=["ab"], ignore_eos=True),
                  SamplingParams(max_tokens=8, temperature=0.9, seed=6, frequency_penalty=0.4, min_p=0.1,
                                 allowed_token_ids=list(range(3, 90)), ignore_eos=True),
                  SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)],
}


@pytest.fixture(scope="module")
def engines():
    """One warmed-up engine per (preset, cudagraph mode), shared by the parameter sets."""
    made: dict[tuple[str, str], LLM] = {}

    def get(preset: str, mode: str) -> LLM:
        if (preset, mode) not in made:
            made[preset, mode] = _engine(preset, mode)
        return made[preset, mode]
    yield get
    for llm in made.values():
        llm.shutdown()


def _engine(preset: str, mode: str) -> LLM:
    llm = LLM(preset, device="cpu", dtype="float32", backend="torch", inspect="off", max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=128, cudagraph_mode=mode)
    llm.warmup(progress=False)
    return llm


# "padded_eager": the batch of 3 decode rows runs padded to the capture size 4, as a CUDA graph
# would replay it (a padded row on the null block / state page, its KV slot PAD_SLOT_ID)
@pytest.mark.parametrize("mode", ["none", "padded_eager"])
@pytest.mark.parametrize("params", list(PARAMS))
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_a_decode_step_syncs_once(engines, monkeypatch, preset, params, mode):
    llm = engines(preset, mode)
    for i, sp in enumerate(PARAMS[params]):
        llm.add_request({"prompt_token_ids": list(range(3 + i, 3 + i + 5 + 4 * i))}, sp)
    record = llm.step()                       # prefills every prompt (64 tokens fit them all)
    assert all(r.is_prefill for r in record.scheduled) and len(record.scheduled) == 3
    for step in range(2):                     # two decode steps
        recorder = HostSyncRecorder()
        with monkeypatch.context() as m:
            recorder.count_host_reads(m)
            with recorder:
                record = llm.step()
        assert len(record.scheduled) == 3 and all(r.runs_as_decode for r in record.scheduled)
        assert record.padded_size == (4 if mode == "padded_eager" else None)
        report = "\n".join(f"  {op:40s} at {where}" for op, where in recorder.events)
        assert len(recorder.events) == 1, \
            f"{preset} ({params}, {mode}) decode step {step}: {len(recorder.events)} host syncs, " \
            f"want 1 (the copy of the sampled ids):\n{report}"
        op, where = recorder.events[0]
        assert op == "Tensor.cpu" and where.startswith("toolkit/runner/model_runner.py"), report
    while llm.has_unfinished_requests():
        llm.step()


# n=3 forks after the parent's prefill: the children copy its KV blocks and state page and each runs
# the last prompt token (all rows run as decodes: padded in "padded_eager"), then they decode
@pytest.mark.parametrize("mode", ["none", "padded_eager"])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_logprobs_prompt_logprobs_and_the_fork_add_no_sync(engines, monkeypatch, preset, mode):
    """Every step of an n=3 request with logprobs and prompt logprobs syncs once in the engine's
    own code (toolkit/: the copy of the sampled ids). A prefill step also runs torch reference
    kernels (kernels/*_ref.py), some of which read the host on their own (they are the CPU op set;
    on a GPU the Triton kernels run instead), so a step whose rows all run as decodes -- the fork
    step and the decode steps -- must sync exactly once in all."""
    llm = engines(preset, mode)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, n=3, logprobs=2, prompt_logprobs=2,
                            ignore_eos=True)
    llm.add_request({"prompt_token_ids": list(range(3, 20))}, params)
    seen_fork = False
    while llm.has_unfinished_requests():
        recorder = HostSyncRecorder()
        with monkeypatch.context() as m:
            recorder.count_host_reads(m)
            with recorder:
                record = llm.step()
        report = "\n".join(f"  {op:40s} at {where}" for op, where in recorder.events)
        engine = [(op, where) for op, where in recorder.events if not where.startswith("kernels/")]
        assert len(engine) == 1 and engine[0][0] == "Tensor.cpu" and \
            engine[0][1].startswith("toolkit/runner/model_runner.py"), \
            f"{preset} ({mode}) step {record.step_index}: want one sync in toolkit/:\n{report}"
        if record.scheduled and all(r.runs_as_decode for r in record.scheduled):
            assert len(recorder.events) == 1, f"{preset} ({mode}) step {record.step_index}:\n{report}"
            seen_fork |= all(r.num_computed_before == 16 for r in record.scheduled) and len(record.scheduled) == 3
    assert seen_fork, "the children's first step (16 tokens computed by the parent) was not seen"


# ---- the sync-free replacements equal what they replace -------------------------------------------
def test_padded_scatter_writes_real_rows_and_leaves_the_rest_bit_identical():
    from toolkit.kernels.kv_cache_ref import write_kv_cache
    from toolkit.kernels.state_slots_ref import write_states_at
    g = torch.Generator().manual_seed(0)
    # a real row on slot 0 among padded rows; a padded row first; every row padded; none padded
    for idx in ([3, -1, 0, 5, -1], [-1, 2, -1], [-1, -1], [4]):
        idx = torch.tensor(idx)
        cache, new = torch.randn(6, 2, 3, generator=g), torch.randn(len(idx), 2, 3, generator=g)
        want = cache.clone()
        want[idx[idx >= 0]] = new[idx >= 0]
        write_states_at(cache, idx, new)
        assert torch.equal(cache, want), idx
        kv, k, v = torch.randn(3, 2, 2, 1, 3, generator=g), new[:, :1].clone(), new[:, 1:2].clone()
        want = kv.clone()
        real = idx >= 0
        want[idx[real] // 2, 0, idx[real] % 2] = k[real]
        want[idx[real] // 2, 1, idx[real] % 2] = v[real]
        write_kv_cache(kv, k, v, idx)
        assert torch.equal(kv, want), idx


@pytest.mark.parametrize("preset", ["tiny-jamba", "tiny-nemotron-h"])
def test_moe_dense_path_equals_the_sparse_path(monkeypatch, preset):
    """Few tokens run every expert (dense routing matrix, no sync); many tokens only the routed
    ones (torch.unique). Same sum, up to the matmul's rounding on a different row count."""
    from toolkit.layers import moe
    from toolkit.models import nemotron_h
    llm = LLM(preset, device="cpu", dtype="float32", backend="torch", inspect="off")
    kinds = (moe.FusedExperts, nemotron_h.NemotronHExperts)
    experts = [m for m in llm.model.modules() if isinstance(m, kinds)]
    assert experts
    g = torch.Generator().manual_seed(0)
    for layer in experts:
        e = layer.num_experts
        dim = layer.down_proj.shape[1]
        x = torch.randn(9, dim, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(9)])
        weights = torch.rand(9, 2, generator=g)
        with torch.inference_mode():
            dense = layer(x, weights, ids)
            monkeypatch.setattr(moe, "DENSE_MAX_TOKENS", 0)
            monkeypatch.setattr(nemotron_h, "DENSE_MAX_TOKENS", 0)
            sparse = layer(x, weights, ids)
            monkeypatch.undo()
        torch.testing.assert_close(dense, sparse, atol=1e-5, rtol=1e-5)
    llm.shutdown()


# speculative decoding: a verify step (drafts on every row, some rejected) syncs once too -- the
# verification, the rollback and the accepted counts run on the host copy of the sampled ids; with
# prefix caching also the pre-copy from the accepted column and the boundary copy into a checkpoint
@pytest.mark.parametrize("preset, caching, penalties", [
    ("tiny-bamba", False, False), ("tiny-bamba", True, False), ("tiny-qwen3-next", False, False),
    ("tiny-qwen3-next", True, False), ("tiny-bamba", False, True)])
def test_a_verify_step_syncs_once(monkeypatch, preset, caching, penalties):
    from harness import ScriptedProposer

    prompts = [list(range(3 + i, 3 + i + 5 + 4 * i)) for i in range(3)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                            **(dict(repetition_penalty=1.2, frequency_penalty=0.3) if penalties else {}))
    engine = dict(device="cpu", dtype="float32", backend="torch", max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=128)
    plain = LLM(preset, inspect="off", **engine)
    refs = [p + list(o.outputs[0].token_ids) for p, o in
            zip(prompts, plain.generate([{"prompt_token_ids": p} for p in prompts], greedy))]
    plain.shutdown()
    llm = LLM(preset, inspect="off", enable_prefix_caching=caching, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **engine)
    llm.model_runner.proposer = ScriptedProposer(refs, 3, wrong_every=2)
    for p in prompts:
        llm.add_request({"prompt_token_ids": p}, greedy)
    while any(r.is_prefill for r in llm.step().scheduled):     # the prefills (chunked at block ends)
        pass
    copies = verify_steps = 0
    for step in range(6):                                # decode steps, most of them verifying drafts
        recorder = HostSyncRecorder()
        with monkeypatch.context() as m:
            recorder.count_host_reads(m)
            with recorder:
                record = llm.step()
        state = llm.model_runner.execute_state
        verify_steps += state.verification is not None
        copies += bool(state.checkpoint_copies)
        report = "\n".join(f"  {op:40s} at {where}" for op, where in recorder.events)
        assert len(recorder.events) == 1, f"{preset} decode step {step}: {len(recorder.events)} host syncs:\n{report}"
        assert recorder.events[0][0] == "Tensor.cpu", report
    assert verify_steps >= 3
    # inspection off: the record's verify rows say their state columns were not read
    assert record.spec and not any(r.columns_read or r.columns for r in record.spec.values())
    assert "state columns not read (inspection off" in spec_step_html(record)
    assert copies or not caching, "no verify step saved a checkpoint"
    llm.shutdown()
