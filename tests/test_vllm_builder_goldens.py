"""This project's Mamba-family metadata builders against vLLM's own, on golden files (issue #23).

tests/data/vllm_builder_goldens.json holds seeded random batches (decodes, one-token prefill chunks on
top of saved state, fresh one-token prompts, first chunks, chunks that continue a state, lengths and
offsets on chunk-size edges, the runner's padded decode batches) and what vLLM 0.33.0's
Mamba1 / Mamba2 (chunk sizes 16, 64, 256) / ShortConv / GDN builders built from them, in vLLM's cache
mode "none" (prefix caching off). `python3 scripts/vllm_reference.py` regenerates it (a scratch venv
with the vllm wheel; not part of `make test`).

Each golden input goes through this project's builder, and every field of vLLM's metadata is accounted
for once, in FIELD_MAPS below:
  COMPARED     vLLM field -> this project's field (same name or not), or a function of this project's
               metadata where the layouts differ (GDN's FLA chunk indices, its all-rows tensors);
               vLLM's empty tensors equal this project's None; direct fields also compare dtypes
  FROM_INPUT   vLLM copies a CommonAttentionMetadata field; this project's metadata does not carry it
               (its layers read nothing of the kind); checked equal to the input
  ABSENT       features this project does not have (speculative decoding, ReplaySSM, prefix-caching
               checkpoints, other GDN backends): None or empty in every golden batch, and the project's
               metadata has no such field
  NOT_COMPARED vLLM-only launch metadata of its Triton causal_conv1d, with the reason
A vLLM field in none of them, or a field of this project's metadata that no entry reads, fails the test.
KNOWN_DIFFERENCES would list a real disagreement with its reason (none today).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

from toolkit.attention import gdn as gdn_module
from toolkit.attention import mamba2 as mamba2_module
from toolkit.attention import mamba_base
from toolkit.attention.common import CommonAttentionMetadata
from toolkit.attention.gdn import GDNAttentionMetadata, GDNMetadataBuilder
from toolkit.attention.mamba1 import Mamba1AttentionMetadata, Mamba1MetadataBuilder
from toolkit.attention.mamba2 import Mamba2AttentionMetadata, Mamba2MetadataBuilder
from toolkit.attention.short_conv import ShortConvAttentionMetadata, ShortConvMetadataBuilder

GOLDEN = Path(__file__).parent / "data" / "vllm_builder_goldens.json"
VLLM_VERSION = "0.33.0"
MIN_BATCHES = 500


# ---- the field map, written once ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Derived:
    """A vLLM field computed from this project's metadata (values compared, not dtypes)."""
    fn: Callable
    reads: tuple[str, ...]     # the project fields it reads
    how: str


def _cat(*parts) -> torch.Tensor | None:
    parts = [p for p in parts if p is not None]
    return torch.cat(parts) if parts else None


def _decode_column(md):
    # vLLM: [D, 1 + num_spec_tokens] (its decode kernels take the spec slots too); here [D] (no spec)
    return None if md.state_indices_tensor_d is None else md.state_indices_tensor_d.view(-1, 1)


def _all_rows_state_indices(md):
    return _cat(md.state_indices_tensor_d, md.state_indices_tensor_p)


def _all_rows_has_initial_state(md):
    # vLLM GDN: num_computed > 0 for every row, built only when the batch has prefills. A decode row
    # always runs on top of saved state.
    if not md.num_prefills:
        return None
    return torch.cat([torch.ones(md.num_decodes, dtype=torch.bool), md.has_initial_states_p])


def _all_rows_query_start_loc(md):
    # decodes take one token each; the prefill rows' boundaries are query_start_loc_p shifted back
    qsl = torch.arange(md.num_decodes + 1, dtype=torch.int32)
    if md.num_prefills:
        qsl = torch.cat([qsl, md.query_start_loc_p[1:] + md.num_decode_tokens])
    return qsl


