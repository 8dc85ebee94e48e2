"""`compare_with_hf(llm, prompts)`: where does a run part from HF transformers?

Four steps: run the prompts through the LLM step by step with a forward hook on every block and
on the final norm (the residual stream after each layer); collect the tokens each request really
consumed, position by position; run HF (fp32, CPU, no cache) on those exact tokens
(`hf_reference`); then walk the steps in order, layers in order (blocks, final norm, logits),
rows in order, and name the first (step, layer, request, position) where the two differ by more
than `atol + rtol * |hf|`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from toolkit.inspect import html as H
from toolkit.inspect.hf_reference import HFReference, load_reference, quiet_transformers, run_hf
from toolkit.inspect.tolerance import absmax, exceeds, format_sci, nan_max
from toolkit.sampling import SamplingParams

LOGITS = "logits"
FINAL_NORM = "final_norm"


@dataclass
class DivergenceReport:
    """Result of `compare_with_hf`. When `diverged`, step_index / request_id / layer / layer_name /
    position / max_abs_diff / max_abs_ref describe the FIRST divergence (step order, then layer
    order -- blocks, then "final_norm", then "logits" --, then token row order); max_abs_diff and
    max_abs_ref are those of the offending token row. `layer` is the block index (int),
    "final_norm" or "logits"; `layer_name` the module path in the model ("model.layers.2",
    "backbone.norm_f", "lm_head"). `per_layer_max_diff` maps each layer name (and "logits") to its
    max |ours - hf| over the whole run."""
    diverged: bool
    step_index: int | None = None
    request_id: str | None = None
    layer: int | str | None = None
    layer_name: str | None = None
    position: int | None = None
    max_abs_diff: float | None = None
    max_abs_ref: float | None = None
    tolerance: tuple[float, float] = (1e-4, 1e-3)        # (atol, rtol)
    per_layer_max_diff: dict[str, float] = field(default_factory=dict)
    num_steps: int = 0
    num_tokens_compared: int = 0
    num_layers: int = 0
    hf_convention: str = ""          # how HF's hidden_states were mapped onto our layers
    tokens: dict[str, list[int]] = field(default_factory=dict)   # tokens each request consumed

    @property
    def overall_max_diff(self) -> float:
        out = 0.0
        for v in self.per_layer_max_diff.values():
            out = nan_max(out, v)
        return out

    def __str__(self) -> str:
        atol, rtol = self.tolerance
        if not self.diverged:
            return (f"no divergence over {self.num_steps} steps, {self.num_tokens_compared} tokens, "
                    f"{self.num_layers} layers (max diff {self.overall_max_diff:.1e}; "
                    f"tol atol {atol:g} + rtol {rtol:g} * |hf|)")
        where = (f"layer {self.layer} ({self.layer_name})" if isinstance(self.layer, int)
                 else f"{self.layer} ({self.layer_name})")
        return (f"first divergence at step {self.step_index}, request {self.request_id!r}, {where}, "
                f"position {self.position}: max |diff| {self.max_abs_diff:.1e} > tol "
                f"(atol {atol:g} + rtol {rtol:g} * |hf|, max |hf| {self.max_abs_ref:.1e})")

    __repr__ = __str__

    def _repr_html_(self) -> str:
        atol, rtol = self.tolerance
        facts: list[tuple[str, str]] = []
        if self.diverged:
            facts += [("step", str(self.step_index)), ("request", repr(self.request_id)),
                      ("layer", f"{self.layer} ({self.layer_name})"), ("position", str(self.position)),
                      ("max |diff|", format_sci(self.max_abs_diff)), ("max |hf|", format_sci(self.max_abs_ref))]
        facts += [("tolerance", f"atol {atol:g} + rtol {rtol:g} * |hf|"),
                  ("compared", f"{self.num_steps} steps, {self.num_tokens_compared} tokens, "
                               f"{self.num_layers} layers")]
        names = list(self.per_layer_max_diff)
        bad = {i for i, name in enumerate(names)
               if name == self.layer_name or (name == LOGITS and self.layer == LOGITS)}
        per_layer = [[H.escape(name), H.escape(format_sci(v))] for name, v in self.per_layer_max_diff.items()]
        return H.wrap(H.verdict("first divergence" if self.diverged else "no divergence", not self.diverged)
                      + H.table(None, [[H.escape(k), H.escape(v)] for k, v in facts])
                      + H.table(["layer", "max |diff| (whole run)"], per_layer, bad))


# ---- what is compared ----------------------------------------------------------------------------
class _Site(NamedTuple):
    """One place compared: a block, the final norm or the logits."""
    layer: int | str        # block index, FINAL_NORM or LOGITS
    name: str               # module path in the model: "model.layers.2", "backbone.norm_f", "lm_head"
    column: str             # its key in per_layer_max_diff (the path; "logits" for the logits)


@dataclass
class _Sites:
    modules: list[torch.nn.Module]      # blocks, then the final norm (hooked in our run)
    hidden: list[_Site]                 # the same, in walk order
    logits: _Site

    @classmethod
    def of(cls, model: torch.nn.Module) -> _Sites:
        body = model.body
        blocks = list(body.layers)
        final_norm = getattr(body, body.final_norm_name)
        names = {id(m): n for n, m in model.named_modules()}
        hidden = [_Site(i, names[id(b)], names[id(b)]) for i, b in enumerate(blocks)]
        hidden.append(_Site(FINAL_NORM, names[id(final_norm)], names[id(final_norm)]))
        head = names.get(id(getattr(model, "lm_head", None)), "lm_head")
        return cls(blocks + [final_norm], hidden, _Site(LOGITS, head, LOGITS))

    @property
    def block_paths(self) -> list[str]:
        return [s.name for s in self.hidden[:-1]]


@dataclass
class _Step:
    """One step of our run that computed tokens: its record and what the hooks captured."""
    record: Any
    outputs: dict[int | str, torch.Tensor]      # site.layer -> [T, H], token rows in batch order
    spans: list[tuple[str, int, int]]           # per batch row: (request id, first token row, end)
    positions: np.ndarray                       # [T] position of each token row
    input_ids: list[int]                        # [T]
    num_tokens: int                             # T

    @classmethod
    def of(cls, rec: Any, outputs: dict[int | str, torch.Tensor]) -> _Step:
        b = rec.input_batch
        qsl = np.asarray(b.query_start_loc_np)
        spans = [(rid, int(qsl[r]), int(qsl[r + 1])) for r, rid in enumerate(b.req_ids)]
        return cls(rec, outputs, spans, b.positions.detach().cpu().numpy(), b.input_ids.detach().cpu().tolist(),
                   int(qsl[-1]))

    def token_requests(self) -> list[str]:
        """The request id of each token row."""
        return [rid for rid, s, e in self.spans for _ in range(s, e)]


# ---- 1. our run, with hooks ----------------------------------------------------------------------
def _as_prompt(p: Any) -> Any:
    if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
        return {"prompt_token_ids": list(p)}
    if isinstance(p, torch.Tensor):
        return {"prompt_token_ids": [int(t) for t in p.reshape(-1)]}
    return p


def _requests(prompts: Any, sampling_params: Any) -> tuple[list[Any], list[SamplingParams]]:
    """The prompts as a list of engine prompts, and one SamplingParams each."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                           and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    prompts = [_as_prompt(p) for p in prompts]
    if sampling_params is None:
        sampling_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
              else [sampling_params] * len(prompts))
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
    return prompts, params


