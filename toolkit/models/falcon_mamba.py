"""FalconMamba (HF `FalconMambaForCausalLM`): Mamba with weightless RMS norms (eps
`mixer_rms_eps`) on the mixer's dt-rank input, B and C, before dt_proj and the scan.

Same HF names as Mamba (backbone.*, lm_head); the norms' all-ones weights are non-persistent
buffers in HF, so checkpoints hold nothing for them. `tie_word_embeddings` defaults to True in
FalconMambaConfig.
"""
from __future__ import annotations

from toolkit.models.mamba import MambaForCausalLM


class FalconMambaForCausalLM(MambaForCausalLM):
    hf_architecture = "FalconMambaForCausalLM"
    hf_model_type = "falcon_mamba"
    bcdt_norm = "weightless"
