"""StepRecord: what one `LLM.step()` did, holding the objects the runner used.

The runner writes each step into persistent buffers, so the record keeps a snapshot (a clone) of
the InputBatch and of the metadata taken right after the step; nothing here is recomputed.
`generate()` takes no snapshots, so with inspection off the step pays nothing for it.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from toolkit.request import RequestOutput
from toolkit.runner.attn_utils import GroupMetadata
from toolkit.runner.input_batch import InputBatch


def snapshot(obj: Any) -> Any:
    """Deep copy that clones tensors and arrays (dataclasses, dicts, lists and tuples walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: snapshot(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return copy.copy(obj)


@dataclass
class ScheduledRequest:
    request_id: str
    num_tokens: int             # tokens scheduled this step
    num_computed_before: int    # tokens already in the cache/state before the step
    is_prefill: bool            # still consuming prompt tokens
    runs_as_decode: bool        # one token on existing state: the layers ran it as a decode (a
                                # one-token prompt chunk too); the rest ran as prefills


@dataclass
class StepRecord:
    step_index: int
    scheduled: list[ScheduledRequest]            # in batch order (decodes first)
    preempted_request_ids: list[str]
    input_batch: InputBatch | None               # None when nothing was scheduled
    attn_metadata: list[GroupMetadata]           # per layer group: common + builder output
    logits: torch.Tensor | None                  # float32 [B, vocab] in batch order
    sampled_token_ids: dict[str, int]            # every row's sample
    kept_token_ids: dict[str, int]               # samples appended to outputs (not partial prefills)
    outputs: list[RequestOutput]                 # requests that finished in this step (or in a
                                                 # generate() call since the last step)

    @property
    def num_decodes(self) -> int:
        """Rows the layers ran as decodes (the Mamba metadata's `num_decodes`)."""
        return sum(s.runs_as_decode for s in self.scheduled)

    @property
    def num_prefills(self) -> int:
        return len(self.scheduled) - self.num_decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def logits_of(self, request_id: str) -> torch.Tensor:
        """float32 [vocab]: the logits this request's row was sampled from."""
        return self.logits[self.input_batch.req_ids.index(request_id)]

    def metadata(self, kind: str) -> GroupMetadata:
        """The first group of a kind ("attention" or "mamba")."""
        for g in self.attn_metadata:
            if g.kind == kind:
                return g
        raise KeyError(f"no {kind!r} layer group in this step (groups: "
                       f"{[g.kind for g in self.attn_metadata]})")
