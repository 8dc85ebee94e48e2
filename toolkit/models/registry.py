"""HF architecture name -> toolkit model class."""
from __future__ import annotations

from transformers import PretrainedConfig

from toolkit.errors import UnsupportedArchitectureError
from toolkit.models.bamba import BambaForCausalLM
from toolkit.models.base import CausalLM
from toolkit.models.falcon_h1 import FalconH1ForCausalLM
from toolkit.models.falcon_mamba import FalconMambaForCausalLM
from toolkit.models.granite_hybrid import GraniteMoeHybridForCausalLM
from toolkit.models.jamba import JambaForCausalLM
from toolkit.models.kimi_linear import KimiLinearForCausalLM
from toolkit.models.lfm2 import Lfm2ForCausalLM
from toolkit.models.lfm2_moe import Lfm2MoeForCausalLM
from toolkit.models.lfm3 import Lfm3ForCausalLM
from toolkit.models.llama import LlamaForCausalLM
from toolkit.models.mamba import MambaForCausalLM
from toolkit.models.mamba2 import Mamba2ForCausalLM
from toolkit.models.minimax import MiniMaxForCausalLM
from toolkit.models.nemotron_h import NemotronHForCausalLM
from toolkit.models.olmo_hybrid import OlmoHybridForCausalLM
from toolkit.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM
from toolkit.models.qwen3_next import Qwen3NextForCausalLM
from toolkit.models.xlstm import xLSTMForCausalLM
from toolkit.models.zamba2 import Zamba2ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    cls.hf_architecture: cls for cls in (LlamaForCausalLM, Mamba2ForCausalLM, BambaForCausalLM,
                                        Lfm2ForCausalLM)
}
MODEL_REGISTRY.update(
    {cls.hf_architecture: cls for cls in (MambaForCausalLM, FalconMambaForCausalLM, JambaForCausalLM)}
)
MODEL_REGISTRY.update(
    {cls.hf_architecture: cls for cls in (NemotronHForCausalLM, GraniteMoeHybridForCausalLM)}
)
MODEL_REGISTRY[Qwen3NextForCausalLM.hf_architecture] = Qwen3NextForCausalLM
MODEL_REGISTRY.update({cls.hf_architecture: cls for cls in (Zamba2ForCausalLM, FalconH1ForCausalLM)})
MODEL_REGISTRY.update({cls.hf_architecture: cls for cls in (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                                                             OlmoHybridForCausalLM, KimiLinearForCausalLM,
                                                             Lfm2MoeForCausalLM, MiniMaxForCausalLM, Lfm3ForCausalLM)})
MODEL_REGISTRY[xLSTMForCausalLM.hf_architecture] = xLSTMForCausalLM
# checkpoints of other architectures that load as one of ours (a vision-language model, text-only)
MODEL_REGISTRY.update({alias: cls for cls in list(MODEL_REGISTRY.values()) for alias in cls.hf_aliases})

_BY_MODEL_TYPE: dict[str, type[CausalLM]] = {cls.hf_model_type: cls for cls in MODEL_REGISTRY.values()}


def get_model_class(config: PretrainedConfig) -> type[CausalLM]:
    """Class for `config.architectures[0]`; if the config names no architecture, by `model_type`.

    Raises UnsupportedArchitectureError (listing the supported architectures) otherwise.
    """
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if archs:
        cls = MODEL_REGISTRY.get(archs[0])
        if cls is not None:
            return cls
        what = f"architecture '{archs[0]}'"
    else:
        cls = _BY_MODEL_TYPE.get(model_type) if model_type else None
        if cls is not None:
            return cls
        what = f"model_type '{model_type}' (config names no architectures)"
    raise UnsupportedArchitectureError(
        f"{what} is not supported; supported architectures: {', '.join(sorted(MODEL_REGISTRY))}"
    )
