"""A model's recommended sampling defaults, as vLLM takes them (`LLM(generation_config=...)`,
vLLM's `--generation-config`).

Model makers ship them in `generation_config.json` (e.g. Qwen3: temperature 0.6, top_p 0.95,
top_k 20), and vLLM serves with them unless told not to. So does this engine:

- "auto" (the default): the model folder's `generation_config.json` (a preset has none);
- "vllm": none, SamplingParams' own defaults (vLLM's neutral ones);
- a folder: the `generation_config.json` in it.

vLLM's fields are taken, nothing else: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as max_tokens (a null value is no value). They fill the fields of a request's
SamplingParams that its caller did not set (`SamplingParams.explicit_fields`; all of them when no
SamplingParams is passed), so `SamplingParams(temperature=0)` stays greedy but takes the model's
max_new_tokens. (vLLM's OpenAI server fills the unset fields the same way; its offline `LLM` uses
them only when no SamplingParams is passed.) They are checked once, when the engine is built: a bad
value is a CheckpointError then, not an error on every request.

Which values are in force is logged once, as a warning of the "toolkit.generation_config" logger
(vLLM warns too: a model's defaults change what the same SamplingParams produce).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.errors import CheckpointError, InvalidRequestError
from toolkit.models.loader import read_json_object
from toolkit.sampling import SamplingParams, copy_params

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's list)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_generation_config(value: object) -> None:
    """`LLM(generation_config=...)`, checked before the model loads."""
    if value in ("auto", "vllm"):
        return
    if not isinstance(value, (str, os.PathLike)) or not Path(value).is_dir():
        raise ValueError(f"generation_config={value!r}: use 'auto' (the model's {FILE}), 'vllm' (none) or a "
                         f"folder holding a {FILE}")
    if not (Path(value) / FILE).is_file():
        raise ValueError(f"generation_config={os.fspath(value)!r}: that folder has no {FILE}")


@dataclass(frozen=True)
class GenerationDefaults:
    """The SamplingParams defaults in force (`values`, SamplingParams field -> value) and the file
    they came from (None: there are none)."""
    values: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with the defaults in the fields its caller did not set (a validated copy)."""
        unset = {k: v for k, v in self.values.items() if k not in params.explicit_fields}
        if not unset:
            return params
        try:
            return copy_params(params, **unset)
        except InvalidRequestError as err:     # e.g. min_tokens above the model's max_new_tokens
            raise InvalidRequestError(f"{err} (with the defaults of {self.source}: {self.describe()}; "
                                      "set the field, or LLM(generation_config='vllm'))") from None

    def sampling_params(self) -> SamplingParams:
        """vLLM's `llm.get_default_sampling_params()`: SamplingParams with these defaults."""
        return SamplingParams(**self.values)

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.values.items())


def load_generation_defaults(setting: str | os.PathLike, model_folder: str | None) -> GenerationDefaults:
    """The defaults `LLM(generation_config=setting)` serves with, for a model loaded from
    `model_folder` (None: a preset); logs them when there are any."""
    if setting == "vllm":
        return GenerationDefaults()
    folder = model_folder if setting == "auto" else os.fspath(setting)
    path = Path(folder) / FILE if folder is not None else None
    if path is None or not path.is_file():
        return GenerationDefaults()
    defaults = GenerationDefaults(read_defaults(path), str(path))
    if defaults.values:
        log.warning("generation defaults from %s: %s (LLM(generation_config=\"vllm\") turns them off)",
                    defaults.source, defaults.describe())
    return defaults


def read_defaults(path: Path) -> dict[str, Any]:
    """vLLM's sampling fields of a generation_config.json, under SamplingParams' names, checked."""
    raw = read_json_object(path)
    values = {name: raw[key] for key, name in FIELDS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**values)
    except InvalidRequestError as err:
        raise CheckpointError(f"{path}: {err} (as a default; LLM(generation_config='vllm') ignores the file)") from err
    return values
