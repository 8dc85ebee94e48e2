"""Text and HTML views of the runner's records: pure functions, object -> str.

Design:
- Every view is a plain function of the object it shows; nothing here keeps state, draws, or
  imports a widget or plotting library. The notebook reprs (`__repr__`, `_repr_html_`) installed
  by `install_reprs()` are thin wrappers around these functions, and the ipywidgets StepInspector
  is meant to reuse the same functions for its panes, so a record reads the same everywhere.
- One generic path for dataclasses: `fields_table(obj)` walks `dataclasses.fields(obj)`, so a
  field added to a metadata class shows up without a change here. Special views (StepRecord,
  GroupMetadata, Trace) only arrange those tables and add a few derived facts.
- Tensors are summarised, never dumped: up to `WHOLE` elements are shown whole; longer ones show
  dtype/shape, min/max (and mean for floats) over finite values, NaN/Inf counts and the first
  `HEAD` values. Computing the stats runs on the tensor's own device; only scalars and the head
  travel to the host.
- The HTML must read the same in JupyterLab (light or dark theme), VS Code (which paints outputs
  on white whatever its theme) and nbconvert exports: explicit light colours and background on
  every element, inline styles only, no <script>, no external CSS, no links.
"""
from __future__ import annotations

import dataclasses
import html
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np
import torch

WHOLE = 16          # tensors with at most this many elements are shown whole
HEAD = 8            # first values shown of a longer tensor or list
MAX_ITEMS = 8       # dict items / non-scalar list items shown before an ellipsis
MAX_STR = 200       # longest plain-text preview of anything else

# ---- styles (inline only; see the module docstring) ------------------------------------------------
_FG, _BG, _LINE, _HEAD_BG = "#1f2328", "#ffffff", "#d0d7de", "#f6f8fa"
_FONT = "-apple-system,BlinkMacSystemFont,'Segoe UI',Helvetica,Arial,sans-serif"
_MONO = "font-family:SFMono-Regular,Menlo,Consolas,'Liberation Mono',monospace"
_WRAP = (f"background:{_BG};color:{_FG};font-family:{_FONT};font-size:12px;line-height:1.45;"
         f"padding:6px 10px;border:1px solid {_LINE};border-radius:6px;text-align:left;"
         "max-width:100%;overflow-x:auto;box-sizing:border-box")
_TABLE = (f"border-collapse:collapse;margin:4px 0 8px 0;background:{_BG};color:{_FG};"
          f"table-layout:auto;font-size:12px;width:auto;{_MONO}")
_TH = (f"text-align:left;padding:2px 8px;border-bottom:1px solid {_LINE};"
       f"background:{_HEAD_BG};color:{_FG};font-weight:600;white-space:nowrap")
_TR = f"background:{_BG};color:{_FG};border-bottom:1px solid #eaeef2"
_TR_BAD = "background:#ffebe9;color:#82071e;border-bottom:1px solid #ffcecb"
_TD = "text-align:left;padding:1px 8px"     # per cell: JupyterLab right-aligns and pads cells
_MUTED = "color:#8c959f;font-style:italic"
_SOFT = "color:#57606a"
_ALERT = "color:#cf222e;font-weight:600"
_TITLE = f"font-weight:600;color:{_FG};margin:6px 0 2px 0"
_SUMMARY = f"cursor:pointer;font-weight:600;color:{_FG};margin:6px 0 2px 0"
_VIOLATION = ("background:#ffebe9;color:#82071e;border-left:3px solid #cf222e;padding:3px 8px;"
              f"margin:2px 0;{_MONO}")


