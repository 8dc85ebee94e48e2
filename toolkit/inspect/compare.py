"""Where does a run part from its reference? Two tools:

`compare_with_hf(llm, prompts)`: run prompts through the LLM step by step, capture every block's
output (the residual stream after the layer), the final norm's output and the logits, and compare
them, step by step and layer by layer, with HF transformers run on the same weights (fp32, CPU, no
cache, on the exact tokens our run consumed). The answer names the first (step, layer, request,
position) where the two differ by more than `atol + rtol * |hf|`.

`diff_traces(a, b)`: where two traces of the same workload part (a fault planted in one, chunked vs
unchunked prefill, ...). Steps need not align: both traces are keyed on (request id, position).

HF `output_hidden_states` conventions (transformers 5.x, read in `utils/output_capturing.py` and
each `modeling_*.py`):
  - Llama, Bamba, Jamba, Lfm2 (`@capture_outputs`, a hook on each decoder layer): entry 0 = input
    of layer 0 (the embeddings), entry i = output of layer i-1, and the LAST entry (which would be
    layer L-1's output) is overwritten with `last_hidden_state`, i.e. after the final norm.
    So layer L-1's pre-norm output is not among them; we take it with a forward hook on HF's
    module of the same path (parameter names, hence module paths, equal the checkpoint's).
  - Mamba, Mamba2, FalconMamba (hand-written loop in `MambaModel.forward` etc.): NO embeddings
    entry; entry i = output of layer i for i < L, entry L = output of `norm_f`.
Both have L + 1 entries; which one a model follows is detected per run (is entry 0 the input of
the first block, i.e. the embeddings, times a multiplier in Falcon-H1 and Granite?), so an older
transformers whose Mamba puts the embeddings first works too.
"""
from __future__ import annotations

import contextlib
import html
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

__all__ = ["DivergenceReport", "TraceDiff", "Difference", "compare_with_hf", "diff_traces"]

LOGITS = "logits"
FINAL_NORM = "final_norm"


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------

