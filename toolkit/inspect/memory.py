"""Memory ledger: bytes by category, measured from the tensors themselves.

`TensorWatch` keeps weak references to every tensor the engine allocates (weights, KV cache,
state cache, persistent buffers), so the same measurement works before and after shutdown: a
tensor that is still alive after shutdown is a leak (what vLLM PR #52374's shutdown order fixes).
`llm.memory_report()` shows the measurements taken at load, after warmup and after shutdown.
"""
from __future__ import annotations

import gc
import os
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from toolkit.inspect import html as H

CATEGORIES = ("weights", "kv_cache", "state_cache", "persistent_buffers", "graphs", "trace_host", "trace_device")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TensorWatch:
    """(category, name, weakref) for each engine tensor; measures what is still alive."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, weakref.ref]] = []

    def add(self, category: str, name: str, tensor: torch.Tensor) -> None:
        self.entries.append((category, name, weakref.ref(tensor)))

    @classmethod
    def of_runner(cls, runner) -> TensorWatch:
        """The runner's tensors, and those of its draft model (method "draft_model"), named "draft.*"."""
        watch = cls()
        watch._add_runner(runner, "")
        if getattr(runner, "draft", None) is not None:
            watch._add_runner(runner.draft, "draft.")
        return watch

    def _add_runner(self, runner, prefix: str) -> None:
        for name, p in list(runner.model.named_parameters()) + list(runner.model.named_buffers()):
            self.add("weights", prefix + name, p)
        for group in runner.kv_cache_groups:
            category = "kv_cache" if group.kind == "attention" else "state_cache"
            for name in group.layer_names:
                value = runner.kv_caches[name]
                for i, t in enumerate(value if isinstance(value, tuple) else (value,)):
                    self.add(category, f"{prefix}{name}[{i}]", t)
        # the draft keeps a list of input buffers and block tables (one per forward of a step)
        many = isinstance(runner.input_buffers, list)
        owners = ([(f"input_buffers[{j}]", b) for j, b in enumerate(runner.input_buffers)] if many
                  else [("input_buffers", runner.input_buffers)])
        if hasattr(runner, "req_states"):
            owners.append(("req_states", runner.req_states))
        if hasattr(runner, "sampler"):          # the penalties' token counts
            owners.append(("sampler.token_counts", runner.sampler.token_counts))
        for owner, obj in owners:
            for attr, value in vars(obj).items():
                if isinstance(value, torch.Tensor):
                    self.add("persistent_buffers", f"{prefix}{owner}.{attr}", value)
        tables = runner.block_tables if many else [runner.block_tables]
        for j, bt in enumerate(tables):
            name = f"{prefix}block_tables{f'[{j}]' if many else ''}"
            for i, t in enumerate(bt.input_block_tables):
                self.add("persistent_buffers", f"{name}.input_block_tables[{i}]", t)
            self.add("persistent_buffers", f"{name}.slot_mappings", bt.slot_mappings)

    def alive(self) -> list[tuple[str, str, torch.Tensor]]:
        out = []
        for category, name, ref in self.entries:
            t = ref()
            if t is not None:
                out.append((category, name, t))
        return out

    def measure(self) -> dict[str, int]:
        """Bytes per category over live tensors, each storage counted once (tied weights)."""
        totals = dict.fromkeys(CATEGORIES, 0)
        seen: set[tuple[str, int]] = set()
        for category, _, t in self.alive():
            key = (str(t.device), t.untyped_storage().data_ptr())
            if key in seen:
                continue
            seen.add(key)
            totals[category] += t.untyped_storage().nbytes()
        return totals


_SCALARS = (int, float, str, bool, bytes, type(None), np.generic)


def object_bytes(obj, where: str | None = None, _seen: set[int] | None = None) -> int:
    """Bytes of the tensors and arrays reachable through dataclasses, dicts, lists and tuples;
    `where`: "host" (CPU tensors and numpy arrays) or "device" (the rest) counts only those.
    Runs on every recorded step (the trace's budget): scalars, the most common leaves, go first."""
    if isinstance(obj, _SCALARS):
        return 0
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        on_host = obj.device.type == "cpu"
        return _nbytes(obj) if where is None or on_host == (where == "host") else 0
    if isinstance(obj, np.ndarray):
        return obj.nbytes if where in (None, "host") else 0
    fields = getattr(type(obj), "__dataclass_fields__", None)
    if fields is not None:
        return sum(object_bytes(getattr(obj, name), where, seen) for name in fields)
    if isinstance(obj, dict):
        return sum(object_bytes(v, where, seen) for v in obj.values() if not isinstance(v, _SCALARS))
    if isinstance(obj, (list, tuple)):        # token lists: their ints skipped without a call each
        return sum(object_bytes(v, where, seen) for v in obj if not isinstance(v, _SCALARS))
    return 0


