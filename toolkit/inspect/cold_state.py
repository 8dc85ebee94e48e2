"""The state a cold run computes: the oracle of the prefix-cache check `checkpoint_equals_cold_state`.

`ColdReplay(runner).states(token_ids)` prefills `token_ids` from zero state in one chunk on a scratch
runner (the engine's own model and ops, its own small caches, no prefix caching, eager) and returns
each recurrent layer's state after the last token. The model's layers are bound to the scratch
caches for that forward and bound back to the engine's caches before it returns, even on error.

With `LLM(inspect="full", enable_prefix_caching=True)` the recorder compares, before the forward,
the state a request admitted with a prefix hit starts from (copied from a checkpoint) with the cold
state at the hit's position, within `STATE_TOLERANCE` of the state's dtype: a checkpoint saved at
the wrong position, a skipped pre-copy or a stale page all show up there. It costs one prefill of the
hit's tokens per distinct prefix (cached), so it runs only in full mode.

With speculative decoding (`check_spec_start_states`, full mode), each verify row's starting state --
the slot its first position copies from, the column its last step's accepted count points at --
is compared the same way with a cold prefill of the request's computed tokens: the state plain
decoding would hold there. One prefill per decode row and step.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch

from toolkit.attention.mamba_base import verify_start_slots
from toolkit.inspect.step_record import Violation
from toolkit.inspect.tolerance import exceeds
from toolkit.layers.ops import set_ops
from toolkit.request import Request
from toolkit.runner.kv_cache import scheduler_groups
from toolkit.runner.model_runner import ModelRunner
from toolkit.sampling import SamplingParams
from toolkit.scheduler import Scheduler

# (atol, rtol) per state dtype: a checkpoint reached through other chunk boundaries than the cold
# run's single chunk differs by rounding only
STATE_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}
CACHED_PREFIXES = 8          # cold states kept (the same shared prefix is hit again and again)


class ColdReplay:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._cache: OrderedDict[tuple[int, ...], dict[str, list[torch.Tensor]]] = OrderedDict()

    def states(self, token_ids: list[int]) -> dict[str, list[torch.Tensor]]:
        """{recurrent layer name: its state tensors (one per state name, per-slot shape)} after a
        cold prefill of `token_ids` (at least one token)."""
        key = tuple(token_ids)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        out = self._replay(list(token_ids))
        self._cache[key] = out
        if len(self._cache) > CACHED_PREFIXES:
            self._cache.popitem(last=False)
        return out

    def _replay(self, token_ids: list[int]) -> dict[str, list[torch.Tensor]]:
        main = self.runner
        n = len(token_ids)
        cfg = dataclasses.replace(main.cfg, max_num_seqs=1, max_num_batched_tokens=n, max_model_len=n + 1,
                                  num_kv_blocks=None, enable_prefix_caching=False, cudagraph_mode="none",
                                  num_state_pages=None, mamba_cache_mode="none", num_speculative_tokens=0)
        try:
            scratch = ModelRunner(main.model, cfg)          # binds the model to its own caches
            groups = scratch.kv_cache_groups
            kinds, num_kv_blocks = scheduler_groups(groups)
            scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=n, max_model_len=n + 1, groups=kinds,
                                  num_kv_blocks=num_kv_blocks, decode=lambda ids: "",
                                  enable_prefix_caching=False, num_state_pages=cfg.state_pages)
            scheduler.add_request(Request("cold", token_ids, SamplingParams(max_tokens=1), frozenset()))
            sched_out = scheduler.schedule()
            if sched_out.num_scheduled_tokens.get("cold") != n:
                raise RuntimeError(f"cold replay: scheduled {sched_out.num_scheduled_tokens} of {n} tokens")
            scratch.execute_model(sched_out)
            held = scheduler.kv.block_ids("cold")
            return {name: [t[held[g.group_id][0]].clone() for t in scratch.kv_caches[name]]
                    for g in groups if g.kind == "mamba" for name in g.layer_names}
        finally:
            main.model.bind_kv_cache(main.kv_caches)
            set_ops(main.model, main.ops)


def _compare(runner, group, name: str, slot: int, cold: list[torch.Tensor], names: list[str]):
    """(state label, max |diff|, bad elements, atol, rtol) of each state tensor of layer `name` at
    `slot` that differs from the cold state beyond STATE_TOLERANCE."""
    out = []
    for i, (ours, ref) in enumerate(zip(runner.kv_caches[name], cold)):
        atol, rtol = STATE_TOLERANCE.get(ours.dtype, STATE_TOLERANCE[torch.float32])
        ours = ours[slot].float()
        bad = exceeds(ours, ref.float(), atol, rtol)
        if bool(bad.any()):
            label = names[i] if i < len(names) else f"state tensor {i}"
            out.append((label, float((ours - ref.float()).abs().max()), int(bad.sum()), atol, rtol))
    return out


def check_spec_start_states(replay: ColdReplay, scheduler, runner, state, where: str,
                            state_names: dict[str, list[str]] | None = None) -> list[Violation]:
    """Before the forward, speculative decoding, inspect="full": each decode row starts (the slot
    its first position reads, `mamba_base.verify_start_slots`) from the state a cold prefill of its computed
    tokens computes, within STATE_TOLERANCE of the state's dtype."""
    batch = state.input_batch
    out: list[Violation] = []
    for gm in state.attn_metadata.groups:
        md = gm.metadata
        starts = verify_start_slots(md) if hasattr(md, "num_accepted_tokens") else None
        if starts is None:
            continue
        group = next(g for g in runner.kv_cache_groups if g.group_id == gm.group_id)
        starts = starts.tolist()
        accepted = md.num_accepted_tokens.tolist()
        # under decode graphs the metadata counts the padded rows too (they follow the batch's rows)
        for row in range(min(md.num_decodes, batch.num_reqs)):
            rid = batch.req_ids[row]
            req = scheduler.requests.get(rid)
            computed = int(batch.num_computed_tokens_np[row])
            if req is None or computed == 0:
                continue
            cold = replay.states(req.all_token_ids[:computed])
            for name in group.layer_names:
                for label, diff, n, atol, rtol in _compare(runner, group, name, starts[row], cold[name],
                                                           (state_names or {}).get(name, [])):
                    out.append(Violation(
                        "spec_start_state_equals_plain", f"{where}, request {rid!r}, layer {name}",
                        f"{label} at slot {starts[row]}", f"the state its verify step starts from "
                        f"(num_accepted_tokens={accepted[row]}) differs from the state plain decoding holds "
                        f"after its {computed} computed tokens: max |diff| {diff:.3g} (atol {atol:g} + rtol "
                        f"{rtol:g} * |cold|) in {n} elements"))
    return out


