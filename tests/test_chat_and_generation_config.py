"""llm.chat (toolkit/chat.py), a model's generation defaults (toolkit/generation_config.py),
llm.get_tokenizer() and SamplingParams.skip_special_tokens, on tiny-llama and HF folders of it
whose tokenizer (a WordLevel one, with a chat template) is built here."""
from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from toolkit import LLM, CheckpointError, InvalidRequestError, SamplingParams
from toolkit.models.loader import save_hf_folder
from toolkit.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROBE = {"prompt_token_ids": [1, 50, 51, 52]}       # its first greedy token becomes the folders' eos
CONV = [{"role": "user", "content": "hello world"}]
CONV2 = [{"role": "system", "content": "world"}, {"role": "user", "content": "hello hello"}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
GENERATION_CONFIG = {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 3, "repetition_penalty": 1.3,
                     "do_sample": False, "top_k": None}
LOGGER = "toolkit.generation_config"


def small(model: str, **kwargs) -> LLM:
    return LLM(model, device="cpu", dtype="float32", inspect="off", **kwargs)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def write_tokenizer(folder, eos: int, chat_template: str | None) -> None:
    """A WordLevel tokenizer: bos `<s>`, eos `</s>` at id `eos` (an id the model emits), a few words."""
    free = (i for i in range(3, 100) if i != eos)
    vocab = {w: next(free) for w in ("<unk>", "<s>", "user", "system", "assistant", ":", "hello", "world")}
    vocab["</s>"] = eos
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(folder)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """`plain`: tiny-llama with a tokenizer without a chat template; `chat`: with one and a
    generation_config.json. Their eos is the first token tiny-llama emits greedily after PROBE."""
    root = tmp_path_factory.mktemp("chat")
    with small("tiny-llama") as llm:
        eos = llm.generate(PROBE, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0] \
            .outputs[0].token_ids[0]
        save_hf_folder(llm, root / "plain")
    shutil.copytree(root / "plain", root / "chat")
    write_tokenizer(root / "plain", eos, None)
    write_tokenizer(root / "chat", eos, TEMPLATE)
    (root / "chat" / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return SimpleNamespace(plain=str(root / "plain"), chat=str(root / "chat"), eos=eos, root=root)


def test_chat_on_a_preset_uses_the_byte_fallbacks_template():
    with small("tiny-llama") as llm:
        tok = llm.get_tokenizer()
        assert isinstance(tok, ByteTokenizer)
        text = "<s><|user|>\nhello world\n<|assistant|>\n"
        assert tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True) == text
        ids = tok.encode(text, add_special_tokens=False)
        assert ids[0] == ByteTokenizer.BOS and ids.count(ByteTokenizer.BOS) == 1     # the template's bos only
        out = llm.chat(CONV, GREEDY)
        assert len(out) == 1 and out[0].prompt == text and out[0].prompt_token_ids == ids
        assert tokens(out) == tokens(llm.generate({"prompt_token_ids": ids}, GREEDY))
        # chat_template= overrides the built-in one; continue_final_message leaves the last message open
        assert llm.chat(CONV, GREEDY, chat_template="{{ bos_token }}{{ messages[0]['content'] }}")[0].prompt \
            == "<s>hello world"
        partial = CONV + [{"role": "assistant", "content": "hel"}]
        assert llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True)[0].prompt \
            .endswith("<|assistant|>\nhel")
        assert llm.get_default_sampling_params() == SamplingParams()       # a preset has no generation config


def test_demo_model_chats():
    with small("demo-mamba") as llm:
        out = llm.chat([{"role": "user", "content": "Once upon a time"}], GREEDY)[0]
        assert out.prompt.startswith("<s><|user|>") and len(out.outputs[0].token_ids) == 4


def test_chat_with_an_hf_template_equals_generate_on_the_rendered_ids(folders):
    with small(folders.chat, generation_config="vllm") as llm:
        tok = llm.get_tokenizer()
        assert isinstance(tok, PreTrainedTokenizerBase)
        texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in (CONV, CONV2)]
        assert texts[0] == "<s>user : hello world assistant :"
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        assert all(i.count(tok.bos_token_id) == 1 and i[0] == tok.bos_token_id for i in ids)
        one = llm.chat(CONV, GREEDY)
        assert one[0].prompt_token_ids == ids[0] and one[0].prompt == texts[0]
        assert tokens(one) == tokens(llm.generate({"prompt_token_ids": ids[0]}, GREEDY))
        both = llm.chat([CONV, CONV2], GREEDY)                     # a batch: one output each, in order
        assert [o.prompt_token_ids for o in both] == ids
        assert tokens(both) == tokens(llm.generate([{"prompt_token_ids": i} for i in ids], GREEDY))


