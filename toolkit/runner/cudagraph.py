"""CUDA graphs for decode batches (MRV2 `CudaGraphManager`, FULL mode for uniform decode only).

A decode batch of n rows (every row one token on top of saved state) is padded to the next capture
size P >= n: the P - n padded rows read token 0 at position 0, their block-table rows point at the
null block / null state slot 0, their tokens' KV slots are PAD_SLOT_ID (nothing written) and their
seq_len is 1 (so attention never softmaxes an empty row). Their outputs are dropped before the
logits. Mixed prefill/decode batches, and decode batches larger than the largest capture size, run
eagerly at their own size.

Modes (`LLM(cudagraph_mode=...)`):
  "full_decode"   capture one graph per capture size at warmup (CUDA, backend "triton"), replay it
  "padded_eager"  run exactly the padded batch a graph would replay, eagerly: the padding and
                  dispatch logic on any device, so the CPU tests can check it
  "none"          every batch eager at its own size (`enforce_eager=True`)
A graph reads the persistent input buffers, block tables and slot mappings at fixed addresses: the
step writes the real batch there and replays. Metadata for capture is built by the same
`prepare_attn` as real steps (`for_capture=True`), so a contract bug fails at capture.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

MODES = ("auto", "full_decode", "padded_eager", "none")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's decode capture sizes: 1, 2, 4, then multiples of 8, up to max_num_seqs (included)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def resolve_mode(mode: str, enforce_eager: bool, device: torch.device, backend: str) -> str:
    """"auto": graphs on CUDA with the Triton ops (the torch reference ops read host values, so
    they cannot be captured), else none. enforce_eager=True forces "none"."""
    if mode not in MODES:
        raise ValueError(f"cudagraph_mode={mode!r}: use one of {MODES}")
    if enforce_eager:
        return "none"
    if mode == "auto":
        return "full_decode" if device.type == "cuda" and backend == "triton" else "none"
    if mode == "full_decode" and (device.type != "cuda" or backend != "triton"):
        raise ValueError("cudagraph_mode='full_decode' needs a CUDA device and backend='triton' "
                         f"(got device {device.type}, backend {backend!r}); 'padded_eager' runs the "
                         "same padded batches without graphs")
    return mode


@dataclass
class CaptureReport:
    sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    graph_bytes: int = 0          # CUDA memory the capture took (pool + static outputs)


class CudaGraphManager:
    """Chooses the padded size of a batch and, in "full_decode" mode, holds one graph per size.

    The runner asks `padded_size(...)`; None means "run eagerly at the batch's own size". In
    "full_decode" mode `forward(size, run)` replays the graph captured for that size (after the
    runner wrote the step's inputs into the persistent buffers) and returns its static output.
    """

    def __init__(self, mode: str, max_num_seqs: int, device: torch.device):
        self.mode = mode
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.report: CaptureReport | None = None

    def padded_size(self, num_reqs: int, num_tokens: int, all_decode: bool) -> int | None:
        if self.mode == "none" or not all_decode or num_tokens != num_reqs or num_reqs > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_reqs)

    def label(self, padded: int | None) -> str:
        """What ran, for the StepRecord: "eager", "padded eager" or "graph" (a captured graph replayed)."""
        if padded is None:
            return "eager"
        return "graph" if self.captured else "padded eager"     # full_decode before warmup: eager

    # ---- CUDA ------------------------------------------------------------------------------
    def capture(self, prepare_dummy: Callable[[int], Callable[[], torch.Tensor]],
                progress: bool = False) -> CaptureReport:
        """Capture one graph per size, largest first (they share one memory pool, as in vLLM).
        `prepare_dummy(size)` writes a padded dummy decode batch of that size into the persistent
        buffers and builds its metadata (outside the capture: host work and host-to-device copies
        cannot be captured); the forward it returns is what the graph records."""
        from tqdm.auto import tqdm
        if self.mode != "full_decode":
            return CaptureReport()
        start = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        for size in tqdm(sorted(self.sizes, reverse=True), desc="capture CUDA graphs", disable=not progress):
            prepare_dummy(size)()                     # warm up outside the capture (Triton compiles)
            forward = prepare_dummy(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = forward()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.report = CaptureReport(sorted(self.sizes), time.perf_counter() - start,
                                    torch.cuda.memory_allocated(self.device) - before)
        return self.report

    def replay(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        return self.outputs[size]

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def held_tensors(self) -> list[torch.Tensor]:
        """The graphs' static outputs (the memory ledger counts them; the pool is in the report)."""
        return list(self.outputs.values())

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None