def _run_ours(llm: Any, prompts: list[Any], params: list[SamplingParams], sites: _Sites) -> list[_Step]:
    """Step the LLM until the requests finish, capturing every hooked module's output per step."""
    pending: dict[int | str, list[torch.Tensor]] = {}

    def hook_for(key: int | str):
        def hook(_m, _a, out):
            t = out[0] if isinstance(out, tuple) else out
            pending.setdefault(key, []).append(t.detach().float().cpu().clone())
        return hook

    steps: list[_Step] = []
    handles = [m.register_forward_hook(hook_for(s.layer)) for m, s in zip(sites.modules, sites.hidden)]
    try:
        for p, sp in zip(prompts, params):
            llm.add_request(p, sp)
        while llm.has_unfinished_requests():
            pending.clear()
            rec = llm.step()
            if rec.input_batch is None or rec.input_batch.num_tokens == 0:
                continue
            T = rec.input_batch.num_tokens
            outputs = {}
            for key, outs in pending.items():
                t = outs[-1]        # one forward per step; the last one if a step ever ran more
                if t.shape[0] < T:
                    raise RuntimeError(f"step {rec.step_index}: captured {tuple(t.shape)} at {key!r} "
                                       f"for a batch of {T} tokens")
                outputs[key] = t[:T]
            steps.append(_Step.of(rec, outputs))
    finally:
        for h in handles:
            h.remove()
    return steps


# ---- 2. the tokens each request consumed ---------------------------------------------------------
def _consumed_tokens(steps: Sequence[_Step]) -> dict[str, list[int]]:
    """Request id -> its tokens, position by position (the first time a position ran)."""
    seen: dict[str, dict[int, int]] = {}
    for step in steps:
        for rid, s, e in step.spans:
            d = seen.setdefault(rid, {})
            for t in range(s, e):
                d.setdefault(int(step.positions[t]), int(step.input_ids[t]))
    tokens: dict[str, list[int]] = {}
    for rid, d in seen.items():
        n = max(d) + 1
        if sorted(d) != list(range(n)):
            raise RuntimeError(f"request {rid!r}: positions {sorted(set(range(n)) - set(d))} never ran")
        tokens[rid] = [d[i] for i in range(n)]
    return tokens


