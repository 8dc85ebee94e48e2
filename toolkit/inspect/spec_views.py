"""Speculative decoding in one step, as HTML: the StepInspector's "Speculation" tab and the
"Speculation" section of a StepRecord's HTML. Pure functions of the record (`StepRecord.spec`, one
`SpecRow` per decode row, and `proposed_drafts`); nothing is recomputed.

For each decode row: its positions left to right, each a chip with the input token (the last
sampled token, then the drafts) over the token the target sampled there; accepted drafts green,
the first rejected one red (the row keeps the target's token at the position before instead), the
ones after it grey (never looked at); the target's tokens at positions 0..accepted are kept (the
last one is the bonus when every draft was accepted). Then the recurrent state columns: the column
the step started from, the slot each position left its state in, and the column the next step
starts from (num_accepted - 1). With prefix caching, a row whose kept tokens reached a block
boundary also says which position's state was copied into the checkpoint
(`StepRecord.checkpoint_copies`).
"""
from __future__ import annotations

from typing import Any

from toolkit.inspect import html as H

CLASS_PREFIX = "sd-"         # chip classes: sd-pos sd-input / sd-accepted / sd-rejected / sd-unchecked
POSITION_STATES = H.SPEC_CHIP_STATES
WORDS = {"input": "the row's last sampled token (verified already)",
         "accepted": "draft accepted: it equals the token the target sampled at the position before",
         "rejected": "first rejected draft: the row keeps the target's token at the position before instead",
         "unchecked": "after a rejection: not looked at (its state column is ignored)",
         "bonus": "every draft accepted: the target's token after the last draft is kept too (the bonus)"}


def no_spec_reason(record: Any, enabled: bool | None = None) -> str | None:
    """Why the step has no speculation to show, in one sentence; None when it has some."""
    if enabled is False:
        return ("speculative decoding is off: build the engine with LLM(..., speculative_config="
                "{'method': 'ngram', 'num_speculative_tokens': 3}) to see drafts and state columns")
    if getattr(record, "spec", None):
        return None
    if not record.scheduled:
        return "nothing was scheduled in this step"
    return ("no row of this step was a decode (only prefill chunks: drafts are verified by decode rows)"
            if enabled else "this step has no speculative decode rows (speculative decoding off, or prefills only)")


def position_state(row: Any, j: int) -> str:
    """What happened at position j of a verify row: its input token was the last sampled token
    (j = 0), an accepted draft, the first rejected draft, or a draft after it (unchecked)."""
    a = row.accepted_drafts
    if j == 0:
        return "input"
    return "accepted" if j <= a else "rejected" if j == a + 1 else "unchecked"


def position_chips(row: Any) -> str:
    """The row's 1 + d positions, each its input token over the token the target sampled there
    (kept for positions 0..accepted drafts), coloured by what happened to the input."""
    inputs = ["last"] + [str(t) for t in row.drafts]
    cells = []
    for j, target in enumerate(row.target):
        state = position_state(row, j)
        kept = "kept" if j < row.num_accepted else "dropped"
        facts = [f"position {j}", f"input {inputs[j]}", f"target sampled {target} ({kept})", WORDS[state]]
        if j == len(row.drafts) and row.drafts and state == "accepted":
            facts.append(WORDS["bonus"])
        cells.append(H.chip([inputs[j], f"→ {target}"], f"{H.CHIP};{POSITION_STATES[state]}", " · ".join(facts),
                            f"{CLASS_PREFIX}pos {CLASS_PREFIX}{state}"))
    return f'<div style="{H.CHIP_ROW}">{"".join(cells)}</div>'


def columns_text(row: Any) -> str:
    """Where the row's recurrent states are: the start column, and where the next step starts."""
    if not getattr(row, "columns_read", True):
        return "state columns not read (inspection off: reading them would sync the device)"
    if row.columns is None:
        return "no recurrent layers"
    cols = row.columns
    start = row.start_column
    return (f"started from column {start} (slot {cols[start]}); position j left its state in column j "
            f"(slots {cols[:len(row.target)]}); the next step starts from column {row.next_column} "
            f"(slot {cols[row.next_column]})")


