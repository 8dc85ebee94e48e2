"""Shard a built model over a tensor-parallel group (vLLM's TP layouts, `toolkit/layers/parallel.py`).

`check_tensor_parallel` refuses, before anything is sharded, a model this toolkit cannot shard yet
and a configuration whose dimensions the group size does not divide (naming the dimension, as vLLM
refuses it). `shard_model` then keeps each rank's slices in place: every layer with a `shard_`
method (attention by heads, MLP by intermediate channels, the Mamba1 mixer and the short conv by
channels, the Mamba2 mixer by heads with its groups split or replicated, MoE experts by their
intermediate channels), the embedding and the LM head by rows of the padded vocabulary. Norms and
the residual stream stay whole on every rank.

Sharding works on the meta device too: that is how a checkpoint is loaded sharded (`load_model(...,
tp=...)` in `loader.py`): the model is built and sharded on the meta device, each sharded parameter
recording the entries it keeps (`toolkit.layers.parallel.SourceSlice`), and only those are read
from the files. Such a model comes back sharded; `shard_model` on it again is a no-op.
"""
from __future__ import annotations

from torch import nn

from toolkit.distributed import TPGroup
from toolkit.errors import NotSupportedYetError
from toolkit.layers.parallel import VocabParallelEmbedding, padded_vocab, shard_lm_head
from toolkit.models.base import CausalLM

# the architectures whose every layer has a shard_ method
SHARDABLE = ("LlamaForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM",
             "BambaForCausalLM", "Lfm2ForCausalLM", "JambaForCausalLM", "GraniteMoeHybridForCausalLM",
             "NemotronHForCausalLM", "FalconH1ForCausalLM", "Zamba2ForCausalLM", "Qwen3NextForCausalLM",
             "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "OlmoHybridForCausalLM",
             "KimiLinearForCausalLM", "Lfm2MoeForCausalLM", "MiniMaxForCausalLM", "Lfm3ForCausalLM",
             "xLSTMForCausalLM")


def check_tensor_parallel(model: CausalLM, tp_size: int) -> None:
    """Raise if `model` cannot run sharded over `tp_size` ranks (nothing to check for one rank):
    each shardable layer checks its own dimensions (`check_shardable`), then the vocabulary."""
    if tp_size == 1:
        return
    if model.hf_architecture not in SHARDABLE:
        raise NotSupportedYetError(f"tensor_parallel_size={tp_size}: sharding is built for {', '.join(SHARDABLE)} "
                                   f"so far, not {model.hf_architecture}")
    for module in model.modules():
        check = getattr(module, "check_shardable", None)
        if check is not None:
            check(tp_size)
    vocab = model.config.vocab_size
    if padded_vocab(vocab) % tp_size:
        raise ValueError(f"the vocabulary padded to a multiple of 64 ({padded_vocab(vocab)} for vocab_size {vocab}) "
                         f"must be divisible by tensor parallel size ({tp_size})")


def shard_model(model: CausalLM, tp: TPGroup) -> CausalLM:
    """Keep this rank's slices of `model` (in place; returned). Call `check_tensor_parallel` first.
    A model already sharded for `tp` (`load_model(..., tp=tp)`) is returned as it is."""
    if model.tp == tp:
        return model
    if model.tp.sharded:
        raise ValueError(f"the model is already sharded for rank {model.tp.rank} of {model.tp.world_size}, "
                         f"not rank {tp.rank} of {tp.world_size}")
    tied = model.is_tied
    for module in list(model.modules()):
        shard = getattr(module, "shard_", None)
        if shard is not None:
            shard(tp)
    body = model.body
    embed = getattr(body, body.embed_name)
    if not isinstance(embed, nn.Embedding):
        raise NotSupportedYetError(f"{model.hf_architecture}: the input embedding is a {type(embed).__name__}")
    setattr(body, body.embed_name, VocabParallelEmbedding(embed, tp))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
        model.lm_head.out_features = model.lm_head.weight.shape[0]
    else:
        shard_lm_head(model.lm_head, model.config.vocab_size, tp)
    model.tp = tp
    return model