# ---- 3. HF on every request's full sequence ------------------------------------------------------
def _run_reference(llm: Any, reference: Any, tokens: dict[str, list[int]],
                   block_paths: list[str]) -> dict[str, HFReference]:
    with quiet_transformers():
        hf = load_reference(llm, reference)
        return {rid: run_hf(hf, toks, block_paths) for rid, toks in tokens.items()}


# ---- 4. the walk: the first divergence -----------------------------------------------------------
class _Walk:
    """Compares in walk order; keeps each site's max |diff| and the FIRST row past tolerance."""

    def __init__(self, report: DivergenceReport, sites: _Sites):
        self.report = report
        self.atol, self.rtol = report.tolerance
        self.per_site = {s.column: 0.0 for s in sites.hidden + [sites.logits]}
        self.skipped: set[str] = set()

    def compare(self, step_index: int | None, site: _Site, ours: torch.Tensor, ref: torch.Tensor,
                requests: Sequence[str], positions: Sequence[int]) -> None:
        """ours, ref: [rows, n]; `requests` and `positions` name each row."""
        diff = (ours - ref).abs()
        self.per_site[site.column] = nan_max(self.per_site[site.column], absmax(diff))
        if self.report.diverged:
            return
        bad = exceeds(ours, ref, self.atol, self.rtol).any(dim=1)
        if not bool(bad.any()):
            return
        t = int(torch.nonzero(bad)[0])
        r = self.report
        r.diverged, r.step_index, r.request_id = True, step_index, requests[t]
        r.layer, r.layer_name, r.position = site.layer, site.name, int(positions[t])
        r.max_abs_diff, r.max_abs_ref = absmax(diff[t]), absmax(ref[t])

    def step(self, step: _Step, refs: dict[str, HFReference], sites: _Sites) -> None:
        """Every hidden site of the step over its token rows, then the logits of every row at
        the row's last token."""
        rec = step.record
        self.report.num_steps += 1
        self.report.num_tokens_compared += step.num_tokens
        for site in sites.hidden:
            ref = _reference_rows(step, refs, site.layer)
            if site.layer not in step.outputs or ref is None:
                self.skipped.add(site.column)
                continue
            self.compare(rec.step_index, site, step.outputs[site.layer], ref, step.token_requests(),
                         step.positions)
        if rec.logits is not None:
            rows = [(rid, int(step.positions[e - 1])) for rid, _, e in step.spans]
            ref = torch.stack([refs[rid].logits[p] for rid, p in rows])
            ours = rec.logits.detach().float().cpu()[:len(rows)]
            self.compare(rec.step_index, sites.logits, ours, ref, [rid for rid, _ in rows], [p for _, p in rows])

    def finish(self) -> DivergenceReport:
        self.report.per_layer_max_diff = {k: v for k, v in self.per_site.items() if k not in self.skipped}
        if not self.report.diverged:
            self.report.max_abs_diff = self.report.overall_max_diff
        return self.report


def _reference_rows(step: _Step, refs: dict[str, HFReference], layer: int | str) -> torch.Tensor | None:
    """HF's rows for the step's token rows at a block or the final norm; None where HF has none."""
    parts = []
    for rid, s, e in step.spans:
        src = refs[rid].final if layer == FINAL_NORM else refs[rid].layers[layer]
        if src is None:
            return None
        parts.append(src[int(step.positions[s]):int(step.positions[e - 1]) + 1])
    return torch.cat(parts)


def compare_with_hf(llm: Any, prompts: Any, sampling_params: Any = None, *, reference: Any = None,
                    atol: float = 1e-4, rtol: float = 1e-3) -> DivergenceReport:
    """Run `prompts` (str, {"prompt_token_ids": [...]}, or a list of ints; one or a list) through
    `llm` step by step and compare every block's output, the final norm's output and the logits
    with HF transformers on the reference weights (see `hf_reference` for how HF's hidden states
    are read).

    sampling_params: one SamplingParams or a list (default: greedy, ignore_eos, max_tokens 8).
    reference: an HF model, an HF folder, or None for the weights the LLM was loaded from (a
    preset's seeded weights are rebuilt; so in-memory edits of `llm.model` show as divergences).
    The LLM must be idle (no unfinished requests)."""
    if llm.has_unfinished_requests():
        raise RuntimeError("compare_with_hf needs an idle LLM: requests are still running")
    prompts, params = _requests(prompts, sampling_params)
    sites = _Sites.of(llm.model)
    steps = _run_ours(llm, prompts, params, sites)
    tokens = _consumed_tokens(steps)
    refs = _run_reference(llm, reference, tokens, sites.block_paths)
    convention = next(reversed(refs.values())).convention if refs else ""
    walk = _Walk(DivergenceReport(diverged=False, tolerance=(atol, rtol), num_layers=len(sites.block_paths),
                                  hf_convention=convention, tokens=tokens), sites)
    for step in steps:
        walk.step(step, refs, sites)
    return walk.finish()