def checkpoint_text(copy: Any) -> str:
    """A boundary reached inside the row (prefix caching): which column's state became the checkpoint."""
    where = "its running page itself" if copy.src_page == copy.dst_page else f"page {copy.dst_page}"
    return (f"checkpoint: the row reached token {copy.boundary}, a block boundary, at position {copy.position}; "
            f"that column's state (slot {copy.src_page}) was copied into {where}, the checkpoint later "
            "requests may hit")


def row_html(rid: str, row: Any, checkpoint: Any = None) -> str:
    d = len(row.drafts)
    head = (f"request {rid!r}: {d} draft{'' if d == 1 else 's'}, {row.accepted_drafts} accepted, "
            f"{row.num_accepted} token{'' if row.num_accepted == 1 else 's'} kept")
    if row.target_at_rejection is not None:
        rejected = row.drafts[row.accepted_drafts]
        head += f"; the target sampled {row.target_at_rejection} where draft {rejected} was rejected"
    head += f"; kept {row.target[:row.num_accepted]}"
    out = (H.div(head, f"{H.TITLE};font-weight:600") + position_chips(row)
           + f'<div class="{CLASS_PREFIX}columns" style="{H.SOFT}">{H.escape(columns_text(row))}</div>')
    if checkpoint is not None:
        out += f'<div class="{CLASS_PREFIX}checkpoint" style="{H.SOFT}">{H.escape(checkpoint_text(checkpoint))}</div>'
    return out


def legend_html() -> str:
    chips = [H.chip([label], f"{H.CHIP};{POSITION_STATES[state]}", WORDS[state], "")
             for state, label in (("input", "last"), ("accepted", "accepted"), ("rejected", "rejected"),
                                  ("unchecked", "unchecked"))]
    words = H.escape("each chip: the input token over the token the target sampled there (hover for more)")
    return f'<div style="{H.SOFT}">{"".join(chips)} {words}</div>'


def spec_step_html(record: Any, enabled: bool | None = None) -> str:
    """The step's speculative decoding: each decode row's drafts against the target, its accepted
    run and its state columns, then the drafts proposed for the next step. `enabled`: whether the
    engine speculates, when known."""
    why = no_spec_reason(record, enabled)
    if why is not None:
        return H.note(why)
    rows = record.spec
    drafts = sum(len(r.drafts) for r in rows.values())
    accepted = sum(r.accepted_drafts for r in rows.values())
    parts = [H.title(f"Verify rows of this step ({len(rows)}): {accepted} of {drafts} drafts accepted")]
    saved = {c.request_id: c for c in getattr(record, "checkpoint_copies", [])}
    parts += [row_html(rid, row, saved.get(rid)) for rid, row in rows.items()]
    parts.append(legend_html())
    proposed = getattr(record, "proposed_drafts", {})
    if proposed:
        table = [[H.escape(rid), H.escape(", ".join(map(str, d)))] for rid, d in proposed.items()]
        parts.append(H.title("Drafts proposed for the next step") + H.table(["request", "drafts"], table))
    return H.wrap("".join(parts))


def spec_table_html(record: Any) -> str:
    """The "Speculation" section of a StepRecord's HTML: a line per verify row; "" without any."""
    rows = getattr(record, "spec", {})
    if not rows:
        return ""
    body = [[H.escape(rid), H.escape(", ".join(map(str, r.drafts))) or H.muted_none(),
             H.escape(", ".join(map(str, r.target))), str(r.num_accepted),
             H.escape(str(r.target_at_rejection)) if r.target_at_rejection is not None else H.muted_none(),
             H.escape(f"{r.start_column} -> {r.next_column}") if r.columns is not None else H.muted_none()]
            for rid, r in rows.items()]
    return H.title("Speculation") + H.table(["request", "drafts", "target", "kept", "target at rejection",
                                              "state column (start -> next)"], body)
