"""Model zoo: HF-parity CausalLM implementations, presets, loading and saving."""
from toolkit.models.base import CausalLM
from toolkit.models.loader import DEMO_MODELS, LoadedModel, load_model, model_folder, save_hf_folder
from toolkit.models.presets import PRESET_SEED, PRESETS
from toolkit.models.registry import MODEL_REGISTRY, get_model_class

__all__ = [
    "CausalLM", "LoadedModel", "load_model", "save_hf_folder", "model_folder", "DEMO_MODELS", "PRESETS",
    "PRESET_SEED",
    "MODEL_REGISTRY", "get_model_class",
]