# ---- the trace's byte budget ----------------------------------------------------------------------
AUTO_BUDGET_CAP = 2 * 2**30          # "auto": min(2 GiB, AUTO_BUDGET_SHARE of available host memory)
AUTO_BUDGET_SHARE = 0.25
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def available_host_memory() -> int | None:
    """Bytes of host memory available to a new allocation (Linux: MemAvailable; elsewhere the free
    physical pages), or None when the platform does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def resolve_trace_budget(value: int | str | None) -> int | None:
    """`LLM(trace_max_bytes=...)`: "auto" (the default: min(2 GiB, 25% of available host memory)),
    a number of bytes (an int, or a string such as "512 MiB" / "1.5 GB"), or None (no byte bound)."""
    if value is None:
        return None
    if value == "auto":
        available = available_host_memory()
        share = int(available * AUTO_BUDGET_SHARE) if available else AUTO_BUDGET_CAP
        return max(1, min(AUTO_BUDGET_CAP, share))
    number = value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if text.endswith(u)), None)
        try:
            number = float(text[:-len(unit)]) * _UNITS[unit] if unit else float(text)
        except ValueError:
            number = None
        number = int(number) if number is not None else None
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"trace_max_bytes={value!r}: give a number of bytes >= 1 (an int, or a string "
                         "such as '512 MiB'), 'auto' (min(2 GiB, 25% of available host memory)), or None "
                         "for no byte bound")
    return number


def graph_bytes(manager) -> int:
    """What a CUDA-graph manager keeps alive: the CUDA memory its capture took (graph pool and
    static outputs, `report.graph_bytes`) once graphs are captured, else the tensors it holds
    (`held_tensors()`); 0 when there is none."""
    if manager is None:
        return 0
    report = getattr(manager, "report", None)
    if report is not None and getattr(manager, "captured", False):
        return int(report.graph_bytes)
    return sum(_nbytes(t) for t in getattr(manager, "held_tensors", lambda: [])())


class MemoryMarks:
    """Bytes by category measured at named moments of an engine's life ("load", "warmup",
    "shutdown"), for `llm.memory_report()`. Cheap: it measures only when asked."""

    def __init__(self, runner, trace, device: torch.device) -> None:
        self.runner = runner
        self.trace = trace
        self.device = device
        self.watch = TensorWatch.of_runner(runner)
        self.marks: dict[str, dict[str, int]] = {}

    def measure(self) -> dict[str, int]:
        out = self.watch.measure()
        out["graphs"] = graph_bytes(getattr(self.runner, "cudagraph_manager", None))
        out["trace_host"] = object_bytes(list(self.trace), "host")
        out["trace_device"] = object_bytes(list(self.trace), "device")
        if self.device.type == "cuda":
            out["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
        return out

    def mark(self, name: str) -> None:
        self.marks[name] = self.measure()

    def report(self) -> MemoryReport:
        return MemoryReport({**self.marks, "now": self.measure()}, str(self.device), self.trace.max_bytes)


@dataclass
class MemoryReport:
    """Bytes by category at each mark ("load", "warmup", "shutdown", "now")."""
    marks: dict[str, dict[str, int]] = field(default_factory=dict)
    device: str = "cpu"
    trace_budget: int | None = None     # the trace's byte budget (host bytes); None: no byte bound
    ranks: list[dict[str, int]] | None = None    # tensor parallelism: each rank's bytes now, rank order

    def __repr__(self) -> str:
        cols = list(self.marks)
        lines = [f"{'category':<20}" + "".join(f"{c:>14}" for c in cols)]
        for cat in self.categories():
            lines.append(f"{cat:<20}" + "".join(f"{fmt_bytes(self.marks[c].get(cat, 0)):>14}" for c in cols))
        text = f"MemoryReport ({self.device})\n" + "\n".join(lines) + f"\n{self.budget_line()}"
        if self.ranks:
            cats = self.rank_categories()
            text += "\nper rank, now:\n" + f"{'rank':<6}" + "".join(f"{c:>20}" for c in cats)
            for r, m in enumerate(self.ranks):
                text += f"\n{r:<6}" + "".join(f"{fmt_bytes(m.get(c, 0)):>20}" for c in cats)
        return text

    def rank_categories(self) -> list[str]:
        """The categories any rank holds bytes in (the trace lives on rank 0 only)."""
        return [c for c in self.categories() if any(m.get(c, 0) for m in self.ranks or [])]

    def budget_line(self) -> str:
        if self.trace_budget is None:
            return "trace budget: none (trace_max_bytes=None)"
        return f"trace budget: {fmt_bytes(self.trace_budget)} of host memory (trace_max_bytes)"

    def categories(self) -> list[str]:
        extra = sorted({k for m in self.marks.values() for k in m} - set(CATEGORIES))
        return list(CATEGORIES) + extra

    def table_html(self) -> str:
        """Title and table, unframed (for a view that shows the report among other things)."""
        cols = list(self.marks)
        rows = [[H.escape(cat)] + [H.escape(fmt_bytes(self.marks[c].get(cat, 0))) for c in cols]
                for cat in self.categories()]
        html = (H.title(f"memory by category ({self.device})")
                + H.table(["category", *cols], rows, right=range(1, len(cols) + 1))
                + H.span(self.budget_line(), H.SOFT))
        if self.ranks:
            cats = self.rank_categories()
            per_rank = [[str(r)] + [H.escape(fmt_bytes(m.get(c, 0))) for c in cats] for r, m in enumerate(self.ranks)]
            html += (H.title("per rank, now (tensor parallel: each rank holds its shard)")
                     + H.table(["rank", *cats], per_rank, right=range(1, len(cats) + 1)))
        return html

    def _repr_html_(self) -> str:
        return H.wrap(self.table_html())


def fmt_bytes(n: int) -> str:
    """1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def collect(full: bool = True) -> None:
    """A full garbage collection (unless `full` is False), then CUDA's cached blocks given back."""
    if full:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def released_by_shutdown(runner) -> list[weakref.ref]:
    """Weak references to what a runner's shutdown must free: its cache tensors, its model and
    the draft model's (`LLM.shutdown` collects garbage only if one outlives the shutdown)."""
    draft = getattr(runner, "draft", None)
    caches = [*getattr(runner, "kv_caches", {}).values(), *getattr(draft, "kv_caches", {}).values()]
    tensors = [t for c in caches for t in (c if isinstance(c, tuple) else (c,))]
    owners = [getattr(runner, "model", None), getattr(draft, "model", None)]
    return [weakref.ref(x) for x in tensors + owners if x is not None]
