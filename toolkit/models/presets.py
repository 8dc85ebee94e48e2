"""Tiny random-weight models for tests and demos, by name.

`PRESETS[name]()` returns a fresh transformers config (with `architectures` set). Every preset is
initialised with `CausalLM.init_random_weights(PRESET_SEED)` unless `load_model(seed=...)` says
otherwise.

Shared: vocab 320, pad/bos/eos = 0/1/2, hidden 64, 4 layers, untied embeddings, 2048 positions,
initializer_range 0.1.
Attention: 4 heads, 2 KV heads (head_dim 16), MLP 128. Mamba2: 8 heads x 16, d_state 16,
chunk 16, conv 4 (tiny-mamba2 uses n_groups=2 so group bugs show; tiny-bamba uses 1).
tiny-mamba / tiny-falcon-mamba (Mamba1): d_state 16, expand 2 (d_inner 128), conv 4;
tiny-mamba: time_step_rank 8 and TIED embeddings (MambaConfig's default, as the state-spaces
checkpoints ship); tiny-falcon-mamba: time_step_rank "auto" (= 4) and untied, so both
lm_head paths are covered.
tiny-jamba: layers mamba, attention, mamba, attention (attn period 2 / offset 1), MoE on layers
1 and 3 (expert period 2 / offset 1; 4 experts, top-2), attention as above (no RoPE in Jamba),
Mamba1 d_state 16, dt_rank 8, expand 2, conv 4.
tiny-lfm2: layers conv, full_attention, conv, full_attention; attention as above (plus q/k
norms); short conv L_cache 3; FFN 128 (block_auto_adjust_ff_dim off, else HF would build 256);
tied embeddings, as LFM2 ships.

Shape-true presets (real model dimensions, random weights; for benchmarks, not CPU tests):
lfm2-350m-shape: LiquidAI/LFM2-350M -- hidden 1024, 16 layers, attention at 2, 5, 8, 10, 12, 14
(16 heads / 8 KV heads), short conv L_cache 3, intermediate_size 6656 auto-adjusted by HF to an
FFN of 4608, vocab 65536, tied, RoPE theta 1e6, eos 7 (354.5M parameters).
mamba-130m-shape: state-spaces/mamba-130m(-hf) -- hidden 768, 24 layers, d_state 16, expand 2,
conv 4, time_step_rank 48 ("auto"), vocab 50280, tied, pad/bos/eos 0/0/0 (129.1M parameters).
mamba2-130m-shape: state-spaces/mamba2-130m, as in the H200 HF baseline -- hidden 768, 24 layers,
24 heads x 64, d_state 128, n_groups 1, expand 2, conv 4, chunk 256, vocab 50288, untied as the
baseline's config defaults were (167.6M parameters; the released checkpoint ties its head).
bamba-300m-shape: the H200 baseline's "bamba-like-300m" -- hidden 1024, 24 layers, attention at 5,
11, 17, 23 (16 heads / 8 KV heads), 32 Mamba2 heads x 64, d_state 128, n_groups 1, expand 2,
chunk 256, FFN 2816, vocab 32000.
"""
from __future__ import annotations

from collections.abc import Callable

from transformers import (
    BambaConfig,
    FalconMambaConfig,
    GraniteMoeHybridConfig,
    JambaConfig,
    Lfm2Config,
    LlamaConfig,
    Mamba2Config,
    MambaConfig,
    NemotronHConfig,
    PretrainedConfig,
)

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


def tiny_lfm2() -> Lfm2Config:
    return Lfm2Config(
        **{**_SHARED, "tie_word_embeddings": True},
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        block_auto_adjust_ff_dim=False,
        conv_L_cache=3,
        architectures=["Lfm2ForCausalLM"],
    )


LFM2_350M_LAYER_TYPES = [
    "full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)
]


def lfm2_350m_shape() -> Lfm2Config:
    return Lfm2Config(
        vocab_size=65536,
        hidden_size=1024,
        intermediate_size=6656,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0,
        block_multiple_of=256,
        num_hidden_layers=16,
        layer_types=list(LFM2_350M_LAYER_TYPES),
        num_attention_heads=16,
        num_key_value_heads=8,
        conv_L_cache=3,
        conv_bias=False,
        norm_eps=1e-5,
        max_position_embeddings=128000,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=7,
        initializer_range=0.02,
        architectures=["Lfm2ForCausalLM"],
    )


