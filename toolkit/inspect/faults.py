"""The fault catalogue: bookkeeping bugs that hybrid-model engines really shipped, planted on
purpose so you can watch the toolkit catch them.

    from toolkit.inspect import faults
    for f in faults.catalogue():
        print(f.name, "-", f.breaks)
    with faults.inject("slot_not_zeroed_on_reuse"):
        llm = LLM("tiny-bamba")          # every LLM built or run inside the block has the fault
        ...                               # -> InvariantError naming the step, request, layer, slot

Each fault is planted where the real bug lived (the model state, a metadata builder, the runner),
by replacing one method or function for the duration of the `with` block, never in the checker.
`Fault.detection` says which check or error reports it. A tensor-parallel engine built inside the
block plants the same faults in the worker processes it starts (`active()`); the tensor-parallel
faults act on ranks 1..N-1 only.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

import toolkit.runner.model_runner as model_runner
from toolkit.attention.mamba_base import BaseMambaMetadataBuilder
from toolkit.errors import ToolkitError
from toolkit.inspect import html as H
from toolkit.kv_cache_manager import KVCacheManager, PrefixHit
from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.runner.block_table import BlockTables
from toolkit.runner.input_batch import runs_as_decode
from toolkit.runner.model_runner import ModelRunner
from toolkit.runner.model_states import DefaultModelState, MambaHybridModelState
from toolkit.scheduler import Scheduler


@dataclass(frozen=True)
class Fault:
    name: str
    breaks: str             # what goes wrong in the engine
    mirrors: str            # the public bug it reproduces
    detection: str          # how the toolkit reports it
    detected_by: str        # the exception type (or check name) a test expects
    plant: Callable[[contextlib.ExitStack], None]
    needs: str = ""         # what the engine must run with for the fault to matter ("prefix caching",
                            # "speculative decoding", "speculative decoding with prefix caching")

    def _repr_html_(self) -> str:
        return catalogue_html([self])


def _patch(stack: contextlib.ExitStack, owner: object, name: str, value: object) -> None:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, original)


# ---- the plants ---------------------------------------------------------------------------------
def _plant_missing_upper_bound(stack: contextlib.ExitStack) -> None:
    original = MambaHybridModelState.attn_metadata_kwargs

    def forgets(self, input_batch, for_capture):
        kwargs = original(self, input_batch, for_capture)
        kwargs.pop("seq_lens_cpu_upper_bound")     # computed, never forwarded (vLLM #46759)
        return kwargs
    _patch(stack, MambaHybridModelState, "attn_metadata_kwargs", forgets)


def _plant_attention_free_default_state(stack: contextlib.ExitStack) -> None:
    original = model_runner.init_model_state

    def routes_by_is_hybrid_only(model, cfg):
        if getattr(model, "is_hybrid", False):        # before #52374: is_attention_free ignored
            return MambaHybridModelState(model, cfg)
        state = original(model, cfg)
        return DefaultModelState(model, cfg) if isinstance(state, MambaHybridModelState) else state
    _patch(stack, model_runner, "init_model_state", routes_by_is_hybrid_only)


def _plant_in_common_fields(stack: contextlib.ExitStack, edit: Callable[[dict], None]) -> None:
    original = BaseMambaMetadataBuilder.common_fields

    def faulty(self, common, s):
        fields = original(self, common, s)
        edit(fields)
        return fields
    _patch(stack, BaseMambaMetadataBuilder, "common_fields", faulty)


def _plant_state_index_off_by_one(stack: contextlib.ExitStack) -> None:
    def shift(fields: dict) -> None:
        for key in ("state_indices_tensor_d", "state_indices_tensor_p"):
            if fields[key] is not None:
                fields[key] = fields[key] - 1     # reads the previous slot (slot 1 -> null slot 0)
    _plant_in_common_fields(stack, shift)


def _plant_initial_state_flag(stack: contextlib.ExitStack) -> None:
    def always_initial(fields: dict) -> None:
        if fields["has_initial_states_p"] is not None:
            fields["has_initial_states_p"] = torch.ones_like(fields["has_initial_states_p"])
    _plant_in_common_fields(stack, always_initial)


def _plant_slot_not_zeroed(stack: contextlib.ExitStack) -> None:
    def add_request_without_zeroing(self, req_idx, new_req):
        slots = [s for g in self.mamba_groups for s in new_req.block_ids[g.group_id]]
        if 0 in slots:
            raise RuntimeError(f"request {new_req.req_id} was given the null state page 0")
    _patch(stack, MambaHybridModelState, "add_request", add_request_without_zeroing)


class CapturedGraphsStandIn:
    """What a CUDA-graph manager holds: its graphs keep the persistent buffers and caches they
    were captured on alive. On the CPU, where nothing is captured, the fault
    `graph_manager_kept_on_shutdown` gives the runner this object so the shutdown order matters.
    Everything else (padded_size, label, captured, release, ...) is the runner's real manager's,
    so steps run as they would without the fault."""

    def __init__(self, runner) -> None:
        self._manager = runner.cudagraph_manager
        self._held = [t for v in runner.kv_caches.values() for t in (v if isinstance(v, tuple) else (v,))]
        self._held += [runner.input_buffers.input_ids, runner.input_buffers.positions]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._manager, name)

    def held_tensors(self) -> list[torch.Tensor]:
        return list(self._held)


def _plant_graph_manager_kept(stack: contextlib.ExitStack) -> None:
    original_init, original_shutdown = ModelRunner.__init__, ModelRunner.shutdown

    def init_with_graphs(self, model, cfg, *args, **kwargs):
        original_init(self, model, cfg, *args, **kwargs)
        self.cudagraph_manager = CapturedGraphsStandIn(self)

    def shutdown_keeping_graphs(self, collect_garbage: bool = True):
        manager = self.cudagraph_manager            # the pre-#52374 order: caches first, and
        original_shutdown(self, collect_garbage)     # the graph manager is never dropped
        self.release_log = [e for e in self.release_log if e != "cudagraph_manager"]
        self.cudagraph_manager = manager
    _patch(stack, ModelRunner, "__init__", init_with_graphs)
    _patch(stack, ModelRunner, "shutdown", shutdown_keeping_graphs)


def _plant_padded_row_on_real_slot(stack: contextlib.ExitStack) -> None:
    def on_slot_one(self, num_rows):       # padded rows get block / slot 1 instead of the null 0
        self.invalidate_staged()           # as null_block_tables: the next real step gathers whole
        for g in range(self.num_groups):
            self.staging.host(f"block_table_{g}")[:num_rows] = 1
            self.staging.written(f"block_table_{g}", num_rows)
        return tuple(t[:num_rows] for t in self.input_block_tables)
    _patch(stack, BlockTables, "null_block_tables", on_slot_one)


def _plant_prefill_before_decode(stack: contextlib.ExitStack) -> None:
    def prefills_first(req_ids, num_scheduled, num_computed, num_drafts=None):
        drafts = num_drafts or {}
        return sorted(req_ids, key=lambda r: (1 if runs_as_decode(num_scheduled[r], num_computed[r],
                                                                  drafts.get(r, 0)) else 0, num_scheduled[r]))
    _patch(stack, model_runner, "sort_batch", prefills_first)


# ---- prefix caching ("align" mode) --------------------------------------------------------------
def _plant_misaligned_checkpoint(stack: contextlib.ExitStack) -> None:
    def plain_chunks(self, req, budget):               # no block-aligned split of prefills
        return min(req.num_tokens_to_compute - req.num_computed_tokens, budget)

    original = KVCacheManager.cache_computed

    def registers_running_page(self, req_id, hashes, num_computed):
        original(self, req_id, hashes, num_computed)
        held = self._ids.get(req_id)
        for g, (group, ids) in enumerate(zip(self.groups, held or ())):
            full = min(num_computed // group.block_size, len(hashes))
            pages = [i for i in ids if i]
            if self.aligned(g) and full and pages:   # the running page, wherever the chunk ended
                self.state_pool.register(pages[-1], hashes[full - 1], full - 1)
    _patch(stack, Scheduler, "_num_new_tokens", plain_chunks)
    _patch(stack, KVCacheManager, "cache_computed", registers_running_page)


def _plant_precopy_skipped(stack: contextlib.ExitStack) -> None:
    original = MambaHybridModelState.preprocess_state

    def bookkeeping_only(self, input_batch, block_tables):
        tensors, self.state_tensors = self.state_tensors, []      # the copies and zeroing touch nothing
        try:
            return original(self, input_batch, block_tables)
        finally:
            self.state_tensors = tensors
    _patch(stack, MambaHybridModelState, "preprocess_state", bookkeeping_only)


def _plant_checkpoint_left_free(stack: contextlib.ExitStack) -> None:
    original = KVCacheManager.adopt

    def adopt_leaving_free(self, req_id, hit):
        waiting = {g: [i for i in ids if i and self.pool(g).is_free(i)]
                   for g, ids in enumerate(hit.ids) if self.aligned(g)}
        original(self, req_id, hit)
        for g, ids in waiting.items():                 # touched, but never taken off the free queue
            for i in ids:
                self.pool(g)._free[i] = None
    _patch(stack, KVCacheManager, "adopt", adopt_leaving_free)


def _plant_hit_without_checkpoint(stack: contextlib.ExitStack) -> None:
    original_lookup, original_hit = KVCacheManager.lookup, KVCacheManager.prefix_hit

    def attention_decides(self, hashes, num_tokens):
        found = original_lookup(self, hashes, num_tokens)
        if found.hit_blocks and found.attention_blocks and found.attention_blocks > found.hit_blocks:
            found = dataclasses.replace(found, hit_blocks=found.attention_blocks)    # counted as a hit
        return found

    def from_older_checkpoint(self, lookup, hashes):
        blocks = lookup.hit_blocks
        if not blocks or hashes[blocks - 1] in self.state_pool.cached:
            return original_hit(self, lookup, hashes)
        older = next(i for i in range(blocks - 1, -1, -1) if hashes[i] in self.state_pool.cached)
        ids = tuple([self.kv_pool.cached[h] for h in hashes[:blocks]] if g.kind == "attention"
                    else [0] * (blocks - 1) + [self.state_pool.cached[hashes[older]]] for g in self.groups)
        return PrefixHit(blocks * lookup.block_size, ids, tuple(blocks for _ in self.groups))
    _patch(stack, KVCacheManager, "lookup", attention_decides)
    _patch(stack, KVCacheManager, "prefix_hit", from_older_checkpoint)


def _plant_verify_from_last_column(stack: contextlib.ExitStack) -> None:
    original = BaseMambaMetadataBuilder.spec_fields

    def from_last(self, common, s):
        fields = original(self, common, s)
        columns = fields["state_indices_tensor_d"].shape[1]      # the last column, whatever was accepted
        fields["num_accepted_tokens"] = torch.full_like(fields["num_accepted_tokens"], columns)
        return fields
    _patch(stack, BaseMambaMetadataBuilder, "spec_fields", from_last)


def _plant_checkpoint_from_last_column(stack: contextlib.ExitStack) -> None:
    def last_position(boundary, start, num_drafts):      # the state after the row's last draft
        return num_drafts
    _patch(stack, MambaHybridModelState, "boundary_position", staticmethod(last_position))


def _plant_accepted_not_reset(stack: contextlib.ExitStack) -> None:
    original = MambaHybridModelState.add_request

    def keeps_count(self, req_idx, new_req):
        stale = self.num_accepted_tokens[req_idx].clone()       # the row's last request's count
        original(self, req_idx, new_req)
        self.num_accepted_tokens[req_idx] = stale
    _patch(stack, MambaHybridModelState, "add_request", keeps_count)


def _on_a_worker_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_rank() > 0


def _plant_rank_misses_an_append(stack: contextlib.ExitStack) -> None:
    original = BlockTables.append_block_ids

    def drops_later_blocks(self, req_idx, block_ids, overwrite):
        before = [int(n[req_idx]) for n in self.num_blocks]
        original(self, req_idx, block_ids, overwrite)
        if _on_a_worker_rank() and not overwrite:
            for g, ids in enumerate(block_ids):       # a row's later blocks stay the null block here
                if ids and before[g] > 0 and not self.aligned[g]:
                    self.tables[g][req_idx, before[g]:before[g] + len(ids)] = 0
    _patch(stack, BlockTables, "append_block_ids", drops_later_blocks)


def _plant_mamba2_group_replicated(stack: contextlib.ExitStack) -> None:
    def first_group_everywhere(self, tp):              # the replicated-group rule applied to split groups
        return torch.arange(max(self.n_groups // tp.world_size, 1) * self.state_size)
    _patch(stack, Mamba2Mixer, "group_rows", first_group_everywhere)


_CATALOGUE = [
    Fault("missing_seq_lens_cpu_upper_bound",
          "the hybrid model state computes seq_lens_cpu_upper_bound but does not forward it to the "
          "metadata builders that require it (the Mamba family, which splits decodes from prefills "
          "with it, and here the paged-attention builder too)",
          "vLLM #46759 (the seed bug: MRV2 warmup crash for Mamba hybrids)",
          "MetadataContractError at warmup naming the field, the builder and MambaHybridModelState",
          "MetadataContractError", _plant_missing_upper_bound),
    Fault("attention_free_default_state",
          "an attention-free model (Mamba, Mamba2) is routed to DefaultModelState, which manages no "
          "state pages",
          "vLLM PR #52374 ([MRV2] Support attention-free models)",
          "ModelStateError when the LLM is built, naming the model state and the Mamba groups",
          "ModelStateError", _plant_attention_free_default_state),
    Fault("state_index_off_by_one",
          "the Mamba builders hand each row the slot before its own: a request reads and writes "
          "another request's (or the null) state",
          "vLLM #55600 (wrong Mamba state index)",
          "InvariantError (state_indices_match_ledger) naming step, request, group and field",
          "state_indices_match_ledger", _plant_state_index_off_by_one),
    Fault("initial_state_flag_on_fresh_request",
          "has_initial_states_p is True for a request with no computed tokens, so its prefill starts "
          "from whatever its slot holds",
          "vLLM #43090 (initial-state flag set for fresh requests)",
          "InvariantError (initial_state_flag) naming step, request and has_initial_states_p",
          "initial_state_flag", _plant_initial_state_flag),
    Fault("slot_not_zeroed_on_reuse",
          "a state page freed by a finished request is handed to a new one without zeroing: the old "
          "request's conv/SSM state sits there, and any path that reads a fresh request's slot (a "
          "wrong initial-state flag, a prefix-cache or spec-decode path) starts from it; alone it is "
          "latent, which is why the check looks at the slot itself",
          "vLLM #56524 / #35219 (stale Mamba state in reused slots)",
          "InvariantError (fresh_slot_is_zero) before the forward, naming request, layer and slot",
          "fresh_slot_is_zero", _plant_slot_not_zeroed),
    Fault("graph_manager_kept_on_shutdown",
          "shutdown frees the caches but keeps the CUDA-graph manager, whose graphs still hold the "
          "caches and buffers: the memory is never returned",
          "vLLM PR #52374 (shutdown must drop the graph manager first)",
          "InvariantError at shutdown (shutdown_order, released_on_shutdown) naming what is still alive",
          "released_on_shutdown", _plant_graph_manager_kept),
    Fault("padded_row_on_real_slot",
          "padded (dummy) rows point at a real state page and KV block instead of the null id 0, so "
          "warmup and padded decode batches overwrite a live request's state",
          "vLLM padded CUDA-graph rows / null-block convention (cf. #56524)",
          "InvariantError (padded_rows_on_null) at warmup naming the group, rows and ids",
          "padded_rows_on_null", _plant_padded_row_on_real_slot),
    Fault("prefill_before_decode_order",
          "the runner orders prefill rows before decode rows; the Mamba kernels split tokens as "
          "[decode | prefill] and would run decodes as prefills",
          "vLLM's decodes-first batch order contract (reorder_batch_to_split_decodes_and_prefills)",
          "MetadataContractError from the Mamba builder: 'breaks the decodes-first batch order'",
          "MetadataContractError", _plant_prefill_before_decode),
    Fault("checkpoint_at_misaligned_position",
          "prefill chunks are not split at block boundaries, and the running state page is still "
          "registered as the checkpoint of the last full block: the page holds the state after the "
          "chunk's end (e.g. token 40), not after the block's last token (32); a later hit starts from it",
          "vLLM align-mode chunking (_mamba_block_aligned_split; #40696, #45238)",
          "InvariantError (checkpoint_at_block_end) after the step, naming the request, page, block and "
          "the token the chunk ended at", "checkpoint_at_block_end", _plant_misaligned_checkpoint,
          "prefix caching"),
    Fault("precopy_skipped",
          "preprocess_state does its bookkeeping but not the copy: a row entering a new block's column "
          "(a prefix hit's first step, or a chunk crossing a boundary) starts from whatever its new page "
          "holds (zeros or another request's stale state)",
          "MRV2 preprocess_state's pre-copy (vLLM #43559 / #53912 class: silently wrong outputs)",
          "InvariantError (state_copied_before_forward) before the forward, naming request, layer and page",
          "state_copied_before_forward", _plant_precopy_skipped, "prefix caching"),
    Fault("checkpoint_evicted_while_referenced",
          "a request adopting a cached checkpoint page counts it but leaves it in the free queue: the "
          "next allocation evicts and overwrites the state the request is about to copy",
          "vLLM block-pool touch / free-queue bookkeeping (a freed Mamba checkpoint still referenced)",
          "InvariantError (held_ids_not_free) after the step, naming the group, page and its holders",
          "held_ids_not_free", _plant_checkpoint_left_free, "prefix caching"),
    Fault("hit_counted_without_checkpoint",
          "the hit length is taken from the attention blocks alone: a request whose recurrent checkpoint "
          "at that position is missing starts from an older checkpoint's state, and the hit is counted",
          "vLLM #45238 (hits silently wrong or 0% when the checkpoint lies in request-unique tokens)",
          "InvariantError (hit_backed_by_every_group) at the step admitting it, naming request, group and "
          "column", "hit_backed_by_every_group", _plant_hit_without_checkpoint, "prefix caching"),
    Fault("verify_starts_from_last_column",
          "a verify step's recurrent layers start from the last of the row's 1 + k state columns instead of "
          "the one its accepted count points at: after a rejection the state holds rejected drafts",
          "vLLM spec-decode state indexing (the initial state must come from column num_accepted - 1)",
          "InvariantError (verify_starts_at_accepted_column) after the step, naming request, group and slots",
          "verify_starts_at_accepted_column", _plant_verify_from_last_column, "speculative decoding"),
    Fault("num_accepted_not_reset",
          "a request taking a freed request row keeps the row's last num_accepted_tokens: its first decode "
          "starts from a stale state column",
          "vLLM #48132 (MRV2 kept a stale num_accepted_tokens on slot reuse)",
          "InvariantError (accepted_count_carried) after the step, naming request and group",
          "accepted_count_carried", _plant_accepted_not_reset, "speculative decoding"),
    Fault("checkpoint_saved_from_rejected_position",
          "prefix caching + speculative decoding: a verify row whose tokens reach a block boundary saves "
          "that block's checkpoint from the state after its last position (its last draft, rejected or "
          "past the boundary) instead of the position that reached the boundary; the page is registered, "
          "and every later request hitting that prefix starts from a wrong state",
          "vLLM MRV2's boundary copy after acceptance (#43559, #53912: hybrid + MTP + prefix caching "
          "silently loses accuracy)",
          "InvariantError (checkpoint_from_accepted_position) after the step, naming request, block and "
          "pages", "checkpoint_from_accepted_position", _plant_checkpoint_from_last_column,
          "speculative decoding with prefix caching"),
    Fault("rank_block_table_differs",
          "tensor parallelism: a worker rank applies a request's first blocks but misses its later ones "
          "(they stay the null block in that rank's table): that rank writes and reads its KV heads' cache "
          "in the null block while rank 0 is right, and the output is silently wrong",
          "every rank of vLLM's executor builds its own input batch and block tables from the scheduler "
          "output rank 0 broadcasts; a rank that applies an update differently drifts without an error",
          "InvariantError (metadata_equal_on_every_rank) before the forward, naming the step, the rank, "
          "the group's block table and the first entry that differs",
          "metadata_equal_on_every_rank", _plant_rank_misses_an_append, "tensor parallelism"),
    Fault("mamba2_group_replicated_instead_of_split",
          "tensor parallelism: a Mamba2 mixer whose groups split over the ranks (n_groups >= tp) gets group "
          "0's B and C rows on every rank, the rule for one replicated group: every shape fits, rank 1's "
          "heads read the wrong group's B and C, and the output is silently wrong",
          "vLLM's `mamba_v2_sharded_weight_loader` (groups are split or replicated depending on n_groups "
          "vs tp; the mapping is easy to get wrong and raises nothing)",
          "no runtime check can see it (each rank is self-consistent); `diff_traces` of the TP=2 trace "
          "against a TP=1 trace (inspect='full', gathered states) names the first request, position and "
          "layer state that differ",
          "diff_traces", _plant_mamba2_group_replicated, "tensor parallelism"),
]


def catalogue() -> list[Fault]:
    return list(_CATALOGUE)


def get(name: str) -> Fault:
    for f in _CATALOGUE:
        if f.name == name:
            return f
    raise UnknownFaultError(f"no fault named {name!r}; the catalogue has: "
                            f"{', '.join(f.name for f in _CATALOGUE)}")


class UnknownFaultError(ToolkitError, KeyError):
    """`inject(name)` with a name that is not in the catalogue."""


@contextlib.contextmanager
def inject(*names: str) -> Iterator[list[Fault]]:
    """Plant the named faults for the duration of the block; removed on exit, even on error."""
    chosen = [get(n) for n in names]
    with contextlib.ExitStack() as stack:
        for fault in chosen:
            fault.plant(stack)
        _ACTIVE.extend(names)
        stack.callback(lambda: [_ACTIVE.remove(n) for n in names])
        yield chosen


_ACTIVE: list[str] = []        # the faults planted now, innermost last


def active() -> tuple[str, ...]:
    """The names of the faults planted now (what a tensor-parallel engine plants in its workers)."""
    return tuple(_ACTIVE)


def catalogue_html(faults: list[Fault] | None = None) -> str:
    """The catalogue (or the given faults) as a table: name, what breaks, the bug it mirrors, and
    how the toolkit reports it."""
    rows = [[H.span(f.name, H.MONO), H.escape(f.breaks), H.escape(f.mirrors), H.escape(f.detection)]
            for f in (faults or catalogue())]
    return H.wrap(H.table(["fault", "what breaks", "mirrors", "how it is detected"], rows))
