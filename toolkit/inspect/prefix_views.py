"""Prefix caching in one step, as HTML: the StepInspector's "Prefix cache" tab and the "Prefix
cache" section of a StepRecord's HTML. Pure functions of the record, which holds the scheduler's
lookups (`StepRecord.prefix_lookups`, kv_cache_manager.PrefixLookup) and the runner's state copies
(`StepRecord.state_copies`); nothing is recomputed.

For each request admitted in the step: its hash chain, one chip per full block (index and hash;
the token range and what each group held in the tooltip), coloured by the block's state: hit (taken
from the cache), cached but not used (some group holds it, the hit stops before it), missing, or
past the N - 1 cap; ◆ marks a block with a recurrent checkpoint at its end, a blue bar the
shared-prefix junction. Then the hit and why (`PrefixLookup.reason`), and where each recurrent
state of the step came from. What the cache holds now is `llm.prefix_cache` (prefix_cache.py).
"""
from __future__ import annotations

from typing import Any

from toolkit.inspect import html as H

OFF = "prefix caching is off"
MAX_CHIPS = 512              # blocks drawn per request; a longer chain says how many were left out
STATE_WORDS = {"hit": "hit (taken from the cache)", "cached": "cached, not used (the hit stops before it)",
               "missing": "not cached", "capped": "past the N - 1 cap (never hit: the last token is computed)"}
CLASS_PREFIX = "pc-"         # chip classes: pc-block pc-hit / pc-cached / pc-missing / pc-capped, pc-checkpoint


# ---- facts -----------------------------------------------------------------------------------------
def searched(record: Any) -> dict[str, Any]:
    """The record's lookups that searched the cache (request id -> PrefixLookup)."""
    return {rid: lk for rid, lk in getattr(record, "prefix_lookups", {}).items() if not lk.not_searched}


def caching_off(record: Any, enabled: bool | None = None) -> bool:
    """Prefix caching is off: the engine says so (`enabled`), or the record's lookups do."""
    lookups = getattr(record, "prefix_lookups", {})
    return enabled is False or (bool(lookups) and all(lk.not_searched == OFF for lk in lookups.values()))


def why_no_prefix_cache(record: Any, enabled: bool | None = None) -> str | None:
    """Why the step has no prefix-cache facts to show, in one sentence; None when it has some.
    `enabled`: whether the engine caches prefixes, when known (a loaded trace does not say)."""
    if caching_off(record, enabled):
        return (f"{OFF}: build the engine with LLM(..., enable_prefix_caching=True) to see lookups, "
                "hits and checkpoints")
    if (getattr(record, "prefix_lookups", {}) or getattr(record, "state_copies", [])
            or getattr(record, "checkpoint_copies", [])):
        return None
    if not record.scheduled:
        return "nothing was scheduled in this step, so no request was looked up and no state moved"
    return ("no request was admitted in this step (the cache is looked up at admission) and no row "
            "entered a new block (no recurrent state was copied to a new page)")


def copy_text(copy: Any, hit_tokens: int | None = None) -> str:
    """Where one row's recurrent state came from: "page 7 (the checkpoint after 480 tokens, its
    prefix hit) -> page 12", "page 7 (the state after 75 tokens) -> page 12", or "zeroed: from
    scratch -> page 12". `hit_tokens`: the row's prefix hit this step."""
    if not copy.src_page:
        return f"zeroed: from scratch -> page {copy.dst_page}"
    if hit_tokens and hit_tokens == copy.from_tokens:
        return (f"page {copy.src_page} (the checkpoint after {copy.from_tokens} tokens, its prefix hit) -> "
                f"page {copy.dst_page}")
    if copy.src_page == copy.dst_page:      # speculative decoding: a spec column became the running one
        return (f"page {copy.src_page} holds the state after {copy.from_tokens} tokens already "
                "(its new running page)")
    return f"page {copy.src_page} (the state after {copy.from_tokens} tokens) -> page {copy.dst_page}"


def checkpoint_copy_text(copy: Any) -> str:
    """A verify row's boundary copy: "the state after 48 tokens, left by verify position 1 in page 9
    -> page 4: the checkpoint of the block ending at token 48"."""
    into = "its running page, already there" if copy.src_page == copy.dst_page else f"page {copy.dst_page}"
    return (f"the state after {copy.boundary} tokens, left by verify position {copy.position} in page "
            f"{copy.src_page} -> {into}: the checkpoint of the block ending at token {copy.boundary}")


# ---- the hash chain -----------------------------------------------------------------------------------
def _held(flags: list[bool] | None, b: int, what: str) -> str:
    if flags is None:
        return ""
    return f"{what} {'cached' if flags[b] else 'not cached'}"


def block_chip(lookup: Any, b: int) -> str:
    """Block b of a lookup as a chip: its index and short hash, ◆ if a checkpoint is cached at its end."""
    bs, state = lookup.block_size, lookup.block_state(b)
    ckpt = lookup.checkpoint_cached is not None and lookup.checkpoint_cached[b]
    facts = [f"block {b}: tokens [{b * bs}, {(b + 1) * bs})", f"hash {lookup.hashes[b]}", STATE_WORDS[state],
             _held(lookup.attention_cached, b, "attention KV block"),
             _held(lookup.window_cached, b, "sliding-window KV block"),
             _held(lookup.checkpoint_cached, b, f"checkpoint after {(b + 1) * bs} tokens")]
    cls = f"{CLASS_PREFIX}block {CLASS_PREFIX}{state}" + (f" {CLASS_PREFIX}checkpoint" if ckpt else "")
    return H.chip([f"{b}{' ◆' if ckpt else ''}", lookup.hashes[b][:4]], f"{H.CHIP};{H.CHIP_STATES[state]}",
                  " · ".join(f for f in facts if f), cls)


