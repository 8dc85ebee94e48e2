"""`llm.chat(messages)` (vLLM's `LLM.chat`): conversations rendered with a chat template, then
generated; and `llm.get_tokenizer()`.

A conversation is a list of {"role": str, "content": str} messages; `messages` is one, or a list of
them (one RequestOutput each, in order). Each is rendered to text by the chat template (the HF
tokenizer's, the byte fallback's `BYTE_CHAT_TEMPLATE` in toolkit/tokenizer.py, or `chat_template=`)
as transformers' `apply_chat_template(tokenize=False)` renders it, then tokenized WITHOUT adding
special tokens: the template writes them (`{{ bos_token }}`), and adding bos again would start the
prompt with two (vLLM tokenizes chat prompts the same way). The output's `prompt` is the rendered
text. Every conversation is rendered and checked before any is queued (generate() then checks the
prompts as it checks any), so a bad one raises and queues nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolkit.errors import InvalidRequestError

if TYPE_CHECKING:       # chat sits below the LLM facade: typing only
    from toolkit.llm import LLM
    from toolkit.outputs import RequestOutput
    from toolkit.sampling import SamplingParams


@dataclass(frozen=True)
class ChatPrompt:
    text: str                   # the conversation rendered by the chat template
    token_ids: list[int]        # its tokens, special tokens not added again


def public_tokenizer(tokenizer: Any) -> Any:
    """What `llm.get_tokenizer()` returns: the transformers tokenizer of an HF folder (the
    engine's wrapper holds it as `hf_tokenizer`), else the byte fallback itself."""
    return getattr(tokenizer, "hf_tokenizer", tokenizer)


def conversations(messages: Any) -> list[list[dict]]:
    """`messages` as a list of conversations, each checked: non-empty, of dicts with a str
    'role' and a str 'content'."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("messages: a conversation (a non-empty list of {'role', 'content'} dicts) "
                                  f"or a list of them, got {messages!r:.80}")
    convs = list(messages) if isinstance(messages[0], (list, tuple)) else [messages]
    for i, conv in enumerate(convs):
        if not isinstance(conv, (list, tuple)) or not conv:
            raise InvalidRequestError(f"messages: conversation {i} is not a non-empty list of messages: {conv!r:.80}")
        for j, msg in enumerate(conv):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str)
                    and isinstance(msg.get("content"), str)):
                raise InvalidRequestError(f"messages: conversation {i}, message {j} is not a dict with a str "
                                          f"'role' and a str 'content': {msg!r:.80}")
    return [list(c) for c in convs]


def render_chats(tokenizer: Any, messages: Any, chat_template: str | None = None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[ChatPrompt]:
    """Each conversation of `messages`, rendered and tokenized (module docstring)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be True: one "
                                  "opens a new assistant message, the other continues the last one")
    if chat_template is not None and not isinstance(chat_template, str):
        raise InvalidRequestError(f"chat_template must be a Jinja template string, got {type(chat_template).__name__}")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError("llm.chat: the tokenizer has no chat template (no 'chat_template' in the "
                                  "model's tokenizer_config.json, no chat_template.jinja): pass chat_template=")
    from jinja2 import TemplateError
    out = []
    for i, conv in enumerate(conversations(messages)):
        try:
            text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 chat_template=chat_template)
        except (TemplateError, ValueError, TypeError, KeyError) as err:
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise InvalidRequestError(f"chat template on conversation {i}: {first_line}") from err
        out.append(ChatPrompt(text, tokenizer.encode(text, add_special_tokens=False)))
    return out


def chat(llm: LLM, messages: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
         use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
         continue_final_message: bool = False) -> list[RequestOutput]:
    """`llm.chat` (module docstring): one RequestOutput per conversation, its `prompt` the rendered text."""
    chats = render_chats(llm.tokenizer, messages, chat_template, add_generation_prompt, continue_final_message)
    outputs = llm.generate([{"prompt_token_ids": c.token_ids} for c in chats], sampling_params, use_tqdm)
    for out, c in zip(outputs, chats):
        out.prompt = c.text
    return outputs
