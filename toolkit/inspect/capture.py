"""What a full-mode step captures, and the capture itself.

`LLM(inspect="full", inspect_layers=..., inspect_requests=...)` (or `llm.set_inspect_filter(...)`)
narrows the capture the way TransformerLens's `names_filter` does: only the chosen recurrent
layers, and only the chosen requests' rows, are gathered from the state cache; the rest is not
read at all (no time, no memory).

- layers: None (every recurrent layer), a regex (`re.search` on the layer name, e.g.
  `r"layers\\.(0|3)\\."`), or layer names (an exact list);
- requests: None (every request), a request id, request ids, or a predicate `f(request_id) -> bool`.

Captured states are copied to host memory (pinned, without blocking, on a GPU), so the device's
memory stays where warmup sized it.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.host import mapped_empty, to_device, to_host

LayerSpec = str | Iterable[str] | None
RequestSpec = str | Iterable[str] | Callable[[str], bool] | None


@dataclass(frozen=True)
class CaptureFilter:
    """The recurrent layers (model order) and the requests a full-mode step captures."""
    layers: tuple[str, ...]
    requests: frozenset[str] | Callable[[str], bool] | None     # None: every request
    num_recurrent_layers: int

    def wants(self, request_id: str) -> bool:
        if self.requests is None:
            return True
        if callable(self.requests):
            return bool(self.requests(request_id))
        return request_id in self.requests

    def describe(self) -> str:
        """E.g. `2 of 24 recurrent layers (model.layers.0.mixer, model.layers.3.mixer); requests '0', '2'`."""
        n = len(self.layers)
        if n == self.num_recurrent_layers:
            layers = f"all {n} recurrent layers"
        else:
            shown = ", ".join(self.layers[:4]) + (", ..." if n > 4 else "")
            layers = f"{n} of {self.num_recurrent_layers} recurrent layers ({shown})"
        if self.requests is None:
            requests = "every request"
        elif callable(self.requests):
            requests = f"requests chosen by {getattr(self.requests, '__name__', 'a predicate')}"
        else:
            requests = "requests " + ", ".join(repr(r) for r in sorted(self.requests))
        return f"{layers}; {requests}"


def check_capture_mode(mode: str, layers: LayerSpec, requests: RequestSpec, always: bool = False) -> None:
    """A capture filter belongs to inspect="full" (`always`: even when both choices are None), and
    `requests` must have a valid form; checked before the model loads."""
    if mode != "full" and (always or layers is not None or requests is not None):
        raise ValueError(f"inspect_layers / inspect_requests choose what inspect='full' captures; this "
                         f"engine runs with inspect={mode!r}")
    resolve_requests(requests)


def resolve_layers(spec: LayerSpec, recurrent: list[str], other: Collection[str] = ()) -> tuple[str, ...]:
    """The recurrent layers `spec` names, in model order. Refused: a regex that matches no recurrent
    layer, a name that is not one (saying whether it is another kind of layer)."""
    if spec is None:
        return tuple(recurrent)
    if not recurrent:
        raise ValueError("inspect_layers: this model has no recurrent layer, so full mode captures no state")
    if isinstance(spec, str):
        try:
            pattern = re.compile(spec)
        except re.error as err:
            raise ValueError(f"inspect_layers={spec!r} is not a valid regex: {err}") from None
        chosen = tuple(name for name in recurrent if pattern.search(name))
        if not chosen:
            raise ValueError(f"inspect_layers={spec!r} matches no recurrent layer; they are: {_listing(recurrent)}")
        return chosen
    names = list(spec)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"inspect_layers={spec!r}: give a regex, a list of layer names, or None for all")
    unknown = [n for n in names if n not in recurrent]
    if unknown:
        kind = " (an attention layer: full mode records recurrent state only)" if unknown[0] in other else ""
        raise ValueError(f"inspect_layers: {unknown[0]!r} is not a recurrent layer{kind}; "
                         f"they are: {_listing(recurrent)}")
    wanted = set(names)
    return tuple(name for name in recurrent if name in wanted)


def resolve_requests(spec: RequestSpec, live: Collection[str] = (), finished: Collection[str] = ()
                     ) -> frozenset[str] | Callable[[str], bool] | None:
    """The requests `spec` names. An id that no running or waiting request has is kept (the request
    may be added later) with a warning when requests are live or the id has finished."""
    if spec is None or callable(spec):
        return spec
    ids = [spec] if isinstance(spec, str) else list(spec)
    if not ids or not all(isinstance(r, str) and r for r in ids):
        raise ValueError(f"inspect_requests={spec!r}: give a request id, a list of them, a predicate "
                         "f(request_id) -> bool, or None for every request")
    for rid in ids:
        if rid in finished:
            warnings.warn(f"inspect_requests: request {rid!r} has finished; ids are not reused, so "
                          "nothing more of it will be captured", stacklevel=3)
        elif live and rid not in live:
            warnings.warn(f"inspect_requests: no running or waiting request has id {rid!r} (they are: "
                          f"{_listing(sorted(live))}); it will be captured if it is added", stacklevel=3)
    return frozenset(ids)


def _listing(names: list[str], most: int = 12) -> str:
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "")


@dataclass
class Captured:
    """One capture of the chosen rows' states: which rows, their slots, and per layer one host
    tensor [b, *shape] per state (b = captured rows, in batch order)."""
    request_ids: list[str]
    slots: dict[str, list[int]]                      # layer -> state page of each captured row
    states: list[tuple[str, list[torch.Tensor]]]     # (layer, tensors)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] on the host. On a CPU, gathered straight into memory of its own (mapped_empty:
    a recorded state lives long, and its memory returns to the OS when the trace drops it); from a
    CUDA device, copied into pinned memory without blocking."""
    if cache.device.type != "cpu":
        return to_host(cache.index_select(0, slots))
    return torch.index_select(cache, 0, slots, out=mapped_empty((len(slots), *cache.shape[1:]), cache.dtype))


def capture_rows(req_ids: list[str], capture: CaptureFilter) -> list[int]:
    """The batch rows whose request the capture wants."""
    return [i for i, r in enumerate(req_ids) if capture.wants(r)]


def gather_states(runner, state, capture: CaptureFilter, rows: list[int], host_slots: dict[str, list[int]]
                  ) -> Captured:
    """The chosen layers' states at the chosen rows' slots (column 0 of the Mamba group's device
    block table; with prefix caching the rows' running pages, with speculative decoding the
    column each verify row starts from or, after the step, leaves its kept state in: `host_slots`),
    copied to the host.
    Nothing is read for a layer or row that is not chosen."""
    req_ids = state.input_batch.req_ids
    chosen = set(capture.layers)
    out = []
    if rows:
        for group in runner.kv_cache_groups:
            if group.kind != "mamba" or not chosen.intersection(group.layer_names):
                continue
            if runner.block_tables.aligned[group.group_id] or runner.cfg.num_speculative_tokens:
                first = next(n for n in group.layer_names if n in chosen)
                slots = to_device(np.asarray(host_slots[first], dtype=np.int64), runner.device)
            else:
                column = state.block_tables[group.group_id][:, 0]
                if len(rows) < len(req_ids):
                    column = column[to_device(np.asarray(rows), column.device)]
                slots = column.long()
            out += [(name, [_gather(t, slots) for t in runner.kv_caches[name]])
                    for name in group.layer_names if name in chosen]
    return Captured([req_ids[i] for i in rows], {n: host_slots[n] for n, _ in out}, out)
