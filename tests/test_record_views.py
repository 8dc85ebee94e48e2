"""Text and HTML views of the inspection records (toolkit/inspect/record_views.py, summaries.py,
html.py, installed as reprs by reprs.py), driven by real steps."""
import dataclasses
import re
from html.parser import HTMLParser

import pytest
import torch

from toolkit import LLM, SamplingParams
from toolkit.inspect import (
    DivergenceReport,
    MemoryReport,
    TraceDiff,
    compare_hf,
    faults,
    html,
    record_views,
    summaries,
    trace_diff,
)
from toolkit.inspect.step_record import Violation
from toolkit.inspect.trace import Trace

VOID_TAGS = {"br", "hr", "img", "meta", "input", "wbr"}


@pytest.fixture(scope="module")
def records():
    """Two steps of tiny-bamba: step 0 runs 8 of the 12-token prompt (a chunk); step 1 finishes that
    prompt beside the 3-token one."""
    llm = LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=8)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    llm.add_request({"prompt_token_ids": list(range(3, 15))}, greedy)
    llm.add_request({"prompt_token_ids": [5, 6, 7]}, greedy)
    recs = [llm.step(), llm.step()]
    llm.shutdown()
    return recs


@pytest.fixture(scope="module")
def rec(records):
    return records[1]


class _TagBalance(HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.errors = [], []

    def handle_starttag(self, tag, attrs):
        if tag not in VOID_TAGS:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def assert_clean_html(h: str) -> None:
    low = h.lower()
    for bad in ("<script", "http", "<link", "<style", "<iframe", "javascript:"):
        assert bad not in low, bad
    parser = _TagBalance()
    parser.feed(h)
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)


def _field_row(h: str, name: str) -> str:
    m = re.search(rf"<td[^>]*>{re.escape(name)}</td>.*?</tr>", h)
    assert m, name
    return m.group(0)


def _tensor_fields(obj):
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, torch.Tensor):
            yield f.name, v


def test_step_html_shows_every_metadata_field_and_small_tensor_values(rec):
    h = rec._repr_html_()
    assert_clean_html(h)
    assert len(rec.attn_metadata) == 2
    for g in rec.attn_metadata:
        assert g.builder in h
        for name in g.layer_names:
            assert name in h
        for obj in (g.common, g.metadata):
            for f in dataclasses.fields(obj):
                assert f">{f.name}</td>" in h, (type(obj).__name__, f.name)
            for name, t in _tensor_fields(obj):
                if t.numel() <= summaries.WHOLE:
                    assert str(t.tolist()) in h, (type(obj).__name__, name)
    qsl = rec.metadata("mamba").common.query_start_loc_cpu.tolist()
    assert str(qsl) in h


def test_step_html_summarises_long_tensors(rec):
    h = rec._repr_html_()
    logits = rec.logits
    assert logits.shape[1] == 320
    assert summaries.shape_str(logits.shape) in h
    assert f"{logits[0, 0].item():.4g}" in h                  # the first values are shown
    first12 = ", ".join(f"{v:.4g}" for v in logits[0, :12].tolist())
    assert first12 not in h and str(logits[0].tolist()) not in h
    s = summaries.tensor_summary(logits)
    assert s.startswith("float32[2, 320]") and "min" in s and "mean" in s and "…" in s
    assert len(s) < 200


def test_none_fields_render_as_muted_none(rec):
    md = rec.metadata("mamba").metadata
    none_fields = [f.name for f in dataclasses.fields(md) if getattr(md, f.name) is None]
    assert none_fields, "step 1 has no decode rows, so the decode-only fields are None"
    h = rec._repr_html_()
    for name in none_fields:
        assert re.search(r"<span[^>]*italic[^>]*>None</span></td></tr>", _field_row(h, name)), name
    assert re.search(r"state_indices_tensor_d\s+None\s+None", summaries.fields_text(md))


def test_batch_table_phases_samples_and_ledger(records):
    first, second = records
    h0, h1 = first._repr_html_(), second._repr_html_()
    assert [s.num_tokens for s in first.scheduled] == [8]
    assert ">prefill chunk<" in h0                         # 8 of 12 prompt tokens
    phases = {s.request_id: record_views.request_phase(s, n) for s, n in
              zip(second.scheduled, second.input_batch.prefill_len_np)}
    assert phases == {"0": "prefill chunk", "1": "prefill"}
    for tok in second.sampled_token_ids.values():
        assert f"<td style=\"{html.TD}\">{tok}</td>" in h1
    if second.ledger is not None:
        assert ">state page<" in h1
        for s in second.scheduled:
            assert str(second.ledger.kv_blocks(s.request_id)) in h1


