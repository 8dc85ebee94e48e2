"""`LLM.warmup()`: its check of the metadata contracts names the field a model state forgot to
forward, the builder that needs it and the producer, for every metadata builder (Mamba1, Mamba2,
short conv, Gated DeltaNet, paged attention; on hybrids without attention layers too), while the
profile run, which builds no metadata, passes either way; and warmup leaves the engine clean and
outputs unchanged."""
from __future__ import annotations

import pytest

from toolkit import LLM, MetadataContractError, SamplingParams
from toolkit.runner.model_states import MambaHybridModelState

from harness import F32, no_attention_folder

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SMALL = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)


def forget_field(monkeypatch, field: str) -> None:
    """MambaHybridModelState stops passing `field` to the metadata builders."""
    original = MambaHybridModelState.attn_metadata_kwargs

    def forgets(self, input_batch, for_capture):
        kwargs = original(self, input_batch, for_capture)
        kwargs.pop(field)
        return kwargs
    monkeypatch.setattr(MambaHybridModelState, "attn_metadata_kwargs", forgets)


@pytest.mark.parametrize("model, builder", [
    ("tiny-mamba", "Mamba1MetadataBuilder"), ("tiny-falcon-mamba", "Mamba1MetadataBuilder"),
    ("tiny-mamba2", "Mamba2MetadataBuilder"), ("no-attention:tiny-lfm2", "ShortConvMetadataBuilder"),
    ("no-attention:tiny-jamba", "Mamba1MetadataBuilder"), ("no-attention:tiny-qwen3-next", "GDNMetadataBuilder"),
    ("tiny-jamba", "PagedAttentionMetadataBuilder"), ("tiny-lfm2", "PagedAttentionMetadataBuilder")])
def test_warmup_names_field_and_builder_for_every_builder(monkeypatch, tmp_path, model, builder):
    if model.startswith("no-attention:"):
        model = no_attention_folder(model.split(":")[1], tmp_path)
    with LLM(model, **F32, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        forget_field(monkeypatch, "seq_lens_cpu_upper_bound")
        with pytest.raises(MetadataContractError) as err:
            llm.warmup(progress=False)
        assert (err.value.field, err.value.builder) == ("seq_lens_cpu_upper_bound", builder)
        assert builder in str(err.value) and "MambaHybridModelState" in str(err.value)


@pytest.mark.parametrize("preset, builders", [
    ("tiny-mamba2", {"Mamba2MetadataBuilder"}),
    ("tiny-bamba", {"PagedAttentionMetadataBuilder", "Mamba2MetadataBuilder"})])
def test_warmup_catches_unforwarded_seq_lens_cpu_upper_bound(monkeypatch, preset, builders):
    """vLLM #46759: the hybrid state computed seq_lens_cpu_upper_bound but did not forward it."""
    with LLM(preset, **SMALL) as llm:
        llm.model_runner.profile_run()      # the profile run builds no metadata: passes either way
        forget_field(monkeypatch, "seq_lens_cpu_upper_bound")
        with pytest.raises(MetadataContractError) as err:
            llm.warmup(progress=False)
        assert err.value.field == "seq_lens_cpu_upper_bound"
        assert err.value.builder in builders and err.value.builder in str(err.value)
        assert "MambaHybridModelState" in str(err.value)
        monkeypatch.undo()
        llm.warmup(progress=False)


def test_warmup_names_the_gdn_builder_for_a_field_it_requires(monkeypatch):
    """The hybrid state forgets `is_prefilling` (the paged builder does not need it, the GDN
    builder does): warmup names the field, GDNMetadataBuilder and the producer."""
    with LLM("tiny-qwen3-next", **F32, max_num_seqs=2, max_num_batched_tokens=16) as llm:
        forget_field(monkeypatch, "is_prefilling")
        with pytest.raises(MetadataContractError) as err:
            llm.warmup(progress=False)
        assert (err.value.field, err.value.builder) == ("is_prefilling", "GDNMetadataBuilder")
        assert "MambaHybridModelState" in str(err.value)
        monkeypatch.undo()
        llm.warmup(progress=False)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mamba2", "tiny-bamba"])
def test_warmup_leaves_engine_clean_and_outputs_unchanged(preset):
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    with LLM(preset, **SMALL) as cold:
        expected = cold.generate(prompt, GREEDY)[0].outputs[0].token_ids
    with LLM(preset, **SMALL) as llm:
        timings = llm.warmup(progress=False)
        assert "profile run" in timings and "real prefill + decode" in timings
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["state_pages_free"] == stats["state_pages_total"]
        assert stats["runner_rows_in_use"] == 0
        llm.add_request(prompt, GREEDY)
        recs = [llm.step()]
        while llm.has_unfinished_requests():
            recs.append(llm.step())
        assert recs[0].step_index == 0                  # warmup's own steps are not counted
        assert recs[-1].outputs[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-bamba"])
def test_warmup_dummy_rows_never_pass_max_model_len(preset):
    """A token budget larger than a few rows of max_model_len: warmup's largest dummy batch spreads
    at most max_model_len tokens over each row (it used to give each row budget / rows tokens, which
    overflowed the block table)."""
    with LLM(preset, device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=256,
             max_model_len=32) as llm:
        stages = llm.warmup(progress=False)
        assert "dummy batch 4 reqs x 128 tokens" in stages
        tokens = llm.generate({"prompt_token_ids": [3, 4, 5]}, GREEDY)[0].outputs[0].token_ids
        assert len(tokens) == GREEDY.max_tokens
