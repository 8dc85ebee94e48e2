"""`check_logprobs_close`: are two runs the same model, judged by their logprobs (vLLM's rule).

Greedy tokens of two correct implementations can part where two candidates are almost equally
likely; after that the sequences differ and nothing more can be compared. vLLM's model tests
(`tests/models/utils.py: check_logprobs_close`) therefore accept a difference at a position when
each run's token is among the other's top-k there, and stop comparing that sequence; anything else
is a failure. This is the tolerant, standard way to say "same model" across HF and an engine.

A sequence is given as
- a `CompletionOutput` (its `token_ids` and `logprobs`: SamplingParams(logprobs=k)), or a
  `RequestOutput` (its first completion);
- a pair `(token_ids, logprobs)` where `logprobs` is a list with one entry per token: a dict
  {token id: Logprob or float}, or a 1-D tensor over the vocabulary;
- a pair `(token_ids, tensor [T, V])` of logits or logprobs (HF's `logits[len(prompt) - 1:]`);
  log_softmax is applied to tensors, which leaves logprobs as they are.

The top-k of a position are its k most likely tokens among what it holds (a dict from
`logprobs=k` holds the top k and the chosen token). With `atol`, the chosen token's logprobs are
also compared where the tokens agree.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LogprobsMismatch:
    """The first position where the rule fails."""
    sequence: int               # index of the sequence pair
    position: int               # index of the output token in the sequence
    token_0: int
    token_1: int
    message: str

    def __str__(self) -> str:
        return f"sequence {self.sequence}, position {self.position}: {self.message}"


@dataclass
class LogprobsCloseReport:
    name_0: str
    name_1: str
    k: int
    atol: float | None
    num_sequences: int = 0
    num_positions: int = 0       # positions compared, over all sequences
    max_abs_diff: float = 0.0    # the largest |logprob difference| of the chosen tokens compared (atol set)
    divergences: list[tuple[int, int]] = field(default_factory=list)   # (sequence, position) where the
                                 # tokens parted within each other's top-k (comparison stopped there)
    failure: LogprobsMismatch | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        head = (f"{self.name_0} vs {self.name_1}: {self.num_sequences} sequences, {self.num_positions} "
                f"positions compared (top-{self.k} rule")
        head += f", chosen-token logprobs within {self.atol:g}; max diff {self.max_abs_diff:.2e})" \
            if self.atol is not None else ")"
        if self.failure is not None:
            return f"{head}: FAILED at {self.failure}"
        parted = f"; tokens parted within top-{self.k} at {self.divergences}" if self.divergences else ""
        return f"{head}: close{parted}"


def _as_pair(output: Any) -> tuple[list[int], Any]:
    if hasattr(output, "outputs"):                  # RequestOutput
        output = output.outputs[0]
    if hasattr(output, "token_ids") and hasattr(output, "logprobs"):     # CompletionOutput
        if output.logprobs is None:
            raise ValueError("the CompletionOutput has no logprobs: run with SamplingParams(logprobs=k)")
        return list(output.token_ids), output.logprobs
    token_ids, logprobs = output
    return [int(t) for t in token_ids], logprobs


def _position(logprobs: Any, i: int) -> dict[int, float] | torch.Tensor | None:
    if isinstance(logprobs, torch.Tensor):
        return torch.log_softmax(logprobs[i].float(), dim=-1) if i < logprobs.shape[0] else None
    if i >= len(logprobs) or logprobs[i] is None:
        return None
    entry = logprobs[i]
    if isinstance(entry, torch.Tensor):
        return torch.log_softmax(entry.float(), dim=-1)
    return {int(t): float(getattr(v, "logprob", v)) for t, v in entry.items()}


def _top(entry: dict[int, float] | torch.Tensor, k: int) -> list[int]:
    if isinstance(entry, torch.Tensor):
        return entry.topk(min(k, entry.numel())).indices.tolist()
    return [t for t, _ in sorted(entry.items(), key=lambda kv: -kv[1])[:k]]


def _value(entry: dict[int, float] | torch.Tensor, token: int) -> float | None:
    if isinstance(entry, torch.Tensor):
        return float(entry[token])
    return entry.get(token)


def check_logprobs_close(outputs_0: Sequence[Any], outputs_1: Sequence[Any], *, name_0: str = "outputs_0",
                         name_1: str = "outputs_1", k: int = 5, atol: float | None = None) -> LogprobsCloseReport:
    """Compare two lists of sequences position by position (vLLM's `check_logprobs_close`): where
    the tokens agree, go on (and with `atol`, the chosen token's logprobs must agree within it);
    where they differ, each token must be among the other's top-k, and the sequence is not compared
    further. Returns a report whose `failure` is the first position that breaks the rule (None
    when all pass); `report.raise_if_failed()` raises AssertionError with it."""
    if len(outputs_0) != len(outputs_1):
        raise ValueError(f"{len(outputs_0)} sequences from {name_0} but {len(outputs_1)} from {name_1}")
    report = LogprobsCloseReport(name_0, name_1, k, atol, num_sequences=len(outputs_0))
    for s, (out_0, out_1) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        ids_0, lps_0 = _as_pair(out_0)
        ids_1, lps_1 = _as_pair(out_1)
        for i, (t0, t1) in enumerate(zip(ids_0, ids_1, strict=False)):    # the shorter one's length
            report.num_positions += 1
            why = _position_failure(report, _position(lps_0, i), _position(lps_1, i), t0, t1)
            if why is not None:
                report.failure = LogprobsMismatch(s, i, t0, t1, why)
                return report
            if t0 != t1:
                report.divergences.append((s, i))
                break
    return report


def _position_failure(report: LogprobsCloseReport, e0, e1, t0: int, t1: int) -> str | None:
    """Why one position breaks the rule (None: it passes); updates report.max_abs_diff."""
    name_0, name_1, k = report.name_0, report.name_1, report.k
    if e0 is None or e1 is None:
        return f"no logprobs at this position ({name_0 if e0 is None else name_1})"
    if t0 == t1:
        if report.atol is None:
            return None
        v0, v1 = _value(e0, t0), _value(e1, t1)
        if v0 is None or v1 is None:
            return f"token {t0} has no logprob in {name_0 if v0 is None else name_1}"
        diff = abs(v0 - v1)
        report.max_abs_diff = max(report.max_abs_diff, diff)
        if diff > report.atol:
            return (f"token {t0}: logprob {v0:.6g} ({name_0}) vs {v1:.6g} ({name_1}), "
                    f"|diff| {diff:.2e} > {report.atol:g}")
        return None
    top_0, top_1 = _top(e0, k), _top(e1, k)
    missing = []
    if t0 not in top_1:
        missing.append(f"{name_0}'s token {t0} is not in {name_1}'s top-{k} {top_1}")
    if t1 not in top_0:
        missing.append(f"{name_1}'s token {t1} is not in {name_0}'s top-{k} {top_0}")
    return "; ".join(missing) or None
