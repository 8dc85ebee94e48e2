"""Qwen3.5 / Qwen3.6 (HF `Qwen3_5ForCausalLM`, dense) and Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`):
Qwen3-Next's hybrid of Gated DeltaNet and gated full attention (3 GDN : 1 attention by default,
`config.layer_types`), with three differences:
- the GDN's input projections are one per input (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a:
  `SplitGatedDeltaNet`), not Qwen3-Next's per-key-head groups;
- the FFN is the same on every layer: a SwiGLU MLP (dense) or, for the MoE model, the shared-expert
  MoE with softmax top-k always renormalised (`Qwen3VLMoeTextTopKRouter`: no norm_topk_prob, no
  mlp_only_layers or decoder_sparse_step);
- RoPE is interleaved mRoPE (`mrope_section`). With text-only input its three position rows (time,
  height, width) are equal, so every frequency sees the token's position and it is exactly partial
  RoPE (partial_rotary_factor, 0.25): implemented as such. Images and video are not supported.

Released checkpoints are vision-language models (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`): they load text-only. Their config's `text_config` builds the
model, the weights' `model.language_model.` prefix becomes `model.` (transformers' conversion mapping
for "qwen3_5_text"), and the vision tower (`model.visual.*`) and the multi-token-prediction head
(`mtp.*`) are skipped, named once in a warning.

HF names: as Qwen3-Next (toolkit/models/qwen3_next.py) but model.layers.{i}.linear_attn.{in_proj_qkv,
in_proj_z, in_proj_b, in_proj_a}.weight; MoE experts on disk per expert (save_pretrained's layout).
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import PretrainedConfig

from toolkit.layers.gdn import SplitGatedDeltaNet
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.moe import merge_expert_checkpoint_tensors, split_expert_state_tensors
from toolkit.models.base import CausalLM, DecoderBody, PreNormBlock
from toolkit.models.qwen3_next import OffsetRMSNorm, SharedExpertMoeBlock, qwen3_next_layer_types, qwen3_next_mixer

log = logging.getLogger(__name__)

LANGUAGE_PREFIX = "model.language_model."          # a ConditionalGeneration checkpoint's text model
SKIPPED_PREFIXES = ("model.visual.", "mtp.")        # its vision tower and multi-token-prediction head


class Qwen3_5ForCausalLM(CausalLM):
    is_hybrid = True
    hf_architecture = "Qwen3_5ForCausalLM"
    hf_model_type = "qwen3_5_text"
    hf_aliases = ("Qwen3_5ForConditionalGeneration",)       # released checkpoints: loaded text-only

    def ffn(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return SwiGLUMLP(config.hidden_size, config.intermediate_size, False, config.hidden_act)

    def build_body(self, config: PretrainedConfig) -> DecoderBody:
        eps = config.rms_norm_eps
        blocks = [PreNormBlock(("input_layernorm", OffsetRMSNorm(config.hidden_size, eps=eps)),
                               qwen3_next_mixer(config, i, kind, SplitGatedDeltaNet),
                               ("post_attention_layernorm", OffsetRMSNorm(config.hidden_size, eps=eps)),
                               ("mlp", self.ffn(config, i)), layer_type=kind)
                  for i, kind in enumerate(qwen3_next_layer_types(config, "Qwen3.5"))]
        return DecoderBody(("embed_tokens", nn.Embedding(config.vocab_size, config.hidden_size)), blocks,
                           ("norm", OffsetRMSNorm(config.hidden_size, eps=eps)))

    @staticmethod
    def language_config(config: PretrainedConfig) -> PretrainedConfig:
        """A ConditionalGeneration config -> its text config (the special token ids and the head's
        tying taken from the outer config where the text config leaves them unset)."""
        text = getattr(config, "text_config", None)
        if text is None:
            return config
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(text, name, None) is None and getattr(config, name, None) is not None:
                setattr(text, name, getattr(config, name))
        if "tie_word_embeddings" in config.to_diff_dict():
            text.tie_word_embeddings = config.tie_word_embeddings
        return text

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Loader hook: a ConditionalGeneration checkpoint's text model renamed (`model.language_model.`
        -> `model.`), its vision tower and MTP head skipped (logged once, with their tensor counts)."""
        kept, skipped = {}, {p: 0 for p in SKIPPED_PREFIXES}
        for key, tensor in state.items():
            prefix = next((p for p in SKIPPED_PREFIXES if key.startswith(p)), None)
            if prefix is not None:
                skipped[prefix] += 1
                continue
            kept["model." + key[len(LANGUAGE_PREFIX):] if key.startswith(LANGUAGE_PREFIX) else key] = tensor
        if any(skipped.values()):
            log.warning("Qwen3.5 checkpoint loaded text-only (images and video are not supported): skipped %s",
                     ", ".join(f"{n} tensors under {p}*" for p, n in skipped.items() if n))
        return kept


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    hf_architecture = "Qwen3_5MoeForCausalLM"
    hf_model_type = "qwen3_5_moe_text"
    hf_aliases = ("Qwen3_5MoeForConditionalGeneration",)

    def ffn(self, config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return SharedExpertMoeBlock(config.hidden_size, config.moe_intermediate_size,
                                    config.shared_expert_intermediate_size, config.num_experts,
                                    config.num_experts_per_tok, True, config.hidden_act)

    @staticmethod
    def checkpoint_to_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As Qwen3.5's, then per-expert checkpoint tensors -> fused experts (HF's qwen2_moe converter)."""
        return merge_expert_checkpoint_tensors(Qwen3_5ForCausalLM.checkpoint_to_state_dict(state))

    @staticmethod
    def state_dict_to_checkpoint(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """save_hf_folder hook: fused experts -> per-expert tensors, the layout save_pretrained writes."""
        return split_expert_state_tensors(state)