def _exceeds(ours: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    """bool, same shape: |ours - ref| > atol + rtol * |ref|; NaN/inf anywhere counts as exceeding."""
    return ~((ours - ref).abs() <= atol + rtol * ref.abs())


def _max(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return float("nan")
    return max(a, b)


def _absmax(t: torch.Tensor) -> float:
    if t.numel() == 0:
        return 0.0
    if torch.isnan(t).any():
        return float("nan")
    return float(t.abs().max())


def _fmt(x: float) -> str:
    return f"{x:.2e}" if isinstance(x, float) else str(x)


_TABLE = ("border-collapse:collapse;font-family:monospace;font-size:12px;"
          "border:1px solid #d0d7de;margin:4px 0")
_TH = "text-align:left;padding:3px 8px;border:1px solid #d0d7de;background:#f6f8fa"
_TH0 = "text-align:left;padding:3px 8px;border:1px solid #d0d7de"
_TD = "text-align:left;padding:3px 8px;border:1px solid #d0d7de"
_OK = "background:#eaf7ea"
_BAD = "background:#fdecea"


def _html_table(title: str, ok: bool, rows: list[tuple[str, str]], extra: str = "") -> str:
    head = f'<tr><th colspan="2" style="{_TH0};{_OK if ok else _BAD}">{html.escape(title)}</th></tr>'
    body = "".join(f'<tr><td style="{_TD}">{html.escape(k)}</td><td style="{_TD}">{html.escape(v)}</td></tr>'
                   for k, v in rows)
    return f'<table style="{_TABLE}">{head}{body}</table>{extra}'


# ------------------------------------------------------------------------------------------------
# compare_with_hf
# ------------------------------------------------------------------------------------------------

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
        vals = list(self.per_layer_max_diff.values())
        out = 0.0
        for v in vals:
            out = _max(out, v)
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
        rows: list[tuple[str, str]] = []
        if self.diverged:
            rows += [("step", str(self.step_index)), ("request", repr(self.request_id)),
                     ("layer", f"{self.layer} ({self.layer_name})"), ("position", str(self.position)),
                     ("max |diff|", _fmt(self.max_abs_diff)), ("max |hf|", _fmt(self.max_abs_ref))]
        rows += [("tolerance", f"atol {atol:g} + rtol {rtol:g} * |hf|"),
                 ("compared", f"{self.num_steps} steps, {self.num_tokens_compared} tokens, "
                              f"{self.num_layers} layers")]
        title = "first divergence" if self.diverged else "no divergence"
        per = "".join(
            f'<tr><td style="{_TD}{";" + _BAD if name == self.layer_name or (name == LOGITS and self.layer == LOGITS) else ""}">'
            f'{html.escape(name)}</td><td style="{_TD}">{_fmt(v)}</td></tr>'
            for name, v in self.per_layer_max_diff.items())
        per_table = (f'<table style="{_TABLE}"><tr><th style="{_TH}">layer</th>'
                     f'<th style="{_TH}">max |diff| (whole run)</th></tr>{per}</table>')
        return _html_table(title, not self.diverged, rows, per_table)


@dataclass
class _HFRef:
    layers: list[torch.Tensor | None]   # per block: [n, H] (None: not available)
    final: torch.Tensor                 # [n, H] after the final norm
    logits: torch.Tensor                # [n, V]


def _default_params():
    from toolkit.sampling import SamplingParams
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def quiet_transformers():
    """No progress bars or fallback-kernel warnings from transformers while the reference runs
    (they would land in the user's notebook); the previous settings come back on exit."""
    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _load_reference(llm, reference: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    if isinstance(reference, torch.nn.Module):
        return reference.eval()
    if reference is not None:
        return AutoModelForCausalLM.from_pretrained(os.fspath(reference), dtype=torch.float32).eval()
    from toolkit.models import PRESETS, load_model, save_hf_folder
    name = os.fspath(llm.model_name)
    if name in PRESETS:              # presets win over folders of the same name (as load_model)
        loaded = load_model(name, dtype=torch.float32, device="cpu", seed=llm.cfg.seed)
        with tempfile.TemporaryDirectory(prefix="runnerscope_ref_") as tmp:
            save_hf_folder(loaded.model, tmp)
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
            # materialise every tensor before the folder goes away (a lazy/mmapped load)
            for p in hf.parameters():
                p.data = p.data.clone()
        return hf.eval()
    from toolkit.models import model_folder
    folder = model_folder(name) or name          # a shipped demo model's folder, or the folder itself
    return AutoModelForCausalLM.from_pretrained(os.fspath(folder), dtype=torch.float32).eval()


def _as_prompt(p: Any) -> Any:
    if isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
        return {"prompt_token_ids": list(p)}
    if isinstance(p, torch.Tensor):
        return {"prompt_token_ids": [int(t) for t in p.reshape(-1)]}
    return p


@torch.inference_mode()
def _run_hf(hf: torch.nn.Module, tokens: list[int], layer_paths: list[str]) -> tuple[_HFRef, str]:
    """One request through HF, uncached, with output_hidden_states; maps the entries onto our
    blocks + final norm (see the module docstring) and returns (reference, convention)."""
    dev = next(hf.parameters()).device
    ids = torch.tensor([tokens], device=dev)
    L = len(layer_paths)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    try:
        # the last block's own output: hidden by the capture_outputs convention, so hook it
        try:
            last = hf.get_submodule(layer_paths[-1])
        except AttributeError:
            last = None
        if last is not None:
            def grab(_m, _a, out):
                captured[L - 1] = (out[0] if isinstance(out, tuple) else out)[0].float().cpu()
            handles.append(last.register_forward_hook(grab))
        try:        # the first block's input: the embeddings, times a multiplier in some models
            first = hf.get_submodule(layer_paths[0])
        except AttributeError:
            first = None
        if first is not None:
            def grab_input(_m, args, kwargs):
                h = args[0] if args else kwargs.get("hidden_states")
                if isinstance(h, torch.Tensor):
                    captured[-1] = h[0].float().cpu()
            handles.append(first.register_forward_pre_hook(grab_input, with_kwargs=True))
        out = hf(ids, use_cache=False, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    hs = [h[0].float().cpu() for h in out.hidden_states]
    if len(hs) != L + 1:
        raise RuntimeError(f"HF returned {len(hs)} hidden states for {L} layers; expected {L + 1}")
    emb = captured.get(-1, hf.get_input_embeddings()(ids)[0].float().cpu())
    if hs[0].shape == emb.shape and torch.allclose(hs[0], emb, rtol=0, atol=1e-6 * max(1.0, _absmax(emb))):
        # embeddings first: entry i+1 = layer i's output for i < L-1, last = final norm
        layers: list[torch.Tensor | None] = [hs[i + 1] for i in range(L - 1)] + [captured.get(L - 1)]
        conv = ("hidden_states[0] = embeddings, [i+1] = layer i (i < L-1), [-1] = final norm; "
                "layer L-1 from a hook on HF's module")
    else:
        layers = [hs[i] for i in range(L)]
        conv = "hidden_states[i] = layer i (no embeddings entry), [-1] = final norm"
    return _HFRef(layers, hs[-1], out.logits[0].float().cpu()), conv


def compare_with_hf(llm, prompts, sampling_params=None, *, reference=None,
                    atol: float = 1e-4, rtol: float = 1e-3) -> DivergenceReport:
    """Run `prompts` (str, {"prompt_token_ids": [...]}, or a list of ints; one or a list) through
    `llm` step by step and compare every block's output, the final norm's output and the logits
    with HF transformers on the reference weights (see the module docstring).

    sampling_params: one SamplingParams or a list (default: greedy, ignore_eos, max_tokens 8).
    reference: an HF model, an HF folder, or None for the weights the LLM was loaded from (a
    preset's seeded weights are rebuilt; so in-memory edits of `llm.model` show as divergences).
    The LLM must be idle (no unfinished requests)."""
    if llm.has_unfinished_requests():
        raise RuntimeError("compare_with_hf needs an idle LLM: requests are still running")
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                           and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    prompts = [_as_prompt(p) for p in prompts]
    if sampling_params is None:
        sampling_params = _default_params()
    params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
              else [sampling_params] * len(prompts))
    if len(params) != len(prompts):
        raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")

    model = llm.model
    body = model.body
    blocks = list(body.layers)
    final_norm = getattr(body, body.final_norm_name)
    names = {id(m): n for n, m in model.named_modules()}
    layer_paths = [names[id(b)] for b in blocks]
    final_path = names[id(final_norm)]
    L = len(blocks)

    # ---- our run, with hooks ------------------------------------------------------------------
    pending: dict[Any, list[torch.Tensor]] = {}

    def hook_for(key):
        def hook(_m, _a, out):
            t = out[0] if isinstance(out, tuple) else out
            pending.setdefault(key, []).append(t.detach().float().cpu().clone())
        return hook

    steps: list[tuple[Any, dict[Any, torch.Tensor]]] = []
    handles = [b.register_forward_hook(hook_for(i)) for i, b in enumerate(blocks)]
    handles.append(final_norm.register_forward_hook(hook_for(FINAL_NORM)))
    try:
        for p, sp in zip(prompts, params):
            llm.add_request(p, sp)
        while llm.has_unfinished_requests():
            pending.clear()
            rec = llm.step()
            if rec.input_batch is None or rec.input_batch.num_tokens == 0:
                continue
            T = rec.input_batch.num_tokens
            caps = {}
            for key, outs in pending.items():
                t = outs[-1]        # one forward per step; the last one if a step ever ran more
                if t.shape[0] < T:
                    raise RuntimeError(f"step {rec.step_index}: captured {tuple(t.shape)} at {key!r} "
                                       f"for a batch of {T} tokens")
                caps[key] = t[:T]
            steps.append((rec, caps))
    finally:
        for h in handles:
            h.remove()

    # ---- the tokens each request consumed, position by position -------------------------------
    seen: dict[str, dict[int, int]] = {}
    for rec, _ in steps:
        b = rec.input_batch
        qsl = np.asarray(b.query_start_loc_np)
        ids = b.input_ids.detach().cpu().tolist()
        pos = b.positions.detach().cpu().tolist()
        for r, rid in enumerate(b.req_ids):
            d = seen.setdefault(rid, {})
            for t in range(int(qsl[r]), int(qsl[r + 1])):
                d.setdefault(int(pos[t]), int(ids[t]))
    tokens: dict[str, list[int]] = {}
    for rid, d in seen.items():
        n = max(d) + 1
        if sorted(d) != list(range(n)):
            raise RuntimeError(f"request {rid!r}: positions {sorted(set(range(n)) - set(d))} never ran")
        tokens[rid] = [d[i] for i in range(n)]

    # ---- HF on every request's full sequence --------------------------------------------------
    refs: dict[str, _HFRef] = {}
    convention = ""
    with quiet_transformers():
        hf = _load_reference(llm, reference)
        for rid, toks in tokens.items():
            refs[rid], convention = _run_hf(hf, toks, layer_paths)

    # ---- walk: step order, then layer order, then row order -----------------------------------
    report = DivergenceReport(diverged=False, tolerance=(atol, rtol), num_layers=L,
                              hf_convention=convention, tokens=tokens)
    per_layer: dict[str, float] = {n: 0.0 for n in layer_paths + [final_path, LOGITS]}
    order: list[tuple[Any, str]] = [(i, layer_paths[i]) for i in range(L)] + [(FINAL_NORM, final_path)]
    skipped: set[str] = set()
    for rec, caps in steps:
        b = rec.input_batch
        qsl = np.asarray(b.query_start_loc_np)
        pos = b.positions.detach().cpu().numpy()
        row_of_token = np.repeat(np.arange(len(b.req_ids)), np.diff(qsl))
        spans = [(rid, int(qsl[r]), int(qsl[r + 1])) for r, rid in enumerate(b.req_ids)]
        report.num_steps += 1
        report.num_tokens_compared += int(qsl[-1])
        for key, path in order:
            if key not in caps:
                skipped.add(path)
                continue
            ref_parts = []
            for rid, s, e in spans:
                src = refs[rid].final if key == FINAL_NORM else refs[rid].layers[key]
                if src is None:
                    ref_parts = None
                    break
                ref_parts.append(src[int(pos[s]):int(pos[e - 1]) + 1])
            if ref_parts is None:
                skipped.add(path)
                continue
            ref = torch.cat(ref_parts)
            ours = caps[key]
            diff = (ours - ref).abs()
            per_layer[path] = _max(per_layer[path], _absmax(diff))
            bad_tok = _exceeds(ours, ref, atol, rtol).any(dim=1)
            if not report.diverged and bool(bad_tok.any()):
                t = int(torch.nonzero(bad_tok)[0])
                report.diverged = True
                report.step_index = rec.step_index
                report.request_id = b.req_ids[int(row_of_token[t])]
                report.layer = key
                report.layer_name = path
                report.position = int(pos[t])
                report.max_abs_diff = _absmax(diff[t])
                report.max_abs_ref = _absmax(ref[t])
        # logits of every row, at the row's last token
        if rec.logits is not None:
            ours_l = rec.logits.detach().float().cpu()
            for r, (rid, s, e) in enumerate(spans):
                p = int(pos[e - 1])
                ref = refs[rid].logits[p]
                d = (ours_l[r] - ref).abs()
                per_layer[LOGITS] = _max(per_layer[LOGITS], _absmax(d))
                if not report.diverged and bool(_exceeds(ours_l[r], ref, atol, rtol).any()):
                    report.diverged = True
                    report.step_index = rec.step_index
                    report.request_id = rid
                    report.layer = LOGITS
                    report.layer_name = names.get(id(getattr(model, "lm_head", None)), "lm_head")
                    report.position = p
                    report.max_abs_diff = _absmax(d)
                    report.max_abs_ref = _absmax(ref)
    report.per_layer_max_diff = {k: v for k, v in per_layer.items() if k not in skipped}
    if not report.diverged:
        report.max_abs_diff = report.overall_max_diff
    return report


# ------------------------------------------------------------------------------------------------
# diff_traces
# ------------------------------------------------------------------------------------------------

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
        rows: list[tuple[str, str]] = []
        if not self.identical:
            rows += [("request", repr(self.request_id)), ("position", str(self.position)),
                     ("step in a / b", f"{self.step_a} / {self.step_b}"), ("what", str(self.what)),
                     ("detail", str(self.detail))]
        rows += [("compared", f"{self.num_requests_compared} requests, {self.num_positions_compared} "
                              f"positions: {self.num_tokens_compared} tokens, {self.num_logits_compared} "
                              f"logits, {self.num_states_compared} states"),
                 ("tolerance", f"atol {atol:g} + rtol {rtol:g} * |b|")]
        extra = ""
        if len(self.per_request) > 1:
            per = "".join(f'<tr><td style="{_TD}">{html.escape(repr(d.request_id))}</td>'
                          f'<td style="{_TD}">{d.position}</td><td style="{_TD}">{html.escape(d.what)}</td>'
                          f'<td style="{_TD}">{html.escape(d.detail)}</td></tr>'
                          for d in self.per_request.values())
            extra = (f'<table style="{_TABLE}"><tr><th style="{_TH}">request</th><th style="{_TH}">'
                     f'position</th><th style="{_TH}">what</th><th style="{_TH}">detail</th></tr>'
                     f'{per}</table>')
        return _html_table("traces agree" if self.identical else "traces part", self.identical,
                           rows, extra)


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
        for row, s in enumerate(rec.scheduled):
            rid = s.request_id
            first_step.setdefault(rid, rec.step_index)
            p = int(s.num_computed_before) + int(s.num_tokens)
            pt = points.setdefault(rid, {}).get(p)
            if pt is None:
                pt = points[rid][p] = _Point(rec.step_index)
            if rid in rec.kept_token_ids and pt.token is None:
                pt.token = int(rec.kept_token_ids[rid])
            if rec.logits is not None and pt.logits is None:
                r = (rec.input_batch.req_ids.index(rid) if rec.input_batch is not None else row_ids.index(rid))
                pt.logits = rec.logits[r].detach().float().cpu()
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
                    if sx.shape != sy.shape or bool(_exceeds(sx, sy, atol, rtol).any()):
                        diff = (f"state {name}", f"max |diff| {_absmax(sx - sy):.1e}"
                                if sx.shape == sy.shape else f"shape {tuple(sx.shape)} vs {tuple(sy.shape)}")
                        break
            if diff is None and x.logits is not None and y.logits is not None:
                out.num_logits_compared += 1
                compared = True
                if bool(_exceeds(x.logits, y.logits, atol, rtol).any()):
                    diff = ("logits", f"max |diff| {_absmax(x.logits - y.logits):.1e}")
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