def tiny_mamba() -> MambaConfig:
    return MambaConfig(
        **{**_SHARED, "tie_word_embeddings": True},
        state_size=16,
        expand=2,
        conv_kernel=4,
        time_step_rank=8,
        architectures=["MambaForCausalLM"],
    )


def tiny_falcon_mamba() -> FalconMambaConfig:
    return FalconMambaConfig(
        **_SHARED,
        state_size=16,
        expand=2,
        conv_kernel=4,
        time_step_rank="auto",
        architectures=["FalconMambaForCausalLM"],
    )


def tiny_jamba() -> JambaConfig:
    return JambaConfig(
        **_SHARED,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
        mamba_dt_rank=8,
        mamba_expand=2,
        mamba_d_conv=4,
        architectures=["JambaForCausalLM"],
    )


def mamba2_130m_shape() -> Mamba2Config:
    return Mamba2Config(
        vocab_size=50288,
        hidden_size=768,
        num_hidden_layers=24,
        num_heads=24,
        head_dim=64,
        state_size=128,
        n_groups=1,
        expand=2,
        conv_kernel=4,
        chunk_size=256,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.1,
        architectures=["Mamba2ForCausalLM"],
    )


def bamba_300m_shape() -> BambaConfig:
    return BambaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        attn_layer_indices=[5, 11, 17, 23],
        mamba_n_heads=32,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_chunk_size=256,
        mamba_d_conv=4,
        mamba_expand=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.1,
        architectures=["BambaForCausalLM"],
    )


def mamba_130m_shape() -> MambaConfig:
    return MambaConfig(
        vocab_size=50280,
        hidden_size=768,
        num_hidden_layers=24,
        state_size=16,
        expand=2,
        conv_kernel=4,
        time_step_rank="auto",
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.1,
        architectures=["MambaForCausalLM"],
    )

PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": tiny_llama,
    "tiny-mamba2": tiny_mamba2,
    "tiny-bamba": tiny_bamba,
    "tiny-mamba": tiny_mamba,
    "tiny-falcon-mamba": tiny_falcon_mamba,
    "tiny-jamba": tiny_jamba,
    "mamba-130m-shape": mamba_130m_shape,
    "mamba2-130m-shape": mamba2_130m_shape,
    "bamba-300m-shape": bamba_300m_shape,
    "tiny-lfm2": tiny_lfm2,
    "lfm2-350m-shape": lfm2_350m_shape,
}


def tiny_nemotron_h() -> NemotronHConfig:
    """tiny-nemotron-h: pattern "M-MEM*E" (Mamba2, relu2 MLP, Mamba2, MoE, Mamba2, attention, MoE);
    attention 4 heads / 2 KV heads x 16 (no RoPE), MLP 128; Mamba2 8 heads x 16, d_state 16,
    n_groups 2, chunk 16, conv 4; MoE 4 relu2 experts of 32, top-2 (sigmoid scores, renormalised,
    x2.5 as Nemotron-3 Nano), shared expert 48. Untied (NemotronH never ties)."""
    shared = {k: v for k, v in _SHARED.items() if k != "num_hidden_layers"}   # from the pattern
    return NemotronHConfig(
        **shared,
        hybrid_override_pattern="M-MEM*E",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        chunk_size=16,
        conv_kernel=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        routed_scaling_factor=2.5,
        architectures=["NemotronHForCausalLM"],
    )


def tiny_granite_hybrid() -> GraniteMoeHybridConfig:
    """tiny-granite-hybrid: layers mamba, attention, mamba, mamba; attention 4 heads / 2 KV heads
    (head_dim 16) with RoPE; Mamba2 8 heads x 16, d_state 16, n_groups 2, chunk 16, conv 4; MoE 4
    SwiGLU experts of 32, top-2, shared expert 64; multipliers unlike 1 so each shows: embedding 4,
    attention 0.2 (head_dim ** -0.5 would be 0.25), residual 0.5, logits_scaling 3. Tied
    embeddings, as Granite 4.0 ships."""
    return GraniteMoeHybridConfig(
        **{**_SHARED, "tie_word_embeddings": True},
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        shared_intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        embedding_multiplier=4.0,
        attention_multiplier=0.2,
        residual_multiplier=0.5,
        logits_scaling=3.0,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        mamba_d_conv=4,
        mamba_expand=2,
        architectures=["GraniteMoeHybridForCausalLM"],
    )


