"""Scheduler-side ownership of KV blocks and Mamba state pages, and the prefix cache.

Two pools, each with id 0 reserved as the null id (dummy and padded rows point there; a real
request never holds it live):
- KV blocks for attention groups: `block_size` tokens each, allocated as a request grows.
- State pages for Mamba groups. Prefix caching off (vLLM's "none" mode): one page per request, its
  running state. Prefix caching on ("align" mode, vLLM's `MambaManager`): the request's row is
  position-indexed, column i standing for tokens [i*bs, (i+1)*bs); only the running column
  (`cdiv(tokens, bs) - 1`) and, for one step after a boundary, the column before it hold pages
  (0 elsewhere: skipped or released columns). The page of a column whose last token is computed at
  a chunk end holds the state after exactly (i+1)*bs tokens: a checkpoint.

Prefix caching (`enable_prefix_caching=True`): a full block of tokens is named by a hash chained
over the blocks before it (`block_hashes`), so one hash fingerprints the whole prefix. After a step
(`cache_computed`), the attention blocks its requests filled and the Mamba pages that hold a
checkpoint are registered under their hash. A freed registered id stays in its pool's free queue,
hittable, until it is handed out again (least recently freed first; unregistered ids go before).
A new request's hit (`find_prefix_hit`, vLLM's `HybridKVCacheCoordinator`) is capped at N - 1
tokens (the last prompt token is always computed, for its logits); attention hits the longest run
of cached blocks; a Mamba group hits the rightmost checkpoint within that run (a checkpoint at 2*bs
says nothing about bs); the hit is the minimum over groups. The search (`lookup`) returns a
`PrefixLookup`: per full block what each group holds, the cap, the hit and, in words, why the hit is
what it is; the scheduler keeps it on the request and the StepRecord of the admitting step holds it.
A ledger records the holders of every id handed out, so leaks, double frees and wrong sharing are
caught.
"""
from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

BlockHash = bytes
KNOWN_HASHES = 1 << 16      # block hashes remembered for the shared-prefix junction (16 bytes each)


@dataclass(frozen=True)
class RowTail:
    """What changed in an aligned Mamba row since the runner last got it: the row from column `start`
    on (`ids`, the row's new end included; columns before `start` are as the runner has them, or
    released checkpoint columns it never reads again). The runner writes `ids` at `start` and
    zeroes its row past them. A step's update costs the columns it touched, not the row's length."""
    start: int
    ids: list[int]