def test_reprs_are_short_and_dump_no_tensor(rec):
    r = repr(rec)
    assert r.startswith(f"StepRecord(step {rec.step_index} ") and len(r) < 300 and "\n" not in r
    assert "tensor(" not in r and "2 prefill + 0 decode rows" in r and f"{rec.num_tokens} tokens" in r
    g = rec.metadata("mamba")
    assert repr(g) == (f"GroupMetadata(group {g.group_id} mamba, Mamba2MetadataBuilder, "
                       f"{len(g.layer_names)} layers)")
    for obj in (g.common, g.metadata, rec.metadata("attention").metadata, rec.input_batch):
        text = repr(obj)
        assert "tensor(" not in text and "array(" not in text and "\n" not in text, text
        assert text.startswith(type(obj).__name__ + "(")
    assert "query_start_loc_cpu=int32[3]" in repr(g.common)
    assert "state_indices_tensor_d=None" in repr(g.metadata)
    assert type(rec).__repr__ is record_views.step_record_repr        # installed by importing toolkit.inspect


def test_object_html_views_are_self_contained(rec):
    g = rec.metadata("attention")
    for obj in (g, g.common, g.metadata, rec.input_batch):
        h = obj._repr_html_()
        assert_clean_html(h)
        assert "background:#ffffff" in h and "color:#1f2328" in h
    assert "PagedAttentionMetadata" in g._repr_html_()


def test_violations_are_highlighted(rec):
    v = Violation("state_indices_match_ledger", "step 1, request '0'", "state_indices_tensor_p",
                  "slot 3 != ledger slot <1>")
    bad = dataclasses.replace(rec, violations=[v])
    h = bad._repr_html_()
    assert_clean_html(h)
    assert "slot 3 != ledger slot &lt;1&gt;" in h and "#ffebe9" in h
    assert "1 violations" in repr(bad)
    assert record_views.violation_html(v) in h and v._repr_html_() == record_views.violation_html(v)


def test_trace_html_one_row_per_record(records):
    t = Trace()
    for r in records:
        t.append(r)
    h = t._repr_html_()
    assert_clean_html(h)
    assert h.count("<tr") == 1 + len(records)
    assert repr(t) in h
    for r in records:
        assert f">{r.stage}<" in h and ", ".join(r.request_ids) in h
        if r.timings:
            assert summaries.format_ms(summaries.total_seconds(r.timings)) in h
    assert "no records" in Trace()._repr_html_()


def test_trace_html_leaves_out_the_middle_of_a_long_trace(rec):
    t = Trace(None, [rec] * 30)
    h = record_views.trace_html(t, max_rows=10)
    assert h.count("<tr") == 1 + 10 + 1 and "20 records left out" in h


def test_tensor_summary_counts_nan_inf_and_uses_finite_values():
    x = torch.linspace(-1.0, 2.0, 30)
    x[3] = x[7] = float("nan")
    x[5], x[9] = float("inf"), float("-inf")
    s = summaries.tensor_summary(x)
    assert "2 NaN" in s and "1 +Inf" in s and "1 -Inf" in s
    finite = x[torch.isfinite(x)]
    assert f"min {finite.min().item():.4g}" in s and f"max {finite.max().item():.4g}" in s
    assert f"mean {finite.mean().item():.4g}" in s
    assert "2 NaN" in summaries.tensor_summary_html(x)
    assert "no finite values" in summaries.tensor_summary(torch.full((20,), float("nan")))


def test_tensor_summary_small_empty_and_ints():
    assert summaries.tensor_summary(torch.empty(0)) == "float32[0] (empty)"
    assert summaries.tensor_summary(torch.empty(0, 5, dtype=torch.int32)) == "int32[0, 5] (empty)"
    assert summaries.tensor_summary(torch.tensor([0, 3, 7], dtype=torch.int32)) == "int32[3] [0, 3, 7]"
    s = summaries.tensor_summary(torch.arange(100))
    assert s.startswith("int64[100] min 0, max 99 [0, 1, 2") and "mean" not in s and s.endswith("…]")
    assert summaries.value_preview(None) == "None" and summaries.value_preview(True) == "True"


def test_fields_table_follows_the_dataclass_fields():
    @dataclasses.dataclass
    class NewMetadata:
        brand_new_field: torch.Tensor
        flag: bool = False
        note: str | None = None

    h = summaries.fields_table(NewMetadata(torch.tensor([4, 5], dtype=torch.int32)))
    assert ">brand_new_field<" in h and "[4, 5]" in h and ">flag<" in h and ">note<" in h
    assert "NewMetadata(brand_new_field=int32[2], flag=False, note=None)" == summaries.compact_repr(
        NewMetadata(torch.tensor([4, 5], dtype=torch.int32)))


