"""Tokenizers: the HF tokenizer of a model folder (offline), or a byte-level fallback.

Byte-level fallback (presets and folders without tokenizer files): ids 0/1/2 are pad/bos/eos,
byte b is id b + 3, so the vocabulary needs >= 259 ids. `encode` prepends bos (unless
`add_special_tokens=False`). As in HF tokenizers, the special tokens' texts `<pad>`, `<s>` and `</s>`
in a text are encoded as their ids (so a chat template can write `{{ bos_token }}`), and `decode`
leaves the special ids out unless `skip_special_tokens=False`, which shows them as those texts
(decode then encode gives the ids back). Ids past the byte range are shown as `<|id|>` either way.

The byte fallback's chat template (`BYTE_CHAT_TEMPLATE`, used by `llm.chat` on presets and the demo
models, which ship no tokenizer files): bos, then per message its role between `<|` and `|>`, a
newline, its content and a newline; with `add_generation_prompt`, `<|assistant|>` and a newline.
[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}] renders as

    <s><|system|>
    Be brief.
    <|user|>
    Hi!
    <|assistant|>
    (an empty last line: the text ends with a newline)

The demo models were trained on plain text, not on chats: they continue it as text.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from toolkit.errors import CheckpointError

BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


class ByteTokenizer:
    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
    SPECIAL_TEXT = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}
    _SPECIAL_RE = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TEXT.values()) + ")")
    _SPECIAL_ID = {text: i for i, text in SPECIAL_TEXT.items()}

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = self.EOS
        self.bos_token, self.eos_token, self.pad_token = "<s>", "</s>", "<pad>"
        self.chat_template: str | None = BYTE_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.BOS] if add_special_tokens else []
        for k, part in enumerate(self._SPECIAL_RE.split(text)):     # odd k: a special token's text
            ids += [self._SPECIAL_ID[part]] if k % 2 else [b + self.OFFSET for b in part.encode("utf-8")]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
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
            elif not skip_special_tokens:
                out.append(self.SPECIAL_TEXT.get(i, ""))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, conversation: list[dict] | list[list[dict]], chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, **kwargs: Any) -> str | list[int] | list[str] | list[list[int]]:
        """transformers' `apply_chat_template` for the byte fallback (rendered by transformers' own
        jinja renderer, so a template behaves as it would on an HF tokenizer): one conversation or a
        list of them; the text, or with `tokenize` its ids (special tokens not added again: the
        template writes bos)."""
        from transformers.utils.chat_template_utils import render_jinja_template
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template: pass chat_template=")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        rendered, _ = render_jinja_template(
            conversations=conversation if batched else [conversation], chat_template=template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **{"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token, **kwargs})
        out = [self.encode(text, add_special_tokens=False) for text in rendered] if tokenize else rendered
        return out if batched else out[0]


class HFTokenizer:
    """The engine's view of a transformers tokenizer (`hf_tokenizer`, what `llm.get_tokenizer()` returns)."""

    def __init__(self, folder: str | Path):
        from transformers import AutoTokenizer
        self.hf_tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.eos_token_id = self.hf_tokenizer.eos_token_id

    @property
    def chat_template(self) -> str | dict | None:
        return self.hf_tokenizer.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, conversation: list, **kwargs: Any) -> Any:
        return self.hf_tokenizer.apply_chat_template(conversation, **kwargs)


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
