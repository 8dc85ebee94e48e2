"""The LLM facade: bad prompts and sampling params, admission, stats and resources, abort, step
records, shutdown, tokenizers (an HF folder's, the byte fallback), the demo command, the installed
kernels package, state pages zeroed on reuse, slot mapping, and requests added by hand beside
generate()."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import (
    LLM,
    CheckpointError,
    InvalidRequestError,
    SamplingParams,
    UnknownModelError,
    UnsupportedArchitectureError,
)
from toolkit.models import save_hf_folder
from toolkit.runner.model_states import MambaHybridModelState

REPO = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def small(preset, **kw):
    args = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32) | kw
    return LLM(preset, **args)


BAD_PROMPTS = [
    ({"prompt_token_ids": []}, "empty"),
    ("", "empty"),  # the byte tokenizer adds BOS, so "" is one token; see test below
    ({"prompt_token_ids": [5, 999]}, "out of range"),
    ({"prompt_token_ids": [5, -1]}, "out of range"),
    ({"prompt_token_ids": list(range(3, 103))}, "max_model_len"),
    ({"prompt_token_ids": "abc"}, "list of ints"),
    (42, "a prompt is"),
]


@pytest.mark.parametrize("prompt, match", [b for b in BAD_PROMPTS if b[0] != ""])
def test_bad_prompts_raise_and_engine_keeps_serving(prompt, match):
    with LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64) as llm:
        good = llm.add_request({"prompt_token_ids": [5, 6, 7]}, GREEDY)
        before = llm.stats()
        with pytest.raises(InvalidRequestError, match=match):
            llm.add_request(prompt, GREEDY)
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate([{"prompt_token_ids": [8, 9]}, prompt], GREEDY)   # nothing queued
        assert llm.stats() == before
        outs = {}
        while llm.has_unfinished_requests():
            outs.update({o.request_id: o for o in llm.step().outputs})
        assert list(outs) == [good] and len(outs[good].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-3), "top_k")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)
    with small("tiny-llama") as llm:
        params = SamplingParams()
        setattr(params, *next(iter(kwargs.items())))       # mutated after construction
        with pytest.raises(InvalidRequestError, match=match):
            llm.add_request({"prompt_token_ids": [5]}, params)
        with pytest.raises(InvalidRequestError, match="SamplingParams"):
            llm.add_request({"prompt_token_ids": [5]}, {"max_tokens": 3})
        assert not llm.has_unfinished_requests()


def test_request_that_can_never_fit_the_kv_cache_is_refused():
    with small("tiny-llama", block_size=4, num_kv_blocks=5) as llm:
        with pytest.raises(InvalidRequestError, match="KV blocks"):
            llm.add_request({"prompt_token_ids": list(range(3, 20))}, GREEDY)


def test_unknown_preset_missing_config_and_unsupported_architecture(tmp_path):
    with pytest.raises(UnknownModelError, match="tiny-llama"):
        LLM("tiny-nothing")
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))


def test_stats_abort_and_resources_return():
    with small("tiny-bamba", max_model_len=128, max_num_batched_tokens=64) as llm:
        total = llm.stats()
        a = llm.add_request({"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=50))
        llm.add_request({"prompt_token_ids": [4, 5]}, GREEDY)
        llm.step()
        mid = llm.stats()
        assert mid["num_running"] == 2 and mid["kv_blocks_free"] < total["kv_blocks_free"]
        assert mid["state_pages_free"] == total["state_pages_free"] - 2
        llm.abort_request(a)
        llm.abort_request("no-such-request")
        while llm.has_unfinished_requests():
            llm.step()
        after = llm.stats()
        for key in ("kv_blocks_total", "kv_blocks_free", "state_pages_total", "state_pages_free"):
            assert after[key] == total[key]
        assert after["num_running"] == after["num_waiting"] == 0


def test_step_record_holds_what_the_runner_used():
    with small("tiny-bamba", max_num_batched_tokens=8) as llm:
        r0 = llm.add_request({"prompt_token_ids": list(range(3, 15))}, GREEDY)
        rec = llm.step()
        assert [s.request_id for s in rec.scheduled] == [r0] and rec.num_tokens == 8
        assert rec.input_batch.query_start_loc_np.tolist() == [0, 8]
        mamba = rec.metadata("mamba")
        assert mamba.builder == "Mamba2MetadataBuilder"
        assert mamba.metadata.num_prefills == 1 and mamba.metadata.has_initial_states_p.tolist() == [False]
        rec2 = llm.step()
        md2 = rec2.metadata("mamba").metadata
        assert md2.has_initial_states_p.tolist() == [True]      # second chunk continues the state
        assert rec.input_batch.query_start_loc_np.tolist() == [0, 8]   # snapshot, not a live view
        assert rec2.input_batch.positions.tolist() == list(range(8, 12))
        attn = rec2.metadata("attention")
        assert attn.common.seq_lens_cpu_upper_bound.tolist() == [12]
        assert rec2.kept_token_ids == {r0: rec2.sampled_token_ids[r0]}


def test_shutdown_is_idempotent_and_final():
    llm = small("tiny-bamba")
    llm.shutdown()
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.add_request({"prompt_token_ids": [5]})
    with small("tiny-mamba2") as llm2:
        assert llm2.generate({"prompt_token_ids": [5, 6]}, GREEDY)[0].finished
    assert llm2._closed and not hasattr(llm2.model_runner, "model")

def test_shutdown_frees_caches_and_model_collecting_garbage_only_for_a_cycle(monkeypatch):
    """Reference counting frees the caches and the model at shutdown; the full garbage collection
    (0.1-0.2 s in a big process) runs only when a reference cycle still holds one of them."""
    import gc
    import weakref
    collections = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collections.append(a) or real_collect(*a))
    for cycle in (False, True):
        llm = small("tiny-bamba")
        llm.generate({"prompt_token_ids": [5, 6]}, GREEDY)
        model = llm.model_runner.model
        cache = next(iter(llm.model_runner.kv_caches.values()))
        refs = [weakref.ref(model), weakref.ref(cache if not isinstance(cache, tuple) else cache[0])]
        if cycle:
            model.loop = [model]             # a cycle through a list (not a submodule): only gc frees it
        del model, cache
        gc.disable()                         # no automatic collection in between
        try:
            llm.shutdown()
        finally:
            gc.enable()
        assert all(ref() is None for ref in refs)
        assert bool(collections) == cycle
        collections.clear()



def test_hf_folder_tokenizer_is_used(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    with LLM("tiny-llama", device="cpu", dtype="float32") as llm:
        save_hf_folder(llm, tmp_path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 10, "world": 11}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(tmp_path)
    with LLM(str(tmp_path), device="cpu", dtype="float32") as llm:
        out = llm.generate("hello world", GREEDY)[0]
        assert out.prompt_token_ids == [10, 11]
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
        save_hf_folder(llm, tmp_path / "copy")                      # carries the tokenizer along
    with LLM(str(tmp_path / "copy"), device="cpu", dtype="float32") as copy:
        assert copy.generate("hello world", GREEDY)[0].prompt_token_ids == [10, 11]


def test_byte_fallback_tokenizer_round_trip():
    with small("tiny-llama") as llm:
        out = llm.generate("héllo", GREEDY)[0]
        assert out.prompt_token_ids == [1] + [b + 3 for b in "héllo".encode()]
        assert llm.tokenizer.decode(out.prompt_token_ids) == "héllo"


def test_demo_on_another_model(capsys):
    from toolkit.cli import main
    assert main(["demo", "--model", "tiny-lfm2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Lfm2ForCausalLM" in out and "MambaHybridModelState" in out
    assert "3/3 state pages free" in out


def test_kernels_install_under_toolkit_not_top_level(tmp_path):
    import toolkit.kernels
    assert Path(toolkit.kernels.__file__).parent == REPO / "kernels"
    # outside the repo (the repo root itself has a kernels/ folder), nothing named `kernels` imports
    probe = "import importlib.util, toolkit.kernels; print(importlib.util.find_spec('kernels'))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None", "a top-level `kernels` module is installed"


def test_fresh_state_slots_are_zeroed_when_a_request_takes_them(monkeypatch):
    seen = []
    original = MambaHybridModelState.add_request

    def spy(self, req_idx, new_req):
        slot = new_req.block_ids[self.mamba_groups[0].group_id][0]
        dirty_before = sum(float(t[slot].abs().sum()) for t in self.state_tensors)
        original(self, req_idx, new_req)
        seen.append((slot, dirty_before, sum(float(t[slot].abs().sum()) for t in self.state_tensors)))
    monkeypatch.setattr(MambaHybridModelState, "add_request", spy)
    with small("tiny-bamba", max_num_seqs=1) as llm:
        llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)     # leaves state in slot 1
        llm.generate({"prompt_token_ids": [8, 9]}, GREEDY)        # takes slot 1 again
    (slot_a, _, _), (slot_b, dirty, after) = seen
    assert slot_a == slot_b == 1 and dirty > 0 and after == 0


def test_slot_mapping_follows_block_table():
    with small("tiny-llama", block_size=4, max_num_batched_tokens=64) as llm:
        llm.add_request({"prompt_token_ids": list(range(3, 13))}, GREEDY)
        llm.add_request({"prompt_token_ids": list(range(3, 9))}, GREEDY)
        llm.step()
        rec = llm.step()                                            # two decode rows
        common = rec.metadata("attention").common
        positions = rec.input_batch.positions.tolist()
        for row, pos in enumerate(positions):
            block = int(common.block_table_tensor[row, pos // 4])
            assert block != 0 and int(common.slot_mapping[row]) == block * 4 + pos % 4
        assert common.seq_lens_cpu_upper_bound.tolist() == [p + 1 for p in positions]


def test_generate_does_not_swallow_requests_added_by_hand():
    with small("tiny-mamba2") as llm:
        rid = llm.add_request({"prompt_token_ids": [5, 6]}, GREEDY)
        outs = llm.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=8, temperature=0.0))
        assert [o.request_id for o in outs] != [rid]
        assert llm.has_unfinished_requests()             # its output still awaits a step()
        rec = llm.step()
        assert [o.request_id for o in rec.outputs] == [rid] and len(rec.outputs[0].outputs[0].token_ids) == 4
        assert not llm.has_unfinished_requests()
        assert llm.step().outputs == []
