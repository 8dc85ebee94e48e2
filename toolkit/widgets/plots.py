"""Pictures of records: pure functions (data -> PNG bytes), shared by the widgets and the views'
static `_repr_mimebundle_`. matplotlib's Agg backend only; nothing is shown on a screen.

Big tensors are drawn the treescope way: at most `MAX_PER_AXIS` cells per axis (rows and columns
picked evenly with the first and last kept), NaN / +-Inf cells marked in their own colours, a
diverging colormap centred on zero for states, integer grids for block tables with the null id
and `PAD_SLOT_ID` masked. Explicit white backgrounds: VS Code paints outputs on white.
"""
from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch

MAX_PER_AXIS = 128
NAN_COLOR, POSINF_COLOR, NEGINF_COLOR = "#ffd400", "#000000", "#7f00ff"
NULL_COLOR, PAD_COLOR = "#d0d7de", "#ffffff"


def _figure(**kwargs):
    """A figure drawn by the Agg canvas directly: no pyplot, so the notebook's own matplotlib
    backend (inline, ipympl) is never switched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _cmap(name: str):
    import matplotlib
    return matplotlib.colormaps[name]


def _rgba(color: str) -> tuple[float, float, float, float]:
    from matplotlib.colors import to_rgba
    return to_rgba(color)


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", facecolor="white")
    return buf.getvalue()


def pick_indices(n: int, limit: int = MAX_PER_AXIS) -> np.ndarray:
    """Evenly spaced indices into range(n), at most `limit`, first and last always kept."""
    if n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(int))


def as_2d(t: torch.Tensor) -> tuple[np.ndarray, str]:
    """A state tensor as a 2D float array and a note on how it was folded: [K-1, D] stays,
    [H, P, N] becomes [H*P, N], a vector becomes one row."""
    a = t.detach().float().cpu().numpy()
    if a.ndim == 1:
        return a[None, :], "1 x n"
    if a.ndim == 2:
        return a, f"{a.shape[0]} x {a.shape[1]}"
    lead = int(np.prod(a.shape[:-1]))
    return a.reshape(lead, a.shape[-1]), f"{' x '.join(map(str, a.shape[:-1]))} folded into {lead} rows"


def downsample(a: np.ndarray) -> tuple[np.ndarray, bool]:
    rows, cols = pick_indices(a.shape[0]), pick_indices(a.shape[1])
    return a[np.ix_(rows, cols)], len(rows) < a.shape[0] or len(cols) < a.shape[1]


def heatmap_png(panels: Sequence[tuple[str, torch.Tensor]], title: str = "", *,
                shared_scale: int = 2) -> bytes:
    """Side-by-side heatmaps (e.g. before / after / after - before) of same-shaped tensors.
    The first `shared_scale` panels share one symmetric colour scale; the rest get their own."""
    from matplotlib.colors import TwoSlopeNorm
    arrays = [(name, *as_2d(t)) for name, t in panels]
    fig = _figure(figsize=(3.4 * len(arrays), 3.0), dpi=90)
    axes = fig.subplots(1, len(arrays), squeeze=False)
    finite_shared = [np.abs(a[np.isfinite(a)]) for _, a, _ in arrays[:shared_scale]]
    shared = max([float(f.max()) for f in finite_shared if f.size] + [1e-12])
    for i, (ax, (name, a, fold)) in enumerate(zip(axes[0], arrays)):
        small, cut = downsample(a)
        finite = np.abs(small[np.isfinite(small)])
        scale = shared if i < shared_scale else max(float(finite.max()) if finite.size else 0.0, 1e-12)
        cmap = _cmap("RdBu_r")
        ax.imshow(np.where(np.isfinite(small), small, 0.0), cmap=cmap, aspect="auto",
                  interpolation="nearest", norm=TwoSlopeNorm(0.0, -scale, scale))
        for mask, color in ((np.isnan(small), NAN_COLOR), (np.isposinf(small), POSINF_COLOR),
                            (np.isneginf(small), NEGINF_COLOR)):
            if mask.any():
                overlay = np.zeros((*small.shape, 4))
                overlay[mask] = _rgba(color)
                ax.imshow(overlay, aspect="auto", interpolation="nearest")
        bad = int((~np.isfinite(a)).sum())
        ax.set_title(f"{name}\n|max| {np.abs(a[np.isfinite(a)]).max() if np.isfinite(a).any() else 0:.3g}"
                     + (f", {bad} non-finite" if bad else ""), fontsize=8)
        ax.set_xlabel(fold + (" (evenly sampled)" if cut else ""), fontsize=7)
        _index_ticks(ax, a.shape)
        ax.tick_params(labelsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _png(fig)


def _index_ticks(ax, shape: tuple[int, int], most: int = 6) -> None:
    """Integer ticks labelled with the ORIGINAL row / column indices of a downsampled array."""
    for axis, n in ((ax.yaxis, shape[0]), (ax.xaxis, shape[1])):
        picked = pick_indices(n)
        where = np.unique(np.linspace(0, len(picked) - 1, min(most, len(picked))).round().astype(int))
        axis.set_ticks(where, [str(picked[i]) for i in where])


def block_grid_png(rows: Sequence[Sequence[int]], row_labels: Sequence[str], title: str, *,
                   used: Sequence[int] | None = None, null_id: int = 0, pad_id: int | None = None) -> bytes:
    """An integer grid: one row per batch row, one cell per block-table column (or per token of a
    slot mapping). Cells past `used[row]` are drawn as padding; the null id is grey, `pad_id`
    (e.g. PAD_SLOT_ID) white; ids are written in the cells when the grid is small."""
    grid = np.array([list(r) for r in rows], dtype=np.int64) if len(rows) else np.zeros((0, 0), np.int64)
    n_rows = max(grid.shape[0], 1)
    if used is not None and grid.size:               # columns nobody uses are not worth drawing
        grid = grid[:, :max(max(used) + 1, 1)]
    cols = pick_indices(grid.shape[1] if grid.size else 1, 64)
    grid = grid[:, cols] if grid.size else np.zeros((1, 1), np.int64)
    fig = _figure(figsize=(max(4.5, min(1.2 + 0.32 * len(cols), 10)), 0.9 + 0.32 * n_rows), dpi=90)
    ax = fig.subplots()
    real = grid.astype(float)
    mask_null = grid == null_id
    mask_pad = np.zeros_like(mask_null) if pad_id is None else grid == pad_id
    if used is not None:
        for r, n in enumerate(used):
            mask_pad[r, np.searchsorted(cols, n):] = True
    shown = np.ma.masked_array(real, mask=mask_null | mask_pad)
    cmap = _cmap("tab20").with_extremes(bad=PAD_COLOR)
    ax.imshow(shown % 20, cmap=cmap, vmin=0, vmax=19, aspect="auto", interpolation="nearest")
    null_overlay = np.zeros((*grid.shape, 4))
    null_overlay[mask_null & ~mask_pad] = _rgba(NULL_COLOR)
    ax.imshow(null_overlay, aspect="auto", interpolation="nearest")
    if grid.size <= 600:
        for (r, c), v in np.ndenumerate(grid):
            if not mask_pad[r, c]:
                ax.text(c, r, "null" if v == null_id else str(v), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(row_labels)), [str(x) for x in row_labels], fontsize=7)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols], fontsize=6)
    ax.set_title(title, fontsize=8, wrap=True)
    fig.tight_layout()
    return _png(fig)


def timeline_png(records) -> bytes:
    """Three panels over a run: tokens per step (prefill vs decode rows), seconds per stage (host
    time, stacked; on CUDA the device time of the forward and of the sampler drawn over it as
    black ticks), and each request's life from its first scheduled step to the step it finished."""
    records = [r for r in records if r.scheduled]
    fig = _figure(figsize=(9.5, 6.2), dpi=90)
    axes = fig.subplots(3, 1, sharex=True)
    xs = np.arange(len(records))
    pre = [sum(s.num_tokens for s in r.scheduled if not s.runs_as_decode) for r in records]
    dec = [sum(s.num_tokens for s in r.scheduled if s.runs_as_decode) for r in records]
    axes[0].bar(xs, pre, color="#4c72b0", label="prefill tokens")
    axes[0].bar(xs, dec, bottom=pre, color="#dd8452", label="decode tokens")
    axes[0].set_ylabel("tokens", fontsize=8)
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    stages = ["schedule", "prepare_inputs", "build_metadata", "forward", "sample", "wait", "update"]
    bottom = np.zeros(len(records))
    for stage in stages:
        ms = np.array([r.timings.get(stage, 0.0) * 1e3 for r in records])
        axes[1].bar(xs, ms, bottom=bottom, label=stage)
        bottom += ms
    device = [getattr(r, "device_timings", {}) for r in records]
    if any(device):
        gpu = np.array([(d.get("forward", 0.0) + d.get("sample", 0.0)) * 1e3 for d in device])
        axes[1].scatter(xs, gpu, marker="_", s=120, color="black", label="device: forward + sample")
    axes[1].set_ylabel("ms (host)", fontsize=8)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, r in enumerate(records):
        for rid in r.request_ids + r.finished_request_ids:
            first.setdefault(rid, i)
            last[rid] = i
    for y, rid in enumerate(first):
        axes[2].plot([first[rid], last[rid]], [y, y], lw=4, solid_capstyle="butt")
    axes[2].set_yticks(range(len(first)), list(first), fontsize=6)
    axes[2].set_ylabel("request", fontsize=8)
    labels = [str(r.step_index) if r.step_index is not None else "w" for r in records]
    step = max(1, len(records) // 20)
    axes[2].set_xticks(xs[::step], labels[::step], fontsize=7)
    axes[2].set_xlabel("step (w = warmup)", fontsize=8)
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25)
    fig.tight_layout()
    return _png(fig)


def norms_png(steps: Sequence[str], norms: dict[str, Sequence[float]], title: str) -> bytes:
    """One line per state tensor: its norm after each of the request's steps."""
    fig = _figure(figsize=(6, 2.4), dpi=90)
    ax = fig.subplots()
    for name, values in norms.items():
        ax.plot(range(len(values)), values, marker="o", ms=3, label=name)
    ax.set_xticks(range(len(steps)), list(steps), fontsize=7)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("L2 norm after the step", fontsize=8)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _png(fig)
