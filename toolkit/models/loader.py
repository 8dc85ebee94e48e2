"""Build a model from a preset name or a HF-format folder; write HF-format folders.

Folder format (what `transformers` writes): config.json plus either model.safetensors or
model.safetensors.index.json with its shards. Only safetensors are read (never pickles), and never a
config that asks for custom code (`auto_map`, what `trust_remote_code` would run).

A name that is neither a preset, a demo model nor a folder, of the form `org/name`, is a Hugging Face Hub
repo id: its snapshot is fetched into the Hub cache (`toolkit.models.hub`) and loaded as a folder.

Sharded loading (`load_model(..., tp=TPGroup(rank, N))`): a folder's model is built on the meta
device and sharded there (`shard_model`: slicing meta tensors is free), which records on each sharded
parameter the entries of its checkpoint tensor it keeps (`toolkit.layers.parallel.SourceSlice`); each
parameter is then read from the files by those slices only (`toolkit.models.lazy_checkpoint`), through
the architecture's key and tensor conversions. Unsharded parameters (norms, routers, ...) are read whole,
as is every tensor when loading unsharded (the default), one tensor at a time.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, PretrainedConfig

from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import CheckpointError, UnknownModelError, UnsupportedArchitectureError
from toolkit.layers.parallel import source_slice
from toolkit.models.base import CausalLM
from toolkit.models.hub import (
    PICKLE_SUFFIXES,
    SAFE_INDEX,
    SAFE_WEIGHTS,
    TOKENIZER_FILES,
    HubSource,
    fetch_model,
    fetch_tokenizer,
    is_repo_id,
)
from toolkit.models.lazy_checkpoint import LazyTensor, open_checkpoint, read
from toolkit.models.presets import PRESETS
from toolkit.models.registry import MODEL_REGISTRY, get_model_class
from toolkit.models.tensor_parallel import check_tensor_parallel, shard_model

# trained byte-level models shipped inside the package (scripts/train_demo_models.py)
DEMO_ROOT = Path(__file__).resolve().parent / "demo"
DEMO_MODELS = {"demo-hybrid": DEMO_ROOT / "demo-hybrid", "demo-mamba": DEMO_ROOT / "demo-mamba"}
# checkpoint entries that are not parameters (old Llama checkpoints store the RoPE buffer)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: CausalLM                 # eval mode, requires_grad off, on the requested device/dtype
    config: PretrainedConfig
    source: str | None              # the folder it came from; None for a preset
    tokenizer_dir: str | None       # folder holding tokenizer files, None if there are none
    hub: HubSource | None = None    # repo, commit and snapshot folder when loaded by Hub id


def _list(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


@contextlib.contextmanager
def _without_default_init():
    """torch's layers draw default weights as they are built (nn.Linear: kaiming_uniform_, nn.Embedding:
    normal_, their biases: uniform_): a preset's are all redrawn by `init_random_weights` right after,
    so the first draws are skipped (a third of building a shape-true preset). Only those three random
    initializers: a constant one (zeros_, ones_) could be a buffer's value."""
    skipped = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(torch.nn.init, name) for name in skipped}
    for name in skipped:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _finish(model: CausalLM, device: torch.device, dtype: torch.dtype) -> CausalLM:
    model.to(device=device, dtype=dtype)
    model.keep_fp32_()
    model.tie_weights()  # moving can replace Parameter objects; re-share the tied tensor
    model.eval()
    model.requires_grad_(False)
    return model