def _fla_chunk_indices(md):
    """FLA's chunk_indices [C, 2] = (prefill row, chunk number within the row), read off this
    project's chunk layout; a chunk that is not FLA's (row start + k * chunk_size, chunk_size long
    or the row's tail) gets chunk number -1, so it cannot match."""
    if not md.num_prefills:
        return None
    cu, seq, qsl = (t.tolist() for t in (md.cu_chunk_seqlen_p, md.seq_idx_p, md.query_start_loc_p))
    cs = int(md.chunk_size)
    out = []
    for c, row in enumerate(seq):
        offset = cu[c] - qsl[row]
        fla = offset % cs == 0 and cu[c + 1] == min(cu[c] + cs, qsl[row + 1])
        out.append([row, offset // cs if fla else -1])
    return torch.tensor(out, dtype=torch.int32).view(-1, 2)


def _fla_chunk_offsets(md):
    # FLA's chunk_offsets [P+1]: cumulative chunk counts per prefill row
    if not md.num_prefills:
        return None
    return torch.cat([torch.zeros(1, dtype=torch.int32), md.last_chunk_indices_p + 1])


COUNTS = ("num_prefills", "num_prefill_tokens", "num_decodes", "num_decode_tokens")
BASE_COMPARED = {
    **{f: f for f in COUNTS}, "num_reqs": "num_reqs",
    "has_initial_states_p": "has_initial_states_p",
    "query_start_loc_p": "query_start_loc_p",
    "state_indices_tensor_p": "state_indices_tensor_p",
    "state_indices_tensor_d": Derived(_decode_column, ("state_indices_tensor_d",), "state_indices_tensor_d as [D, 1]"),
}
SPEC = "speculative decoding (not in this project yet)"
REPLAYSSM = "ReplaySSM decode (--use-replayssm; not in this project)"
CONV_LAUNCH = ("launch tiling of vLLM's Triton causal_conv1d_fn (BLOCK_M=8 programs, 2048-long -1-filled "
               "pointers); this project's conv kernel launches a (P, D-blocks, splits) grid from "
               "query_start_loc_p and needs none of it")
BASE_ABSENT = {
    "query_start_loc_d": SPEC, "num_accepted_tokens": SPEC,
    "write_pos_d": REPLAYSSM, "is_flush_d": REPLAYSSM, "bc_pre_scratch": REPLAYSSM,
    "replayssm_scratch": REPLAYSSM, "replayssm_state_indices_d": REPLAYSSM,
}
BASE_FROM_INPUT = {"seq_lens": "seq_lens"}       # vLLM: "only used for prefix caching in align mode"
BASE_NOT_COMPARED = {"nums_dict": CONV_LAUNCH, "batch_ptr": CONV_LAUNCH, "token_chunk_offset_ptr": CONV_LAUNCH}

MAMBA1_LIKE = dict(
    compared=BASE_COMPARED,
    absent={**BASE_ABSENT,
            "cu_chunk_seqlen_p": "Mamba1 / ShortConv chunk only in prefix-caching modes",
            "last_chunk_indices_p": "Mamba1 / ShortConv chunk only in prefix-caching modes"},
    from_input=BASE_FROM_INPUT, not_compared=BASE_NOT_COMPARED, project_only={})

MAMBA2 = dict(
    compared={**BASE_COMPARED, "prep_initial_states": "prep_initial_states", "chunk_size": "chunk_size",
              "seq_idx_p": "seq_idx_p", "cu_chunk_seqlen_p": "cu_chunk_seqlen_p",
              "last_chunk_indices_p": "last_chunk_indices_p"},
    absent={**BASE_ABSENT, "checkpoint_chunk_idx": "prefill checkpoints of align mode (prefix caching)",
            "checkpoint_meta": "prefill checkpoints of align mode (prefix caching)"},
    from_input=BASE_FROM_INPUT, not_compared=BASE_NOT_COMPARED, project_only={})

GDN = dict(
    compared={
        **{f: f for f in COUNTS},
        "num_spec_decodes": Derived(lambda md: 0, (), "0: no speculative decoding"),
        "num_spec_decode_tokens": Derived(lambda md: 0, (), "0: no speculative decoding"),
        "has_initial_state": Derived(_all_rows_has_initial_state, ("num_decodes", "has_initial_states_p"),
                                     "[True] * num_decodes + has_initial_states_p"),
        "non_spec_query_start_loc": Derived(_all_rows_query_start_loc, ("query_start_loc_p",),
                                            "arange(D + 1) + (query_start_loc_p[1:] + D)"),
        "non_spec_state_indices_tensor": Derived(_all_rows_state_indices,
                                                 ("state_indices_tensor_d", "state_indices_tensor_p"),
                                                 "state_indices_tensor_d + state_indices_tensor_p"),
        "prefill_query_start_loc": "query_start_loc_p",
        "prefill_state_indices": "state_indices_tensor_p",
        "prefill_has_initial_state": "has_initial_states_p",
        "chunk_indices": Derived(_fla_chunk_indices, ("cu_chunk_seqlen_p", "seq_idx_p", "chunk_size"),
                                 "(seq_idx_p, chunk number in its row) from cu_chunk_seqlen_p"),
        "chunk_offsets": Derived(_fla_chunk_offsets, ("last_chunk_indices_p",), "[0] + (last_chunk_indices_p + 1)"),
    },
    absent={
        "checkpoint": "prefill checkpoints of align mode (prefix caching)",
        "flashinfer_checkpoint_plan": "FlashInfer GDN prefill backend (CUDA) with align-mode checkpoints",
        "aiter_prefill_metadata": "ROCm AITER GDN prefill backend",
        **{f: SPEC for f in ("spec_query_start_loc", "spec_state_indices_tensor", "spec_sequence_masks",
                             "spec_sequence_masks_cpu", "spec_token_indx", "non_spec_token_indx",
                             "num_accepted_tokens", "uniform_spec_sequence_length")},
    },
    from_input={"num_actual_tokens": "num_actual_tokens"},
    not_compared=BASE_NOT_COMPARED,
    # the project's GDN metadata has num_reqs (vLLM's GDN metadata does not; its rows are the input's)
    project_only={"num_reqs": "vLLM's GDN metadata has no num_reqs; checked == the input's num_reqs"})

FAMILIES = {  # vLLM builder class -> (this project's metadata class, builder factory(chunk_size), map)
    "Mamba1AttentionMetadataBuilder": (Mamba1AttentionMetadata, lambda cs: Mamba1MetadataBuilder(), MAMBA1_LIKE),
    "ShortConvAttentionMetadataBuilder": (ShortConvAttentionMetadata, lambda cs: ShortConvMetadataBuilder(),
                                          MAMBA1_LIKE),
    "Mamba2AttentionMetadataBuilder": (Mamba2AttentionMetadata, Mamba2MetadataBuilder, MAMBA2),
    "GDNAttentionMetadataBuilder": (GDNAttentionMetadata, lambda cs: GDNMetadataBuilder(), GDN),
}
# (golden builder, vLLM field) -> why this project differs on purpose. Each entry must still differ.
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {}


# ---- the goldens ----------------------------------------------------------------------------------

@cache
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


def column(name: str, field: str) -> list:
    doc = golden()
    col = doc["outputs"][name][field]
    if isinstance(col, dict) and "const" in col:
        return [col["const"]] * doc["num_batches"]
    if isinstance(col, dict) and "same_as" in col:
        return column(*col["same_as"].split(".", 1))
    return col


def common(i: int) -> CommonAttentionMetadata:
    """This project's CommonAttentionMetadata of golden batch i (the same tensors vLLM was given)."""
    inp = golden()["inputs"]
    q = torch.tensor(inp["q"][i], dtype=torch.int32)
    seq = torch.tensor(inp["computed"][i], dtype=torch.int32) + q
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    torch.cumsum(q, 0, out=qsl[1:])
    t = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=len(q),
        num_actual_tokens=t, max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=torch.tensor(inp["slots"][i], dtype=torch.int32).view(-1, 1),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64), seq_lens_cpu_upper_bound=seq.clone(),
        is_prefilling=torch.tensor(inp["prefilling"][i], dtype=torch.bool))


