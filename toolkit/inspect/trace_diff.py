"""`diff_traces(a, b)`: where two traces of the same workload part (a fault planted in one,
chunked vs unchunked prefill, ...). Steps need not align: both traces are keyed on (request id,
position), and at each position the recurrent states, the logits row and the kept token are
compared in that order. A verify row of speculative decoding gives a position per token it kept
(the target's token and logits row there), and its states at its last kept position; so a run with
speculation can be diffed against one without.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from toolkit.inspect import html as H
from toolkit.inspect.tolerance import absmax, exceeds


@dataclass
class Difference:
    """One difference between two traces, at (request, position). position = the index of the
    token sampled at that point (the request's token count after the step); a state difference
    is the state after the step that reached that token count."""
    request_id: str
    position: int | None
    step_a: int | None
    step_b: int | None
    what: str              # "token" | "logits" | "state <layer>.<state>" | "missing request" | "missing token"
    detail: str

    def __str__(self) -> str:
        pos = "" if self.position is None else f", position {self.position}"
        return (f"request {self.request_id!r}{pos}: {self.what} ({self.detail}); "
                f"step {self.step_a} in a, {self.step_b} in b")


@dataclass
class TraceDiff:
    """Result of `diff_traces`: the first difference overall (the one earliest in trace a's step
    order; each request's own first is in `per_request`), and what was compared."""
    identical: bool
    request_id: str | None = None
    position: int | None = None
    step_a: int | None = None
    step_b: int | None = None
    what: str | None = None
    detail: str | None = None
    per_request: dict[str, Difference] = field(default_factory=dict)
    num_requests_compared: int = 0
    num_positions_compared: int = 0
    num_tokens_compared: int = 0
    num_logits_compared: int = 0
    num_states_compared: int = 0
    tolerance: tuple[float, float] = (1e-5, 1e-4)

    def __str__(self) -> str:
        counts = (f"{self.num_requests_compared} requests, {self.num_tokens_compared} tokens, "
                  f"{self.num_logits_compared} logits rows, {self.num_states_compared} states")
        if self.identical:
            return f"traces agree: {counts} compared"
        pos = "" if self.position is None else f", position {self.position}"
        more = len(self.per_request) - 1
        return (f"traces part at request {self.request_id!r}{pos}: {self.what} ({self.detail}); "
                f"step {self.step_a} in a, step {self.step_b} in b"
                + (f"; {more} more request(s) differ" if more > 0 else "") + f" [{counts}]")

    __repr__ = __str__

    def _repr_html_(self) -> str:
        atol, rtol = self.tolerance
        facts: list[tuple[str, str]] = []
        if not self.identical:
            facts += [("request", repr(self.request_id)), ("position", str(self.position)),
                      ("step in a / b", f"{self.step_a} / {self.step_b}"), ("what", str(self.what)),
                      ("detail", str(self.detail))]
        facts += [("compared", f"{self.num_requests_compared} requests, {self.num_positions_compared} "
                               f"positions: {self.num_tokens_compared} tokens, {self.num_logits_compared} "
                               f"logits, {self.num_states_compared} states"),
                  ("tolerance", f"atol {atol:g} + rtol {rtol:g} * |b|")]
        body = (H.verdict("traces agree" if self.identical else "traces part", self.identical)
                + H.table(None, [[H.escape(k), H.escape(v)] for k, v in facts]))
        if len(self.per_request) > 1:
            rows = [[H.escape(repr(d.request_id)), H.escape(d.position), H.escape(d.what), H.escape(d.detail)]
                    for d in self.per_request.values()]
            body += H.table(["request", "position", "what", "detail"], rows)
        return H.wrap(body)


@dataclass
class _Point:
    step_index: int | None
    token: int | None = None
    logits: torch.Tensor | None = None
    states: dict[str, torch.Tensor] | None = None


def _collect(trace: Iterable) -> tuple[dict[str, dict[int, _Point]], dict[str, int | None]]:
    """request id -> position -> what the trace saw there (first occurrence wins, e.g. over a
    preempted request's recompute); and each request's first step."""
    points: dict[str, dict[int, _Point]] = {}
    first_step: dict[str, int | None] = {}
    for rec in trace:
        if getattr(rec, "is_warmup", False) or not getattr(rec, "scheduled", None):
            continue
        states = list(getattr(rec, "states", None) or [])
        row_ids = rec.request_ids
        spec = getattr(rec, "spec", {})
        for s in rec.scheduled:
            rid = s.request_id
            first_step.setdefault(rid, rec.step_index)
            row = spec.get(rid)
            if row is not None and row.drafts:      # a verify row: a position per kept token
                start = int(s.num_computed_before) + 1
                for i, token in enumerate(row.target[:row.num_accepted]):
                    pt = points.setdefault(rid, {}).setdefault(start + i, _Point(rec.step_index))
                    if pt.token is None and rid in rec.kept_token_ids:
                        pt.token = int(token)
                    if rec.logits is not None and pt.logits is None:
                        pt.logits = rec.kept_logits(rid)[i].detach().float().cpu()
                p = start + row.num_accepted - 1     # the recurrent states: those after its last kept token
            else:
                p = int(s.num_computed_before) + int(s.num_tokens)
            pt = points.setdefault(rid, {}).get(p)
            if pt is None:
                pt = points[rid][p] = _Point(rec.step_index)
            if rid in rec.kept_token_ids and pt.token is None:
                pt.token = int(rec.kept_token_ids[rid])
            if rec.logits is not None and pt.logits is None:
                r = (rec.input_batch.req_ids.index(rid) if rec.input_batch is not None else row_ids.index(rid))
                pt.logits = rec.logits[int(rec.input_batch.cu_num_logits_np[r])].detach().float().cpu() \
                    if rec.input_batch is not None else rec.logits[r].detach().float().cpu()
            if states and pt.states is None:
                got = {}
                for ls in states:
                    if rid in ls.request_ids:
                        for name, t in ls.of(rid, "after").items():
                            got[f"{ls.layer_name}.{name}"] = t.detach().float().cpu()
                pt.states = got
    return points, first_step


def diff_traces(a, b, *, atol: float = 1e-5, rtol: float = 1e-4) -> TraceDiff:
    """Where two traces (Trace or any iterable of StepRecords) of the same workload part, aligned
    on (request id, position) rather than on steps. At each position of a request, in position
    order: the recurrent states after the step (when both traces hold states, inspect="full"),
    the logits row, then the kept token; a value differs when |a - b| > atol + rtol * |b| anywhere.
    Also reported: requests present in one trace only ("missing request") and kept tokens
    present in one only ("missing token", e.g. one request stopped earlier)."""
    pa, first_a = _collect(a)
    pb, first_b = _collect(b)
    out = TraceDiff(identical=True, tolerance=(atol, rtol))
    found: dict[str, Difference] = {}
    for rid in list(first_a) + [r for r in first_b if r not in first_a]:
        if rid not in pb or rid not in pa:
            found[rid] = Difference(rid, None, first_a.get(rid), first_b.get(rid), "missing request",
                                    "only in trace " + ("a" if rid in pa else "b"))
            continue
        out.num_requests_compared += 1
        A, B = pa[rid], pb[rid]
        for p in sorted(set(A) | set(B)):
            x, y = A.get(p), B.get(p)
            if x is None or y is None:
                one = x or y
                if one.token is not None:
                    found[rid] = Difference(rid, p, x and x.step_index, y and y.step_index, "missing token",
                                            f"token {one.token} only in trace {'a' if x else 'b'}")
                    break
                continue
            diff: tuple[str, str] | None = None
            compared = False
            if x.states and y.states:
                for name in x.states:
                    if name not in y.states:
                        continue
                    sx, sy = x.states[name], y.states[name]
                    out.num_states_compared += 1
                    compared = True
                    if sx.shape != sy.shape or bool(exceeds(sx, sy, atol, rtol).any()):
                        diff = (f"state {name}", f"max |diff| {absmax(sx - sy):.1e}"
                                if sx.shape == sy.shape else f"shape {tuple(sx.shape)} vs {tuple(sy.shape)}")
                        break
            if diff is None and x.logits is not None and y.logits is not None:
                out.num_logits_compared += 1
                compared = True
                if bool(exceeds(x.logits, y.logits, atol, rtol).any()):
                    diff = ("logits", f"max |diff| {absmax(x.logits - y.logits):.1e}")
            if diff is None and (x.token is not None or y.token is not None):
                if x.token is None or y.token is None:
                    diff = ("missing token", f"token {x.token if x.token is not None else y.token} only "
                                             f"in trace {'a' if x.token is not None else 'b'}")
                else:
                    out.num_tokens_compared += 1
                    compared = True
                    if x.token != y.token:
                        diff = ("token", f"token {x.token} vs {y.token}")
            out.num_positions_compared += int(compared)
            if diff is not None:
                found[rid] = Difference(rid, p, x.step_index, y.step_index, *diff)
                break
    out.per_request = found
    if found:
        rank = {rid: i for i, rid in enumerate(list(first_a) + list(first_b))}
        inf = float("inf")

        def key(d: Difference):
            return (d.step_a if d.step_a is not None else inf,
                    d.step_b if d.step_b is not None else inf, rank.get(d.request_id, 0))
        first = min(found.values(), key=key)
        out.identical = False
        out.request_id, out.position, out.step_a, out.step_b = (first.request_id, first.position,
                                                                first.step_a, first.step_b)
        out.what, out.detail = first.what, first.detail
    return out