def load_model(
    model: str | os.PathLike, *, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
    tp: TPGroup = SINGLE, revision: str | None = None, download_dir: str | os.PathLike | None = None,
) -> LoadedModel:
    """Preset name -> config + `init_random_weights(seed)`; existing folder -> HF checkpoint; else a Hub
    repo id `org/name` -> its snapshot at `revision` (a branch, tag or commit sha; None: the default
    branch), fetched into `download_dir` (None: the Hub cache) and loaded as a folder (`.hub` says which
    commit). `revision` and `download_dir` with a preset or a folder raise ValueError: those have no versions.

    Preset names take precedence over folders of the same name, folders over Hub ids. Errors:
    UnknownModelError (neither a preset, a folder nor a Hub repo; or the Hub refused, each with its way
    out), CheckpointError (no/invalid config.json, no safetensors weights, missing/unexpected/misshapen
    tensors), UnsupportedArchitectureError (architecture not in MODEL_REGISTRY, or custom code).
    Stored weights of any float dtype are cast to `dtype`.

    `tp`: the model comes back sharded for this rank (`shard_model` is then a no-op on it). A preset
    is built whole (its seeded weights need the whole tensors) and then sharded; a folder is read
    sharded, each rank reading only its slices. A configuration that cannot shard over
    `tp.world_size` raises (`check_tensor_parallel`) before any weight is made or read.
    """
    device = torch.device(device)
    name = os.fspath(model)
    if name in PRESETS:
        _no_hub_arguments(name, "a preset (random weights from a seed)", revision, download_dir)
        config = PRESETS[name]()
        cls = get_model_class(config)
        with _without_default_init():       # init_random_weights draws every parameter next
            m = cls(config)
        check_tensor_parallel(m, tp.world_size)
        m.init_random_weights(seed)
        return LoadedModel(shard_model(_finish(m, device, dtype), tp), config, None, None)
    folder = model_folder(name)
    if folder is not None:
        _no_hub_arguments(name, "a shipped demo model" if name in DEMO_MODELS else "a local folder", revision,
                          download_dir)
        return _load_folder(folder, dtype, device, tp)
    if not is_repo_id(name):
        raise UnknownModelError(
            f"'{name}' is neither a preset, a shipped demo model nor an existing folder; presets: "
            f"{', '.join(PRESETS)}; demo models: {', '.join(DEMO_MODELS)}"
        )
    hub = fetch_model(name, revision=revision, download_dir=download_dir)
    try:
        loaded = _load_folder(Path(hub.folder), dtype, device, tp)
    except (CheckpointError, UnsupportedArchitectureError) as err:   # name the repo and commit, not just the cache
        raise type(err)(f"Hub repo {hub.label}: {err}") from err
    return dataclasses.replace(loaded, hub=hub)


def _no_hub_arguments(name: str, kind: str, revision: str | None, download_dir: str | os.PathLike | None) -> None:
    """Refuse Hub-only arguments for a model that is not fetched: silently ignoring `revision` would load
    other weights than the ones asked for."""
    given = [f"{k}={v!r}" for k, v in (("revision", revision), ("download_dir", download_dir)) if v is not None]
    if given:
        raise ValueError(f"{' and '.join(given)} given for '{name}', {kind}: only a Hub repo id (org/name) has "
                         "revisions and downloads")


def tokenizer_folder(name: str | os.PathLike, *, download_dir: str | os.PathLike | None = None) -> str:
    """The folder with the tokenizer files `LLM(tokenizer=name)` names: a shipped demo model, an existing
    folder, or a Hub repo id (its tokenizer files only, at the default branch). A preset has none."""
    name = os.fspath(name)
    folder = model_folder(name)
    if folder is None and not is_repo_id(name):
        why = ("a preset: presets have no tokenizer files" if name in PRESETS
               else "neither a shipped demo model, an existing folder nor a Hub repo id (org/name)")
        raise UnknownModelError(f"tokenizer='{name}' is {why}; leave tokenizer unset for the model's own")
    if folder is None:
        folder = Path(fetch_tokenizer(name, download_dir=download_dir).folder)
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"tokenizer='{name}': no tokenizer files in {folder} (expected one of "
                              f"{', '.join(TOKENIZER_FILES)})")
    return str(folder)


def model_folder(name: str | os.PathLike) -> Path | None:
    """The HF folder a model name stands for: a shipped demo model or an existing folder."""
    name = os.fspath(name)
    if name in DEMO_MODELS and (DEMO_MODELS[name] / "config.json").is_file():
        return DEMO_MODELS[name]
    folder = Path(name)
    return folder if folder.is_dir() else None


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON file (config.json, generation_config.json) as a dict; CheckpointError
    naming the file when it cannot be read or is not a JSON object."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable {path.name} ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: {path.name} is not a JSON object")
    return raw


