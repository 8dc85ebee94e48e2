"""What a step needs of its device beyond tensors: the right current CUDA device, and stage times
measured on the device as well as on the host.

- `on_device`: a runner method decorated with it runs with `torch.cuda.device(self.device)` as the
  current device, so that Triton launches and graph capture go to the engine's GPU (`cuda:1`), not
  to whichever GPU is current in the process.
- `StageClock`: the host time of each stage of a step (`time.perf_counter`) and, on CUDA, its device
  time from CUDA events recorded on the stream at the same points. The events are read only after
  the step's one sync (the sampled ids' copy), so timing adds no sync. On a CPU the ops run
  synchronously and host time is device time: no events.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch


def on_device(method: Callable) -> Callable:
    """Run `method(self, ...)` with `self.device` as the current CUDA device (nothing on a CPU)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)
    return wrapper


class StageClock:
    """`mark(name)` ends a stage begun at the previous mark (or at `start()` / `skip()`); `host`
    holds seconds per stage (a stage marked twice adds up); `device_times()`, called after the
    step's sync, the same stages on the device, for marks made with an event."""

    def __init__(self, use_events: bool, event_factory: Callable | None = None):
        self.use_events = use_events
        self.event_factory = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self.host: dict[str, float] = {}
        self._events: list[tuple[str, object]] = []     # (stage ended here, event); "" begins a stage
        self._last = 0.0

    def start(self) -> None:
        self.host, self._events = {}, []
        self.skip()

    def skip(self) -> None:
        """Begin a stage here without ending one (the time in between is nobody's)."""
        self._last = time.perf_counter()
        self._record("")

    def mark(self, name: str, event: bool = True) -> None:
        """End stage `name` here; `event=False`: host time only (e.g. after the sync, where an
        event would not have completed when the step reads it)."""
        now = time.perf_counter()
        self.host[name] = self.host.get(name, 0.0) + now - self._last
        self._last = now
        if event:
            self._record(name)

    def device_times(self) -> dict[str, float]:
        """Seconds per stage on the device (empty without events); call it after the step's sync."""
        out: dict[str, float] = {}
        for (_, begin), (name, end) in zip(self._events, self._events[1:]):
            if name:
                out[name] = out.get(name, 0.0) + begin.elapsed_time(end) / 1000.0
        return out

    def _record(self, name: str) -> None:
        if self.use_events:
            event = self.event_factory()
            event.record()
            self._events.append((name, event))
