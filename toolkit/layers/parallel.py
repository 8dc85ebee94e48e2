"""Tensor-parallel sharding of built layers (vLLM `layers/linear.py`, `vocab_parallel_embedding.py`).

A model is built whole on every rank (a preset's seeded weights; a checkpoint's model on the meta
device, see below), then each rank keeps its slices in place (`toolkit/models/tensor_parallel.py`
walks the model):
- column-parallel (`shard_columns`): a projection's output features [out/tp, in] (and bias rows);
  the rank computes its heads / channels with no communication;
- row-parallel (`shard_rows`): a projection's input features [out, in/tp]; its output is a partial
  sum, all-reduced by the layer (one `[T, hidden]` all-reduce per block half); the bias is added
  on rank 0 only (zeros elsewhere), as vLLM's RowParallelLinear adds it;
- vocab-parallel: the vocabulary padded to a multiple of 64 (`padded_vocab`), rank r keeping rows
  [r*Vp/tp, (r+1)*Vp/tp) (padding rows zero); the embedding looks up its own ids and all-reduces,
  the LM head's local logits are all-gathered and cut to the real vocabulary.
Parameter names do not change, so a sharded model's state dict names what the checkpoint names.

Every sharded parameter is made by `_kept` / `_zeros` here, which record on it (`tp_source`, a
`SourceSlice`) which entries of the whole tensor it holds. That is how sharded loading reads only a
rank's slices (`toolkit/models/loader.py`): the model is built and sharded on the meta device (free),
then each parameter's recorded selection is read from the safetensors files. The layouts thus live in
the `shard_` methods alone; layer code slices parameters only through these helpers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.distributed import SINGLE, TPGroup

VOCAB_PADDING = 64


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary padded to a multiple of 64 (vLLM `pad_vocab_size`)."""
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING


@dataclass(frozen=True)
class SourceSlice:
    """What a sharded parameter holds of the whole (checkpoint) tensor, its `tp_source`: per dim, the
    kept indices (-1: a zero entry, the vocabulary's padding) or None for all; `zeros`: nothing of it
    (a row-parallel bias on ranks != 0), only zeros."""
    index: tuple[torch.Tensor | None, ...]
    zeros: bool = False


def source_slice(p: torch.Tensor) -> SourceSlice | None:
    """The selection `p` holds of its whole tensor; None: all of it (not sharded)."""
    return getattr(p, "tp_source", None)


def _recorded(t: torch.Tensor, like: nn.Parameter, source: SourceSlice) -> nn.Parameter:
    p = nn.Parameter(t.contiguous(), requires_grad=like.requires_grad)
    p.tp_source = source
    return p


def _kept(like: nn.Parameter, dim: int, index: torch.Tensor) -> nn.Parameter:
    """A new parameter holding entries `index` of `like` along `dim` (-1: zeros), recording them
    composed with what `like` already held of its whole tensor."""
    index = index.to(torch.long)
    pad = index < 0
    picked = like.data[(slice(None),) * dim + (index.clamp(min=0),)]
    if bool(pad.any()):
        picked.index_fill_(dim, pad.nonzero().squeeze(1).to(picked.device), 0)
    prev = source_slice(like) or SourceSlice((None,) * like.dim())
    old = prev.index[dim]
    if old is not None:
        index = torch.where(pad, -1, old[index.clamp(min=0)])
    return _recorded(picked, like, SourceSlice(prev.index[:dim] + (index,) + prev.index[dim + 1:], prev.zeros))


def _zeros(like: nn.Parameter) -> nn.Parameter:
    """A new parameter of zeros shaped as `like` (nothing of the checkpoint to read)."""
    return _recorded(torch.zeros_like(like.data), like, SourceSlice((None,) * like.dim(), zeros=True))


def _span(start: int, size: int) -> torch.Tensor:
    return torch.arange(start, start + size)


def shard_columns(linear: nn.Linear, start: int, size: int) -> None:
    """Column-parallel: keep output features [start, start + size) (weight rows, bias entries)."""
    keep_rows(linear, _span(start, size))


def keep_entries(module: nn.Module, name: str, index: torch.Tensor, dim: int = 0) -> None:
    """Keep entries `index` along `dim` of parameter `name` of `module` (per-head / per-channel
    vectors; the experts' intermediate channels of a fused [E, ...] tensor)."""
    setattr(module, name, _kept(getattr(module, name), dim, index))


