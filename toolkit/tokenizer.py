"""Tokenizers: the HF tokenizer of a model folder (offline), or a byte-level fallback.

Byte-level fallback (presets and folders without tokenizer files): ids 0/1/2 are pad/bos/eos,
byte b is id b + 3, so the vocabulary needs >= 259 ids. `encode` prepends bos. `decode` skips
the special ids and shows ids past the byte range as `<|id|>`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.errors import CheckpointError


class ByteTokenizer:
    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = self.EOS

    def encode(self, text: str) -> list[int]:
        return [self.BOS] + [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if self.OFFSET <= i < self.OFFSET + 256:
                pending.append(i - self.OFFSET)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
            if i >= self.OFFSET + 256:
                out.append(f"<|{i}|>")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer
        self._tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(tokenizer_dir: str | Path | None, vocab_size: int) -> ByteTokenizer | HFTokenizer:
    """`tokenizer_dir`: the model folder when the loader found tokenizer files in it, else None."""
    return HFTokenizer(tokenizer_dir) if tokenizer_dir is not None else ByteTokenizer(vocab_size)


def collect_eos_token_ids(hf_config: Any, folder: str | None, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends generation, as vLLM gathers them: the config's `eos_token_id` (an int or
    a list, e.g. Llama 3's [128001, 128008, 128009]), `generation_config.json`'s in a model folder,
    and an HF tokenizer's eos (the byte fallback's id 2 is a convention, not the model's)."""
    ids: list[int] = []             # in the order found, without repeats

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            if value not in ids:
                ids.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)

    add(getattr(hf_config, "eos_token_id", None))
    if folder is not None and (Path(folder) / "generation_config.json").is_file():
        try:
            add(json.loads((Path(folder) / "generation_config.json").read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, AttributeError) as err:
            raise CheckpointError(f"{folder}/generation_config.json is not a JSON object: {err}") from err
    if isinstance(tokenizer, HFTokenizer):
        add(tokenizer.eos_token_id)
    return tuple(ids)
