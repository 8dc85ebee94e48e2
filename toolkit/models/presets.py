"""Tiny random-weight models for tests and demos, by name.

`PRESETS[name]()` returns a fresh transformers config (with `architectures` set). Every preset is
initialised with `CausalLM.init_random_weights(PRESET_SEED)` unless `load_model(seed=...)` says
otherwise.

Shared: vocab 320, pad/bos/eos = 0/1/2, hidden 64, 4 layers, untied embeddings, 2048 positions,
initializer_range 0.1.
Attention: 4 heads, 2 KV heads (head_dim 16), MLP 128. Mamba2: 8 heads x 16, d_state 16,
chunk 16, conv 4 (tiny-mamba2 uses n_groups=2 so group bugs show; tiny-bamba uses 1).
"""
from __future__ import annotations

from typing import Callable

from transformers import BambaConfig, LlamaConfig, Mamba2Config, PretrainedConfig

PRESET_SEED = 0

_SHARED = dict(
    vocab_size=320,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    hidden_size=64,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    num_hidden_layers=4,
    # 0.1 rather than the usual 0.02: with a 64-wide model, 0.02 gives near-uniform attention, and
    # attention bugs (scale, RoPE) would move the logits by less than the parity tolerance.
    initializer_range=0.1,
)


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        **_SHARED,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        architectures=["LlamaForCausalLM"],
    )


def tiny_mamba2() -> Mamba2Config:
    return Mamba2Config(
        **_SHARED,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=2,
        chunk_size=16,
        conv_kernel=4,
        expand=2,
        architectures=["Mamba2ForCausalLM"],
    )


def tiny_bamba() -> BambaConfig:
    return BambaConfig(
        **_SHARED,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        attn_layer_indices=[1, 3],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        mamba_d_conv=4,
        mamba_expand=2,
        architectures=["BambaForCausalLM"],
    )


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": tiny_llama,
    "tiny-mamba2": tiny_mamba2,
    "tiny-bamba": tiny_bamba,
}