def junction_mark(lookup: Any) -> str:
    tokens = lookup.junction
    return (f'<span class="{CLASS_PREFIX}junction" title="the junction: the prefix shared with earlier '
            f'requests ends at token {tokens}; this request stops a prefill chunk there" '
            f'style="{H.JUNCTION}">{tokens}</span>')


def chain_html(lookup: Any) -> str:
    """The request's full blocks in order, the junction marked after the block it ends."""
    shown = min(lookup.num_blocks, MAX_CHIPS)
    end = lookup.junction // lookup.block_size if lookup.junction else None
    cells = []
    for b in range(shown):
        cells.append(block_chip(lookup, b))
        if end is not None and b == end - 1:
            cells.append(junction_mark(lookup))
    if lookup.num_blocks > shown:
        cells.append(H.span(f"… {lookup.num_blocks - shown} more blocks not drawn", H.MUTED))
    return f'<div style="{H.CHIP_ROW}">{"".join(cells)}</div>'


def legend_html() -> str:
    chips = [H.chip([label], f"{H.CHIP};{H.CHIP_STATES[state]}", STATE_WORDS[state], "")
             for state, label in (("hit", "hit"), ("cached", "cached, unused"), ("missing", "missing"),
                                  ("capped", "past the cap"))]
    words = H.escape("◆ a recurrent checkpoint is cached at the block's end; blue bar: the junction "
                     "(hover a block for its tokens and what each group holds)")
    return f'<div style="{H.SOFT}">{"".join(chips)} {words}</div>'


def _blocks(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def lookup_html(request_id: str, lookup: Any) -> str:
    """One request's lookup: a header line, its hash chain (if searched) and the reason."""
    head = f"request {request_id!r}: {lookup.num_tokens} tokens"
    if lookup.not_searched:
        return H.div(f"{head}: {lookup.reason}", H.SOFT)
    head += (f", {_blocks(lookup.num_blocks, 'full block')} of {lookup.block_size}; hit {lookup.hit_tokens} "
             f"tokens ({_blocks(lookup.hit_blocks, 'block')}, cap {lookup.cap_blocks})")
    return (H.div(head, f"{H.TITLE};font-weight:600") + chain_html(lookup)
            + f'<div class="{CLASS_PREFIX}reason" style="{H.SOFT}">{H.escape(lookup.reason)}</div>')


def copies_html(record: Any) -> str:
    """Where each recurrent state of the step came from (every row that entered a new block)."""
    copies = getattr(record, "state_copies", [])
    if not copies and not getattr(record, "checkpoint_copies", []):
        return ""
    hits = getattr(record, "prefix_hits", {})
    rows = [[H.escape(c.request_id), H.escape(copy_text(c, hits.get(c.request_id)))] for c in copies]
    out = (H.title("Recurrent states this step (rows that entered a new block)")
           + H.table(["request", "state from -> into"], rows)) if rows else ""
    saved = getattr(record, "checkpoint_copies", [])
    if saved:
        out += (H.title("Checkpoints saved from verify rows (a block boundary reached inside a verify step)")
                + H.table(["request", "checkpoint"], [[H.escape(c.request_id), H.escape(checkpoint_copy_text(c))]
                                                      for c in saved]))
    return out


# ---- the views ------------------------------------------------------------------------------------------
def prefix_cache_step_html(record: Any, enabled: bool | None = None) -> str:
    """The step's prefix caching: each admitted request's lookup (hash chain, hit, reason), then
    where each recurrent state came from. A step with nothing to show says why in one sentence.
    `enabled`: whether the engine caches prefixes, when known."""
    why = why_no_prefix_cache(record, enabled)
    if why is not None:
        return H.note(why)
    lookups = getattr(record, "prefix_lookups", {})
    parts = [H.title(f"Prefix cache lookups of the requests admitted in this step ({len(lookups)})")]
    if not lookups:
        parts.append(H.div("no request was admitted in this step (the cache is looked up at admission)", H.MUTED))
    parts += [lookup_html(rid, lk) for rid, lk in lookups.items()]
    if searched(record):
        parts.append(legend_html())
    parts.append(copies_html(record))
    return H.wrap("".join(parts))


def prefix_cache_table_html(record: Any) -> str:
    """The "Prefix cache" section of a StepRecord's HTML: per request looked up (with the cache on)
    or whose state moved, the tokens it hit and why, and where its state came from; "" when the
    step has none of these (or prefix caching is off)."""
    lookups = {rid: lk for rid, lk in getattr(record, "prefix_lookups", {}).items() if lk.not_searched != OFF}
    hits = getattr(record, "prefix_hits", {})
    copies = {c.request_id: c for c in getattr(record, "state_copies", [])}
    rids = list(dict.fromkeys([*lookups, *copies, *hits]))
    if not rids:
        return ""
    rows = []
    for rid in rids:
        lk, c = lookups.get(rid), copies.get(rid)
        hit = str(lk.hit_tokens) if lk is not None else str(hits[rid]) if rid in hits else ""
        rows.append([H.escape(rid), hit, H.escape(lk.reason) if lk is not None else H.muted_none(),
                     H.escape(copy_text(c, hits.get(rid))) if c is not None else H.muted_none()])
    return H.title("Prefix cache") + H.table(["request", "tokens hit", "why", "state from -> into"], rows)