def _read_config(folder: Path) -> PretrainedConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder}: no config.json (not a HF model folder)")
    raw = read_json_object(cfg_path)
    archs = raw.get("architectures") or []
    supported = ", ".join(sorted(MODEL_REGISTRY))
    auto_map = raw.get("auto_map")
    if auto_map:   # refused before transformers reads the config: AutoConfig would look for that code
        classes = ", ".join(sorted(auto_map)) if isinstance(auto_map, dict) else str(auto_map)
        raise UnsupportedArchitectureError(
            f"{folder}: config.json asks for custom code (auto_map: {classes}), which runnerscope never runs "
            f"(there is no trust_remote_code); supported architectures: {supported}"
        )
    if archs and archs[0] not in MODEL_REGISTRY:
        raise UnsupportedArchitectureError(
            f"{folder}: architecture '{archs[0]}' is not supported; supported architectures: {supported}"
        )
    if not archs:
        types = {cls.hf_model_type for cls in MODEL_REGISTRY.values()}
        if raw.get("model_type") not in types:
            raise UnsupportedArchitectureError(
                f"{folder}: model_type '{raw.get('model_type')}' (no architectures listed) is not "
                f"supported; supported architectures: {supported}"
            )
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        raise CheckpointError(f"{cfg_path}: transformers could not read the config ({e})") from e


def _weight_files(folder: Path) -> list[Path]:
    single = folder / SAFE_WEIGHTS
    if single.is_file():
        return [single]
    index = folder / SAFE_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable safetensors index ({e})") from e
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (folder / f).is_file()]
        if absent:
            raise CheckpointError(f"{folder}: shards listed in {SAFE_INDEX} are missing: {_list(absent)}")
        return [folder / f for f in files]
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise CheckpointError(
            f"{folder}: only pickle weights found ({_list(pickles)}); runnerscope loads safetensors only "
            f"(re-save with `save_pretrained(..., safe_serialization=True)`)"
        )
    raise CheckpointError(f"{folder}: no weights found (expected {SAFE_WEIGHTS} or {SAFE_INDEX})")


