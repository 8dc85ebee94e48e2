"""`init_model_state`: pick the model state class, in vLLM's order (post #52374).

1. the model provides one (`get_model_state_cls()`);
2. encoder-decoder (a cross-attention layer)      -> not supported yet: clear error;
3. encoder-only (a non-causal attention layer)     -> not supported yet: clear error;
4. `is_hybrid or is_attention_free`                -> MambaHybridModelState;
5. otherwise                                      -> DefaultModelState.
Layers mark their kind with an `attn_type` attribute ("decoder" when absent).
"""
from __future__ import annotations

from torch import nn

from toolkit.config import RunnerConfig
from toolkit.errors import NotSupportedYetError
from toolkit.runner.model_states.default import DefaultModelState
from toolkit.runner.model_states.interface import ModelState
from toolkit.runner.model_states.mamba_hybrid import MambaHybridModelState

__all__ = ["init_model_state", "ModelState", "DefaultModelState", "MambaHybridModelState"]


def _has_attn_type(model: nn.Module, attn_type: str) -> bool:
    return any(getattr(m, "attn_type", "decoder") == attn_type for m in model.modules())


def init_model_state(model: nn.Module, cfg: RunnerConfig) -> ModelState:
    if hasattr(model, "get_model_state_cls"):
        return model.get_model_state_cls()(model, cfg)
    if _has_attn_type(model, "encoder_decoder"):
        raise NotSupportedYetError(
            f"{type(model).__name__} has cross-attention: encoder-decoder models need an "
            "EncoderDecoderModelState, which this toolkit does not have yet")
    if _has_attn_type(model, "encoder_only"):
        raise NotSupportedYetError(
            f"{type(model).__name__} has encoder-only attention: it needs an "
            "EncoderOnlyModelState, which this toolkit does not have yet")
    if getattr(model, "is_hybrid", False) or getattr(model, "is_attention_free", False):
        return MambaHybridModelState(model, cfg)
    return DefaultModelState(model, cfg)