def plain(v):
    """A value as JSON-like data: tensors as lists (bool as 0/1), empty tensors as None."""
    if isinstance(v, torch.Tensor):
        if v.numel() == 0:
            return None
        return (v.int() if v.dtype == torch.bool else v).tolist()
    if isinstance(v, np.integer):
        return int(v)
    return v


def vllm_value(v, cm: CommonAttentionMetadata):
    if isinstance(v, str) and v.startswith("="):        # a CommonAttentionMetadata field, copied
        return plain(getattr(cm, v[1:]))
    return None if v == [] else v


def describe(name: str, i: int) -> str:
    inp = golden()["inputs"]
    return (f"{name} batch {i} ({inp['kind'][i]}, rows {inp['rows'][i]}: q={inp['q'][i]} "
            f"computed={inp['computed'][i]} prefilling={inp['prefilling'][i]} slots={inp['slots'][i]})")


def mismatches(name: str, limit: int = 8) -> tuple[int, list[str]]:
    """(number of disagreeing (batch, field) pairs, the first `limit` of them in words)."""
    info = golden()["builders"][name]
    _, factory, fmap = FAMILIES[info["vllm_class"].rsplit(".", 1)[1]]
    builder = factory(info["chunk_size"])
    cols = {f: column(name, f) for f in info["fields"]}
    count, out = 0, []

    def report(i, field, theirs, ours, what):
        nonlocal count
        if (name, field) in KNOWN_DIFFERENCES:
            return
        count += 1
        if len(out) < limit:
            out.append(f"{describe(name, i)}: vLLM {field}={theirs}, this project's {what}={ours}")

    for i in range(golden()["num_batches"]):
        cm = common(i)
        try:
            md = builder.build(cm, producer="vllm goldens")
        except Exception as err:
            report(i, "(build)", "built metadata", f"{type(err).__name__}: {err}", "builder")
            continue
        for field, target in fmap["compared"].items():
            theirs = vllm_value(cols[field][i], cm)
            if isinstance(target, Derived):
                ours, what = plain(target.fn(md)), target.how
            else:
                raw = getattr(md, target)
                ours, what = plain(raw), target
                want = info["dtypes"].get(field)
                if isinstance(raw, torch.Tensor) and want and str(raw.dtype).removeprefix("torch.") != want:
                    report(i, field, f"dtype {want}", raw.dtype, f"{target}.dtype")
            if theirs != ours:
                report(i, field, theirs, ours, what)
        for field, source in fmap["from_input"].items():
            theirs, given = vllm_value(cols[field][i], cm), plain(getattr(cm, source))
            if theirs != given:
                report(i, field, theirs, given, f"input {source} (vLLM copies it)")
        for field in fmap["absent"]:
            if vllm_value(cols[field][i], cm) is not None:
                report(i, field, cols[field][i], "(no such field)", field)
        if "num_reqs" in fmap["project_only"] and md.num_reqs != cm.num_reqs:
            report(i, "num_reqs", cm.num_reqs, md.num_reqs, "num_reqs (input's)")
    return count, out


