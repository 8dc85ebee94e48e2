"""Values in a few words: tensor summaries, value previews, dataclass field tables, timings.

Pure functions, object -> str, shared by the record views, the reprs and the widgets.
- Tensors are summarised, never dumped: up to `WHOLE` elements are shown whole; longer ones show
  dtype/shape, min/max (and mean for floats) over finite values, NaN/Inf counts and the first
  `HEAD` values. Computing the stats runs on the tensor's own device; only scalars and the head
  travel to the host.
- One generic path for dataclasses: `fields_table(obj)` walks `dataclasses.fields(obj)`, so a
  field added to a metadata class shows up without a change here.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from toolkit.inspect import html as H

WHOLE = 16          # tensors with at most this many elements are shown whole
HEAD = 8            # first values shown of a longer tensor or list
MAX_ITEMS = 8       # dict items / non-scalar list items shown before an ellipsis
MAX_STR = 200       # longest plain-text preview of anything else


# ---- numbers, tensors, arrays ------------------------------------------------------------------------
def format_number(x: Any) -> str:
    """Floats to four significant digits; anything else as `str` writes it."""
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def format_values(v: Any) -> str:
    """A (nested) list of numbers as `[a, b, ...]`; ints and bools exactly as `str(list)` writes them."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(format_values(x) for x in v) + "]"
    return format_number(v)


def is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def is_record(v: Any) -> bool:
    """A dataclass instance (not the class)."""
    return dataclasses.is_dataclass(v) and not isinstance(v, type)


def clip(s: str, n: int = MAX_STR) -> str:
    """`s`, cut to `n` characters with an ellipsis."""
    return s if len(s) <= n else s[:n - 1] + "…"


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
    stats = [f"min {format_number(finite.min().item())}", f"max {format_number(finite.max().item())}",
             f"mean {format_number(finite.mean().item())}"]
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
        values = format_values(x.tolist()) if x.size <= whole else ""
        return Summary(label, values, [], [], "" if values else "not numeric")
    if t.device.type == "meta":
        return Summary(label, "", [], [], "meta tensor, no data")
    if t.numel() == 0:
        return Summary(label, "", [], [], "empty")
    if t.numel() <= whole:      # shown whole; NaN/Inf still counted so the HTML can flag them
        alerts = _float_stats(t.reshape(-1))[1] if t.is_floating_point() else []
        return Summary(label, format_values(t.cpu().tolist()), [], alerts)
    stats, alerts = _stats(t.reshape(-1))
    return Summary(label, _head_values(t, head), stats, alerts)


def _head_values(t: torch.Tensor, head: int) -> str:
    """The first `head` values with an ellipsis; a 2-D tensor shows the start of its first rows
    (`[[2, 0, 0, 0, …], [1, 0, 0, 0, …]]`), which reads better for block tables and logits."""
    def cut(row: torch.Tensor, n: int) -> str:
        return format_values(row[:n].cpu().tolist())[:-1] + (", …]" if row.numel() > n else "]")
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
    parts = [H.span(s.label, H.SOFT)] if with_label else []
    if s.note:
        parts.append(H.span(s.note, H.MUTED))
    if s.values:
        parts.append(H.escape(s.values))
    if s.stats:
        parts.append(H.span(" · ".join(s.stats), H.SOFT))
    if s.alerts:
        parts.append(H.span(", ".join(s.alerts), H.ALERT))
    return " ".join(parts)


# ---- any value ---------------------------------------------------------------------------------------
def _is_scalar(v: Any) -> bool:
    return isinstance(v, (bool, int, float, str, np.generic)) or v is None


def type_name(v: Any) -> str:
    """`torch.int32`, `numpy.int64`, or the Python type name (`int`, `list`, `None`)."""
    if isinstance(v, torch.Tensor):
        return str(v.dtype)
    if isinstance(v, np.ndarray):
        return f"numpy.{v.dtype.name}"
    return "None" if v is None else type(v).__name__


def shape_of(v: Any) -> str:
    if is_array(v):
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