def check_hit_states(replay: ColdReplay, scheduler, runner, state, where: str,
                     state_names: dict[str, list[str]] | None = None) -> list[Violation]:
    """Before the forward, prefix caching on, inspect="full": each row starting right after its
    prefix hit (computed tokens = the hit) holds in its running page the state a cold prefill of its
    first `hit` tokens computes, within STATE_TOLERANCE of the state's dtype."""
    batch = state.input_batch
    out: list[Violation] = []
    for row, rid in enumerate(batch.req_ids):
        req = scheduler.requests.get(rid)
        start = int(batch.num_computed_tokens_np[row])
        if req is None or not req.num_cached_tokens or start != req.num_cached_tokens:
            continue
        cold = replay.states(req.all_token_ids[:start])
        end = batch.num_computed_tokens_np[row:row + 1] + batch.num_scheduled_tokens[row:row + 1]
        idx = batch.idx_mapping_np[row:row + 1]
        for group in runner.kv_cache_groups:
            if group.kind != "mamba":
                continue
            page = int(runner.block_tables.state_pages(group.group_id, idx, end)[0])
            for name in group.layer_names:
                for label, diff, n, atol, rtol in _compare(runner, group, name, page, cold[name],
                                                           (state_names or {}).get(name, [])):
                    out.append(Violation(
                        "checkpoint_equals_cold_state", f"{where}, request {rid!r}, layer {name}",
                        f"{label} at page {page}", f"the state it starts from after a hit of {start} "
                        f"tokens differs from a cold prefill of those tokens: max |diff| {diff:.3g} "
                        f"(atol {atol:g} + rtol {rtol:g} * |cold|) in {n} elements"))
    return out
