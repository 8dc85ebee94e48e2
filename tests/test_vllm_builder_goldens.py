"""This project's Mamba-family metadata builders against vLLM's own, on golden files (issue #23).

tests/data/vllm_builder_goldens.json holds seeded random batches (decodes, one-token prefill chunks on
top of saved state, fresh one-token prompts, first chunks, chunks that continue a state, lengths and
offsets on chunk-size edges, the runner's padded decode batches) and what vLLM 0.33.0's
Mamba1 / Mamba2 (chunk sizes 16, 64, 256) / ShortConv / GDN builders built from them, in vLLM's cache
mode "none" (prefix caching off). `python3 scripts/vllm_reference.py` regenerates it (a scratch venv
with the vllm wheel; not part of `make test`).

tests/data/vllm_builder_goldens_align.json holds the same for cache mode "align" (prefix caching on,
`--mode align`): every builder once per Mamba block size (16 and 64; builders `<name>_bs<size>`), on
position-indexed block tables [B, cdiv(max_model_len, bs)] with distinct page ids per column and null
columns before the running one. This project's builders run with `mamba_block_size=bs` and must pick
vLLM's state index, the page in the column of each row's last scheduled token.

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
import hashlib
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

GOLDENS = {"none": Path(__file__).parent / "data" / "vllm_builder_goldens.json",
           "align": Path(__file__).parent / "data" / "vllm_builder_goldens_align.json"}
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
    # vLLM: [D, 1 + num_spec_tokens] (its decode kernels take the spec slots too); here [D] without
    # speculative decoding (the goldens' builders have none), [D, 1 + k] with it
    if md.state_indices_tensor_d is None:
        return None
    return md.state_indices_tensor_d if md.num_accepted_tokens is not None else md.state_indices_tensor_d.view(-1, 1)


def _spec_rows(md, value):
    # vLLM GDN's spec-decode fields: set only when the batch has spec rows (here: decode rows of a
    # speculative engine, which all carry num_accepted_tokens)
    return value if md.num_accepted_tokens is not None else None


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
    "query_start_loc_d": "query_start_loc_d", "num_accepted_tokens": "num_accepted_tokens",
}
SPEC = "speculative decoding (not in the goldens' batches yet)"
SPEC_LOOP = {f: "speculative decoding's per-position loop over the verify rows' state columns (mamba_base.py); "
             "None without it" for f in ("spec_token_index_d", "spec_src_slots_d", "spec_dst_slots_d",
                                         "spec_out_index_d")}
REPLAYSSM = "ReplaySSM decode (--use-replayssm; not in this project)"
CONV_LAUNCH = ("launch tiling of vLLM's Triton causal_conv1d_fn (BLOCK_M=8 programs, 2048-long -1-filled "
               "pointers); this project's conv kernel launches a (P, D-blocks, splits) grid from "
               "query_start_loc_p and needs none of it")
BASE_ABSENT = {
    "write_pos_d": REPLAYSSM, "is_flush_d": REPLAYSSM, "bc_pre_scratch": REPLAYSSM,
    "replayssm_scratch": REPLAYSSM, "replayssm_state_indices_d": REPLAYSSM,
}
BASE_FROM_INPUT = {"seq_lens": "seq_lens"}       # vLLM: "only used for prefix caching in align mode"
CHECKPOINTS_ONLY = {f: "internal checkpoints of cache mode \"all\" (vLLM 0.33's MRV2 has align only); None here"
                    for f in ("checkpoint_token_index_p", "checkpoint_slots_p")}
BASE_NOT_COMPARED = {"nums_dict": CONV_LAUNCH, "batch_ptr": CONV_LAUNCH, "token_chunk_offset_ptr": CONV_LAUNCH}

# vLLM 0.33 builds prefill checkpoints only in align mode, for layers that declare checkpoint blocks, once an
# engine has resolved hash_block_size; the goldens keep vLLM's MambaSpec default (0 blocks), so they are None
CHECKPOINTS = "prefill checkpoints of align mode (not in this project; none in the goldens' MambaSpec)"
MAMBA1_LIKE = dict(
    compared=BASE_COMPARED,
    absent={**BASE_ABSENT,
            "cu_chunk_seqlen_p": "vLLM's Mamba1 / ShortConv builders leave them None in both cache modes",
            "last_chunk_indices_p": "vLLM's Mamba1 / ShortConv builders leave them None in both cache modes"},
    from_input=BASE_FROM_INPUT, not_compared=BASE_NOT_COMPARED, project_only={**CHECKPOINTS_ONLY, **SPEC_LOOP})

MAMBA2 = dict(
    compared={**BASE_COMPARED, "prep_initial_states": "prep_initial_states", "chunk_size": "chunk_size",
              "seq_idx_p": "seq_idx_p", "cu_chunk_seqlen_p": "cu_chunk_seqlen_p",
              "last_chunk_indices_p": "last_chunk_indices_p"},
    absent={**BASE_ABSENT, "checkpoint_chunk_idx": CHECKPOINTS, "checkpoint_meta": CHECKPOINTS},
    from_input=BASE_FROM_INPUT, not_compared=BASE_NOT_COMPARED, project_only={**CHECKPOINTS_ONLY, **SPEC_LOOP})

GDN = dict(
    compared={
        **{f: f for f in COUNTS},
        "num_spec_decodes": Derived(lambda md: _spec_rows(md, md.num_decodes) or 0, ("num_decodes",),
                                    "num_decodes with speculative decoding, else 0"),
        "num_spec_decode_tokens": Derived(lambda md: _spec_rows(md, md.num_decode_tokens) or 0,
                                          ("num_decode_tokens",),
                                          "num_decode_tokens with speculative decoding, else 0"),
        "spec_query_start_loc": "query_start_loc_d",
        "spec_state_indices_tensor": Derived(lambda md: _spec_rows(md, md.state_indices_tensor_d),
                                             ("state_indices_tensor_d",), "state_indices_tensor_d [D, 1 + k] "
                                             "with speculative decoding"),
        "num_accepted_tokens": "num_accepted_tokens",
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
        "checkpoint": CHECKPOINTS,
        "flashinfer_checkpoint_plan": "FlashInfer GDN prefill backend (CUDA) with align-mode checkpoints",
        "aiter_prefill_metadata": "ROCm AITER GDN prefill backend",
        **{f: SPEC for f in ("spec_sequence_masks", "spec_sequence_masks_cpu", "spec_token_indx",
                             "non_spec_token_indx", "uniform_spec_sequence_length")},
    },
    from_input={"num_actual_tokens": "num_actual_tokens"},
    not_compared=BASE_NOT_COMPARED,
    # the project's GDN metadata has num_reqs (vLLM's GDN metadata does not; its rows are the input's)
    project_only={"num_reqs": "vLLM's GDN metadata has no num_reqs; checked == the input's num_reqs",
                  **CHECKPOINTS_ONLY, **SPEC_LOOP})

FAMILIES = {  # vLLM builder class -> (this project's metadata class, factory(chunk_size, mamba_block_size), map)
    "Mamba1AttentionMetadataBuilder": (Mamba1AttentionMetadata,
                                       lambda cs, bs: Mamba1MetadataBuilder(mamba_block_size=bs), MAMBA1_LIKE),
    "ShortConvAttentionMetadataBuilder": (ShortConvAttentionMetadata,
                                          lambda cs, bs: ShortConvMetadataBuilder(mamba_block_size=bs), MAMBA1_LIKE),
    "Mamba2AttentionMetadataBuilder": (Mamba2AttentionMetadata,
                                       lambda cs, bs: Mamba2MetadataBuilder(cs, mamba_block_size=bs), MAMBA2),
    "GDNAttentionMetadataBuilder": (GDNAttentionMetadata, lambda cs, bs: GDNMetadataBuilder(mamba_block_size=bs), GDN),
}
# (golden builder, vLLM field) -> why this project differs on purpose. Each entry must still differ.
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {}


# ---- the goldens ----------------------------------------------------------------------------------

@cache
def golden(mode: str) -> dict:
    return json.loads(GOLDENS[mode].read_text())


# golden builder name -> its file's mode (the align file's names carry their block size: distinct)
MODE_OF = {name: mode for mode in GOLDENS for name in golden(mode)["builders"]}


def column(name: str, field: str) -> list:
    doc = golden(MODE_OF[name])
    col = doc["outputs"][name][field]
    if isinstance(col, dict) and "const" in col:
        return [col["const"]] * doc["num_batches"]
    if isinstance(col, dict) and "same_as" in col:
        return column(*col["same_as"].split(".", 1))
    return col


def align_block_table(i: int, bs: int) -> torch.Tensor:
    """The align file's block table of batch i for block size bs, rebuilt from its [A, C] as the file's
    input_format (and scripts/vllm_reference.py `block_table_for`) says; checked against table_sha256."""
    doc = golden("align")
    inp, layout = doc["inputs"], doc["table_layout"]
    a, c = inp["tables"][str(bs)][i]
    rows, width = len(inp["q"][i]), -(-doc["max_model_len"] // bs)
    flat = torch.arange(rows * width, dtype=torch.int64).view(rows, width)
    pages = 1 + (a * flat + c) % layout["page_prime"]
    seq_lens = torch.tensor(inp["q"][i], dtype=torch.int64) + torch.tensor(inp["computed"][i], dtype=torch.int64)
    running = ((seq_lens - 1) // bs).clamp(min=0).view(-1, 1)
    null = (torch.arange(width).view(1, -1) < running) & (pages % layout["null_every"] == 0)
    null |= torch.tensor([k == "x" for k in inp["rows"][i]]).view(-1, 1)     # padding rows: all null
    return torch.where(null, 0, pages).to(torch.int32)


def common(mode: str, i: int, bs: int | None = None) -> CommonAttentionMetadata:
    """This project's CommonAttentionMetadata of golden batch i (the same tensors vLLM was given); align:
    the block table of block size bs."""
    inp = golden(mode)["inputs"]
    q = torch.tensor(inp["q"][i], dtype=torch.int32)
    seq = torch.tensor(inp["computed"][i], dtype=torch.int32) + q
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    torch.cumsum(q, 0, out=qsl[1:])
    t = int(qsl[-1])
    table = (torch.tensor(inp["slots"][i], dtype=torch.int32).view(-1, 1) if mode == "none"
             else align_block_table(i, bs))
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=len(q),
        num_actual_tokens=t, max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=table, slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(), is_prefilling=torch.tensor(inp["prefilling"][i], dtype=torch.bool))


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
    inp = golden(MODE_OF[name])["inputs"]
    if "slots" in inp:
        table = f"slots={inp['slots'][i]}"
    else:
        bs = golden("align")["builders"][name]["block_size"]
        seq = [q + c for q, c in zip(inp["q"][i], inp["computed"][i])]
        table = f"block size {bs}, running columns {[max(s - 1, 0) // bs for s in seq]}"
    return (f"{name} batch {i} ({inp['kind'][i]}, rows {inp['rows'][i]}: q={inp['q'][i]} "
            f"computed={inp['computed'][i]} prefilling={inp['prefilling'][i]} {table})")


def mismatches(name: str, limit: int = 8) -> tuple[int, list[str]]:
    """(number of disagreeing (batch, field) pairs, the first `limit` of them in words)."""
    mode = MODE_OF[name]
    info = golden(mode)["builders"][name]
    _, factory, fmap = FAMILIES[info["vllm_class"].rsplit(".", 1)[1]]
    bs = info["mamba_block_size"] if mode == "align" else None
    builder = factory(info["chunk_size"], bs)
    cols = {f: column(name, f) for f in info["fields"]}
    count, out = 0, []

    def report(i, field, theirs, ours, what):
        nonlocal count
        if (name, field) in KNOWN_DIFFERENCES:
            return
        count += 1
        if len(out) < limit:
            out.append(f"{describe(name, i)}: vLLM {field}={theirs}, this project's {what}={ours}")

    for i in range(golden(mode)["num_batches"]):
        cm = common(mode, i, bs)
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
    doc = golden("none")
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


def test_align_goldens_come_from_vllm_0_33_0_align_mode_with_every_case():
    doc = golden("align")
    assert doc["vllm_version"] == VLLM_VERSION and doc["mode"] == "align" and isinstance(doc["seed"], int)
    assert doc["num_batches"] >= MIN_BATCHES
    assert all(len(v) == doc["num_batches"] for k, v in doc["inputs"].items() if k not in ("tables", "table_sha256"))
    block_sizes = doc["block_sizes"]
    assert 16 in block_sizes and len(block_sizes) >= 2, block_sizes
    for bs in block_sizes:
        tables, digests = doc["inputs"]["tables"][str(bs)], doc["inputs"]["table_sha256"][str(bs)]
        assert len(tables) == len(digests) == doc["num_batches"], bs
        built = {b["vllm_class"].rsplit(".", 1)[1]: b for b in doc["builders"].values() if b["block_size"] == bs}
        assert set(built) == set(FAMILIES), (bs, set(built))
        chunk_sizes = {b["chunk_size"] for b in doc["builders"].values() if b["block_size"] == bs
                       and b["vllm_class"].endswith(".Mamba2AttentionMetadataBuilder")}
        assert len(chunk_sizes) >= 3, (bs, chunk_sizes)
    for name, b in doc["builders"].items():
        assert b["mamba_cache_mode"] == "align" and b["mamba_block_size"] == b["block_size"], name
        assert b["enable_chunked_prefill"] and b["num_prefill_checkpoint_blocks"] == 0, name
        assert all(len(column(name, f)) == doc["num_batches"] for f in b["fields"]), name
    cov = doc["coverage"]
    for key in ("rows_decode", "rows_prompt_tail_1", "rows_prompt_1", "rows_first_chunk", "rows_continue_chunk",
                "rows_padding", "batches_decode_only", "batches_prefill_only", "batches_mixed"):
        assert cov[key] >= 20, (key, cov[key])
    for bs in block_sizes:     # the edges of the state-index rule, at every block size
        edges = {k: v for k, v in cov.items() if k.startswith(f"bs{bs}_rows_")}
        assert len(edges) >= 7 and all(v >= 20 for v in edges.values()), edges


def test_align_block_tables_rebuild_exactly():
    """The test's block tables are the ones vLLM was given (their sha256 digests in the file)."""
    doc = golden("align")
    for bs in doc["block_sizes"]:
        for i, want in enumerate(doc["inputs"]["table_sha256"][str(bs)]):
            table = align_block_table(i, bs)
            got = hashlib.sha256(np.ascontiguousarray(table.numpy(), dtype="<i4").tobytes()).hexdigest()[:12]
            assert got == want, f"block size {bs}, batch {i}: rebuilt table {got}, vLLM's {want}"