def hash_block(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """The hash of a full block: its tokens chained to the hash of the blocks before it."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, known: list[BlockHash], offset: int = 0) -> list[BlockHash]:
    """The chained hashes of every full block of `token_ids`; `known` (a prefix of them, computed
    before) is extended in place and returned. `offset`: token_ids are the sequence's tokens from
    that index on (at most len(known) * block_size), so a caller extending the hashes of a long
    request passes only its tail."""
    for i in range(len(known), (offset + len(token_ids)) // block_size):
        known.append(hash_block(known[-1] if known else None,
                                token_ids[i * block_size - offset:(i + 1) * block_size - offset]))
    return known


def window_start_block(num_computed: int, window: int, block_size: int) -> int:
    """The first block a sliding window of W tokens reads when its next query is at position
    `num_computed`: keys from num_computed - W + 1 on (vLLM's `get_num_skipped_tokens`)."""
    return max(num_computed - window + 1, 0) // block_size


def window_blocks(window: int, block_size: int) -> int:
    """Full blocks a sliding window needs cached before a prefix hit's end: cdiv(W - 1, bs) (vLLM's
    `sliding_window_contiguous_blocks`)."""
    return -(-(window - 1) // block_size)


def window_hit(cached: list[bool], limit: int, need: int) -> int:
    """A sliding-window group's hit in blocks, at most `limit` (vLLM's
    `SlidingWindowManager.find_longest_cache_hit`): the end of the rightmost run of `need` consecutive
    cached blocks ending at or before `limit`; without one, the cached blocks from block 0 (a window
    that reaches the prompt's start needs nothing before it). need 0 (W = 1): any prefix."""
    if need == 0:
        return limit
    run = 0
    for i in range(limit - 1, -1, -1):
        if not cached[i]:
            run = 0
            continue
        run += 1
        if run == need:
            return i + need
    return run


class BlockPool:
    """Ids 1..num_ids-1; id 0 is the null id. A free id waits in `_free`: the head is handed out
    first. Freed unregistered ids go to the head (reused first); freed registered ids (prefix
    cache) to the tail, so the least recently freed cached id is evicted first."""

    def __init__(self, num_ids: int, name: str):
        self.name = name
        self.num_ids = num_ids
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_ids))
        self.holders: dict[int, set[str]] = {}       # id -> requests holding it (ref count = size)
        self.hash_of: dict[int, BlockHash] = {}      # registered ids (prefix cache)
        self.cached: dict[BlockHash, int] = {}       # hash -> id
        self.block_index: dict[int, int] = {}        # registered id -> the block of the prompt it holds
        self.num_evictions = 0
        # the ids whose holders or place in the free queue changed, while an auditor asks for them
        # (track_changes: the runtime checks' LedgerBook); None: nobody does, nothing is kept
        self.changed: set[int] | None = None

    def track_changes(self) -> None:
        """From now on, note in `changed` each id that allocate / touch / free / hand_over move (the
        auditor empties it); these four methods are the only writers of `holders` and `_free`."""
        if self.changed is None:
            self.changed = set()

    @property
    def num_total(self) -> int:
        return max(self.num_ids - 1, 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, i: int) -> bool:
        """Id i waits in the free queue (held by nobody; cached or not)."""
        return i in self._free

    def scratch_ids(self, n: int) -> list[int]:
        """Up to n free ids that hold nothing cached (no prefix-cache entry): ids whose content
        nobody reads, which a warmup check may write (and then zero) without losing anything."""
        return list(itertools.islice((i for i in self._free if i not in self.hash_of), n))

    def allocate(self, n: int, holder: str) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{self.name}: asked for {n}, {len(self._free)} free")
        ids = []
        for _ in range(n):
            i, _ = self._free.popitem(last=False)
            h = self.hash_of.pop(i, None)
            if h is not None:                        # a cached id is reused: its hash goes
                del self.cached[h]
                del self.block_index[i]
                self.num_evictions += 1
            self.holders[i] = {holder}
            ids.append(i)
        if self.changed is not None:
            self.changed.update(ids)
        return ids

    def touch(self, ids: list[int], holder: str) -> None:
        """`holder` shares ids found in the prefix cache (held by others, or waiting free)."""
        for i in ids:
            self._free.pop(i, None)
            self.holders.setdefault(i, set()).add(holder)
        if self.changed is not None:
            self.changed.update(ids)

    def free(self, ids: list[int], holder: str) -> None:
        for i in reversed(ids):                      # a prefix's tail is evicted before its head
            held = self.holders.get(i)
            if held is None or holder not in held:
                raise RuntimeError(f"{self.name}: id {i} freed by {holder!r} but held by "
                                   f"{sorted(held) if held else 'nobody'}")
            held.discard(holder)
            if held:
                continue
            del self.holders[i]
            self._free[i] = None
            if i not in self.hash_of:
                self._free.move_to_end(i, last=False)
        if self.changed is not None:
            self.changed.update(ids)

    def register(self, i: int, h: BlockHash, index: int) -> None:
        """Id i now holds the content named by h, block `index` of its prefix (the first id
        registered under a hash keeps it)."""
        if h not in self.cached and i not in self.hash_of:
            self.cached[h] = i
            self.hash_of[i] = h
            self.block_index[i] = index

    def hand_over(self, ids: list[int], from_holder: str, to_holder: str) -> None:
        for i in ids:
            held = self.holders.get(i)
            if held is None or from_holder not in held:
                raise RuntimeError(f"{self.name}: id {i} handed on by {from_holder!r} but held by "
                                   f"{sorted(held) if held else 'nobody'}")
            held.discard(from_holder)
            held.add(to_holder)
        if self.changed is not None:
            self.changed.update(ids)


@dataclass(frozen=True)
class CacheGroupKind:
    kind: str                # "attention" or "mamba"
    block_size: int          # tokens per block (attention; a Mamba group in "align" mode)
    sliding_window: int | None = None   # W of a sliding-window attention group (vLLM's SlidingWindowManager):
                                        # its blocks out of every query's window go back to its own pool
    num_blocks: int = 0                 # a sliding-window group's pool: ids, the null id included


@dataclass
class PrefixHit:
    """What a new request found in the prefix cache."""
    num_tokens: int                                   # computed tokens it starts with (a block multiple)
    ids: tuple[list[int], ...]                        # per group: the ids it adopts (Mamba: the row)
    blocks_hit: tuple[int, ...] = ()                  # per group: attention blocks / checkpoint column + 1


@dataclass
class PrefixLookup:
    """What the prefix cache held for one request when the scheduler looked it up (at admission;
    again at each re-admission after a preemption). Block b is tokens [b*bs, (b+1)*bs) of the
    request's tokens (its prompt, plus its outputs when resumed); only full blocks have a hash.
    `not_searched` says why the cache was not searched (the other fields then stay empty)."""
    num_tokens: int                          # N: the request's tokens when looked up
    block_size: int                          # bs: tokens per block
    hashes: list[str] = field(default_factory=list)   # per full block (N // bs): its chained hash,
                                             # first 12 hex digits (as llm.prefix_cache shows them)
    attention_cached: list[bool] | None = None   # per full block: its attention KV block is cached
                                                 # (None: the model has no attention group)
    checkpoint_cached: list[bool] | None = None  # per full block: a recurrent checkpoint (a state
                                                 # page saved after exactly (b+1)*bs tokens) is cached
                                                 # (None: the model has no Mamba group)
    cap_blocks: int = 0                      # floor((N - 1) / bs): a hit leaves the last token to compute
    attention_blocks: int | None = None      # the longest run of cached attention blocks within the cap
                                             # (None: no attention group)
    hit_blocks: int = 0                      # the hit (what `find_prefix_hit` returns), in blocks
    known_blocks: int = 0                    # the longest prefix (within the cap) some request computed
                                             # lately, cached or not: the shared-prefix junction
    not_searched: str = ""                   # why the cache was not searched; "" when it was
    internal_checkpoints: bool = False       # cache mode "all": prefills also save states inside chunks
    window_cached: list[bool] | None = None  # per full block: every sliding-window group holds its KV block
                                             # (None: no sliding-window group); a hit needs the blocks of
                                             # the window before its end only

    def __repr__(self) -> str:
        return (f"PrefixLookup({self.num_tokens} tokens, {self.num_blocks} full blocks of {self.block_size}: "
                f"{self.reason})")

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size

    @property
    def num_blocks(self) -> int:
        """Full blocks of the request's tokens."""
        return len(self.hashes)

    @property
    def junction(self) -> int:
        """Tokens: where a recurrent request's prefill stops a chunk, so that a checkpoint lands at
        the end of the prefix it shares with earlier requests (vLLM `shared_prefix_boundary`,
        #45238); 0 without a Mamba group or when the hit reaches that far."""
        if self.checkpoint_cached is None or self.known_blocks <= self.hit_blocks or self.internal_checkpoints:
            return 0
        return self.known_blocks * self.block_size

    def block_state(self, b: int) -> str:
        """Block b: "hit" (taken from the cache), "capped" (past floor((N-1)/bs): never hit),
        "cached" (some group holds it, but the hit stops before it) or "missing"."""
        if b < self.hit_blocks:
            return "hit"
        if b >= self.cap_blocks:
            return "capped"
        held = [flags[b] for flags in (self.attention_cached, self.window_cached, self.checkpoint_cached)
                if flags is not None]
        return "cached" if any(held) else "missing"

    @property
    def reason(self) -> str:
        """Why the hit is what it is, in one sentence."""
        if self.not_searched:
            return self.not_searched
        if not self.cap_blocks:
            return (f"the prompt has no full block before its last token (a hit covers at most N - 1 = "
                    f"{self.num_tokens - 1} tokens; block size {self.block_size})")
        if self.hit_blocks:
            return self._hit_reason()
        return self._miss_reason()

    def _hit_reason(self) -> str:
        why = self._hit_reason_by_groups()
        if self.window_cached is not None and self.hit_blocks < self.cap_blocks:
            why += "; sliding-window layers need only their window's blocks before a hit's end cached"
        return why

    def _hit_reason_by_groups(self) -> str:
        bs, hit = self.block_size, self.hit_tokens
        head = f"hit {hit} of {self.num_tokens} tokens: "
        if self.hit_blocks == self.cap_blocks:
            return head + ("every full block before the last token is cached (a hit covers at most "
                           f"N - 1 = {self.num_tokens - 1} tokens)")
        if self.checkpoint_cached is None:
            return head + f"the longest run of cached attention blocks (block {self.hit_blocks} is not cached)"
        if self.attention_cached is None:
            return head + "the rightmost recurrent checkpoint before the last token"
        why = head + "the longest prefix with attention blocks and a checkpoint at its end"
        if self.attention_blocks > self.hit_blocks:
            why += (f" (attention blocks are cached up to token {self.attention_blocks * bs}, "
                    f"with no checkpoint after token {hit})")
        return why

    def _miss_reason(self) -> str:
        bs = self.block_size
        attn = self.attention_blocks
        if attn == 0 or (attn is None and not self.known_blocks):
            if not self.known_blocks:
                return "no block of this prompt was computed before"
            return (f"block 0 (tokens [0, {bs})) was computed before but its attention KV block is no "
                    "longer cached (evicted)")
        if attn is None:
            shared = (f"tokens [0, {self.known_blocks * bs}) were computed before but no recurrent "
                      "checkpoint is cached at a block end within them")
        else:
            shared = (f"attention blocks cached for tokens [0, {attn * bs}) but no recurrent checkpoint "
                      "at a block end within them")
        if self.internal_checkpoints:
            return shared + (": those checkpoints were evicted, or no state page was free when the prefix "
                             "was computed (cache mode \"all\" saves them in free pages only)")
        why = (shared + ": the request(s) that computed this prefix saved their state only at their own "
               "chunk ends, which lie past the shared tokens (or those checkpoints were evicted)")
        if self.junction:
            why += (f"; this request stops a chunk at the junction (token {self.junction}) so the next "
                    "one can hit")
        return why


def lookup_not_searched(num_tokens: int, block_size: int, why: str) -> PrefixLookup:
    """The lookup of a request whose prefix the scheduler did not search, and why."""
    return PrefixLookup(num_tokens, block_size, not_searched=why)


@dataclass
class StateMoves:
    """Prefix caching (Mamba "align" rows): the rows that enter a new block's column this step, as
    the scheduler planned them (the one place that knows where each row's state is): before the
    forward the runner copies the running state from page `src` (the state after `from_tokens`
    tokens) to page `dst`, the new column's, or zeroes `dst` where `src` is 0 (nothing computed);
    src == dst: already there. The row's accepted count is then 1 (its state in column 0)."""
    req_ids: list[str] = field(default_factory=list)
    from_tokens: list[int] = field(default_factory=list)
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    queries: int = 0                 # requests looked up
    hits: int = 0                    # of those, with a hit
    prompt_tokens: int = 0           # tokens of the requests looked up
    hit_tokens: int = 0              # tokens they skipped

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class KVCacheManager:
    def __init__(self, groups: list[CacheGroupKind], num_kv_blocks: int, num_state_pages: int,
                 enable_prefix_caching: bool = False, state_columns: int = 1,
                 num_lookahead_tokens: int = 0, max_model_len: int | None = None):
        self.groups = groups
        self.caching = enable_prefix_caching
        # KV slots a request holds past its scheduled tokens (vLLM's num_lookahead_tokens: a draft
        # model's guesses are written there, in its own KV at the target's block ids), up to
        # max_model_len
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        # slots per request without caching (1 + k with spec decoding); with caching, an aligned row's
        # running column and the k spec columns after it
        self.state_columns = state_columns
        has_attn = any(g.kind == "attention" and g.sliding_window is None for g in groups)
        has_mamba = any(g.kind == "mamba" for g in groups)
        self.kv_pool = BlockPool(num_kv_blocks if has_attn else 0, "kv blocks")
        # a sliding-window group's own pool (its layers' tensors are sized for windows, not contexts)
        self.window_pools: dict[int, BlockPool] = {
            g: BlockPool(group.num_blocks, f"kv blocks (window {group.sliding_window})")
            for g, group in enumerate(groups) if group.kind == "attention" and group.sliding_window is not None}
        self.state_pool = BlockPool(num_state_pages + 1 if has_mamba else 0,
                                    "state pages")
        self._ids: dict[str, tuple[list[int], ...]] = {}
        self.stats = PrefixCacheStats()
        # every full block computed lately, cached or not: where a new request's shared prefix ends
        # (its "junction"), even when no checkpoint is there yet
        self.known_hashes: OrderedDict[BlockHash, None] = OrderedDict()
        self._hashed_upto: dict[str, int] = {}      # per request: blocks registered so far
        self._pages_registered_upto: dict[str, int] = {}   # per request: Mamba columns registered so far
        self._pages_released_upto: dict[str, int] = {}     # and the columns released so far (behind them)
        # per request: the first column of its aligned rows changed since the runner last got them
        self._row_dirty_from: dict[str, int] = {}
        # per (request, attention group): blocks registered so far (a step registers only the blocks it
        # completed, as vLLM's cache_full_blocks: host work per step never grows with the context)
        self._blocks_registered_upto: dict[tuple[str, int], int] = {}
        # per (request, sliding-window group): the columns before this one hold the null id (released)
        self._window_released_upto: dict[tuple[str, int], int] = {}
        self._running_column: dict[str, int] = {}   # per request: its aligned rows' running column at
                                                    # the last allocation
        self._num_drafts: dict[str, int] = {}       # ... and the drafts its row verified then
        # per request: where its state is after its last step, counted from its running column (the
        # runner says so after sampling: ModelRunnerOutput.state_offsets); 0 when not listed
        self._state_offset: dict[str, int] = {}
        self._state_moves: dict[str, tuple[int, int, int]] = {}   # this step's moves (StateMoves), by request

    def pool(self, g: int) -> BlockPool:
        if g in self.window_pools:
            return self.window_pools[g]
        return self.kv_pool if self.groups[g].kind == "attention" else self.state_pool

    @property
    def pools(self) -> list[BlockPool]:
        """Every pool: full-attention KV blocks, each sliding window's, state pages."""
        return [self.kv_pool, *self.window_pools.values(), self.state_pool]

    def aligned(self, g: int) -> bool:
        """A Mamba group with a position-indexed row ("align" mode)."""
        return self.caching and self.groups[g].kind == "mamba"

    def windowed(self, g: int) -> bool:
        """A sliding-window attention group: its rows hold the null id 0 in released columns."""
        return g in self.window_pools

    def has_gaps(self, g: int) -> bool:
        """Rows of group g may hold the null id 0 (released or never-held columns)."""
        return self.aligned(g) or g in self.window_pools

    def holdings(self) -> dict[str, tuple[list[int], ...]]:
        """Every request's ids per group (a copy): the ledger. An aligned Mamba row holds 0 in the
        columns without a page."""
        return {rid: tuple(list(ids) for ids in held) for rid, held in self._ids.items()}

    def block_ids_by_request(self):
        """(request id, its ids per group) for every holder, without a copy: read, never write."""
        return self._ids.items()

    def released_columns(self, req_id: str, g: int | None = None) -> int:
        """Aligned Mamba rows (g None or a Mamba group): the columns before this one hold no page of the
        request any more (`_release_checkpoints`); a sliding-window group g: its blocks out of the window.
        The runner's row may still show the ids released there (never read again)."""
        if g is not None and g in self.window_pools:
            return self._window_released_upto.get((req_id, g), 0)
        return self._pages_released_upto.get(req_id, 0)

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        ids = self._ids.get(req_id)         # (no empty default built for the holders, the common case)
        return ids if ids is not None else tuple([] for _ in self.groups)

    def _live(self, g: int, ids: list[int]) -> list[int]:
        return [i for i in ids if i] if self.has_gaps(g) else list(ids)

    def ids_covering(self, req_id: str, num_tokens: int) -> tuple[list[int], ...]:
        """Per group, the request's ids that hold its first `num_tokens` tokens: the KV blocks
        covering them, and the state page (what an n > 1 child copies from its parent)."""
        return tuple(list(ids[:-(-num_tokens // g.block_size)]) if g.kind == "attention" else list(ids)
                     for g, ids in zip(self.groups, self.block_ids(req_id)))

    def transfer(self, from_id: str, to_id: str) -> None:
        """Hand every id `from_id` holds to `to_id` (which holds none): an n > 1 parent's ids to
        its last child, which then needs no copy."""
        held = self._ids.pop(from_id, None)
        if held is None:
            return
        if to_id in self._ids:
            raise RuntimeError(f"cannot hand {from_id!r}'s ids to {to_id!r}, which holds ids already")
        for g, ids in enumerate(held):
            self.pool(g).hand_over(self._live(g, ids), from_id, to_id)
        self._ids[to_id] = held
        for g in self.window_pools:
            if (from_id, g) in self._window_released_upto:
                self._window_released_upto[to_id, g] = self._window_released_upto.pop((from_id, g))
        if from_id in self._running_column:
            self._running_column[to_id] = self._running_column.pop(from_id)
            self._num_drafts[to_id] = self._num_drafts.pop(from_id, 0)
        if from_id in self._state_offset:
            self._state_offset[to_id] = self._state_offset.pop(from_id)

    # ---- growing a request ------------------------------------------------------------------------
    def _plan(self, req_id: str, num_computed: int, num_after: int, num_drafts: int = 0
              ) -> list[tuple[list[int] | int, list[int]]]:
        """Per group: (ids to allocate: a count, or for an aligned Mamba group the columns that need a
        page; aligned Mamba pages to release)."""
        plan = []
        for g, (group, ids) in enumerate(zip(self.groups, self.block_ids(req_id))):
            if g in self.window_pools:      # no lookahead: a draft model writes at the full group's ids;
                # blocks out of the window were released after the last step (trim_windows)
                first, end = self._window_start(g, num_computed), -(-num_after // group.block_size)
                plan.append((max(end - max(len(ids), first), 0), []))
            elif group.kind == "attention":
                tokens = num_after + self.num_lookahead_tokens
                if self.num_lookahead_tokens and self.max_model_len is not None:
                    tokens = max(min(tokens, self.max_model_len), num_after)
                plan.append((max(-(-tokens // group.block_size) - len(ids), 0), []))
            elif not self.aligned(g):
                plan.append((0 if ids else self.state_columns, []))
            else:
                plan.append(self._plan_aligned(req_id, ids, group.block_size, num_computed, num_after, num_drafts))
        return plan

    def _plan_aligned(self, req_id: str, ids: list[int], bs: int, num_computed: int, num_after: int,
                      num_drafts: int) -> tuple[list[int], list[int]]:
        """An aligned Mamba row (vLLM `MambaManager`, "align"): a page at the running column (that of
        the last scheduled token, drafts included) and, for a verify row of d drafts, at the d columns
        after it, where its positions leave their states; with drafts crossing a block boundary also
        at the column of the block the first new token is in (the boundary copy's target). Kept: the
        columns where the computed tokens' state can be (the last step's running column and the
        columns its drafts wrote: its accepted count picks one). Every other page is released
        (registered checkpoints stay cached in the pool)."""
        new = -(-num_after // bs) - 1
        last = self._running_column.get(req_id, -(-num_computed // bs) - 1)
        keep = set(range(last, last + self._num_drafts.get(req_id, 0) + 1))
        need = set(range(new, new + num_drafts + 1))
        first_block = num_computed // bs
        if num_drafts and first_block < new:
            need.add(first_block)
        # columns before the released ones hold no page (`_release_checkpoints`): scanned from there only
        start = self._pages_released_upto.get(req_id, 0)
        release = [c for c in range(start, len(ids)) if ids[c] and c not in keep and c not in need]
        return sorted(c for c in need if c >= len(ids) or not ids[c]), release

    def _window_start(self, g: int, num_computed: int) -> int:
        group = self.groups[g]
        return window_start_block(num_computed, group.sliding_window, group.block_size)

    def trim_windows(self, req_id: str, num_computed: int) -> None:
        """After a step (the scheduler calls it for every scheduled request, before the next step's
        allocation): the request's sliding-window blocks that its next query (at position
        `num_computed`) no longer reads go back to the pool (registered ones stay cached there,
        hittable), and its row holds the null id there; what it holds between steps is its window
        only. The runner's row keeps the old ids (the kernel never reads keys before the window). Work
        in the columns released."""
        held = self._ids.get(req_id)
        if held is None:
            return
        for g in self.window_pools:
            row, key = held[g], (req_id, g)
            start, first = self._window_released_upto.get(key, 0), self._window_start(g, num_computed)
            release = [c for c in range(start, min(first, len(row))) if row[c]]
            if release:
                self.pool(g).free([row[c] for c in release], req_id)
                for c in release:
                    row[c] = 0
            self._window_released_upto[key] = max(start, min(first, len(row)))

    def can_allocate(self, req_id: str, num_computed: int, num_after: int, num_drafts: int = 0) -> bool:
        return self._fits(self._plan(req_id, num_computed, num_after, num_drafts))

    def _fits(self, plan: list[tuple[list[int] | int, list[int]]]) -> bool:
        """Whether the pools have what `plan` allocates (its releases do not change what it needs)."""
        need: dict[int, int] = {}                         # id(pool) -> ids asked of it
        for g, (n, _) in enumerate(plan):
            count = len(n) if isinstance(n, list) else n
            if count:                                     # most decode steps ask for nothing
                key = id(self.pool(g))
                need[key] = need.get(key, 0) + count
        return not need or all(need.get(id(pool), 0) <= pool.num_free for pool in self.pools)

    def allocate(self, req_id: str, num_computed: int, num_after: int, num_drafts: int = 0
                 ) -> tuple[list[int], ...] | None:
        """Grow the request's holdings from `num_computed` to cover `num_after` tokens (the last
        `num_drafts` of them drafts a verify step checks). Returns per group the newly allocated ids
        (an aligned Mamba group: a RowTail, the row from its first column changed since the runner
        last got it, which may also have released pages), or None (nothing allocated) if a pool is
        short. Work in the columns it touches, never the row's length."""
        plan = self._plan(req_id, num_computed, num_after, num_drafts)
        created = req_id not in self._ids
        if not created and not self.caching and not any(n or release for n, release in plan):
            return tuple([] for _ in self.groups)     # most decode rows: nothing to add (no aligned rows)
        held = self._ids.setdefault(req_id, tuple([] for _ in self.groups))
        for g, (_, release) in enumerate(plan):          # no longer needed whether or not we grow
            if release:
                self.pool(g).free([held[g][c] for c in release], req_id)
                for c in release:
                    held[g][c] = 0
                self._mark_dirty(req_id, release[0])
        if not self._fits(plan):
            if created:
                del self._ids[req_id]
            return None
        added = []
        for g, (n, _) in enumerate(plan):
            row = held[g]
            if g in self.window_pools:      # columns before the window (a fork's row) hold the null id
                pad = max(min(self._window_start(g, num_computed), -(-num_after // self.groups[g].block_size))
                          - len(row), 0)
                new = [0] * pad + self.pool(g).allocate(n, req_id)
                row += new
                added.append(new)
                continue
            if not self.aligned(g):
                new = self.pool(g).allocate(n, req_id)
                row += new
                added.append(new)
                continue
            new = self.pool(g).allocate(len(n), req_id)
            for col, page in zip(n, new):
                if col >= len(row):
                    self._mark_dirty(req_id, len(row))
                    row += [0] * (col + 1 - len(row))
                row[col] = page
                self._mark_dirty(req_id, col)
            self._plan_state_move(req_id, row, self.groups[g].block_size, num_computed, num_after)
            self._num_drafts[req_id] = num_drafts
            added.append(self.row_tail(req_id, g))
        self.row_delivered(req_id)                   # the tails above carry every change
        return tuple(added)

    def _plan_state_move(self, req_id: str, row: list[int], bs: int, num_computed: int, num_after: int) -> None:
        """An aligned row allocated for this step: its running column moves to that of its last
        scheduled token. Where it moves, the step's StateMoves gets (tokens, src page, dst page): the
        state after the computed tokens is at the old running column plus the row's state offset (a
        new request: the column of its prefix hit's checkpoint, or nothing to copy, src 0)."""
        new = -(-num_after // bs) - 1
        last = self._running_column.get(req_id, -(-num_computed // bs) - 1)
        self._running_column[req_id] = new
        if new == last:
            return
        src = row[last + self._state_offset.pop(req_id, 0)] if last >= 0 else 0
        if row[new] == 0 or (last >= 0 and src == 0):
            raise RuntimeError(f"prefix caching: request {req_id!r}'s state move from column {last} to {new} "
                               f"names the null page (row {row[max(last, 0):new + 1]})")
        self._state_moves[req_id] = (num_computed if last >= 0 else 0, src, row[new])

    def take_state_moves(self, scheduled: Collection[str]) -> StateMoves:
        """The step's StateMoves (of the requests it schedules, in the order they were allocated) and
        a clean slate. Work in the moves, not the rows."""
        if not self._state_moves:        # most steps, and every step without prefix caching
            return StateMoves()
        moves, self._state_moves = self._state_moves, {}
        out = StateMoves()
        for req_id, move in moves.items():
            if req_id in scheduled:
                out.req_ids.append(req_id)
                for values, v in zip((out.from_tokens, out.src, out.dst), move):
                    values.append(v)
        return out

    def set_state_offsets(self, req_ids: Collection[str], offsets: dict[str, int]) -> None:
        """After a step: each of its requests' state offset (ModelRunnerOutput.state_offsets)."""
        for req_id in req_ids:
            if req_id in self._running_column:
                offset = offsets.get(req_id, 0)
                if offset:
                    self._state_offset[req_id] = offset
                else:
                    self._state_offset.pop(req_id, None)

    def _mark_dirty(self, req_id: str, column: int) -> None:
        self._row_dirty_from[req_id] = min(column, self._row_dirty_from.get(req_id, column))

    def row_tail(self, req_id: str, g: int, since: int | None = None) -> RowTail:
        """The aligned row `g` of the request from its first column changed since the runner last
        got it, or from `since` if that is earlier (empty, at the row's end, when nothing changed)."""
        row = self._ids[req_id][g]
        start = min(self._row_dirty_from.get(req_id, len(row)), len(row) if since is None else since, len(row))
        return RowTail(start, row[start:])

    def row_delivered(self, req_id: str) -> None:
        """The runner has every change of the request's aligned rows (the scheduler sent their tails)."""
        self._row_dirty_from.pop(req_id, None)

    def add_state_pages(self, req_id: str, columns: list[int]) -> bool:
        """Cache mode "all": give the request's aligned Mamba rows a page at each of `columns` that has
        none, while the state pool has free pages (evicting the least recently used checkpoints, as
        any allocation does). Returns whether any row changed."""
        changed = False
        for g, row in enumerate(self._ids.get(req_id, ())):
            if not self.aligned(g):
                continue
            for col in columns:
                if col < len(row) and not row[col] and self.state_pool.num_free:
                    row[col] = self.state_pool.allocate(1, req_id)[0]
                    self._mark_dirty(req_id, col)
                    changed = True
        return changed

    def free(self, req_id: str) -> None:
        self._hashed_upto.pop(req_id, None)
        self._running_column.pop(req_id, None)
        self._num_drafts.pop(req_id, None)
        self._state_offset.pop(req_id, None)
        self._state_moves.pop(req_id, None)
        self._pages_registered_upto.pop(req_id, None)
        self._pages_released_upto.pop(req_id, None)
        self._row_dirty_from.pop(req_id, None)
        for g in range(len(self.groups)):
            self._blocks_registered_upto.pop((req_id, g), None)
            self._window_released_upto.pop((req_id, g), None)
        held = self._ids.pop(req_id, None)
        if held is None:
            return
        for g, ids in enumerate(held):
            self.pool(g).free(self._live(g, ids), req_id)

    # ---- the prefix cache ---------------------------------------------------------------------------
    def lookup(self, hashes: list[BlockHash], num_tokens: int) -> PrefixLookup:
        """What the cache holds for a new request's `num_tokens` tokens (hashes: its full blocks'),
        per block and group, and the hit: the longest prefix (at most N - 1 tokens) that every group
        holds, attention blocks for each block, a sliding window's blocks for the window before its end
        and a Mamba checkpoint at its end (vLLM's HybridKVCacheCoordinator: each group's rule applied in
        turn until none shortens it). Nothing changes."""
        bs = self.groups[0].block_size
        cap = max(min((num_tokens - 1) // bs, len(hashes)), 0)   # the last token is always computed
        attn = ckpt = run = window = None
        if any(g.kind == "attention" and g.sliding_window is None for g in self.groups):
            attn = [h in self.kv_pool.cached for h in hashes]
            run = next((i for i in range(cap) if not attn[i]), cap)
        windows = {g: [h in pool.cached for h in hashes] for g, pool in self.window_pools.items()}
        if windows:
            window = [all(flags) for flags in zip(*windows.values())]
        if any(g.kind == "mamba" for g in self.groups):
            ckpt = [h in self.state_pool.cached for h in hashes]
        blocks, limit = cap if run is None else run, None
        while blocks != limit:       # each rule only shortens the hit: a few rounds at most
            limit = blocks
            for g, flags in windows.items():
                blocks = window_hit(flags, blocks, self._window_blocks(g))
            if ckpt is not None:         # the rightmost checkpoint within it
                blocks = next((i + 1 for i in range(blocks - 1, -1, -1) if ckpt[i]), 0)
        known = next((i for i in range(cap) if hashes[i] not in self.known_hashes), cap)
        return PrefixLookup(num_tokens, bs, [h.hex()[:12] for h in hashes], attn, ckpt, cap, run, blocks, known,
                            window_cached=window)

    def _window_blocks(self, g: int) -> int:
        group = self.groups[g]
        return window_blocks(group.sliding_window, group.block_size)

    def prefix_hit(self, lookup: PrefixLookup, hashes: list[BlockHash]) -> PrefixHit | None:
        """The ids a lookup's hit adopts (None without a hit): every attention block; a sliding
        window's blocks within the window before the hit's end (the null id before them); the Mamba
        checkpoint at its end."""
        blocks = lookup.hit_blocks
        if not blocks:
            return None
        ids = []
        for g, group in enumerate(self.groups):
            pool = self.pool(g)
            if g in self.window_pools:
                first = max(blocks - self._window_blocks(g), 0)
                ids.append([0] * first + [pool.cached[h] for h in hashes[first:blocks]])
            elif group.kind == "attention":
                ids.append([pool.cached[h] for h in hashes[:blocks]])
            else:
                ids.append([0] * (blocks - 1) + [pool.cached[hashes[blocks - 1]]])
        return PrefixHit(blocks * lookup.block_size, tuple(ids), tuple(blocks for _ in self.groups))

    def find_prefix_hit(self, hashes: list[BlockHash], num_tokens: int) -> PrefixHit | None:
        """The hit of `lookup` with its ids; None without a hit. Nothing changes (see `adopt`,
        `count_lookup`)."""
        return self.prefix_hit(self.lookup(hashes, num_tokens), hashes)

    def count_lookup(self, num_tokens: int, hit: PrefixHit | None) -> None:
        """A looked-up request was admitted: count it in `stats`."""
        got = hit.num_tokens if hit else 0
        self.stats.queries += 1
        self.stats.prompt_tokens += num_tokens
        self.stats.hits += bool(got)
        self.stats.hit_tokens += got

    def adopt(self, req_id: str, hit: PrefixHit) -> None:
        """The request (holding nothing) shares the hit's ids."""
        if req_id in self._ids:
            raise RuntimeError(f"{req_id!r} adopts a prefix hit but holds ids already")
        for g, ids in enumerate(hit.ids):
            self.pool(g).touch(self._live(g, ids), req_id)
        self._ids[req_id] = tuple(list(ids) for ids in hit.ids)

    def cache_computed(self, req_id: str, hashes: list[BlockHash], num_computed: int) -> None:
        """After a step: register the request's attention blocks whose tokens are all computed, and
        its Mamba page if the step ended on a block boundary (the page holds that checkpoint)."""
        held = self._ids.get(req_id)
        if held is None:
            return
        full = min(num_computed // self.groups[0].block_size, len(hashes))
        for h in hashes[self._hashed_upto.get(req_id, 0):full]:
            self.known_hashes[h] = None
            self.known_hashes.move_to_end(h)
            if len(self.known_hashes) > KNOWN_HASHES:
                self.known_hashes.popitem(last=False)
        self._hashed_upto[req_id] = full
        for g, (group, ids) in enumerate(zip(self.groups, held)):
            full = min(num_computed // group.block_size, len(hashes))
            if group.kind == "attention":
                done = self._blocks_registered_upto.get((req_id, g), 0)
                pool = self.pool(g)
                for i in range(done, full):
                    if ids[i]:                      # a sliding window's columns before a hit hold 0
                        pool.register(ids[i], hashes[i], i)
                self._blocks_registered_upto[req_id, g] = max(done, full)
            elif self.aligned(g):
                # the pages of the blocks finished since the last call: the running page when the step
                # ended on its block's last token, and ("all") the pages of the boundaries inside the chunk
                done = self._pages_registered_upto.get(req_id, 0)
                for c in range(done, min(full, len(ids))):
                    if ids[c]:
                        self.state_pool.register(ids[c], hashes[c], c)
                self._pages_registered_upto[req_id] = max(done, full)
                self._release_checkpoints(req_id, g, ids, full)

    def _release_checkpoints(self, req_id: str, g: int, ids: list[int], registered: int) -> None:
        """Release the request's registered checkpoint pages behind its running column: their blocks
        are complete and their states saved, and the request never writes or reads them again, so they
        wait in the free queue, hittable, and evictable by the next allocation instead of held until
        this request's next `allocate` (which would release them then). Cache mode "all" hands out such
        pages inside every prefill chunk; held, they emptied the pool and had other requests preempted.
        The runner's row may still show a released page (never read: it lies before the running
        column), as vLLM's block table keeps freed Mamba blocks."""
        running = self._running_column.get(req_id)
        if running is None:
            return
        start, end = self._pages_released_upto.get(req_id, 0), min(registered, running, len(ids))
        release = [c for c in range(start, end) if ids[c]]        # only the columns passed since last time
        if release:
            self.state_pool.free([ids[c] for c in release], req_id)
            for c in release:
                ids[c] = 0
        self._pages_released_upto[req_id] = max(start, end)


def prefix_cache_stats(kv: KVCacheManager) -> dict[str, int | float]:
    """`LLM.stats()`'s prefix-cache entries (vLLM's PrefixCacheStats, plus what is cached now)."""
    st = kv.stats
    return {"prefix_cache_queries": st.queries, "prefix_cache_hits": st.hits,
            "prefix_cache_hit_rate": round(st.hit_rate, 4), "prompt_tokens_queried": st.prompt_tokens,
            "prompt_tokens_skipped": st.hit_tokens,
            "cached_kv_blocks": sum(len(p.cached) for p in kv.pools if p is not kv.state_pool),
            "cached_state_pages": len(kv.state_pool.cached),
            "prefix_cache_evictions": sum(p.num_evictions for p in kv.pools)}