def keep_rows(module: nn.Module, index: torch.Tensor) -> None:
    """Keep rows `index` of a module's weight and bias (dim 0: a Linear's output features, a depthwise
    Conv1d's channels): a fused projection's sections, each sliced on its own."""
    module.weight = _kept(module.weight, 0, index)
    if getattr(module, "bias", None) is not None:
        module.bias = _kept(module.bias, 0, index)
    if isinstance(module, nn.Linear):
        module.out_features = len(index)


def shard_rows(linear: nn.Linear, start: int, size: int, tp: TPGroup) -> None:
    """Row-parallel: keep input features [start, start + size) (weight columns); the bias stays whole
    on rank 0 and becomes zeros elsewhere (the all-reduce of the outputs adds it once)."""
    linear.weight = _kept(linear.weight, 1, _span(start, size))
    if linear.bias is not None and tp.rank != 0:
        linear.bias = _zeros(linear.bias)
    linear.in_features = size


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(first id, rows) of this rank's slice of the padded vocabulary."""
    per = padded_vocab(vocab_size) // tp.world_size
    return tp.rank * per, per


def _vocab_rows(weight: nn.Parameter, vocab_size: int, tp: TPGroup) -> nn.Parameter:
    """This rank's rows of the padded vocabulary [per, dim]: the real rows it owns, zeros after."""
    start, per = vocab_shard(vocab_size, tp)
    real = max(min(vocab_size - start, per), 0)
    return _kept(weight, 0, torch.cat([_span(start, real), torch.full((per - real,), -1)]))


class VocabParallelEmbedding(nn.Module):
    """ids [T] -> [T, dim] from this rank's slice of the padded vocabulary: ids it does not own read
    a zero row, and the all-reduce over ranks assembles every row (vLLM `VocabParallelEmbedding`)."""

    def __init__(self, full: nn.Embedding, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = full.num_embeddings            # the real vocabulary
        self.embedding_dim = full.embedding_dim
        self.start, self.rows = vocab_shard(full.num_embeddings, tp)
        self.weight = _vocab_rows(full.weight, full.num_embeddings, tp)
        self.multiplier = getattr(full, "multiplier", None)      # a scaled embedding (Granite) keeps its scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))
        return out if self.multiplier is None else out * self.multiplier


def shard_lm_head(lm_head: nn.Linear, vocab_size: int, tp: TPGroup) -> None:
    """The LM head's rows of the padded vocabulary (its logits are all-gathered by the model)."""
    lm_head.weight = _vocab_rows(lm_head.weight, vocab_size, tp)
    lm_head.out_features = lm_head.weight.shape[0]


def shard_gated_mlp(gate: nn.Linear, up: nn.Linear, down: nn.Linear, tp: TPGroup) -> None:
    """A gated MLP down(act(gate(x)) * up(x)): gate / up column-parallel over the intermediate size,
    down row-parallel (its output all-reduced by the MLP)."""
    size = down.in_features // tp.world_size
    shard_columns(gate, tp.rank * size, size)
    shard_columns(up, tp.rank * size, size)
    shard_rows(down, tp.rank * size, size, tp)


def check_divides(what: str, size: int, tp_size: int) -> None:
    """ValueError naming the dimension when `tp_size` does not divide `size`."""
    if size % tp_size:
        raise ValueError(f"{what} ({size}) must be divisible by tensor parallel size ({tp_size})")


class ShardedGatedMLP:
    """Mixin for a gated MLP down(act(gate(x)) * up(x)) whose three nn.Linear attributes are named by
    `tp_projections` (gate, up, down): its `check_shardable` and `shard_`; its forward all-reduces
    `self.tp.all_reduce(down(...))`."""
    tp: TPGroup = SINGLE
    tp_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def check_shardable(self, tp_size: int) -> None:
        check_divides("the MLP's intermediate size", getattr(self, self.tp_projections[2]).in_features, tp_size)

    def shard_(self, tp: TPGroup) -> None:
        shard_gated_mlp(*(getattr(self, name) for name in self.tp_projections), tp)
        self.tp = tp
