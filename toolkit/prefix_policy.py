"""The scheduler's prefix-cache policy (vLLM's KV cache manager and Mamba "align" split, scheduler
side): what a request admitted from scratch looks up and adopts, where an "align" prefill chunk
must end so that a recurrent checkpoint lands where a later request can hit it, and what a step's
requests computed that becomes hittable. The pools, hashes and pages themselves are the KV cache
manager's (kv_cache_manager.py); the scheduler asks this policy at admission, when it sizes a
chunk, and after each step."""
from __future__ import annotations

from toolkit.kv_cache_manager import KVCacheManager, PrefixHit, PrefixLookup, block_hashes, lookup_not_searched
from toolkit.request import Request


class PrefixPolicy:
    """`caching`: prefix caching on. `align`: caching on a model with Mamba layers in cache mode
    "align" (prefill chunks end on block boundaries); `prefill_checkpoints`: cache mode "all" (the
    layers save states at the boundaries inside a chunk)."""

    def __init__(self, kv: KVCacheManager, block_size: int, caching: bool, align: bool, prefill_checkpoints: bool):
        self.kv = kv
        self.block_size = block_size
        self.caching = caching
        self.align = align
        self.prefill_checkpoints = prefill_checkpoints

    def adopt_hit(self, req: Request) -> PrefixHit | None:
        """A request about to be admitted from scratch takes the longest cached prefix of its tokens.
        Its lookup (what the cache held, and why the hit is what it is) stays on the request
        (`prefix_lookup`), as does, in "align" mode, the junction its prefill stops at."""
        lookup = self.lookup(req)
        req.prefix_lookup = lookup
        # a shared prefix without a checkpoint at its end: the prefill makes one there
        req.prefix_junction = lookup.junction if self.align else 0
        hit = self.kv.prefix_hit(lookup, req.block_hashes) if lookup.hit_blocks else None
        if hit is not None:
            self.kv.adopt(req.request_id, hit)
            req.num_computed_tokens = hit.num_tokens
        return hit

    def lookup(self, req: Request) -> PrefixLookup:
        """The request's prefix lookup; not searched with caching off, for a request that starts
        with computed tokens, or with prompt logprobs (every prompt position must be computed, as
        in vLLM)."""
        why = ""
        if not self.caching:
            why = "prefix caching is off"
        elif req.num_computed_tokens or req.fork_from is not None:
            why = "not searched: the request starts with its parent's computed tokens (an n > 1 child)"
        elif req.sampling_params.prompt_logprobs is not None:
            why = ("not searched: the request asks for prompt logprobs, which need every prompt "
                   "position computed (as in vLLM)")
        if why:
            return lookup_not_searched(req.num_tokens, self.block_size, why)
        hashes = block_hashes(req.all_token_ids, self.block_size, req.block_hashes)
        found = self.kv.lookup(hashes, req.num_tokens)
        found.internal_checkpoints = self.prefill_checkpoints
        return found

    def aligned_chunk_end(self, req: Request, start: int, end: int, total: int) -> int:
        """Where a prefill chunk [start, end) of a request with `total` tokens to compute ends in
        "align" mode (vLLM `_mamba_block_aligned_split`): on a block boundary unless it is the last,
        an unfinished chunk's end floored to a boundary (unless the block is larger than the
        budget), a chunk that starts mid-block stopping at the next boundary, and every chunk
        stopping at the last boundary before the final token, where the state a later request can
        hit must be saved, and at the end of the prefix it shares with earlier requests
        (`prefix_junction`), so that the next request sharing it can hit there."""
        bs = self.block_size
        if end < total and end // bs * bs > start:
            end = end // bs * bs
        if start % bs:
            end = min(end, (start // bs + 1) * bs)
        for stop in (req.prefix_junction, (req.num_tokens - 1) // bs * bs):   # the junction, the last
            if start < stop < end:                                            # boundary before the end
                end = stop
        return end

    def checkpoint_columns(self, start: int, num_tokens: int) -> list[int]:
        """Cache mode "all": the columns of the block boundaries inside a prefill chunk of
        `num_tokens` tokens from `start` (where the layers save states, given a page)."""
        bs = self.block_size
        return [b // bs - 1 for b in range((start // bs + 1) * bs, start + num_tokens, bs)]

    def cache_computed(self, requests: dict[str, Request], scheduled: dict[str, int],
                       spec_tokens: dict[str, list[int]], kept: dict[str, list[int]] | None = None) -> None:
        """After a step: what its requests computed becomes hittable (scheduler-side only: the next
        step's admissions see it, never this step's). A verify row's computed tokens include its
        accepted drafts (`kept[req_id]` minus the target's own last token), not yet appended."""
        for req_id in scheduled:
            req = requests.get(req_id)
            if req is None:
                continue
            hashes = req.block_hashes
            if len(hashes) < req.num_computed_tokens // self.block_size:   # a block filled: hash it
                start = len(hashes) * self.block_size       # the tail only: work per block, not per token held
                tokens = req.token_slice(start, req.num_tokens)
                if kept and req_id in spec_tokens:
                    tokens += kept[req_id][:-1]
                hashes = block_hashes(tokens, self.block_size, hashes, offset=start)
            self.kv.cache_computed(req_id, hashes, req.num_computed_tokens)
