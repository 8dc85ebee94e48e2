"""Tokenizers: the HF tokenizer of a model folder (offline), or a byte-level fallback.

Byte-level fallback (presets and folders without tokenizer files): ids 0/1/2 are pad/bos/eos,
byte b is id b + 3, so the vocabulary needs >= 259 ids. `encode` prepends bos. `decode` skips
the special ids and shows ids past the byte range as `<|id|>`.
"""
from __future__ import annotations

from pathlib import Path


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