PRESETS.update({"tiny-nemotron-h": tiny_nemotron_h, "tiny-granite-hybrid": tiny_granite_hybrid})


def tiny_qwen3_next() -> PretrainedConfig:
    """Layers linear_attention (Gated DeltaNet), full_attention, linear_attention, full_attention;
    gated attention 4 heads / 2 KV heads (head_dim 16), partial RoPE 0.25 (Qwen3NextConfig's
    default); GDN 2 key heads x 8, 4 value heads x 16 (key dim != value dim, so a transposed state
    shows), conv 4; MoE on every layer: 4 experts of 32, top-2, renormalised, shared expert 64."""
    from transformers import Qwen3NextConfig
    return Qwen3NextConfig(
        **_SHARED,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        architectures=["Qwen3NextForCausalLM"],
    )


PRESETS["tiny-qwen3-next"] = tiny_qwen3_next


def _tiny_qwen3_5_text(moe: bool) -> dict:
    """Shared by tiny-qwen3.5 and tiny-qwen3.5-moe: Qwen3.5's default pattern of 3 GDN layers to 1
    gated attention layer; attention 4 heads / 2 KV heads x 16, partial RoPE 0.25 written as the
    released configs write it (interleaved mRoPE, mrope_section [1, 1, 0]: the rotary dims' 2
    frequencies); GDN 2 key heads x 8, 4 value heads x 16, conv 4."""
    return dict(
        **_SHARED,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        **(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
           if moe else dict(intermediate_size=128)),
    )