def list_preview(v: Sequence[Any], compact: bool) -> str:
    """`[1, 2, 3]`; long lists of numbers end `, …] (n items)`, others `, … (n items)]`."""
    if all(isinstance(x, (bool, int, float, np.generic)) for x in v):
        if len(v) <= WHOLE:
            return format_values([x.item() if isinstance(x, np.generic) else x for x in v])
        return format_values(list(v[:HEAD]))[:-1] + f", …] ({len(v)} items)"
    show = [_item(x, compact) for x in v[:MAX_ITEMS]]
    more = f", … ({len(v)} items)" if len(v) > MAX_ITEMS else ""
    return "[" + ", ".join(show) + more + "]"


def dict_preview(d: dict, compact: bool) -> str:
    """`{'a': 1, …}` with at most `MAX_ITEMS` items."""
    items = list(d.items())
    show = [f"{k!r}: {_item(x, compact)}" for k, x in items[:MAX_ITEMS]]
    more = f", … ({len(items)} items)" if len(items) > MAX_ITEMS else ""
    return "{" + ", ".join(show) + more + "}"


def short_value(v: Any) -> str:
    """The compact form used inside one-line reprs: tensors as `int32[3]`, strings quoted."""
    if is_array(v):
        return array_label(v)
    if isinstance(v, str):
        return repr(clip(v, 60))
    if isinstance(v, np.generic):
        return format_number(v.item())
    if is_record(v):
        return f"{type(v).__name__}(…)"
    if isinstance(v, (list, tuple)):
        return clip(list_preview(v, compact=True), 80)
    if isinstance(v, dict):
        return clip(dict_preview(v, compact=True), 80)
    return clip(format_number(v) if _is_scalar(v) else repr(v), 80)


def value_preview(v: Any) -> str:
    """One line of plain text for a fields table: scalars as they are, tensors summarised."""
    if v is None:
        return "None"
    if is_array(v):
        return tensor_summary(v)
    if isinstance(v, np.generic):
        return format_number(v.item())
    if _is_scalar(v):
        return clip(format_number(v))
    if is_record(v):
        return clip(repr(v))       # install_reprs() keeps the tensor-holding ones short
    if isinstance(v, (list, tuple)):
        return clip(list_preview(v, compact=False))
    if isinstance(v, dict):
        return clip(dict_preview(v, compact=False))
    return clip(repr(v))


def value_preview_html(v: Any) -> str:
    if v is None:
        return H.muted_none()
    if is_array(v):
        return tensor_summary_html(v, with_label=False)
    return H.escape(value_preview(v))


# ---- dataclasses -------------------------------------------------------------------------------------
def field_values(obj: Any) -> list[tuple[str, Any]]:
    """(name, value) of every dataclass field of `obj`, in declaration order."""
    return [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]


def compact_repr(obj: Any, names: Sequence[str] | None = None) -> str:
    """`Name(a=1, b=int32[3], c=None)` over every dataclass field, or only `names` then `…`."""
    pairs = field_values(obj)
    if names is not None:
        pairs = [(n, v) for n, v in pairs if n in names]
    body = ", ".join(f"{n}={short_value(v)}" for n, v in pairs)
    if names is not None and len(pairs) < len(dataclasses.fields(obj)):
        body += ", …"
    return f"{type(obj).__name__}({body})"


def fields_text(obj: Any) -> str:
    """One aligned line per dataclass field: name, type, shape, device, preview."""
    rows = [(n, type_name(v), shape_of(v), device_of(v),
             tensor_summary(v, with_label=False) if is_array(v) else value_preview(v))
            for n, v in field_values(obj)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else []
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    return "\n".join([type(obj).__name__] + lines)


def values_table(pairs: Iterable[tuple[str, Any]]) -> str:
    """HTML table of (name, value) pairs: name, type, shape, device, preview."""
    rows = [[H.escape(n), H.span(type_name(v), H.MUTED if v is None else H.SOFT), H.escape(shape_of(v)),
             H.escape(device_of(v)), value_preview_html(v)] for n, v in pairs]
    return H.table(["field", "type", "shape", "device", "value"], rows)


def fields_table(obj: Any) -> str:
    """HTML table, one row per dataclass field of `obj` (new fields appear on their own)."""
    return values_table(field_values(obj))


def dataclass_html(obj: Any, title: str | None = None) -> str:
    """A framed fields table under a title (the class name by default)."""
    return H.wrap(H.title(title or type(obj).__name__) + fields_table(obj))


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