# ---- tests ----------------------------------------------------------------------------------------

def test_goldens_come_from_vllm_0_33_0_none_mode_with_every_case():
    doc = golden()
    assert doc["vllm_version"] == VLLM_VERSION and doc["mode"] == "none" and isinstance(doc["seed"], int)
    assert doc["num_batches"] >= MIN_BATCHES
    assert all(len(v) == doc["num_batches"] for v in doc["inputs"].values())
    names = set(doc["builders"])
    assert {"mamba1", "short_conv", "gdn"} <= names
    chunk_sizes = {b["chunk_size"] for b in doc["builders"].values()
                   if b["vllm_class"].endswith(".Mamba2AttentionMetadataBuilder")}
    assert len(chunk_sizes) >= 3, chunk_sizes
    for name, b in doc["builders"].items():
        assert b["mamba_cache_mode"] == "none", name
        assert all(len(column(name, f)) == doc["num_batches"] for f in b["fields"]), name
    cov = doc["coverage"]
    for key in ("rows_decode", "rows_prompt_tail_1", "rows_prompt_1", "rows_first_chunk", "rows_continue_chunk",
                "rows_padding", "batches_decode_only", "batches_prefill_only", "batches_mixed"):
        assert cov[key] >= 20, (key, cov[key])
    assert all(v >= 20 for k, v in cov.items() if k.startswith("prefill_rows_")), cov


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())["builders"]))
def test_field_map_accounts_for_every_field(name):
    info = golden()["builders"][name]
    md_cls, _, fmap = FAMILIES[info["vllm_class"].rsplit(".", 1)[1]]
    groups = [set(fmap[k]) for k in ("compared", "absent", "from_input", "not_compared")]
    listed = set().union(*groups)
    assert sum(map(len, groups)) == len(listed), f"{name}: a field is in two groups of the map"
    assert listed == set(info["fields"]), (f"{name}: vLLM fields not in the map: {set(info['fields']) - listed}; "
                                           f"in the map but not vLLM's: {listed - set(info['fields'])}")
    project_fields = {f.name for f in dataclasses.fields(md_cls)}
    read = set(fmap["project_only"])
    for target in fmap["compared"].values():
        read |= set(target.reads) if isinstance(target, Derived) else {target}
    assert read == project_fields, (f"{name}: this project's fields no map entry reads: {project_fields - read}; "
                                    f"read but missing: {read - project_fields}")
    assert not set(fmap["absent"]) & project_fields, f"{name}: an ABSENT field exists in this project"


