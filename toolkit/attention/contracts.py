"""Field contracts between `CommonAttentionMetadata` and the builders that consume it.

Each builder declares `required_fields`; `check_required_fields` runs before every `build()` and
raises `MetadataContractError` naming the field, the builder and the producer (the model state
that built the common metadata) instead of a bare assert deep inside a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit.errors import MetadataContractError


@dataclass(frozen=True)
class FieldSpec:
    name: str
    dtype: torch.dtype | None = None
    on_cpu: bool = False           # must live on the CPU (host-side bookkeeping, no device sync)
    shape: str = ""                # "[B]", "[B+1]", "[T]", "[B, *]" or "" (not a tensor / unchecked)

    def expected_shape(self, num_reqs: int, num_tokens: int) -> tuple[int | None, ...] | None:
        table = {"[B]": (num_reqs,), "[B+1]": (num_reqs + 1,), "[T]": (num_tokens,),
                 "[B, *]": (num_reqs, None)}
        return table.get(self.shape)


def check_required_fields(common, specs: tuple[FieldSpec, ...], builder: str, producer: str) -> None:
    for spec in specs:
        value = getattr(common, spec.name, None)
        if value is None:
            raise MetadataContractError(spec.name, builder, producer, "is missing (None)")
        if not spec.shape and spec.dtype is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise MetadataContractError(spec.name, builder, producer,
                                        f"must be a tensor, got {type(value).__name__}")
        if spec.dtype is not None and value.dtype != spec.dtype:
            raise MetadataContractError(spec.name, builder, producer,
                                        f"must have dtype {spec.dtype}, got {value.dtype}")
        if spec.on_cpu and value.device.type != "cpu":
            raise MetadataContractError(spec.name, builder, producer,
                                        f"must live on the CPU, got {value.device}")
        want = spec.expected_shape(common.num_reqs, common.num_actual_tokens)
        if want is not None:
            ok = len(value.shape) == len(want) and all(w is None or w == s
                                                       for w, s in zip(want, value.shape))
            if not ok:
                shown = tuple("*" if w is None else w for w in want)
                raise MetadataContractError(
                    spec.name, builder, producer,
                    f"must have shape {spec.shape} = {shown}, got {tuple(value.shape)}")