def tiny_qwen3_5() -> PretrainedConfig:
    """Qwen3.5 (dense): see `_tiny_qwen3_5_text`; SwiGLU MLP 128 on every layer."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(**_tiny_qwen3_5_text(moe=False), architectures=["Qwen3_5ForCausalLM"])


def tiny_qwen3_5_moe() -> PretrainedConfig:
    """Qwen3.5-MoE: see `_tiny_qwen3_5_text`; on every layer 4 experts of 32, top-2 (always
    renormalised), and a gated shared expert of 64."""
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(**_tiny_qwen3_5_text(moe=True), architectures=["Qwen3_5MoeForCausalLM"])


PRESETS.update({"tiny-qwen3.5": tiny_qwen3_5, "tiny-qwen3.5-moe": tiny_qwen3_5_moe})


def tiny_zamba2() -> PretrainedConfig:
    """Layers mamba, hybrid, hybrid, hybrid; 2 shared blocks (num_mem_blocks 2: hybrid layers 1 and
    3 share block 0, layer 2 has block 1) with per-layer adapters of rank 8 on q/k/v and gate_up
    (use_shared_attention_adapter), RoPE in the shared attention (use_mem_rope); attention over the
    2H = 128 concatenation, 4 heads x 32 (KV heads = heads: HF's k/v adapters need it); MLP 128, gelu
    (Zamba2's default); Mamba2 8 heads x 16, d_state 16, 2 groups, chunk 16, conv 4. Tied
    embeddings, as Zamba2 ships: in transformers 5.x that is also what ties the shared blocks."""
    from transformers import Zamba2Config
    return Zamba2Config(
        **{**_SHARED, "tie_word_embeddings": True},
        layers_block_type=["mamba", "hybrid", "hybrid", "hybrid"],
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
        n_mamba_heads=8,
        mamba_d_state=16,
        mamba_ngroups=2,
        mamba_d_conv=4,
        mamba_expand=2,
        chunk_size=16,
        architectures=["Zamba2ForCausalLM"],
    )


def tiny_falcon_h1() -> PretrainedConfig:
    """Attention (4 heads / 2 KV heads, head_dim 16, RoPE) and Mamba2 (d_ssm 128 = 8 heads x 16,
    d_state 16, 2 groups, chunk 16, conv 4, gated RMS norm normalising before the gate) in parallel
    in all 4 layers; FFN 128; every muP multiplier set to a distinct value != 1 so that a misplaced
    one shows."""
    from transformers import FalconH1Config
    return FalconH1Config(
        **_SHARED,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        mamba_d_ssm=128,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        mlp_multipliers=[1.5, 0.75],
        key_multiplier=0.8,
        attention_in_multiplier=1.2,
        attention_out_multiplier=0.9,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
        ssm_in_multiplier=0.7,
        ssm_out_multiplier=1.25,
        architectures=["FalconH1ForCausalLM"],
    )


PRESETS.update({"tiny-zamba2": tiny_zamba2, "tiny-falcon-h1": tiny_falcon_h1})


def tiny_olmo_hybrid() -> PretrainedConfig:
    """OLMo Hybrid's default pattern (3 GDN layers, then attention); GDN 4 key = 4 value heads (HF's
    OLMo GDN has no grouped values), key dim 8, value dim 16 (2x, as released), conv 4, beta in
    [0, 2]; post-norm attention 4 heads / 2 KV heads x 16 with whole-width q/k norms and no RoPE
    (the released checkpoint's NoPE); MLP 128."""
    from transformers import OlmoHybridConfig
    return OlmoHybridConfig(
        **_SHARED,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True,
        rope_parameters={"rope_type": "default", "rope_theta": None},       # NoPE, as HF reads the release
        architectures=["OlmoHybridForCausalLM"],
    )


PRESETS["tiny-olmo-hybrid"] = tiny_olmo_hybrid


def tiny_kimi_linear() -> PretrainedConfig:
    """Kimi Linear: 3 Kimi Delta Attention layers (4 heads x 16, conv 4), then multi-head latent
    attention (4 heads, latent 16 + rope dims 8 cached, nope 16, v 16, no q LoRA, NoPE); layer 0's FFN
    a SwiGLU MLP of 128 (first_k_dense_replace 1), the others a DeepSeek-V3 MoE: 8 experts of 32 in
    2 groups (1 kept), top-2, renormalised, scaled by 2.446, and one shared expert."""
    from transformers import KimiLinearConfig
    return KimiLinearConfig(
        **_SHARED,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        linear_head_dim=16,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        architectures=["KimiLinearForCausalLM"],
    )


PRESETS["tiny-kimi-linear"] = tiny_kimi_linear


def tiny_lfm2_moe() -> PretrainedConfig:
    """LFM2-MoE: layers conv, conv, full_attention, conv (LFM2's short conv L_cache 3 and attention
    4 heads / 2 KV heads x 16 with q/k norms); layer 0's FFN a SwiGLU MLP of 128 (num_dense_layers
    1), the others the MoE: 8 experts of 32, top-2 by sigmoid score plus expert_bias, renormalised,
    x1.5 (routed_scaling_factor; 1.0 in the release, so a misplaced scale would hide); tied
    embeddings, as LFM2-8B-A1B ships."""
    from transformers import Lfm2MoeConfig
    return Lfm2MoeConfig(
        **{**_SHARED, "tie_word_embeddings": True},
        layer_types=["conv", "conv", "full_attention", "conv"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        routed_scaling_factor=1.5,
        conv_L_cache=3,
        architectures=["Lfm2MoeForCausalLM"],
    )


PRESETS["tiny-lfm2-moe"] = tiny_lfm2_moe


def tiny_minimax() -> PretrainedConfig:
    """MiniMax: layers lightning, lightning, softmax attention, lightning (the release's 7:1 pattern cut
    to 4); 4 heads x 16 (a power of two: vLLM's ALiBi-style decay slopes equal HF's only then),
    2 KV heads on the softmax layer (RoPE over the whole head); every layer a MoE of 4 experts of 32,
    top-2, renormalised; every residual scale != 1 (alpha 1.2 / 0.9 / 1.1 on linear / full / MLP,
    beta 0.8 / 1.3 / 0.7) so a misplaced one shows; HF's prefill block_size 4 (it tiles HF's
    prefill only; HF's parity prompts cross its blocks)."""
    from transformers import MiniMaxConfig
    return MiniMaxConfig(
        **_SHARED,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        block_size=4,
        linear_attn_alpha_factor=1.2, linear_attn_beta_factor=0.8,
        full_attn_alpha_factor=0.9, full_attn_beta_factor=1.3,
        mlp_alpha_factor=1.1, mlp_beta_factor=0.7,
        architectures=["MiniMaxForCausalLM"],
    )


PRESETS["tiny-minimax"] = tiny_minimax


def tiny_lfm3() -> PretrainedConfig:
    """LFM3: layers conv, conv, full_attention, conv, sliding_attention, conv (the default pattern, 6
    layers); short conv L_cache 7 (the release's); attention 4 heads / 2 KV heads x 16 with q/k norms
    and per-head output gates; sliding window 4 (prompts run far past it); full layers proportional
    RoPE (partial 0.5, theta 1e6), sliding layers default RoPE (theta 1e4); sandwich norms; SwiGLU 128;
    tied embeddings."""
    from transformers import Lfm3Config
    return Lfm3Config(
        **{**_SHARED, "tie_word_embeddings": True, "num_hidden_layers": 6},
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        sliding_window=4,
        conv_L_cache=7,
        architectures=["Lfm3ForCausalLM"],
    )


PRESETS["tiny-lfm3"] = tiny_lfm3


def tiny_xlstm() -> PretrainedConfig:
    """xLSTM (mLSTM blocks, attention-free): hidden 128 (HF's xLSTMCache rounds the q/k width up to a
    multiple of 64, so at hidden 64 HF's cached generate breaks), 2 blocks of 2 heads, q/k 64 (32 a
    head), v 128 (64 a head); FFN 384 (128 * 2.667 rounded up to 64); HF's chunkwise prefill in chunks
    of 8 (its parity prompts run chunks and the recurrent tail); gate soft cap 4 and output logit soft
    cap 5, small enough to bend the values they cap. HF initialises every projection named "gate"
    (igate/fgate/ogate_preact and the FFN's proj_up_gate) to zero, so the FFN and the gates would add
    exactly nothing; the preset's seeded weights give them random values, and the input / forget gate
    biases non-trivial ones (xLSTMForCausalLM.init_random_weights)."""
    from transformers import xLSTMConfig
    return xLSTMConfig(
        **{**_SHARED, "hidden_size": 128, "num_hidden_layers": 2},
        num_heads=2,
        chunk_size=8,
        gate_soft_cap=4.0,
        output_logit_soft_cap=5.0,
        architectures=["xLSTMForCausalLM"],
    )


PRESETS["tiny-xlstm"] = tiny_xlstm


# ---- Zoo III shape-true presets --------------------------------------------------------------------
# Each is the transformers config class's defaults, which its docstring ties to a released checkpoint
# (Qwen3_5TextConfig's: hidden 4096, 32 layers, 8.95B parameters, Qwen3.5-9B's text model), cut to
# one period of the layer pattern (or one layer of each kind) so that the fp32 weights fit a
# laptop's memory; the name says how many layers. Random weights: for benchmarks and the
# ahead-of-time compile test (tests/kernel_workloads.py SHAPE_TRIMS), not for CPU engine tests.

def is_shape_preset(name: str) -> bool:
    """A shape-true preset (real dimensions, hundreds of MB to GB): "<model>-shape" or "<model>-shape-<n>l"."""
    return name.endswith("-shape") or "-shape-" in name


def qwen3_5_9b_shape_4l() -> PretrainedConfig:
    """Qwen/Qwen3.5-9B's text model, 4 of 32 layers (GDN, GDN, GDN, gated attention): hidden 4096;
    GDN 16 key heads / 32 value heads x 128, conv 4; attention 16 heads / 4 KV heads x 256, partial
    RoPE 0.25 (theta: the class default, 1e4); MLP 12288; vocab 248320, untied (2.90B parameters)."""
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                             architectures=["Qwen3_5ForCausalLM"])


def qwen3_5_35b_a3b_shape_2l() -> PretrainedConfig:
    """Qwen/Qwen3.5-35B-A3B's text model, 2 of 40 layers (GDN, gated attention), each with its MoE:
    hidden 2048; GDN 16 key / 32 value heads x 128; attention 16 heads / 2 KV heads x 256; 256
    experts of 512, top-8, and a gated shared expert of 512; vocab 248320 (2.70B parameters)."""
    from transformers import Qwen3_5MoeTextConfig
    return Qwen3_5MoeTextConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                architectures=["Qwen3_5MoeForCausalLM"])


def olmo_hybrid_7b_shape_4l() -> PretrainedConfig:
    """allenai/Olmo-Hybrid-7B, 4 of 32 layers (GDN, GDN, GDN, post-norm attention): hidden 3840;
    GDN 30 heads, key dim 96, value dim 192, conv 4, beta in [0, 2]; attention 30 heads x 128, no
    RoPE (the release's NoPE); MLP 11008; vocab 100352 (1.60B parameters)."""
    from transformers import OlmoHybridConfig
    return OlmoHybridConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                            rope_parameters={"rope_type": "default", "rope_theta": None},
                            architectures=["OlmoHybridForCausalLM"])