def test_chat_refuses_what_it_cannot_render(folders):
    with small(folders.plain) as llm:
        with pytest.raises(InvalidRequestError, match="no chat template"):
            llm.chat(CONV, GREEDY)
        assert llm.chat(CONV, GREEDY, chat_template=TEMPLATE)[0].prompt == "<s>user : hello world assistant :"
        bad = [[], "hi", [{"role": "user"}], [[]], [CONV, "x"], [{"role": "user", "content": 3}]]
        for messages in bad:
            with pytest.raises(InvalidRequestError, match="messages"):
                llm.chat(messages, GREEDY, chat_template=TEMPLATE)
        with pytest.raises(InvalidRequestError, match="cannot both be True"):
            llm.chat(CONV, GREEDY, chat_template=TEMPLATE, continue_final_message=True)
        with pytest.raises(InvalidRequestError, match="chat template on conversation 0"):
            llm.chat(CONV, GREEDY, chat_template="{{ raise_exception('no system message') }}")
        assert not llm.has_unfinished_requests()


def test_generation_config_fills_the_fields_the_caller_did_not_set(folders, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER), small(folders.chat) as llm:
        logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert len(logged) == 1 and "generation_config.json" in logged[0]
        assert all(f in logged[0] for f in ("temperature=0.0", "top_p=0.9", "max_tokens=3", "repetition_penalty=1.3"))
        assert 'generation_config="vllm"' in logged[0] and "top_k" not in logged[0]       # null: no value
        d = llm.get_default_sampling_params()
        assert (d.temperature, d.top_p, d.max_tokens, d.repetition_penalty, d.top_k) == (0.0, 0.9, 3, 1.3, 0)
        # what each request was given: None takes every default; a set field keeps the caller's value
        rid = llm.add_request(PROBE)
        seen = llm.scheduler.requests[rid].sampling_params
        assert (seen.temperature, seen.top_p, seen.max_tokens, seen.repetition_penalty) == (0.0, 0.9, 3, 1.3)
        rid = llm.add_request(PROBE, SamplingParams(max_tokens=5, repetition_penalty=1.0))
        seen = llm.scheduler.requests[rid].sampling_params
        assert (seen.temperature, seen.top_p, seen.max_tokens, seen.repetition_penalty) == (0.0, 0.9, 5, 1.0)
        while llm.has_unfinished_requests():
            llm.step()
        keep_going = SamplingParams(temperature=0.0, ignore_eos=True)
        assert [len(t) for t in tokens(llm.generate(PROBE, keep_going))] == [3]
        assert [len(t) for t in tokens(llm.generate(PROBE, SamplingParams(max_tokens=5, ignore_eos=True)))] == [5]
        assert [len(t) for t in tokens(llm.chat(CONV, keep_going))] == [3]
        with pytest.raises(InvalidRequestError, match="generation_config.json"):
            llm.generate(PROBE, SamplingParams(min_tokens=4))        # above the model's max_new_tokens
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER), small(folders.chat, generation_config="vllm") as llm:
        assert not caplog.records and llm.get_default_sampling_params() == SamplingParams()
        assert [len(t) for t in tokens(llm.generate(PROBE, SamplingParams(temperature=0.0, ignore_eos=True)))] == [16]
    with small(folders.plain, generation_config=folders.chat) as llm:         # a folder's file, for another model
        assert llm.get_default_sampling_params().max_tokens == 3
    with small(folders.plain) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_bad_generation_configs(folders):
    with pytest.raises(ValueError, match="generation_config='nope'"):
        small(folders.plain, generation_config="nope")
    with pytest.raises(ValueError, match="has no generation_config.json"):
        small(folders.chat, generation_config=str(folders.root))
    for name, text in (("broken", "{not json"), ("negative", json.dumps({"temperature": -1}))):
        (folders.root / name).mkdir()
        (folders.root / name / "generation_config.json").write_text(text)
        with pytest.raises(CheckpointError, match="generation_config.json") as err:
            small(folders.plain, generation_config=str(folders.root / name))
        assert "\n" not in str(err.value)


def test_skip_special_tokens_false_keeps_the_special_tokens_text(folders):
    with small(folders.chat, generation_config="vllm") as llm:
        assert folders.eos in llm.eos_token_ids
        stopped = llm.generate(PROBE, SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
        assert stopped.token_ids == [folders.eos] and stopped.text == ""      # a stop token's text is left out
        shown, skipped = (llm.generate(PROBE, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                             skip_special_tokens=skip))[0].outputs[0]
                          for skip in (False, True))
        assert shown.token_ids == skipped.token_ids and shown.token_ids[0] == folders.eos
        assert shown.text.startswith("</s>") and "</s>" not in skipped.text
        # the incremental detokenization for stop strings decodes the same way
        hit, missed = (llm.generate(PROBE, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, stop="</s>",
                                                          skip_special_tokens=skip))[0].outputs[0]
                       for skip in (False, True))
        assert (hit.finish_reason, hit.stop_reason, hit.text, len(hit.token_ids)) == ("stop", "</s>", "", 1)
        assert (missed.finish_reason, len(missed.token_ids)) == ("length", 3)
    tok = ByteTokenizer(320)
    assert tok.decode([1, 107, 2, 0, 300], skip_special_tokens=False) == "<s>h</s><pad><|300|>"
    assert tok.decode([1, 107, 2, 0, 300]) == "h<|300|>"
    assert tok.encode("<s>h</s><pad>", add_special_tokens=False) == [1, 107, 2, 0]