def _checkpoint_tensors(files: list[Path], cls: type[CausalLM], stack: ExitStack) -> dict[str, LazyTensor]:
    """The checkpoint's tensors under the model's names, unread (see `lazy_checkpoint`)."""
    stored = open_checkpoint(files, stack)
    remap = getattr(cls, "remap_checkpoint_key", None)
    state = {(remap(k) if remap is not None else k): t for k, t in stored.items() if not k.endswith(IGNORED_SUFFIXES)}
    # whole-checkpoint conversion, after every shard is listed (e.g. per-expert MoE tensors -> fused)
    to_model = getattr(cls, "checkpoint_to_state_dict", None)
    return to_model(state) if to_model is not None else state


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE) -> LoadedModel:
    """The checkpoint in `folder`, sharded for `tp` (module docstring). The checks compare the FULL
    shapes in the files with the whole model's; NaN / Inf are looked for in what this rank reads
    (all of it unsharded)."""
    config = _read_config(folder)
    cls = get_model_class(config)
    config = cls.language_config(config)
    files = _weight_files(folder)

    with torch.device("meta"):
        model = cls(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fp32 = model.fp32_tensor_names()
    tied = model.is_tied
    check_tensor_parallel(model, tp.world_size)
    targets = shard_model(model, tp).state_dict(keep_vars=True)

    with ExitStack() as stack:
        stored = _checkpoint_tensors(files, cls, stack)
        optional = {"lm_head.weight"} if tied else set()
        missing = sorted(k for k in expected if k not in stored and k not in optional)
        unexpected = sorted(k for k in stored if k not in expected)
        misshapen = sorted(
            f"{k} (checkpoint {tuple(t.shape)}, model {expected[k]})"
            for k, t in stored.items()
            if k in expected and tuple(t.shape) != expected[k]
        )
        non_float = sorted(k for k, t in stored.items() if k in expected and not t.is_floating_point())
        state: dict[str, torch.Tensor] = {}
        non_finite = []
        for k, lazy in stored.items():
            selection = source_slice(targets[k]) if k in targets else None
            # a misshapen tensor is read (unsharded only) just to look for NaN / Inf, as before sharding
            if k in expected and lazy.is_floating_point() and (tuple(lazy.shape) == expected[k] or selection is None):
                t = read(lazy, selection)
                if not bool(torch.isfinite(t).all()):
                    non_finite.append(f"{k} ({int((~torch.isfinite(t)).sum())} of {t.numel()} values)")
                state[k] = t.to(device=device, dtype=torch.float32 if k in fp32 else dtype)
    if non_finite:
        raise CheckpointError(f"{folder}: NaN or Inf weights in {_list(sorted(non_finite))}; a model with them "
                              "runs and emits tokens that mean nothing: re-export the checkpoint")
    if missing or unexpected or misshapen or non_float:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_list(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_list(unexpected)}")
        if misshapen:
            parts.append(f"misshapen tensors: {_list(misshapen)}")
        if non_float:
            parts.append(f"non-float tensors: {_list(non_float)}")
        raise CheckpointError(f"{folder}: checkpoint does not match {cls.__name__}: " + "; ".join(parts))

    if tied:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:  # cannot happen after the checks above; guards against a model bug
        raise CheckpointError(f"{folder}: parameters left uninitialised: {_list(leftover)}")
    model.eval()
    model.requires_grad_(False)

    tok_dir = str(folder) if any((folder / f).is_file() for f in TOKENIZER_FILES) else None
    return LoadedModel(model, config, str(folder), tok_dir)


def _resolve_model(obj: Any) -> CausalLM:
    """A CausalLM, or an object holding one as `.model_runner.model` (the LLM facade) or `.model`
    (LoadedModel)."""
    if isinstance(obj, CausalLM):
        return obj
    runner = getattr(obj, "model_runner", None)
    if isinstance(getattr(runner, "model", None), CausalLM):
        return runner.model
    if isinstance(getattr(obj, "model", None), CausalLM):
        return obj.model
    raise TypeError(f"save_hf_folder: expected a CausalLM or an object holding one, got {type(obj).__name__}")


def save_hf_folder(model_or_llm: Any, path: str | os.PathLike) -> Path:
    """Write `path/config.json` + `path/model.safetensors` so that
    `transformers.AutoModelForCausalLM.from_pretrained(path)` (and `load_model(path)`) rebuild the
    same weights. Accepts a CausalLM, a LoadedModel, or an object with `.model_runner.model`
    (the LLM facade). Tied lm_head is not stored (HF re-ties it). Tokenizer files are copied when
    the object has a `tokenizer_dir` folder. Returns the folder path.
    """
    model = _resolve_model(model_or_llm)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    params = list(model.parameters())
    cfg = copy.deepcopy(model.config)
    cfg.architectures = [model.hf_architecture]
    if params:
        cfg.dtype = params[0].dtype
    cfg.save_pretrained(str(out))
    tied = model.is_tied
    tensors = {
        k: v.detach().to("cpu").contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    to_checkpoint = getattr(type(model), "state_dict_to_checkpoint", None)
    if to_checkpoint is not None:  # the on-disk layout HF writes (e.g. per-expert MoE tensors)
        takes_config = "config" in inspect.signature(to_checkpoint).parameters
        tensors = to_checkpoint(tensors, config=cfg) if takes_config else to_checkpoint(tensors)
    save_file(tensors, str(out / SAFE_WEIGHTS), metadata={"format": "pt"})
    tok_dir = getattr(model_or_llm, "tokenizer_dir", None)
    if isinstance(tok_dir, str) and os.path.isdir(tok_dir) and Path(tok_dir).resolve() != out.resolve():
        for f in TOKENIZER_FILES:
            src = Path(tok_dir) / f
            if src.is_file():
                shutil.copy2(src, out / f)
    return out