@pytest.mark.parametrize("name", sorted(MODE_OF))
def test_field_map_accounts_for_every_field(name):
    info = golden(MODE_OF[name])["builders"][name]
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


@pytest.mark.parametrize("name", sorted(MODE_OF))
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


def _plant_align_column_of_next_token(monkeypatch):
    def seq_len_over_bs(seq_lens, mamba_block_size):            # seq_len // bs instead of (seq_len - 1) // bs
        return (seq_lens // mamba_block_size).to(torch.int64).unsqueeze(1)
    monkeypatch.setattr(mamba_base, "align_state_columns", seq_len_over_bs)


def _plant_align_column_0(monkeypatch):
    def none_mode(self, common):                                # the "none" layout in align mode
        return common.block_table_tensor[:, 0]
    monkeypatch.setattr(mamba_base.BaseMambaMetadataBuilder, "state_indices", none_mode)


def _plant_align_decodes_only(monkeypatch):
    real = mamba_base.BaseMambaMetadataBuilder.common_fields

    def prefills_in_column_0(self, common, s):                  # prefill rows keep column 0
        fields = real(self, common, s)
        if s.num_prefills:
            fields["state_indices_tensor_p"] = common.block_table_tensor[s.num_decodes:, 0]
        return fields
    monkeypatch.setattr(mamba_base.BaseMambaMetadataBuilder, "common_fields", prefills_in_column_0)


@pytest.mark.parametrize("plant, caught_by", [
    (_plant_chunk_boundary, ["mamba2_cs16", "mamba2_cs64", "mamba2_cs256"]),
    (_plant_initial_state_flag, ["mamba1", "mamba2_cs64", "short_conv", "gdn"]),
    (_plant_decode_rule, ["mamba1", "mamba2_cs16", "short_conv", "gdn"]),
    (_plant_gdn_chunk_size, ["gdn"]),
    (_plant_align_column_of_next_token, ["mamba1_bs16", "mamba2_cs16_bs64", "mamba2_cs256_bs16", "short_conv_bs64",
                                         "gdn_bs16", "gdn_bs64"]),
    (_plant_align_column_0, ["mamba1_bs64", "mamba2_cs64_bs16", "short_conv_bs16", "gdn_bs64"]),
    (_plant_align_decodes_only, ["mamba1_bs16", "mamba2_cs64_bs64", "short_conv_bs64", "gdn_bs16"]),
], ids=lambda v: v.__name__.removeprefix("_plant_") if callable(v) else None)
def test_a_planted_builder_change_is_caught(plant, caught_by, monkeypatch):
    plant(monkeypatch)
    for name in caught_by:
        count, _ = mismatches(name, limit=0)
        assert count, f"{plant.__name__} went unnoticed by {name}"