def test_recorded_states_and_top_logits_are_summarised():
    with LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=8,
             inspect="full") as llm:
        llm.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, temperature=0.0))
        rec = llm.step()
    assert rec.states
    h = rec._repr_html_()
    assert_clean_html(h)
    assert f"Recorded states ({len(rec.states)} layers)" in h
    for s in rec.states:
        assert s.layer_name in h
        for name, t in zip(s.state_names, s.before):
            assert f"{name} {summaries.array_label(t)}" in h
        text = repr(s)
        assert text.startswith(f"LayerState({s.layer_name!r}") and "\n" not in text and "tensor(" not in text
        assert_clean_html(s._repr_html_())
    assert ">top_logit_values</td>" in h and "tensor(" not in repr(rec)


def test_trace_and_record_say_how_the_forward_ran():
    from toolkit import LLM, SamplingParams
    with LLM("tiny-bamba", cudagraph_mode="padded_eager") as llm:
        llm.generate([{"prompt_token_ids": [3, 4, 5 + i]} for i in range(3)],
                     SamplingParams(max_tokens=3, temperature=0.0))
        h = llm.trace._repr_html_()
        padded = [r for r in llm.trace if r.padded_size]
    assert ">forward<" in h and ">eager<" in h and ">padded eager (4 rows)<" in h
    assert padded and "padded eager, padded to 4 rows" in padded[0]._repr_html_()


def test_records_without_rows_say_why(records):
    with LLM("tiny-bamba", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=8) as llm:
        llm.warmup(progress=False)
        idle = llm.step()                            # nothing to run
    dummy = llm.trace[1]
    assert dummy.stage.startswith("warmup/dummy batch") and not dummy.scheduled
    h = dummy._repr_html_()
    assert_clean_html(h)
    assert f"no request rows: {dummy.stage} is a warmup stage" in h and "<img" not in h
    assert not idle.scheduled and "nothing scheduled in this step: no request was waiting to run" in idle._repr_html_()
    assert record_views.batch_table_html(idle) == html.span(record_views.why_no_rows(idle), html.MUTED)
    assert "no records yet" in record_views.trace_html(Trace())


def test_every_html_view_uses_the_one_style(records):
    """Reports, the fault catalogue and the memory ledger are built from toolkit.inspect.html like
    the record views: framed, explicit light colours, no script or links."""
    diverged = DivergenceReport(True, step_index=1, request_id="0", layer=2, layer_name="model.layers.2",
                                position=5, max_abs_diff=0.5, max_abs_ref=1.0,
                                per_layer_max_diff={"model.layers.2": 0.5, "logits": 0.25})
    parted = TraceDiff(False, request_id="1", position=4, step_a=2, step_b=3, what="token", detail="token 5 vs 6",
                       per_request={r: trace_diff.Difference(r, 4, 2, 3, "token", "token 5 vs 6") for r in "01"})
    memory = MemoryReport({"load": {"weights": 2048}, "shutdown": {"weights": 0}})
    views = [diverged._repr_html_(), DivergenceReport(False)._repr_html_(), parted._repr_html_(),
             TraceDiff(True)._repr_html_(), faults.catalogue_html(), faults.get("state_index_off_by_one")._repr_html_(),
             memory._repr_html_(), records[1]._repr_html_()]
    for h in views:
        assert_clean_html(h)
        assert h.startswith(f'<div style="{html.WRAP}">') and f'<table style="{html.TABLE}">' in h
    assert html.TR_BAD in views[0] and "first divergence" in views[0] and "no divergence" in views[1]
    assert html.VERDICT_BAD in views[2] and html.VERDICT_OK in views[3] and "token 5 vs 6" in views[2]
    assert all(f.name in views[4] for f in faults.catalogue())
    assert "2.0 KiB" in views[6] and "memory by category (cpu)" in views[6]
    assert compare_hf.LOGITS == "logits"


def test_only_the_html_module_writes_colours():
    """No inspection view or widget defines inline styles of its own: colours live in html.py."""
    import pathlib
    root = pathlib.Path(html.__file__).resolve().parents[1]
    files = [*(root / "inspect").glob("*.py"), *(root / "widgets").glob("*.py")]
    offenders = [f"{p.parent.name}/{p.name}" for p in files if p.name not in ("html.py", "plots.py")
                 and re.search(r"#[0-9a-fA-F]{6}\b|style='", p.read_text())]
    assert offenders == [], offenders
