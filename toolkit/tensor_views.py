"""Views of long-lived tensors handed out step after step, made once (`HeadViews`): the runner's
views of its persistent buffers, and the Mamba metadata builders' views of the block tables."""
from __future__ import annotations

import torch


class HeadViews:
    """The views a step hands out of its owner's persistent tensors (`t[:n]`, `t[g, :n]`, `t[:, j]`,
    `t[:r, :c]`), made once per tensor and size and handed out again at every step that asks for the
    same.

    Why: a batch's and its metadata's views would otherwise be new objects each step, and while
    recording, a record keeps them (by reference) for the trace's life: a tensor object made in one
    step and held across many costs some 3-6 us a step, and slows even the forward (benchmarks/
    RESULTS.md, stop 65). A cached view is the same view: same storage, offset, shape and stride.
    Only for tensors that live as long as their owner (each entry keeps its tensor alive, so its
    `id` names it); nothing may change a handed-out view's shape or strides in place. At most
    MAX_VIEWS are kept (prefill chunks of many lengths would otherwise add views without end): past
    that the cache starts again empty, which costs only the views made anew."""

    MAX_VIEWS = 4096

    def __init__(self):
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def head(self, t: torch.Tensor, n: int) -> torch.Tensor:
        """t[:n]."""
        got = self._views.get((id(t), n))
        if got is None:
            got = self._keep((id(t), n), t, t[:n])
        return got[1]

    def row_head(self, t: torch.Tensor, row: int, n: int) -> torch.Tensor:
        """t[row, :n]."""
        got = self._views.get((id(t), row, n))
        if got is None:
            got = self._keep((id(t), row, n), t, t[row, :n])
        return got[1]

    def column(self, t: torch.Tensor, j: int) -> torch.Tensor:
        """t[:, j]."""
        got = self._views.get((id(t), "column", j))
        if got is None:
            got = self._keep((id(t), "column", j), t, t[:, j])
        return got[1]

    def corner(self, t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """t[:rows, :cols]."""
        got = self._views.get((id(t), "corner", rows, cols))
        if got is None:
            got = self._keep((id(t), "corner", rows, cols), t, t[:rows, :cols])
        return got[1]

    def _keep(self, key: tuple, t: torch.Tensor, view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self._views) >= self.MAX_VIEWS:
            self._views.clear()
        self._views[key] = (t, view)
        return t, view

    def __len__(self) -> int:
        return len(self._views)