def kimi_linear_48b_a3b_shape_2l() -> PretrainedConfig:
    """moonshotai/Kimi-Linear-48B-A3B-Instruct, 2 of 27 layers: layer 0 KDA with the dense MLP
    (9216), layer 1 MLA with the MoE: hidden 2304; KDA 32 heads x 128, conv 4; MLA 32 heads, latent
    512 + rope dims 64 cached per token, nope 128, v 128, no q LoRA, NoPE; 256 experts of 1024, top-8,
    one shared expert; vocab 163840 (2.71B parameters)."""
    from transformers import KimiLinearConfig
    return KimiLinearConfig(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            mlp_layer_types=["dense", "sparse"], architectures=["KimiLinearForCausalLM"])


PRESETS.update({
    "qwen3.5-9b-shape-4l": qwen3_5_9b_shape_4l,
    "qwen3.5-35b-a3b-shape-2l": qwen3_5_35b_a3b_shape_2l,
    "olmo-hybrid-7b-shape-4l": olmo_hybrid_7b_shape_4l,
    "kimi-linear-48b-a3b-shape-2l": kimi_linear_48b_a3b_shape_2l,
})


def lfm2_8b_a1b_shape_4l() -> PretrainedConfig:
    """LiquidAI/LFM2-8B-A1B (Lfm2MoeConfig's defaults), 4 of 24 layers: conv, conv, attention, conv;
    hidden 2048; short conv L_cache 3; attention 32 heads / 8 KV heads x 64; layers 0-1 a dense FFN of
    7168, then the MoE: 32 experts of 1792, top-4, expert bias; vocab 65536, tied (0.99B parameters)."""
    from transformers import Lfm2MoeConfig
    return Lfm2MoeConfig(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"],
                         architectures=["Lfm2MoeForCausalLM"])