# ---- numbers, tensors, arrays ------------------------------------------------------------------------
def _num(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def _fmt_values(v: Any) -> str:
    """A (nested) list of numbers as `[a, b, ...]`; ints and bools exactly as `str(list)` writes them."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_values(x) for x in v) + "]"
    return _num(v)


def _is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def _as_tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor | None:
    """The data as a torch tensor (numpy shares memory), or None for dtypes torch cannot hold."""
    if isinstance(x, torch.Tensor):
        return x.detach()
    try:
        return torch.from_numpy(np.ascontiguousarray(x))
    except TypeError:
        return None


def dtype_name(x: torch.Tensor | np.ndarray) -> str:
    return str(x.dtype).removeprefix("torch.") if isinstance(x, torch.Tensor) else x.dtype.name


def shape_str(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(n)) for n in shape) + "]"


def array_label(x: torch.Tensor | np.ndarray) -> str:
    """`int32[3]`; a tensor off the CPU carries its device: `int32[3]@cuda:0`."""
    label = dtype_name(x) + shape_str(x.shape)
    if isinstance(x, torch.Tensor) and x.device.type != "cpu":
        label += f"@{x.device}"
    return label


class Summary(NamedTuple):
    """The pieces of a tensor summary, formatted as text or HTML by the callers."""
    label: str                # dtype[shape]
    values: str               # whole contents, or the head with an ellipsis; "" when none shown
    stats: list[str]          # "min -1.5", "max 3", "mean 0.1", "3 True"
    alerts: list[str]         # "2 NaN", "1 +Inf", "1 -Inf", "no finite values"
    note: str = ""            # "empty", "meta tensor, no data", "not numeric"


def _float_stats(flat: torch.Tensor) -> tuple[list[str], list[str]]:
    f = flat if flat.dtype == torch.float64 else flat.float()
    counts = [(int(torch.isnan(f).sum()), "NaN"), (int((f == float("inf")).sum()), "+Inf"),
              (int((f == float("-inf")).sum()), "-Inf")]
    alerts = [f"{n} {what}" for n, what in counts if n]
    finite = f[torch.isfinite(f)]
    if finite.numel() == 0:
        return [], alerts + ["no finite values"]
    stats = [f"min {_num(finite.min().item())}", f"max {_num(finite.max().item())}",
             f"mean {_num(finite.mean().item())}"]
    return stats, alerts


def _stats(flat: torch.Tensor) -> tuple[list[str], list[str]]:
    if flat.dtype == torch.bool:
        return [f"{int(flat.sum())} True"], []
    if flat.is_floating_point():
        return _float_stats(flat)
    if flat.is_complex():
        return [], []
    return [f"min {flat.min().item()}", f"max {flat.max().item()}"], []


def summarize(x: torch.Tensor | np.ndarray, whole: int = WHOLE, head: int = HEAD) -> Summary:
    label = array_label(x)
    t = _as_tensor(x)
    if t is None:       # e.g. a numpy array of strings or objects
        values = _fmt_values(x.tolist()) if x.size <= whole else ""
        return Summary(label, values, [], [], "" if values else "not numeric")
    if t.device.type == "meta":
        return Summary(label, "", [], [], "meta tensor, no data")
    if t.numel() == 0:
        return Summary(label, "", [], [], "empty")
    if t.numel() <= whole:      # shown whole; NaN/Inf still counted so the HTML can flag them
        alerts = _float_stats(t.reshape(-1))[1] if t.is_floating_point() else []
        return Summary(label, _fmt_values(t.cpu().tolist()), [], alerts)
    stats, alerts = _stats(t.reshape(-1))
    return Summary(label, _head_values(t, head), stats, alerts)


def _head_values(t: torch.Tensor, head: int) -> str:
    """The first `head` values with an ellipsis; a 2-D tensor shows the start of its first rows
    (`[[2, 0, 0, 0, …], [1, 0, 0, 0, …]]`), which reads better for block tables and logits."""
    def cut(row: torch.Tensor, n: int) -> str:
        return _fmt_values(row[:n].cpu().tolist())[:-1] + (", …]" if row.numel() > n else "]")
    if t.dim() != 2 or t.shape[0] < 2:
        return cut(t.reshape(-1), head)
    rows = [cut(r, max(2, head // 2)) for r in t[:4]]
    return "[" + ", ".join(rows) + (", …]" if t.shape[0] > 4 else "]")


def tensor_summary(x: torch.Tensor | np.ndarray, with_label: bool = True) -> str:
    """One line: `float32[2, 320] min -3.1, max 4.2, mean 0.01, 2 NaN [0.1, …]`; small tensors
    whole: `int32[3] [0, 3, 7]`."""
    s = summarize(x)
    parts = [s.label] if with_label else []
    if s.note:
        parts.append(f"({s.note})")
    if s.stats or s.alerts:
        parts.append(", ".join(s.stats + s.alerts))
    if s.values:
        parts.append(s.values)
    return " ".join(parts)


def tensor_summary_html(x: torch.Tensor | np.ndarray, with_label: bool = True) -> str:
    s = summarize(x)
    parts = [_span(s.label, _SOFT)] if with_label else []
    if s.note:
        parts.append(_span(s.note, _MUTED))
    if s.values:
        parts.append(_esc(s.values))
    if s.stats:
        parts.append(_span(" · ".join(s.stats), _SOFT))
    if s.alerts:
        parts.append(_span(", ".join(s.alerts), _ALERT))
    return " ".join(parts)


# ---- any value ---------------------------------------------------------------------------------------
def _is_scalar(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str, np.generic)) or v is None


def _is_record(v: Any) -> bool:
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def _clip(s: str, n: int = MAX_STR) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def type_name(v: Any) -> str:
    """`torch.int32`, `numpy.int64`, or the Python type name (`int`, `list`, `None`)."""
    if isinstance(v, torch.Tensor):
        return str(v.dtype)
    if isinstance(v, np.ndarray):
        return f"numpy.{v.dtype.name}"
    return "None" if v is None else type(v).__name__


def shape_of(v: Any) -> str:
    if _is_array(v):
        return shape_str(v.shape)
    if isinstance(v, (list, tuple, dict)):
        return f"len {len(v)}"
    return ""


def device_of(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return str(v.device)
    return "cpu" if isinstance(v, np.ndarray) else ""


def _item(x: Any, compact: bool) -> str:
    """A list item or dict value; strings keep their quotes so ids read as ids."""
    return short_value(x) if compact or isinstance(x, str) else value_preview(x)


def _list_preview(v: Sequence[Any], compact: bool) -> str:
    if all(isinstance(x, (bool, int, float, np.generic)) for x in v):
        if len(v) <= WHOLE:
            return _fmt_values([x.item() if isinstance(x, np.generic) else x for x in v])
        return _fmt_values(list(v[:HEAD]))[:-1] + f", …] ({len(v)} items)"
    show = [_item(x, compact) for x in v[:MAX_ITEMS]]
    more = f", … ({len(v)} items)" if len(v) > MAX_ITEMS else ""
    return "[" + ", ".join(show) + more + "]"


def _dict_preview(d: dict, compact: bool) -> str:
    items = list(d.items())
    show = [f"{k!r}: {_item(x, compact)}" for k, x in items[:MAX_ITEMS]]
    more = f", … ({len(items)} items)" if len(items) > MAX_ITEMS else ""
    return "{" + ", ".join(show) + more + "}"


def short_value(v: Any) -> str:
    """The compact form used inside one-line reprs: tensors as `int32[3]`, strings quoted."""
    if _is_array(v):
        return array_label(v)
    if isinstance(v, str):
        return repr(_clip(v, 60))
    if isinstance(v, np.generic):
        return _num(v.item())
    if _is_record(v):
        return f"{type(v).__name__}(…)"
    if isinstance(v, (list, tuple)):
        return _clip(_list_preview(v, compact=True), 80)
    if isinstance(v, dict):
        return _clip(_dict_preview(v, compact=True), 80)
    return _clip(_num(v) if _is_scalar(v) else repr(v), 80)


def value_preview(v: Any) -> str:
    """One line of plain text for a fields table: scalars as they are, tensors summarised."""
    if v is None:
        return "None"
    if _is_array(v):
        return tensor_summary(v)
    if isinstance(v, np.generic):
        return _num(v.item())
    if _is_scalar(v):
        return _clip(_num(v))
    if _is_record(v):
        return _clip(repr(v))       # install_reprs() keeps the tensor-holding ones short
    if isinstance(v, (list, tuple)):
        return _clip(_list_preview(v, compact=False))
    if isinstance(v, dict):
        return _clip(_dict_preview(v, compact=False))
    return _clip(repr(v))


def value_preview_html(v: Any) -> str:
    if v is None:
        return _span("None", _MUTED)
    if _is_array(v):
        return tensor_summary_html(v, with_label=False)
    return _esc(value_preview(v))


# ---- dataclasses -------------------------------------------------------------------------------------
def _field_values(obj: Any) -> list[tuple[str, Any]]:
    return [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]


def compact_repr(obj: Any, names: Sequence[str] | None = None) -> str:
    """`Name(a=1, b=int32[3], c=None)` over every dataclass field, or only `names` then `…`."""
    pairs = _field_values(obj)
    if names is not None:
        pairs = [(n, v) for n, v in pairs if n in names]
    body = ", ".join(f"{n}={short_value(v)}" for n, v in pairs)
    if names is not None and len(pairs) < len(dataclasses.fields(obj)):
        body += ", …"
    return f"{type(obj).__name__}({body})"


def fields_text(obj: Any) -> str:
    """One aligned line per dataclass field: name, type, shape, device, preview."""
    rows = [(n, type_name(v), shape_of(v), device_of(v),
             tensor_summary(v, with_label=False) if _is_array(v) else value_preview(v))
            for n, v in _field_values(obj)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else []
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    return "\n".join([type(obj).__name__] + lines)


def _value_rows(pairs: Iterable[tuple[str, Any]]) -> str:
    rows = [[_esc(n), _span(type_name(v), _MUTED if v is None else _SOFT), _esc(shape_of(v)),
             _esc(device_of(v)), value_preview_html(v)] for n, v in pairs]
    return _table(["field", "type", "shape", "device", "value"], rows)


def fields_table(obj: Any) -> str:
    """HTML table, one row per dataclass field of `obj` (new fields appear on their own)."""
    return _value_rows(_field_values(obj))


def dataclass_html(obj: Any, title: str | None = None) -> str:
    """A framed fields table under a title (the class name by default)."""
    return _wrap(_title(title or type(obj).__name__) + fields_table(obj))


# ---- HTML building blocks ----------------------------------------------------------------------------
def _esc(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _span(text: str, style: str) -> str:
    return f'<span style="{style}">{_esc(text)}</span>'


def _title(text: str) -> str:
    return f'<div style="{_TITLE}">{_esc(text)}</div>'


def _table(headers: list[str], rows: list[list[str]], bad_rows: set[int] = frozenset()) -> str:
    """Cells are HTML already; headers are escaped here. Colours sit on the rows (they override
    JupyterLab's striped/hover row backgrounds); alignment and padding on the cells."""
    head = "".join(f'<th style="{_TH}">{_esc(h)}</th>' for h in headers)
    body = "".join(f'<tr style="{_TR_BAD if i in bad_rows else _TR}">'
                   + "".join(f'<td style="{_TD}">{c}</td>' for c in row) + "</tr>"
                   for i, row in enumerate(rows))
    return f'<table style="{_TABLE}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _section(summary: str, body: str, open_: bool = True) -> str:
    """A collapsible block; <details> needs no script and works in JupyterLab, VS Code and exports."""
    return (f'<details{" open" if open_ else ""} style="margin:4px 0">'
            f'<summary style="{_SUMMARY}">{_esc(summary)}</summary>{body}</details>')


def _wrap(body: str) -> str:
    return f'<div style="{_WRAP}">{body}</div>'


def _muted_none() -> str:
    return _span("None", _MUTED)


# ---- timings -----------------------------------------------------------------------------------------
def format_ms(seconds: float) -> str:
    """Milliseconds: two decimals, or two significant digits below 0.1 ms."""
    ms = seconds * 1e3
    return f"{ms:.2f} ms" if ms >= 0.1 else f"{ms:.2g} ms"


def total_seconds(timings: dict[str, float]) -> float | None:
    """`timings["total"]` when the runner records one, else the sum of the stages; None if empty."""
    if not timings:
        return None
    return timings["total"] if "total" in timings else sum(timings.values())


def timings_text(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {format_ms(v)}" for k, v in timings.items())


# ---- StepRecord and its parts ------------------------------------------------------------------------
def _step_name(rec: Any) -> str:
    return "warmup" if rec.step_index is None else f"step {rec.step_index}"


def step_record_repr(rec: Any) -> str:
    """`StepRecord(step 3 'generate': 2 prefill + 1 decode rows, 37 tokens, sampled {'0': 17, …})`."""
    parts = [f"{rec.num_prefills} prefill + {rec.num_decodes} decode rows", f"{rec.num_tokens} tokens"]
    if rec.sampled_token_ids:
        parts.append(f"sampled {_clip(_dict_preview(rec.sampled_token_ids, compact=True), 90)}")
    if rec.finished_request_ids:
        parts.append(f"finished {_clip(short_value(list(rec.finished_request_ids)), 60)}")
    if rec.violations:
        parts.append(f"{len(rec.violations)} violations")
    return f"StepRecord({_step_name(rec)} {rec.stage!r}: " + ", ".join(parts) + ")"


def request_phase(s: Any, prefill_len: int | None = None) -> str:
    """"decode" for rows the layers ran as decodes; "prefill chunk" for a prompt chunk that resumes
    a saved state or leaves prompt tokens for a later step; else "prefill" (the whole prompt)."""
    if s.runs_as_decode:
        return "decode"
    if not s.is_prefill:
        return "prefill"
    partial = prefill_len is not None and s.num_computed_before + s.num_tokens < prefill_len
    return "prefill chunk" if s.num_computed_before > 0 or partial else "prefill"


def _prefill_lens(rec: Any) -> dict[str, int]:
    b = rec.input_batch
    if b is None:
        return {}
    return {rid: int(n) for rid, n in zip(b.req_ids, b.prefill_len_np)}


def row_holdings(rec: Any, row: int) -> tuple[int | None, list[int] | None]:
    """(state slot, KV block ids) of a batch row, read from the block tables the runner used
    (the first Mamba and attention groups); None where the model has no such group. Trailing
    null entries of a block-table row are unused columns."""
    slot, blocks = None, None
    for gm in rec.attn_metadata:
        table = gm.common.block_table_tensor
        if row >= table.shape[0]:
            continue
        if gm.kind == "mamba" and slot is None:
            slot = int(table[row, 0])
        elif gm.kind == "attention" and blocks is None:
            ids = table[row].tolist()
            while ids and ids[-1] == 0:
                ids.pop()
            blocks = ids
    return slot, blocks


def _batch_rows(rec: Any, decode: Callable[[list[int]], str] | None = None
                ) -> tuple[list[str], list[list[str]]]:
    headers = ["row", "request", "phase", "computed before", "tokens", "state slot", "KV blocks",
               "sampled", "kept"]
    lens = _prefill_lens(rec)
    rows = []
    for i, s in enumerate(rec.scheduled):
        slot, blocks = row_holdings(rec, i)
        sampled = rec.sampled_token_ids.get(s.request_id)
        kept = s.request_id in rec.kept_token_ids
        shown = _muted_none() if sampled is None else str(sampled)
        if sampled is not None and decode is not None:
            shown += " " + _span(repr(decode([sampled])), _SOFT)
        rows.append([str(i), _esc(s.request_id), _esc(request_phase(s, lens.get(s.request_id))),
                     str(s.num_computed_before), str(s.num_tokens),
                     _span("-", _MUTED) if slot is None else str(slot),
                     _span("-", _MUTED) if blocks is None else _esc(value_preview(blocks)),
                     shown, "yes" if kept else _span("no (partial prefill)", _MUTED)])
    return headers, rows


def batch_table_html(rec: Any, decode: Callable[[list[int]], str] | None = None) -> str:
    """The step's rows in batch order; `decode` (e.g. llm.tokenizer.decode) adds token text."""
    if not rec.scheduled:
        return _span("no rows in this step", _MUTED)
    headers, rows = _batch_rows(rec, decode)
    return _table(headers, rows)


def _header_lines(rec: Any) -> str:
    facts = [_step_name(rec).capitalize(), rec.stage, f"{rec.num_tokens} tokens",
             f"{rec.num_prefills} prefill + {rec.num_decodes} decode rows",
             f"{getattr(rec, 'backend', 'torch')} ops"]
    if getattr(rec, "padded_size", None) is not None:
        facts.append(f"{rec.graph}, padded to {rec.padded_size} rows")   # eager steps say nothing
    lines = [f'<div style="font-size:13px;font-weight:600;color:{_FG}">{_esc(" · ".join(facts))}</div>']
    extra = []
    if rec.timings:
        total = total_seconds(rec.timings)
        extra.append(f"timings: {timings_text(rec.timings)}" +
                     ("" if "total" in rec.timings else f" (total {format_ms(total)})"))
    if rec.preempted_request_ids:
        extra.append(f"preempted: {', '.join(rec.preempted_request_ids)}")
    if rec.finished_request_ids:
        extra.append(f"finished: {', '.join(rec.finished_request_ids)}")
    lines += [f'<div style="{_SOFT}">{_esc(e)}</div>' for e in extra]
    return "".join(lines)


def _output_row(o: Any) -> list[str]:
    c = o.outputs[0] if o.outputs else None
    if c is None:
        return [_esc(o.request_id), "", "", ""]
    return [_esc(o.request_id), _esc(c.finish_reason), _esc(value_preview(c.token_ids)),
            _esc(_clip(repr(c.text), 80))]


def _outputs_html(rec: Any) -> str:
    if not rec.outputs:
        return ""
    rows = [_output_row(o) for o in rec.outputs]
    return _title("Finished outputs") + _table(["request", "finish reason", "token ids", "text"], rows)


def group_metadata_repr(g: Any) -> str:
    """`GroupMetadata(group 1 mamba, Mamba2MetadataBuilder, 4 layers)`."""
    return f"GroupMetadata(group {g.group_id} {g.kind}, {g.builder}, {len(g.layer_names)} layers)"


def _group_body(g: Any) -> str:
    layers = _span(", ".join(g.layer_names), _MONO)
    parts = [f'<div style="{_SOFT}">builder {_esc(g.builder)} · layers: {layers}</div>']
    for label, obj in (("given", g.common), ("built", g.metadata)):
        parts.append(_title(f"{label}: {type(obj).__name__}"))
        parts.append(fields_table(obj) if _is_record(obj) else value_preview_html(obj))
    return "".join(parts)


def _group_summary(g: Any) -> str:
    return (f"group {g.group_id} · {g.kind} · {g.builder} → {type(g.metadata).__name__} · "
            f"{len(g.layer_names)} layers")


def group_metadata_html(g: Any) -> str:
    return _wrap(_title(_group_summary(g)) + _group_body(g))


def violation_html(v: Any) -> str:
    return f'<div style="{_VIOLATION}">{_esc(str(v))}</div>'


def _violations_html(violations: Sequence[Any]) -> str:
    if not violations:
        return ""
    title = f'<div style="{_TITLE};color:#cf222e">{len(violations)} violation(s)</div>'
    return title + "".join(violation_html(v) for v in violations)


def layer_state_repr(s: Any) -> str:
    """`LayerState('model.layers.0.mamba' mamba2, 2 rows, slots [2, 1]: conv_state float32[2, 3, 64], …)`."""
    shapes = ", ".join(f"{n} {array_label(t)}" for n, t in zip(s.state_names, s.before))
    return (f"LayerState({s.layer_name!r} {s.mamba_type}, {len(s.request_ids)} rows, "
            f"slots {_clip(_list_preview(s.slots, compact=True), 60)}: {shapes})")


def _states_html(states: Sequence[Any]) -> str:
    if not states:
        return ""
    rows = [[_esc(s.layer_name), _esc(s.mamba_type), _esc(value_preview(s.slots)),
             _esc(", ".join(f"{n} {array_label(t)}" for n, t in zip(s.state_names, s.before)))]
            for s in states]
    return _section(f"Recorded states ({len(states)} layers)",
                    _table(["layer", "type", "slots", "states (before/after)"], rows))


def layer_state_html(s: Any) -> str:
    pairs = [("layer_name", s.layer_name), ("mamba_type", s.mamba_type), ("request_ids", s.request_ids),
             ("slots", s.slots)]
    for when in ("before", "after"):
        pairs += [(f"{when}.{n}", t) for n, t in zip(s.state_names, getattr(s, when))]
    return _wrap(_title(f"LayerState {s.layer_name}") + _value_rows(pairs))


def step_record_html(rec: Any) -> str:
    parts = [_header_lines(rec)]
    if rec.scheduled:
        headers, rows = _batch_rows(rec)
        parts.append(_title("Batch (decodes first)") + _table(headers, rows))
    else:
        parts.append(f'<div style="{_MUTED}">nothing scheduled</div>')
    parts.append(_outputs_html(rec))
    parts += [_section(_group_summary(g), _group_body(g)) for g in rec.attn_metadata]
    parts.append(_violations_html(rec.violations))
    parts.append(_states_html(rec.states))
    if rec.input_batch is not None:
        parts.append(_section("InputBatch", fields_table(rec.input_batch), open_=False))
    parts.append(_section("All record fields", fields_table(rec), open_=False))
    return _wrap("".join(parts))


def input_batch_repr(b: Any) -> str:
    return compact_repr(b, ["req_ids", "num_reqs", "num_tokens", "max_query_len"])


# ---- Trace -------------------------------------------------------------------------------------------
def _trace_row(i: int, rec: Any) -> list[str]:
    total = total_seconds(rec.timings)
    n_viol = len(rec.violations)
    return [str(i), _muted_none() if rec.step_index is None else str(rec.step_index), _esc(rec.stage),
            str(rec.num_prefills), str(rec.num_decodes), str(rec.num_tokens), _esc(forward_label(rec)),
            _esc(_clip(", ".join(rec.request_ids), 80)),
            _esc(_clip(", ".join(rec.finished_request_ids), 80)),
            "" if total is None else _esc(format_ms(total)),
            _span(str(n_viol), _ALERT) if n_viol else "0"]


def forward_label(rec: Any) -> str:
    """How the step's forward ran: "eager", or "padded eager" / "graph" with the padded size."""
    padded = getattr(rec, "padded_size", None)
    graph = getattr(rec, "graph", "eager")
    return graph if padded is None else f"{graph} ({padded} rows)"


def trace_html(trace: Any, max_rows: int = 200) -> str:
    """One row per record, oldest first; past `max_rows` the middle is left out."""
    records = list(trace)
    keep: list[int | None] = list(range(len(records)))
    if len(records) > max_rows:
        half = max_rows // 2
        keep = [*range(half), None, *range(len(records) - (max_rows - half), len(records))]
    rows, bad = [], set()
    for i in keep:
        if i is None:
            rows.append([_span(f"… {len(records) - max_rows} records left out", _MUTED)] + [""] * 10)
            continue
        if records[i].violations:
            bad.add(len(rows))
        rows.append(_trace_row(i, records[i]))
    headers = ["#", "step", "stage", "prefill rows", "decode rows", "tokens", "forward", "requests",
               "finished", "time", "violations"]
    body = _title(repr(trace))
    body += _table(headers, rows, bad) if rows else f'<div style="{_MUTED}">no records</div>'
    return _wrap(body)


# ---- installing the reprs ----------------------------------------------------------------------------
def _all_subclasses(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _all_subclasses(sub)
    return out


def install_reprs() -> None:
    """Attach `_repr_html_` (and a short `__repr__` where the dataclass one would dump tensors) to
    the record classes. Idempotent; assigning on the class overrides the dataclass-made method."""
    from toolkit.attention.common import CommonAttentionMetadata
    from toolkit.attention.mamba_base import BaseMambaAttentionMetadata
    from toolkit.attention.paged_attn import PagedAttentionMetadata
    from toolkit.inspect.step_record import LayerState, StepRecord, Violation
    from toolkit.inspect.trace import Trace
    from toolkit.runner.attn_utils import GroupMetadata
    from toolkit.runner.input_batch import InputBatch

    StepRecord.__repr__ = step_record_repr
    StepRecord._repr_html_ = step_record_html
    GroupMetadata.__repr__ = group_metadata_repr
    GroupMetadata._repr_html_ = group_metadata_html
    InputBatch.__repr__ = input_batch_repr
    InputBatch._repr_html_ = dataclass_html
    LayerState.__repr__ = layer_state_repr
    LayerState._repr_html_ = layer_state_html
    Violation._repr_html_ = violation_html
    Trace._repr_html_ = trace_html
    for cls in [CommonAttentionMetadata, PagedAttentionMetadata, *_all_subclasses(BaseMambaAttentionMetadata)]:
        cls.__repr__ = compact_repr
        cls._repr_html_ = dataclass_html


install_reprs()


# ---- building blocks shared with the widget views (toolkit/widgets) --------------------------------
escape, span, title, table, section, wrap = _esc, _span, _title, _table, _section, _wrap
MUTED, SOFT, ALERT = _MUTED, _SOFT, _ALERT
