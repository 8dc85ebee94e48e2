"""The HF transformers side of `compare_with_hf`: load the reference model (fp32, CPU) and run one
request through it uncached, mapping its `output_hidden_states` onto our blocks and final norm.

HF `output_hidden_states` conventions (transformers 5.x, read in `utils/output_capturing.py` and
each `modeling_*.py`):
  - Llama, Bamba, Jamba, Lfm2 (`@capture_outputs`, a hook on each decoder layer): entry 0 = input
    of layer 0 (the embeddings), entry i = output of layer i-1, and the LAST entry (which would be
    layer L-1's output) is overwritten with `last_hidden_state`, i.e. after the final norm.
    So layer L-1's pre-norm output is not among them; we take it with a forward hook on HF's
    module of the same path (parameter names, hence module paths, equal the checkpoint's).
  - Mamba, Mamba2, FalconMamba (hand-written loop in `MambaModel.forward` etc.): NO embeddings
    entry; entry i = output of layer i for i < L, entry L = output of `norm_f`.
Both have L + 1 entries; which one a model follows is detected per run (is entry 0 the input of
the first block, i.e. the embeddings, times a multiplier in Falcon-H1 and Granite?), so an older
transformers whose Mamba puts the embeddings first works too.

transformers is imported inside the functions that use it: `import toolkit` must not pay for it.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from toolkit.inspect.tolerance import absmax
from toolkit.models import PRESETS, load_model, model_folder, save_hf_folder


@dataclass
class HFReference:
    """What HF computed for one request's whole sequence, row = position."""
    layers: list[torch.Tensor | None]   # per block: [n, H] (None: not available)
    final: torch.Tensor                 # [n, H] after the final norm
    logits: torch.Tensor                # [n, V]
    convention: str                     # how HF's hidden_states were mapped onto our layers


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or fallback-kernel warnings from transformers while the reference runs
    (they would land in the user's notebook); the previous settings come back on exit."""
    from transformers.utils import logging as hf_logging
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_reference(llm: Any, reference: Any) -> torch.nn.Module:
    """`reference` (an HF model, or an HF folder) in eval mode; None: the weights `llm` was loaded
    from, in fp32 (a preset's seeded weights are rebuilt, a demo model's or folder's reloaded)."""
    from transformers import AutoModelForCausalLM
    if isinstance(reference, torch.nn.Module):
        return reference.eval()
    if reference is not None:
        return AutoModelForCausalLM.from_pretrained(os.fspath(reference), dtype=torch.float32).eval()
    name = os.fspath(llm.model_name)
    if name in PRESETS:              # presets win over folders of the same name (as load_model)
        loaded = load_model(name, dtype=torch.float32, device="cpu", seed=llm.cfg.seed)
        with tempfile.TemporaryDirectory(prefix="runnerscope_ref_") as tmp:
            save_hf_folder(loaded.model, tmp)
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
            # materialise every tensor before the folder goes away (a lazy/mmapped load)
            for p in hf.parameters():
                p.data = p.data.clone()
        return hf.eval()
    hub = getattr(llm, "hub_source", None)       # a Hub id: the snapshot it loaded (same commit, no request)
    folder = hub.folder if hub is not None else model_folder(name) or name   # a demo model's folder, or the folder
    return AutoModelForCausalLM.from_pretrained(os.fspath(folder), dtype=torch.float32).eval()


def _submodule(hf: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return hf.get_submodule(path)
    except AttributeError:
        return None


@torch.inference_mode()
def run_hf(hf: torch.nn.Module, tokens: list[int], layer_paths: list[str]) -> HFReference:
    """One request through HF, uncached, with output_hidden_states; maps the entries onto our
    blocks + final norm (see the module docstring)."""
    dev = next(hf.parameters()).device
    ids = torch.tensor([tokens], device=dev)
    L = len(layer_paths)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    try:
        last = _submodule(hf, layer_paths[-1])      # the last block's own output: hidden by the
        if last is not None:                        # capture_outputs convention, so hook it
            def grab(_m, _a, out):
                captured[L - 1] = (out[0] if isinstance(out, tuple) else out)[0].float().cpu()
            handles.append(last.register_forward_hook(grab))
        first = _submodule(hf, layer_paths[0])      # the first block's input: the embeddings,
        if first is not None:                       # times a multiplier in some models
            def grab_input(_m, args, kwargs):
                h = args[0] if args else kwargs.get("hidden_states")
                if isinstance(h, torch.Tensor):
                    captured[-1] = h[0].float().cpu()
            handles.append(first.register_forward_pre_hook(grab_input, with_kwargs=True))
        out = hf(ids, use_cache=False, output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    hs = [h[0].float().cpu() for h in out.hidden_states]
    if len(hs) != L + 1:
        raise RuntimeError(f"HF returned {len(hs)} hidden states for {L} layers; expected {L + 1}")
    emb = captured.get(-1, hf.get_input_embeddings()(ids)[0].float().cpu())
    if hs[0].shape == emb.shape and torch.allclose(hs[0], emb, rtol=0, atol=1e-6 * max(1.0, absmax(emb))):
        # embeddings first: entry i+1 = layer i's output for i < L-1, last = final norm
        layers: list[torch.Tensor | None] = [hs[i + 1] for i in range(L - 1)] + [captured.get(L - 1)]
        conv = ("hidden_states[0] = embeddings, [i+1] = layer i (i < L-1), [-1] = final norm; "
                "layer L-1 from a hook on HF's module")
    else:
        layers = [hs[i] for i in range(L)]
        conv = "hidden_states[i] = layer i (no embeddings entry), [-1] = final norm"
    return HFReference(layers, hs[-1], out.logits[0].float().cpu(), conv)
