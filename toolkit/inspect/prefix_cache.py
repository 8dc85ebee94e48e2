"""`llm.prefix_cache`: what the prefix cache holds now, read from the scheduler's pools.

One row per registered id: the KV block or the Mamba state page (a checkpoint), the tokens of the
prefix it stands for, its hash, who holds it (a running request shares it: its ref count) or, when
free, its place in the eviction queue (1 = the next id the pool hands out, when no unregistered id
is left). With the counts of `llm.stats()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.inspect import html as H
from toolkit.kv_cache_manager import BlockPool, KVCacheManager, prefix_cache_stats


@dataclass
class CachedEntry:
    kind: str                    # "kv block", "kv block (window W)" (a sliding-window group) or "state page"
    id: int                      # block id / page id in its pool
    block: int                   # the prompt block it stands for: tokens [block*bs, (block+1)*bs)
    tokens: tuple[int, int]      # that range
    hash: str                    # the chained hash, first 12 hex digits
    holders: list[str]           # requests holding it now (ref count = len)
    evict_rank: int | None       # free: its place in the eviction order among cached ids (1 = first)


@dataclass
class PrefixCacheReport:
    enabled: bool
    block_size: int
    entries: list[CachedEntry] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        if not self.enabled:
            return "PrefixCacheReport(prefix caching is off: LLM(..., enable_prefix_caching=True))"
        kinds = {k: sum(e.kind.startswith(k) for e in self.entries) for k in ("kv block", "state page")}
        return (f"PrefixCacheReport({kinds['kv block']} KV blocks, {kinds['state page']} state pages cached; "
                f"hit rate {self.stats.get('prefix_cache_hit_rate', 0):.1%}, "
                f"{self.stats.get('prompt_tokens_skipped', 0)} prompt tokens skipped)")

    def _repr_html_(self) -> str:
        return prefix_cache_html(self)


def _entries(pool: BlockPool, kind: str, bs: int) -> list[CachedEntry]:
    free_cached = [i for i in pool._free if i in pool.hash_of]
    rank = {i: n + 1 for n, i in enumerate(free_cached)}
    out = []
    for i, h in pool.hash_of.items():
        b = pool.block_index[i]
        out.append(CachedEntry(kind, i, b, (b * bs, (b + 1) * bs), h.hex()[:12],
                               sorted(pool.holders.get(i, ())), rank.get(i)))
    return sorted(out, key=lambda e: (e.kind, e.block, e.id))


def prefix_cache_report(kv: KVCacheManager) -> PrefixCacheReport:
    bs = kv.groups[0].block_size if kv.groups else 0
    if not kv.caching:
        return PrefixCacheReport(False, bs)
    windows = [e for g, pool in kv.window_pools.items()
               for e in _entries(pool, f"kv block (window {kv.groups[g].sliding_window})", bs)]
    return PrefixCacheReport(True, bs, _entries(kv.kv_pool, "kv block", bs) + windows
                             + _entries(kv.state_pool, "state page", bs), prefix_cache_stats(kv))


def prefix_cache_html(report: PrefixCacheReport) -> str:
    if not report.enabled:
        return H.note("Prefix caching is off: build the engine with enable_prefix_caching=True.")
    st = report.stats
    head = H.title("Prefix cache") + H.div(H.escape(
        f"block size {report.block_size}; {st['prefix_cache_hits']} of {st['prefix_cache_queries']} requests hit, "
        f"{st['prompt_tokens_skipped']} of {st['prompt_tokens_queried']} prompt tokens skipped "
        f"({st['prefix_cache_hit_rate']:.1%}); {st['prefix_cache_evictions']} evictions"), H.MUTED)
    if not report.entries:
        return H.wrap(head + H.div(H.escape(
            "Nothing cached yet: a KV block is cached once a request has computed all its tokens, a "
            "state page (a checkpoint) once a prefill chunk or a decode ends on its block's last token."), H.MUTED))
    rows = [[H.escape(e.kind), str(e.id), f"{e.block} [{e.tokens[0]}, {e.tokens[1]})", H.escape(e.hash),
             H.escape(", ".join(e.holders)) if e.holders else H.muted_none(),
             str(e.evict_rank) if e.evict_rank is not None else H.muted_none()]
            for e in report.entries]
    return H.wrap(head + H.table(["kind", "id", "block [tokens)", "hash", "held by", "eviction rank"], rows,
                                 right=(1,)))