def minimax_text_01_shape_2l() -> PretrainedConfig:
    """MiniMaxAI/MiniMax-Text-01 at the technical report's dimensions (456B in all over 80 layers,
    7 lightning : 1 softmax), 2 layers: lightning, softmax attention; hidden 6144, 64 heads x 128 (8 KV
    heads on the softmax layer), 32 experts of 9216, top-2; vocab 200064. MiniMaxConfig's own defaults
    are Mixtral's sizes, not these. Even 2 layers hold 13.7B parameters: for GPU benchmarks in bf16."""
    from transformers import MiniMaxConfig
    return MiniMaxConfig(vocab_size=200064, hidden_size=6144, intermediate_size=9216, num_hidden_layers=2,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=128, num_local_experts=32,
                         num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                         architectures=["MiniMaxForCausalLM"])


PRESETS.update({"lfm2-8b-a1b-shape-4l": lfm2_8b_a1b_shape_4l, "minimax-text-01-shape-2l": minimax_text_01_shape_2l})


def lfm3_1_7b_shape() -> PretrainedConfig:
    """LiquidAI/LFM3-1.7B (Lfm3Config's defaults), all 24 layers (1.73B parameters: fp32 fits a laptop):
    hidden 2048; 13 conv layers (L_cache 7), 6 full attention (i % 4 == 2; proportional RoPE 0.5, theta
    1e6), 5 sliding-window (i % 4 == 0, i > 0; window 256, theta 1e4); attention 16 heads / 4 KV heads
    x 128 with per-head gates; SwiGLU 7680; vocab 128000, tied."""
    from transformers import Lfm3Config
    return Lfm3Config(architectures=["Lfm3ForCausalLM"])


PRESETS["lfm3-1.7b-shape"] = lfm3_1_7b_shape


def xlstm_7b_shape_4l() -> PretrainedConfig:
    """NX-AI/xLSTM-7b (xLSTMConfig's defaults), 4 of 32 mLSTM blocks: hidden 4096, 8 heads, q/k 2048 (256
    a head), v 4096 (512 a head), FFN 10944, gate soft cap 15, logit soft cap 30; vocab 50304, untied
    (1.22B parameters; a request's state is C [8, 256, 512] + n [8, 256] + m [8] fp32 per block)."""
    from transformers import xLSTMConfig
    return xLSTMConfig(num_hidden_layers=4, num_blocks=4, architectures=["xLSTMForCausalLM"])


PRESETS["xlstm-7b-shape-4l"] = xlstm_7b_shape_4l
