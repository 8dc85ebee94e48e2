"""CUDA graphs for decode batches (MRV2 `CudaGraphManager`, FULL mode for uniform decode only).

A decode batch of n rows (every row one token on top of saved state; with speculative decoding every
row its last sampled token and k drafts, t = 1 + k tokens) is padded to the next capture size
P >= n: the P - n padded rows read token 0 at positions 0..t-1, their block-table rows point at the
null block / null state page 0, their tokens' KV slots are PAD_SLOT_ID (nothing written) and their
seq_len is t (so attention never softmaxes an empty row). Their outputs are dropped before the
logits. Mixed prefill/decode batches, verify batches whose rows do not all carry k drafts, and
decode batches larger than the largest capture size, run
eagerly at their own size.

Graph families: a manager holds one graph per (capture size, tokens per row). Without speculation
that is one family, t = 1; with it, t = 1 + k, and with n-gram drafts also t = 1 (`plain_rows`): a
step none of whose rows found a match runs its rows as 1-token verify rows (no drafts to pad to k),
and has graphs of its own, captured after the 1 + k family into the same memory pool.

Modes (`LLM(cudagraph_mode=...)`):
  "full_decode"   capture one graph per capture size at warmup (CUDA, backend "triton"), replay it
  "padded_eager"  run exactly the padded batch a graph would replay, eagerly: the padding and
                  dispatch logic on any device, so the CPU tests can check it
  "none"          every batch eager at its own size (`enforce_eager=True`)
A graph reads the persistent input buffers, block tables and slot mappings at fixed addresses: the
step writes the real batch there and replays. Metadata for capture is built by the same
`prepare_attn` as real steps (`for_capture=True`), so a contract bug fails at capture.

Capture is checked as it goes: each size's graph is replayed on a dummy batch with token ids other
than the capture's and compared with the eager forward on the same inputs (greedy tokens equal,
logits within the dtype's tolerance). A graph that reads something the step does not rewrite (a
tensor that is not a persistent buffer) fails this: that size is dropped and runs eagerly, with one
warning naming the size and the first differing output (`CaptureReport.failed`). A capture that
raises releases what it captured, so no half-filled manager is left. Each manager captures on a
stream of its own (two engines in one process do not share one), keeps every captured forward (and
so its metadata tensors) alive while its graph lives, and measures the capture's memory as the
growth of the caching allocator's reserved memory (a graph pool's intermediates are freed back to
the pool, so allocated memory cannot see them).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

MODES = ("auto", "full_decode", "padded_eager", "none")


def capture_sizes(max_num_seqs: int, max_tokens: int | None = None) -> list[int]:
    """vLLM's decode capture sizes: 1, 2, 4, then multiples of 8, up to max_num_seqs (included),
    and up to `max_tokens` when the model cannot capture larger steps (a MoE layer's dense routing
    stops at DENSE_MAX_TOKENS: above it, its sparse path syncs, which a graph cannot hold)."""
    top = max_num_seqs if max_tokens is None else min(max_num_seqs, max_tokens)
    if top < 1:                     # not one row fits (a verify row longer than the step's budget)
        return []
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
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
    sizes: list[int] = field(default_factory=list)    # sizes whose graph replays (checked at capture)
    seconds: float = 0.0                              # capture and its check
    graph_bytes: int = 0          # CUDA memory the capture took (growth of reserved memory)
    failed: dict[int, str] = field(default_factory=dict)   # size -> why its graph was dropped (runs eagerly)
    check_seconds: float = 0.0                        # of `seconds`, the replay-vs-eager checks
    # n-gram speculation (`plain_rows`): the 1-token family's sizes that replay, and those dropped
    plain_sizes: list[int] = field(default_factory=list)
    plain_failed: dict[int, str] = field(default_factory=dict)


# (atol, rtol) of a replayed graph's logits against the eager forward on the same inputs
CHECK_TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2), torch.bfloat16: (6e-2, 2e-2)}
# the check: (size, run eagerly, replay) -> None, or the first differing output in words
CaptureCheck = Callable[[int, Callable[[], torch.Tensor], Callable[[], torch.Tensor]], "str | None"]


def replay_differs(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> str | None:
    """A replay's logits `got` [B, V] against the eager forward's `want` (float32): None when the greedy
    tokens are equal and the logits within CHECK_TOLERANCE of the model's dtype, else the first
    differing output in words."""
    atol, rtol = CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE[torch.float32])
    tokens = want.argmax(-1) != got.argmax(-1)
    bad = (got - want).abs() > atol + rtol * want.abs()
    if not (tokens.any() or bad.any()):
        return None
    row = int(tokens.nonzero()[0, 0]) if tokens.any() else int(bad.nonzero()[0, 0])
    col = int((got[row] - want[row]).abs().argmax())
    return (f"row {row}: eager token {int(want[row].argmax())}, graph token {int(got[row].argmax())}; "
            f"logit {col}: eager {float(want[row, col]):.6g}, graph {float(got[row, col]):.6g} "
            f"(tolerance {atol:g} + {rtol:g} * |eager|)")


class CudaGraphManager:
    """Chooses the padded size of a batch and, in "full_decode" mode, holds one graph per size.

    The runner asks `padded_size(...)`; None means "run eagerly at the batch's own size". In
    "full_decode" mode `forward(size, run)` replays the graph captured for that size (after the
    runner wrote the step's inputs into the persistent buffers) and returns its static output.
    """

    def __init__(self, mode: str, max_num_seqs: int, device: torch.device, max_tokens: int | None = None,
                 tokens_per_row: int = 1, plain_rows: bool = False):
        self.mode = mode
        self.device = device
        # speculative decoding: a decode row is a verify row of 1 + k tokens; graphs are for batches
        # whose rows all carry k drafts (vLLM's FULL graphs: uniform 1 + k decode batches), and with
        # `plain_rows` (n-gram drafts) for batches none of whose rows carries one (module docstring)
        self.tokens_per_row = tokens_per_row
        self.families = [tokens_per_row] + ([1] if plain_rows and tokens_per_row > 1 else [])
        self.family_sizes = {t: capture_sizes(max_num_seqs, None if max_tokens is None else max_tokens // t)
                             for t in self.families}
        self.sizes = self.family_sizes[tokens_per_row]
        # keyed by (capture size, tokens per row)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.forwards: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}   # keep each graph's inputs alive
        self.pool = None
        self.stream: torch.cuda.Stream | None = None
        self.report: CaptureReport | None = None

    def padded_size(self, num_reqs: int, num_tokens: int, all_decode: bool) -> int | None:
        """The capture size a decode batch runs at (rows), or None: run eagerly at its own size. Its
        tokens per row (num_tokens / num_reqs) pick the family."""
        t = num_tokens // num_reqs if num_reqs else 0
        sizes = self.family_sizes.get(t) if num_reqs and num_tokens == num_reqs * t else None
        if self.mode == "none" or not all_decode or not sizes or num_reqs > sizes[-1]:
            return None
        return next(s for s in sizes if s >= num_reqs)

    def label(self, padded: int | None, tokens_per_row: int | None = None) -> str:
        """What ran, for the StepRecord: "eager", "padded eager" or "graph" (a captured graph replayed)."""
        if padded is None:
            return "eager"
        return "graph" if self.has_graph(padded, tokens_per_row) else "padded eager"   # before warmup, or dropped

    def has_graph(self, size: int | None, tokens_per_row: int | None = None) -> bool:
        """Whether a graph of `size` rows of `tokens_per_row` tokens (default: 1 + k) replays."""
        return (size, tokens_per_row or self.tokens_per_row) in self.graphs

    # ---- capture -------------------------------------------------------------------------------
    def capture(self, prepare_dummy: Callable[..., Callable[[], torch.Tensor]], check: CaptureCheck | None = None,
                progress: bool = False) -> CaptureReport:
        """Capture one graph per size, largest first (they share one memory pool, as in vLLM), each
        checked by `check` right after (see the module docstring), family by family (1 + k tokens a
        row, then 1). `prepare_dummy(size, tokens_per_row, vary_tokens=False)` writes a padded dummy
        decode batch of that size into the persistent buffers and builds its metadata (outside the
        capture: host work and host-to-device copies cannot be captured); the forward it returns is
        what the graph records. If anything raises, everything captured so far is released and the
        error propagates."""
        if self.mode != "full_decode":
            return CaptureReport()
        start = time.perf_counter()
        before = self._reserved_bytes()
        report = CaptureReport()
        keys = [(size, t) for t in self.families for size in sorted(self.family_sizes[t], reverse=True)]
        try:
            for key in tqdm(keys, desc="capture CUDA graphs", disable=not progress):
                size, t = key
                forward = prepare_dummy(size, t)
                self.graphs[key], self.outputs[key] = self._record(forward)
                self.forwards[key] = forward
                if check is not None:
                    checked = time.perf_counter()
                    problem = check(size, lambda s=size, t=t: prepare_dummy(s, t, True)(),
                                    lambda s=size, t=t: self._replay_checked(s, t, prepare_dummy))
                    report.check_seconds += time.perf_counter() - checked
                    if problem is not None:
                        self._drop(key)
                        (report.failed if t == self.tokens_per_row else report.plain_failed)[size] = problem
        except BaseException:
            self.release()
            raise
        report.sizes = sorted(s for s, t in self.graphs if t == self.tokens_per_row)
        report.plain_sizes = sorted(s for s, t in self.graphs if t != self.tokens_per_row)
        report.seconds = time.perf_counter() - start
        report.graph_bytes = self._reserved_bytes() - before
        for failed, family in ((report.failed, self.tokens_per_row), (report.plain_failed, 1)):
            if failed:
                size, why = next(iter(failed.items()))
                what = "decode graph sizes" if family == self.tokens_per_row else "1-token decode graph sizes"
                warnings.warn(f"CUDA graph check: {len(failed)} of {len(self.family_sizes[family])} {what} "
                              f"replayed differently from the eager forward and run eagerly instead "
                              f"({sorted(failed)}); size {size}: {why}", RuntimeWarning, stacklevel=3)
        self.report = report
        return report

    def _replay_checked(self, size: int, tokens_per_row: int, prepare_dummy) -> torch.Tensor:
        """Replay `size`'s graph on the check's inputs: the same dummy batch as the eager run, with
        its token ids, written into the persistent buffers (metadata built anew, not used: a graph
        reads only what the step rewrites)."""
        prepare_dummy(size, tokens_per_row, True)
        return self.replay(size, tokens_per_row)

    def _drop(self, key: tuple[int, int]) -> None:
        for held in (self.graphs, self.outputs, self.forwards):
            held.pop(key, None)

    def _record(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """CUDA: run `forward` once, then capture it into a graph, both on this manager's own stream
        (the warm-up compiles the Triton kernels and allocates the stream's cuBLAS workspace, which
        must not first happen inside a capture) and pool."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))     # the dummy batch's copies
        with torch.cuda.stream(self.stream):
            forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            output = forward()
        torch.cuda.synchronize(self.device)
        return graph, output

    def _reserved_bytes(self) -> int:
        """CUDA memory the caching allocator holds, after clearing what it can give back (so that
        the difference around the capture is what the graphs keep)."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def replay(self, size: int, tokens_per_row: int | None = None) -> torch.Tensor:
        key = (size, tokens_per_row or self.tokens_per_row)
        self.graphs[key].replay()
        return self.outputs[key]

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def held_tensors(self) -> list[torch.Tensor]:
        """The graphs' static outputs (the memory ledger counts them; the pool is in the report)."""
        return list(self.outputs.values())

    def release(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
        self.forwards.clear()
        self.pool = None
        self.stream = None
