"""Model building blocks (torch reference implementations)."""
from toolkit.layers.attention import PagedAttention
from toolkit.layers.mamba2_mixer import Mamba2Mixer
from toolkit.layers.mlp import SwiGLUMLP
from toolkit.layers.norms import RMSNorm, RMSNormGated
from toolkit.layers.rotary import RotaryEmbedding

__all__ = ["PagedAttention", "Mamba2Mixer", "SwiGLUMLP", "RMSNorm", "RMSNormGated", "RotaryEmbedding"]