@pytest.mark.parametrize("name", sorted(json.loads(GOLDEN.read_text())["builders"]))
def test_builder_matches_vllm(name):
    count, first = mismatches(name)
    assert count == 0, f"{count} disagreements with vLLM {VLLM_VERSION}, the first:\n" + "\n".join(first)


def test_known_differences_still_differ():
    for (name, field), reason in KNOWN_DIFFERENCES.items():
        saved = KNOWN_DIFFERENCES.pop((name, field))
        try:
            count, _ = mismatches(name, limit=0)
        finally:
            KNOWN_DIFFERENCES[(name, field)] = saved
        assert count, f"{name}.{field} now agrees with vLLM: drop it from KNOWN_DIFFERENCES ({reason})"


# Planted changes: the comparison must see each (a check that it is not vacuous).
def _plant_chunk_boundary(monkeypatch):
    real = mamba2_module.compute_chunk_metadata

    def no_top_up(query_lens_p, num_computed_p, chunk_size):   # chunks start at each row's first token
        return real(query_lens_p, np.zeros_like(num_computed_p), chunk_size)
    monkeypatch.setattr(mamba2_module, "compute_chunk_metadata", no_top_up)


def _plant_initial_state_flag(monkeypatch):
    real = mamba_base.BaseMambaMetadataBuilder.common_fields

    def flags_from_seq_len(self, common, s):                   # seq_len > 0 instead of num_computed > 0
        fields = real(self, common, s)
        if s.num_prefills:
            fields["has_initial_states_p"] = common.seq_lens[s.num_decodes:] > 0
        return fields
    monkeypatch.setattr(mamba_base.BaseMambaMetadataBuilder, "common_fields", flags_from_seq_len)


def _plant_decode_rule(monkeypatch):
    real = mamba_base.BaseMambaMetadataBuilder.split

    def prefilling_rows_never_decode(self, common, producer=""):   # drops the vLLM #42430 rule
        return real(self, common.replace(seq_lens_cpu_upper_bound=torch.where(
            common.is_prefilling, torch.ones_like(common.seq_lens_cpu_upper_bound),
            common.seq_lens_cpu_upper_bound)), producer)
    monkeypatch.setattr(mamba_base.BaseMambaMetadataBuilder, "split", prefilling_rows_never_decode)


def _plant_gdn_chunk_size(monkeypatch):
    real = gdn_module.compute_gdn_chunk_metadata

    def half_chunks(query_lens_p, chunk_size):                # chunks of 32 where FLA's are 64
        return real(query_lens_p, chunk_size // 2)
    monkeypatch.setattr(gdn_module, "compute_gdn_chunk_metadata", half_chunks)


@pytest.mark.parametrize("plant, caught_by", [
    (_plant_chunk_boundary, ["mamba2_cs16", "mamba2_cs64", "mamba2_cs256"]),
    (_plant_initial_state_flag, ["mamba1", "mamba2_cs64", "short_conv", "gdn"]),
    (_plant_decode_rule, ["mamba1", "mamba2_cs16", "short_conv", "gdn"]),
    (_plant_gdn_chunk_size, ["gdn"]),
], ids=lambda v: v.__name__.removeprefix("_plant_") if callable(v) else None)
def test_a_planted_builder_change_is_caught(plant, caught_by, monkeypatch):
    plant(monkeypatch)
    for name in caught_by:
        count, _ = mismatches(name, limit=0)
        assert count, f"{plant.__name__} went unnoticed by {name}"
