"""This project's Mamba-family metadata builders against vLLM's own, on golden files (issue #23).

tests/data/vllm_builder_goldens.json holds seeded random batches (decodes, one-token prefill chunks on
top of saved state, fresh one-token prompts, first chunks, chunks that continue a state, lengths and
offsets on chunk-size edges, the runner's padded decode batches) and what vLLM 0.33.0's
Mamba1 / Mamba2 (chunk sizes 16, 64, 256) / ShortConv / GDN builders built from them, in vLLM's cache
mode "none" (prefix caching off), and vLLM's LinearAttentionMetadataBuilder (MiniMax's lightning
attention; align files too, with mamba_cache_mode "align" set in its CacheConfig since vLLM 0.33 does not
switch MiniMax to it; no spec path, so named in the spec files' "not_speculative"). The GDN builder three
times: from Qwen3-Next's config ("gdn"), OLMo Hybrid's ("gdn_olmo_hybrid") and Kimi Linear's, whose KDA
layers vLLM runs on it ("kda_kimi_linear"), each with its model's state shapes; every file holds the
three. `python3 scripts/vllm_reference.py` regenerates it (a scratch venv with the vllm wheel; not part of `make test`).

tests/data/vllm_builder_goldens_align.json holds the same for cache mode "align" (prefix caching on,
`--mode align`): every builder once per Mamba block size (16 and 64; builders `<name>_bs<size>`), on
position-indexed block tables [B, cdiv(max_model_len, bs)] with distinct page ids per column and null
columns before the running one. This project's builders run with `mamba_block_size=bs` and must pick
vLLM's state index, the page in the column of each row's last scheduled token.

tests/data/vllm_builder_goldens_spec.json holds speculative-decoding batches (issue 26, `--mode spec`):
vLLM's Mamba2 / ShortConv / GDN builders of engines with an n-gram SpeculativeConfig of k = 3 and k = 1
tokens (builders `<name>_k<k>`, each on its own range of batches), fed verify rows of 1 + d tokens
(d in 0..k) with their num_accepted_tokens, mixed with the other row kinds, block tables [B, 1 + k] and
`num_decode_draft_tokens_cpu` as vLLM's MRV2 builds it. This project's builders run with
`num_speculative_tokens=k` on the same inputs. vLLM's Mamba1 builder has no spec path (the file's
`left_out`); this project's Mamba1 spec metadata is held to vLLM's spec-aware base builder (ShortConv's).
vLLM's GDN regroups a spec batch by mask (spec rows = num_decode_draft_tokens_cpu >= 0, the rest
non-spec, one-token ones counted as prefills); this project's GDN keeps the base layout, so those fields
are Derived from its metadata and the input's draft counts (GDNView).

tests/data/vllm_builder_goldens_align_spec.json holds speculative decoding WITH prefix caching (`--mode
align-spec`): the same vLLM builders from engines with both CacheConfig(enable_prefix_caching=True,
block_size=bs) (cache mode "align") and the n-gram SpeculativeConfig of k tokens, a MambaSpec with k spec
blocks (builders `<name>_bs<bs>_k<k>`, bs 16 and 64, k 3 and 1), on the spec file's kind of batches with
some verify rows whose drafts cross a block boundary, and position-indexed block tables
[B, cdiv(max_model_len, bs) + k] as in the align file. vLLM gathers each row's running column
(seq_len - 1) // bs and the k after it (`mamba_get_block_table_tensor`): a decode row keeps all 1 + k
([D, 1 + k]), a prefill row the first. This project's builders run with `mamba_block_size=bs` and
`num_speculative_tokens=k` (`spec_columns`), through the spec file's comparisons (GDNView included).

Each golden input goes through this project's builder, and every field of vLLM's metadata is accounted
for once, in FIELD_MAPS below:
  COMPARED     vLLM field -> this project's field (same name or not), or a function of this project's
               metadata where the layouts differ (GDN's FLA chunk indices, its all-rows tensors);
               vLLM's empty tensors equal this project's None; direct fields also compare dtypes
  FROM_INPUT   vLLM copies a CommonAttentionMetadata field; this project's metadata does not carry it
               (its layers read nothing of the kind); checked equal to the input
  ABSENT       features this project does not have (ReplaySSM, prefix-caching checkpoints, other GDN
               backends): None or empty in every golden batch, and the project's metadata has no such field
  NOT_COMPARED vLLM-only launch metadata of its Triton causal_conv1d, with the reason
A vLLM field in none of them, or a field of this project's metadata that no entry reads, fails the test.
KNOWN_DIFFERENCES would list a real disagreement with its reason (none today). Two deliberate layout
differences are Derived instead, each strict on both sides: vLLM GDN's spec / non-spec regrouping
(GDNView), and vLLM's base builder handing on its num_accepted_tokens kwarg unsliced in a spec batch
without decodes, where this project's field is None (`_base_num_accepted`).
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
from toolkit.attention.linear_attn import LinearAttentionMetadata, LinearAttentionMetadataBuilder
from toolkit.attention.mamba1 import Mamba1AttentionMetadata, Mamba1MetadataBuilder
from toolkit.attention.mamba2 import Mamba2AttentionMetadata, Mamba2MetadataBuilder
from toolkit.attention.short_conv import ShortConvAttentionMetadata, ShortConvMetadataBuilder

GOLDENS = {"none": Path(__file__).parent / "data" / "vllm_builder_goldens.json",
           "align": Path(__file__).parent / "data" / "vllm_builder_goldens_align.json",
           "spec": Path(__file__).parent / "data" / "vllm_builder_goldens_spec.json",
           "align-spec": Path(__file__).parent / "data" / "vllm_builder_goldens_align_spec.json"}
VLLM_VERSION = "0.33.0"
MIN_BATCHES = 500
MIN_SPEC_BATCHES = {3: 300, 1: 300}     # per num_speculative_tokens of the spec and align-spec files
ALIGN_MODES = ("align", "align-spec")    # the files with prefix caching: builders per block size


# ---- the field map, written once ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Derived:
    """A vLLM field computed from this project's metadata (values compared; dtypes too with `dtype`, for
    a tensor handed on as this project built it); with `inputs`, also from those CommonAttentionMetadata
    fields (fn(md, common))."""
    fn: Callable
    reads: tuple[str, ...]     # the project fields it reads
    how: str
    inputs: tuple[str, ...] = ()
    dtype: bool = False

    def __call__(self, md, cm):
        return self.fn(md, cm) if self.inputs else self.fn(md)


def _cat(*parts) -> torch.Tensor | None:
    parts = [p for p in parts if p is not None]
    return torch.cat(parts) if parts else None


def _decode_column(md):
    # vLLM: [D, 1 + num_spec_tokens] (its decode kernels take the spec slots too); here [D] without
    # speculative decoding, [D, 1 + k] with it (the spec file's builders)
    if md.state_indices_tensor_d is None:
        return None
    return md.state_indices_tensor_d if md.num_accepted_tokens is not None else md.state_indices_tensor_d.view(-1, 1)


# ---- vLLM GDN's row groups, read off this project's metadata ---------------------------------------
# vLLM's GDN builder (gdn_attn.py `GDNAttentionMetadataBuilder.build`) regroups a speculative batch by
# mask: its spec rows are the rows with num_decode_draft_tokens_cpu >= 0 (MRV2: the decode-phase rows,
# 0 drafts included), and every other row is non-spec; with spec rows present, a non-spec one-token row
# (a one-token prefill chunk on saved state, a padded row) is counted as a prefill ("num_decodes and
# num_spec_decodes are mutually exclusive"), and the spec / non-spec tokens are gathered by index
# (spec_token_indx / non_spec_token_indx). This project's GDN keeps the base layout (mamba_base.py):
# decodes first, every decode row of a speculative engine a verify row. So the vLLM fields are derived:
# the project's decode rows split by the input's draft counts into vLLM's spec rows and the rest
# ("other": one-token rows vLLM runs as one-token prefills / plain decodes on column 0). An "other" row
# is the same computation only if it is one token with num_accepted_tokens 1 (its verify step reads
# and writes column 0): anything else makes every derived field a message, so it fails the comparison.
# Without speculative decoding (the none / align files, or no verify row in the batch: vLLM's non-spec
# path) the view is the project's split as it is.

@dataclasses.dataclass(frozen=True)
class GDNView:
    spec: list[int]            # project decode rows that are vLLM spec rows
    other: list[int]           # project decode rows that are not
    qd: np.ndarray             # query length of every project decode row
    error: str | None          # why the project's metadata cannot be vLLM's (a row that is not equivalent)

    @property
    def any_spec(self) -> bool:
        return bool(self.spec)


def _gdn_view(md, cm) -> GDNView:
    d = md.num_decodes
    qd = (np.diff(md.query_start_loc_d.cpu().numpy()) if md.query_start_loc_d is not None
          else np.ones(d, dtype=np.int64))
    drafts = cm.num_decode_draft_tokens_cpu
    if drafts is None or not (drafts.numpy() >= 0).any():
        spec, other = [], list(range(d))
    else:
        mask = drafts.numpy()[:d] >= 0
        spec, other = np.flatnonzero(mask).tolist(), np.flatnonzero(~mask).tolist()
    error = None
    if md.num_accepted_tokens is not None:      # a speculative builder: its other rows must equal vLLM's
        accepted = md.num_accepted_tokens.cpu().numpy()
        bad = [r for r in other if qd[r] != 1 or accepted[r] != 1]
        if bad:
            r = bad[0]
            error = (f"decode row {r} (query {qd[r]}, num_accepted {accepted[r]}) is no spec row for vLLM "
                     f"and not a one-token step on column 0")
    return GDNView(spec, other, qd, error)


def _gdn(fn):
    """A derived GDN field: fn(md, view, common), or the view's error."""
    def derived(md, cm):
        view = _gdn_view(md, cm)
        return view.error if view.error else fn(md, view, cm)
    return derived


def _cumsum0(lengths) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.as_tensor(np.asarray(lengths, dtype=np.int64)), 0, out=out[1:])
    return out


def _col0(md, rows=None):
    sid = md.state_indices_tensor_d
    if sid is None:
        return None
    sid = sid if sid.dim() == 1 else sid[:, 0]
    return sid if rows is None else sid[rows]


def _gdn_non_spec_rows(md, v):
    """The non-spec rows' project decode rows: all decodes on vLLM's non-spec path, the others on its spec path."""
    return v.other if v.any_spec else list(range(md.num_decodes))


def _gdn_num_prefills(md, v, cm):
    return md.num_prefills + (len(v.other) if v.any_spec else 0)


def _gdn_non_spec_state_indices(md, v, cm):
    rows = _gdn_non_spec_rows(md, v)
    return _cat(_col0(md, rows) if rows else None, md.state_indices_tensor_p)


def _gdn_non_spec_query_start_loc(md, v, cm):
    # the non-spec rows' query lengths: their decode rows', then the prefill rows' (query_start_loc_p)
    rows = _gdn_non_spec_rows(md, v)
    if not rows and not md.num_prefills:
        return None
    qsl = _cumsum0(v.qd[rows])
    if md.num_prefills:
        qsl = torch.cat([qsl, md.query_start_loc_p[1:].cpu() + int(qsl[-1])])
    return qsl


def _gdn_has_initial_state(md, v, cm):
    # vLLM: num_computed > 0 of its non-spec rows, built only when it has prefills. Non-spec path: a decode
    # row always runs on top of saved state. Spec path: the other rows (prompt tails on saved state; padded
    # rows, seq_len 1) by their input num_computed = seq_len - query
    if not _gdn_num_prefills(md, v, cm):
        return None
    if v.any_spec:
        seq = cm.seq_lens_cpu_upper_bound.numpy()
        head = torch.tensor([bool(seq[r] - v.qd[r] > 0) for r in v.other], dtype=torch.bool)
    else:
        head = torch.ones(md.num_decodes, dtype=torch.bool)
    return _cat(head, md.has_initial_states_p)


def _gdn_spec_token_indx(md, v, cm):
    if not v.any_spec:
        return None
    qsl = md.query_start_loc_d.cpu().numpy()
    return np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in v.spec]).tolist()


def _gdn_non_spec_token_indx(md, v, cm):
    if not v.any_spec:
        return None
    qsl = md.query_start_loc_d.cpu().numpy()
    parts = [np.arange(qsl[r], qsl[r + 1]) for r in v.other]
    parts.append(np.arange(md.num_decode_tokens, md.num_decode_tokens + md.num_prefill_tokens))
    return np.concatenate(parts).tolist() or None


def _gdn_spec_masks(md, v, cm):
    if not v.any_spec:
        return None
    mask = torch.zeros(md.num_reqs, dtype=torch.bool)
    mask[v.spec] = True
    return mask


def _gdn_uniform_spec_length(md, v, cm):
    if not v.any_spec:
        return None
    lens = v.qd[v.spec]
    return int(lens[0]) if lens[0] > 0 and (lens == lens[0]).all() else None


def _gdn_if_prefills(fn):
    # vLLM builds its prefill / chunk fields only when it has prefill rows
    return lambda md, v, cm: fn(md, v, cm) if _gdn_num_prefills(md, v, cm) else None


def _gdn_chunk_indices(md, v, cm):
    # FLA's chunks over vLLM's prefill rows: on its spec path the other rows (one token, one chunk each)
    # lead, then this project's prefill rows, shifted by their count
    n = len(v.other) if v.any_spec else 0
    head = torch.tensor([[i, 0] for i in range(n)], dtype=torch.int32).view(-1, 2)
    own = _fla_chunk_indices(md)
    if own is not None:
        own = own + torch.tensor([n, 0], dtype=torch.int32)
    return _cat(head if n else None, own)


def _gdn_chunk_offsets(md, v, cm):
    n = len(v.other) if v.any_spec else 0
    out = torch.arange(n + 1, dtype=torch.int32)
    if md.num_prefills:
        out = torch.cat([out, md.last_chunk_indices_p.cpu() + 1 + n])
    return out


def _base_num_accepted(md, cm):
    """vLLM's base builder (mamba_attn.py `_compute_common_metadata`) slices its num_accepted_tokens kwarg
    to the decodes only inside `if num_decodes > 0 and self.use_spec_decode`; in a batch without decodes
    it hands the kwarg on as it came, all B rows, which none of its layers reads there (mamba_mixer2.py
    and short_conv.py read it only for decode rows). This project keeps the field decode-only, None
    without decodes (mamba_base.py), on purpose: then vLLM's value must be the input's, and this
    project's None (anything else is returned as a message, so it fails)."""
    if md.num_decodes or cm.num_accepted_tokens is None:
        return md.num_accepted_tokens
    if md.num_accepted_tokens is not None:
        return f"num_accepted_tokens {md.num_accepted_tokens.tolist()} without decode rows (None expected)"
    return cm.num_accepted_tokens


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
    "query_start_loc_d": "query_start_loc_d",
    "num_accepted_tokens": Derived(
        lambda md, cm: _base_num_accepted(md, cm), ("num_accepted_tokens", "num_decodes"),
        "num_accepted_tokens [D]; in a speculative batch without decodes (this project: None) vLLM's "
        "input kwarg, unsliced", ("num_accepted_tokens",), dtype=True),
}
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
    from_input=BASE_FROM_INPUT, not_compared=BASE_NOT_COMPARED, project_only={**CHECKPOINTS_ONLY})

MAMBA2 = dict(
    compared={**BASE_COMPARED, "prep_initial_states": "prep_initial_states", "chunk_size": "chunk_size",
              "seq_idx_p": "seq_idx_p", "cu_chunk_seqlen_p": "cu_chunk_seqlen_p",
              "last_chunk_indices_p": "last_chunk_indices_p"},
    absent={**BASE_ABSENT, "checkpoint_chunk_idx": CHECKPOINTS, "checkpoint_meta": CHECKPOINTS},
    from_input=BASE_FROM_INPUT, not_compared=BASE_NOT_COMPARED, project_only={**CHECKPOINTS_ONLY})

SPEC_INPUTS = ("num_decode_draft_tokens_cpu",)     # the input every GDN view reads (GDNView)


def _gdn_field(fn, reads, how, inputs=(), dtype=False):
    return Derived(_gdn(fn), reads + ("num_decodes", "query_start_loc_d", "num_accepted_tokens"), how,
                   SPEC_INPUTS + inputs, dtype)


GDN = dict(
    compared={
        "num_decodes": _gdn_field(lambda md, v, cm: 0 if v.any_spec else md.num_decodes, (),
                                  "num_decodes; 0 with spec rows"),
        "num_decode_tokens": _gdn_field(lambda md, v, cm: 0 if v.any_spec else md.num_decode_tokens,
                                        ("num_decode_tokens",), "num_decode_tokens; 0 with spec rows"),
        "num_prefills": _gdn_field(_gdn_num_prefills, ("num_prefills",),
                                   "num_prefills (+ the other decode rows with spec rows)"),
        "num_prefill_tokens": _gdn_field(
            lambda md, v, cm: md.num_prefill_tokens + (int(v.qd[v.other].sum()) if v.any_spec else 0),
            ("num_prefill_tokens",), "num_prefill_tokens (+ the other decode rows' tokens with spec rows)"),
        "num_spec_decodes": _gdn_field(lambda md, v, cm: len(v.spec), (), "the spec rows among the decodes"),
        "num_spec_decode_tokens": _gdn_field(lambda md, v, cm: int(v.qd[v.spec].sum()), (),
                                             "the spec rows' tokens (query_start_loc_d)"),
        "spec_query_start_loc": _gdn_field(lambda md, v, cm: _cumsum0(v.qd[v.spec]) if v.any_spec else None, (),
                                           "[0] + cumsum of the spec rows' query lengths (query_start_loc_d)",
                                           dtype=True),
        "spec_state_indices_tensor": _gdn_field(
            lambda md, v, cm: md.state_indices_tensor_d[v.spec] if v.any_spec else None, ("state_indices_tensor_d",),
            "state_indices_tensor_d [D, 1 + k], the spec rows", dtype=True),
        "num_accepted_tokens": _gdn_field(lambda md, v, cm: md.num_accepted_tokens[v.spec] if v.any_spec else None,
                                          (), "num_accepted_tokens of the spec rows", dtype=True),
        "spec_sequence_masks": _gdn_field(_gdn_spec_masks, ("num_reqs",), "the spec rows, over all rows"),
        "spec_sequence_masks_cpu": _gdn_field(_gdn_spec_masks, ("num_reqs",), "the spec rows, over all rows"),
        "spec_token_indx": _gdn_field(_gdn_spec_token_indx, (), "the spec rows' tokens (query_start_loc_d)"),
        "non_spec_token_indx": _gdn_field(_gdn_non_spec_token_indx, ("num_decode_tokens", "num_prefill_tokens"),
                                          "the other decode rows' tokens, then the prefill tokens"),
        "uniform_spec_sequence_length": _gdn_field(_gdn_uniform_spec_length, (),
                                                   "the spec rows' common query length, if any"),
        "has_initial_state": _gdn_field(_gdn_has_initial_state, ("num_prefills", "has_initial_states_p"),
                                        "non-spec path: [True] * D + has_initial_states_p; spec path: the other "
                                        "rows' input num_computed > 0 + has_initial_states_p",
                                        ("seq_lens_cpu_upper_bound",), dtype=True),
        "non_spec_query_start_loc": _gdn_field(_gdn_non_spec_query_start_loc, ("num_prefills", "query_start_loc_p"),
                                               "[0] + cumsum of the non-spec decode rows' lengths, then "
                                               "query_start_loc_p[1:] shifted by their tokens", dtype=True),
        "non_spec_state_indices_tensor": _gdn_field(_gdn_non_spec_state_indices,
                                                    ("state_indices_tensor_d", "state_indices_tensor_p"),
                                                    "column 0 of the non-spec decode rows + state_indices_tensor_p",
                                                    dtype=True),
        "prefill_query_start_loc": _gdn_field(
            _gdn_if_prefills(lambda md, v, cm: _gdn_non_spec_query_start_loc(md, v, cm) if v.any_spec
                             else md.query_start_loc_p), ("num_prefills", "query_start_loc_p"),
            "query_start_loc_p; spec path: non_spec_query_start_loc", dtype=True),
        "prefill_state_indices": _gdn_field(
            _gdn_if_prefills(lambda md, v, cm: _gdn_non_spec_state_indices(md, v, cm) if v.any_spec
                             else md.state_indices_tensor_p), ("num_prefills", "state_indices_tensor_p",
                                                               "state_indices_tensor_d"),
            "state_indices_tensor_p; spec path: non_spec_state_indices_tensor", dtype=True),
        "prefill_has_initial_state": _gdn_field(
            _gdn_if_prefills(lambda md, v, cm: _gdn_has_initial_state(md, v, cm) if v.any_spec
                             else md.has_initial_states_p), ("num_prefills", "has_initial_states_p"),
            "has_initial_states_p; spec path: has_initial_state", ("seq_lens_cpu_upper_bound",), dtype=True),
        "chunk_indices": _gdn_field(_gdn_if_prefills(_gdn_chunk_indices),
                                    ("num_prefills", "cu_chunk_seqlen_p", "seq_idx_p", "chunk_size",
                                     "query_start_loc_p"),
                                    "(seq_idx_p, chunk number in its row) from cu_chunk_seqlen_p; spec path: "
                                    "one chunk per other decode row first", dtype=True),
        "chunk_offsets": _gdn_field(_gdn_if_prefills(_gdn_chunk_offsets), ("num_prefills", "last_chunk_indices_p"),
                                    "[0] + (last_chunk_indices_p + 1); spec path: one per other decode row first"),
    },
    absent={
        "checkpoint": CHECKPOINTS,
        "flashinfer_checkpoint_plan": "FlashInfer GDN prefill backend (CUDA) with align-mode checkpoints",
        "aiter_prefill_metadata": "ROCm AITER GDN prefill backend",
    },
    from_input={"num_actual_tokens": "num_actual_tokens"},
    not_compared=BASE_NOT_COMPARED,
    # the project's GDN metadata has num_reqs (vLLM's GDN metadata does not; its rows are the input's)
    project_only={"num_reqs": "vLLM's GDN metadata has no num_reqs; checked == the input's num_reqs",
                  **CHECKPOINTS_ONLY})

SSD_LAYOUT = ("this project's lightning prefill is the SSD chunk scan (toolkit/layers/lightning.py), which reads "
              "Mamba2's chunk layout; vLLM's lightning kernels tile on their own")
def _short_prefills(md) -> int:
    """The prefill rows of one token at the head of the prefill section (fresh one-token prompts)."""
    if not md.num_prefills:
        return 0
    lens = (md.query_start_loc_p[1:] - md.query_start_loc_p[:-1]).tolist()
    return next((i for i, n in enumerate(lens) if n != 1), len(lens))


# vLLM's linear-attention builder splits with split_decodes_and_prefills' default (short extends as decodes):
# a fresh one-token prompt is a decode there, whose kernel reads the slot as its state; this project runs
# it as a prefill from a zero state, the base rule of vLLM's other Mamba builders (vLLM #42430, mamba_base.py)
SHORT_AS_DECODE = ("the base split, with the fresh one-token prompts at the head of the prefill rows counted as "
                   "decodes (vLLM's split_decodes_and_prefills default; this project runs them as prefills from a "
                   "zero state, as vLLM's other Mamba builders do)")
LINEAR = dict(
    compared={"num_decodes": Derived(lambda md: md.num_decodes + _short_prefills(md),
                                     ("num_decodes", "num_prefills", "query_start_loc_p"), SHORT_AS_DECODE),
              "num_decode_tokens": Derived(lambda md: md.num_decode_tokens + _short_prefills(md),
                                           ("num_decode_tokens",), SHORT_AS_DECODE),
              "num_prefills": Derived(lambda md: md.num_prefills - _short_prefills(md), (), SHORT_AS_DECODE),
              "num_prefill_tokens": Derived(lambda md: md.num_prefill_tokens - _short_prefills(md),
                                            ("num_prefill_tokens",), SHORT_AS_DECODE),
              "state_indices_tensor": Derived(
                  lambda md: _cat(md.state_indices_tensor_d, md.state_indices_tensor_p),
                  ("state_indices_tensor_d", "state_indices_tensor_p"),
                  "state_indices_tensor_d then state_indices_tensor_p (one slot per row, decodes first)")},
    absent={},
    from_input={"query_start_loc": "query_start_loc", "seq_lens": "seq_lens"},
    not_compared={},
    project_only={
        "num_reqs": "vLLM's linear-attention metadata has no num_reqs; checked == the input's num_reqs",
        "has_initial_states_p": "the base builder's flag (vLLM's linear attention has none: its prefill reads "
                                "the slot when the row has computed tokens)",
        "query_start_loc_d": "speculative decoding only (None here: vLLM's builder has no spec path)",
        "num_accepted_tokens": "speculative decoding only (None here)",
        "prep_initial_states": SSD_LAYOUT, "chunk_size": SSD_LAYOUT, "seq_idx_p": SSD_LAYOUT,
        "cu_chunk_seqlen_p": SSD_LAYOUT, "last_chunk_indices_p": SSD_LAYOUT, **CHECKPOINTS_ONLY})

FAMILIES = {  # vLLM builder class -> (this project's metadata class, factory(chunk_size, mamba_block_size,
              #                      num_speculative_tokens), map)
    "Mamba1AttentionMetadataBuilder": (
        Mamba1AttentionMetadata, lambda cs, bs, k: Mamba1MetadataBuilder(mamba_block_size=bs, num_speculative_tokens=k),
        MAMBA1_LIKE),
    "ShortConvAttentionMetadataBuilder": (
        ShortConvAttentionMetadata,
        lambda cs, bs, k: ShortConvMetadataBuilder(mamba_block_size=bs, num_speculative_tokens=k), MAMBA1_LIKE),
    "Mamba2AttentionMetadataBuilder": (
        Mamba2AttentionMetadata,
        lambda cs, bs, k: Mamba2MetadataBuilder(cs, mamba_block_size=bs, num_speculative_tokens=k), MAMBA2),
    "GDNAttentionMetadataBuilder": (
        GDNAttentionMetadata, lambda cs, bs, k: GDNMetadataBuilder(mamba_block_size=bs, num_speculative_tokens=k), GDN),
    "LinearAttentionMetadataBuilder": (
        LinearAttentionMetadata,
        lambda cs, bs, k: LinearAttentionMetadataBuilder(cs or 16, mamba_block_size=bs, num_speculative_tokens=k),
        LINEAR),
}
# vLLM builders without a speculative path: Mamba1 (the files' "left_out", checked on their batches) and
# linear attention ("not_speculative": its build() takes no spec kwargs)
NOT_IN_SPEC_FILES = {"Mamba1AttentionMetadataBuilder", "LinearAttentionMetadataBuilder"}
# (golden builder, vLLM field) -> why this project differs on purpose. Each entry must still differ.
KNOWN_DIFFERENCES: dict[tuple[str, str], str] = {}


# ---- the goldens ----------------------------------------------------------------------------------

@cache
def golden(mode: str) -> dict:
    return json.loads(GOLDENS[mode].read_text())


# golden builder name -> its file's mode (the align file's names carry their block size: distinct)
MODE_OF = {name: mode for mode in GOLDENS for name in golden(mode)["builders"]}


def batches_of(name: str) -> range:
    """The golden batches a builder read: all of its file's, or (spec file) those of its k."""
    doc = golden(MODE_OF[name])
    return range(*doc["builders"][name].get("batch_range", (0, doc["num_batches"])))


def column(name: str, field: str) -> list:
    """A builder's field over batches_of(name)."""
    doc = golden(MODE_OF[name])
    col = doc["outputs"][name][field]
    if isinstance(col, dict) and "const" in col:
        return [col["const"]] * len(batches_of(name))
    if isinstance(col, dict) and "same_as" in col:
        return column(*col["same_as"].split(".", 1))
    return col


def align_block_table(i: int, bs: int, mode: str = "align") -> torch.Tensor:
    """The align (align-spec) file's block table of batch i for block size bs, rebuilt from its [A, C] as
    the file's input_format (and scripts/vllm_reference.py `block_table_for`) says; checked against
    table_sha256. align-spec: k more columns (vLLM's MambaSpec.max_num_blocks_per_req in align mode)."""
    doc = golden(mode)
    inp, layout = doc["inputs"], doc["table_layout"]
    a, c = inp["tables"][str(bs)][i]
    rows, width = len(inp["q"][i]), -(-doc["max_model_len"] // bs) + (inp["k"][i] if mode == "align-spec" else 0)
    flat = torch.arange(rows * width, dtype=torch.int64).view(rows, width)
    pages = 1 + (a * flat + c) % layout["page_prime"]
    seq_lens = torch.tensor(inp["q"][i], dtype=torch.int64) + torch.tensor(inp["computed"][i], dtype=torch.int64)
    running = ((seq_lens - 1) // bs).clamp(min=0).view(-1, 1)
    null = (torch.arange(width).view(1, -1) < running) & (pages % layout["null_every"] == 0)
    null |= torch.tensor([k == "x" for k in inp["rows"][i]]).view(-1, 1)     # padding rows: all null
    return torch.where(null, 0, pages).to(torch.int32)


def common(mode: str, i: int, bs: int | None = None) -> CommonAttentionMetadata:
    """This project's CommonAttentionMetadata of golden batch i (the same tensors vLLM was given); align:
    the block table of block size bs; spec: the [B, 1 + k] block table and the two speculative inputs
    vLLM's builders took as keyword arguments (num_accepted_tokens, num_decode_draft_tokens_cpu);
    align-spec: the align block table (k columns wider) and the spec inputs."""
    inp = golden(mode)["inputs"]
    q = torch.tensor(inp["q"][i], dtype=torch.int32)
    seq = torch.tensor(inp["computed"][i], dtype=torch.int32) + q
    qsl = torch.zeros(len(q) + 1, dtype=torch.int32)
    torch.cumsum(q, 0, out=qsl[1:])
    t = int(qsl[-1])
    spec = {}
    if mode in ("spec", "align-spec"):
        spec = dict(num_accepted_tokens=torch.tensor(inp["num_accepted_tokens"][i], dtype=torch.int32),
                    num_decode_draft_tokens_cpu=torch.tensor(inp["num_decode_draft_tokens_cpu"][i], dtype=torch.int32))
    if mode == "none":
        table = torch.tensor(inp["slots"][i], dtype=torch.int32).view(-1, 1)
    elif mode == "spec":
        table = torch.tensor(inp["slots"][i], dtype=torch.int32).view(len(q), 1 + inp["k"][i])
    else:
        table = align_block_table(i, bs, mode)
    return CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), num_reqs=len(q),
        num_actual_tokens=t, max_query_len=int(q.max()), max_seq_len=int(seq.max()),
        block_table_tensor=table, slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(), is_prefilling=torch.tensor(inp["prefilling"][i], dtype=torch.bool),
        **spec)


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
    mode = MODE_OF[name]
    inp = golden(mode)["inputs"]
    table = ""
    if mode in ALIGN_MODES:
        bs = golden(mode)["builders"][name]["block_size"]
        seq = [q + c for q, c in zip(inp["q"][i], inp["computed"][i])]
        table = f"block size {bs}, running columns {[max(s - 1, 0) // bs for s in seq]}"
    if "slots" in inp:
        table = f"slots={inp['slots'][i]}"
    if "num_accepted_tokens" in inp:
        table += (f" k={inp['k'][i]} num_accepted_tokens={inp['num_accepted_tokens'][i]} "
                  f"num_decode_draft_tokens_cpu={inp['num_decode_draft_tokens_cpu'][i]}")
    return (f"{name} batch {i} ({inp['kind'][i]}, rows {inp['rows'][i]}: q={inp['q'][i]} "
            f"computed={inp['computed'][i]} prefilling={inp['prefilling'][i]} {table})")


def mismatches(name: str, limit: int = 8, project: str | None = None) -> tuple[int, list[str]]:
    """(number of disagreeing (batch, field) pairs, the first `limit` of them in words). `project`: the
    FAMILIES entry whose builder and map to use (default: the golden builder's own family)."""
    mode = MODE_OF[name]
    info = golden(mode)["builders"][name]
    _, factory, fmap = FAMILIES[project or info["vllm_class"].rsplit(".", 1)[1]]
    bs = info["mamba_block_size"] if mode in ALIGN_MODES else None
    builder = factory(info["chunk_size"], bs, info.get("num_speculative_tokens", 0))
    cols = {f: column(name, f) for f in info["fields"]}
    count, out = 0, []

    def report(i, field, theirs, ours, what):
        nonlocal count
        if (name, field) in KNOWN_DIFFERENCES:
            return
        count += 1
        if len(out) < limit:
            out.append(f"{describe(name, i)}: vLLM {field}={theirs}, this project's {what}={ours}")

    for j, i in enumerate(batches_of(name)):
        cm = common(mode, i, bs)
        try:
            md = builder.build(cm, producer="vllm goldens")
        except Exception as err:
            report(i, "(build)", "built metadata", f"{type(err).__name__}: {err}", "builder")
            continue
        for field, target in fmap["compared"].items():
            theirs = vllm_value(cols[field][j], cm)
            if isinstance(target, Derived):
                raw = target(md, cm)
                ours, what = plain(raw), target.how
                check_dtype = target.dtype
            else:
                raw = getattr(md, target)
                ours, what = plain(raw), target
                check_dtype = True
            want = info["dtypes"].get(field)
            if check_dtype and isinstance(raw, torch.Tensor) and want and str(raw.dtype).removeprefix("torch.") != want:
                report(i, field, f"dtype {want}", raw.dtype, f"{what} dtype")
            if theirs != ours:
                report(i, field, theirs, ours, what)
        for field, source in fmap["from_input"].items():
            theirs, given = vllm_value(cols[field][j], cm), plain(getattr(cm, source))
            if theirs != given:
                report(i, field, theirs, given, f"input {source} (vLLM copies it)")
        for field in fmap["absent"]:
            if vllm_value(cols[field][j], cm) is not None:
                report(i, field, cols[field][j], "(no such field)", field)
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
    assert {"mamba1", "short_conv", "gdn", "gdn_olmo_hybrid", "kda_kimi_linear"} <= names
    assert doc["builders"]["kda_kimi_linear"]["architecture"] == "KimiLinearForCausalLM"
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
        assert all(b.get("cache_config_set_explicitly") == {"mamba_cache_mode": "align", "mamba_block_size": bs}
                   for b in built.values() if b["vllm_class"].endswith(".LinearAttentionMetadataBuilder")), bs
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


def test_spec_goldens_come_from_vllm_0_33_0_speculative_builders_with_every_case():
    doc = golden("spec")
    assert doc["vllm_version"] == VLLM_VERSION and doc["mode"] == "spec" and isinstance(doc["seed"], int)
    assert set(doc["not_speculative"]) == {"linear_attn"} == set(golden("align-spec")["not_speculative"])
    spec = doc["speculative"]
    assert set(spec["num_speculative_tokens"]) == set(MIN_SPEC_BATCHES), spec["num_speculative_tokens"]
    assert all(len(v) == doc["num_batches"] for v in doc["inputs"].values())
    for k, want in MIN_SPEC_BATCHES.items():
        lo, hi = spec["batch_range"][str(k)]
        assert hi - lo >= want, (k, lo, hi)
        assert set(doc["inputs"]["k"][lo:hi]) == {k}, k
        built = {b["vllm_class"].rsplit(".", 1)[1]: b for b in doc["builders"].values()
                 if b["num_speculative_tokens"] == k}
        # Mamba1 is left out: vLLM 0.33's Mamba1 builder ignores the spec inputs (checked on every batch)
        assert set(built) == set(FAMILIES) - NOT_IN_SPEC_FILES, (k, set(built))
        chunk_sizes = {b["chunk_size"] for b in doc["builders"].values() if b["num_speculative_tokens"] == k
                       and b["vllm_class"].endswith(".Mamba2AttentionMetadataBuilder")}
        assert len(chunk_sizes) >= 3, (k, chunk_sizes)
        left = spec["left_out"][f"mamba1_k{k}"]
        assert left["batches_where_spec_kwargs_change_nothing"] == left["batches"] == hi - lo, left
        assert left["batches_where_its_num_decodes_differs_from_short_conv"] >= 20, left
    for name, b in doc["builders"].items():
        k = b["num_speculative_tokens"]
        assert b["mamba_cache_mode"] == "none" and b["num_speculative_blocks"] == k, name
        assert b["reorder_batch_threshold"] == 1 + k and b["speculative_method"] == "ngram", name
        assert b["batch_range"] == spec["batch_range"][str(k)], name
        assert all(len(column(name, f)) == len(batches_of(name)) for f in b["fields"]), name
    inp = doc["inputs"]
    for i in range(doc["num_batches"]):       # the inputs are MRV2's (MambaHybridModelState.prepare_attn)
        k, q, p = inp["k"][i], inp["q"][i], inp["prefilling"][i]
        assert len(inp["slots"][i]) == len(q) and all(len(row) == 1 + k for row in inp["slots"][i]), i
        check_mrv2_spec_inputs(inp, i, k, q, p)
        ids = [s for row in inp["slots"][i] for s in row if s]
        assert len(ids) == len(set(ids)), i
    cov = doc["coverage"]
    for k in MIN_SPEC_BATCHES:
        keys = spec_coverage_keys(cov, k, ("short_chunks_of_1_plus_k_tokens",
                                           "batches_with_decode_rows_but_no_spec_rows"))
        assert len(keys) >= 21 + 2 * (k + 1), keys
        for key in keys:
            assert cov[key] >= 15, (key, cov[key])


# what a speculative golden file's batches cover, per k (each at least 15 times)
SPEC_COVERAGE = ("rows_spec_decode", "rows_prompt_tail_1", "rows_prompt_1", "rows_first_chunk", "rows_continue_chunk",
                 "rows_short_chunk", "rows_padding", "batches_mixed", "batches_decode_only", "batches_prefill_only",
                 "batches_uniform_verify", "batches_no_verify", "batches_order_by_len", "batches_order_mrv2",
                 "batches_with_spec_rows", "batches_with_spec_rows_and_one_token_non_spec_rows",
                 "batches_with_a_non_spec_row_between_spec_rows", "batches_with_spec_rows_and_prefills",
                 "batches_all_spec_rows")


def spec_coverage_keys(cov: dict, k: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The coverage keys of k: SPEC_COVERAGE, `extra`, and every "verify rows with d drafts" count."""
    return ([f"k{k}_{key}" for key in SPEC_COVERAGE + extra]
            + [key for key in cov if key.startswith(f"k{k}_verify_rows_with_")])


def check_mrv2_spec_inputs(inp: dict, i: int, k: int, q: list[int], p: list[int]) -> None:
    """Batch i's spec inputs are MRV2's (MambaHybridModelState.prepare_attn): a verify row ("v") has
    its draft count and 1..k+1 accepted; any other row -1 drafts and 1 accepted."""
    drafts, accepted = inp["num_decode_draft_tokens_cpu"][i], inp["num_accepted_tokens"][i]
    for r, code in enumerate(inp["rows"][i]):
        verify = code == "v"
        assert (drafts[r] == q[r] - 1) if verify else drafts[r] == -1, (i, r)
        assert (1 <= accepted[r] <= k + 1) if verify else accepted[r] == 1, (i, r)
        assert verify == (not p[r] and q[r] <= k + 1 and code != "x"), (i, r)


def test_align_spec_goldens_come_from_vllm_0_33_0_align_mode_with_speculative_builders_with_every_case():
    doc = golden("align-spec")
    assert doc["vllm_version"] == VLLM_VERSION and doc["mode"] == "align-spec" and isinstance(doc["seed"], int)
    spec, inp = doc["speculative"], doc["inputs"]
    assert set(spec["num_speculative_tokens"]) == set(MIN_SPEC_BATCHES), spec["num_speculative_tokens"]
    assert all(len(v) == doc["num_batches"] for k, v in inp.items() if k not in ("tables", "table_sha256"))
    block_sizes = doc["block_sizes"]
    assert 16 in block_sizes and len(block_sizes) >= 2, block_sizes
    for bs in block_sizes:
        assert len(inp["tables"][str(bs)]) == len(inp["table_sha256"][str(bs)]) == doc["num_batches"], bs
    for k, want in MIN_SPEC_BATCHES.items():
        lo, hi = spec["batch_range"][str(k)]
        assert hi - lo >= want, (k, lo, hi)
        assert set(inp["k"][lo:hi]) == {k}, k
        for bs in block_sizes:
            built = {b["vllm_class"].rsplit(".", 1)[1]: b for b in doc["builders"].values()
                     if b["num_speculative_tokens"] == k and b["block_size"] == bs}
            # Mamba1 is left out as in the spec file (vLLM 0.33's Mamba1 ignores the spec inputs; checked)
            assert set(built) == set(FAMILIES) - NOT_IN_SPEC_FILES, (k, bs, set(built))
            chunk_sizes = {b["chunk_size"] for b in doc["builders"].values() if b["num_speculative_tokens"] == k
                           and b["block_size"] == bs and b["vllm_class"].endswith(".Mamba2AttentionMetadataBuilder")}
            assert len(chunk_sizes) >= 3, (k, bs, chunk_sizes)
            left = spec["left_out"][f"mamba1_bs{bs}_k{k}"]
            assert left["batches_where_spec_kwargs_change_nothing"] == left["batches"] == hi - lo, left
            assert left["batches_where_its_num_decodes_differs_from_short_conv"] >= 20, left
    for name, b in doc["builders"].items():
        k, bs = b["num_speculative_tokens"], b["block_size"]
        assert name.endswith(f"_bs{bs}_k{k}"), name
        assert b["mamba_cache_mode"] == "align" and b["mamba_block_size"] == bs, name
        assert b["enable_chunked_prefill"] and b["num_prefill_checkpoint_blocks"] == 0, name
        assert b["num_speculative_blocks"] == k and b["reorder_batch_threshold"] == 1 + k, name
        assert b["speculative_method"] == "ngram", name
        assert b["max_num_blocks_per_req"] == -(-doc["max_model_len"] // bs) + k, name     # the tables' width
        assert b["batch_range"] == spec["batch_range"][str(k)], name
        assert all(len(column(name, f)) == len(batches_of(name)) for f in b["fields"]), name
        # vLLM's own state indices follow the align + spec layout in every row (checked by the generator
        # against the tables; the comparison below holds this project's builders to the same values)
        check = spec["layout_check"][name]
        assert check["rows_as_designed"] == check["rows"] > 0 and check["decode_rows_crossing_a_block"] >= 100, check
    for i in range(doc["num_batches"]):       # the inputs are MRV2's (MambaHybridModelState.prepare_attn)
        check_mrv2_spec_inputs(inp, i, inp["k"][i], inp["q"][i], inp["prefilling"][i])
    cov = doc["coverage"]
    for k in MIN_SPEC_BATCHES:
        keys = spec_coverage_keys(cov, k)
        for bs in block_sizes:     # the edges of the align + spec state-index rule, at every block size
            keys += [f"k{k}_bs{bs}_rows_{key}" for key in (
                "verify_rows_crossing_a_block", "verify_rows_with_last_draft_first_in_its_block",
                "verify_rows_with_seq_len_multiple_of_bs", "verify_rows_running_column_past_0",
                "verify_rows_with_drafts_within_one_block", "one_token_rows_entering_a_new_block",
                "prefills_crossing_a_block", "null_column_before_running", "seq_len_1")]
        for key in keys:
            assert cov[key] >= 15, (key, cov[key])


@pytest.mark.parametrize("mode", ALIGN_MODES)
def test_align_block_tables_rebuild_exactly(mode):
    """The test's block tables are the ones vLLM was given (their sha256 digests in the file)."""
    doc = golden(mode)
    inp = doc["inputs"]
    for bs in doc["block_sizes"]:
        for i, want in enumerate(inp["table_sha256"][str(bs)]):
            table = align_block_table(i, bs, mode)
            got = hashlib.sha256(np.ascontiguousarray(table.numpy(), dtype="<i4").tobytes()).hexdigest()[:12]
            assert got == want, f"{mode}: block size {bs}, batch {i}: rebuilt table {got}, vLLM's {want}"
            # distinct pages, and a page in every real row's running column (align-spec: and the k after it),
            # so a builder that reads any other column reads another id
            ids = table[table != 0]
            assert ids.unique().numel() == ids.numel(), (mode, bs, i)
            k = inp["k"][i] if mode == "align-spec" else 0
            for r, (q, c, code) in enumerate(zip(inp["q"][i], inp["computed"][i], inp["rows"][i], strict=True)):
                col = max(q + c - 1, 0) // bs
                assert code == "x" or bool((table[r, col:col + 1 + k] != 0).all()), (mode, bs, i, r)


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


@pytest.mark.parametrize("name", sorted(n for n, mode in MODE_OF.items()
                                         if mode in ("spec", "align-spec") and n.startswith("short_conv_")))
def test_mamba1_spec_path_matches_vllm_base_builder(name):
    """vLLM 0.33's Mamba1 has no speculative path (the spec / align-spec files' `left_out`); this project's
    has. Its metadata is the base builder's, so it is held to vLLM's spec-aware base builder: ShortConv's,
    which is BaseMambaAttentionMetadataBuilder unchanged (its metadata has exactly the base fields, as
    Mamba1's), with and without prefix caching."""
    count, first = mismatches(name, project="Mamba1AttentionMetadataBuilder")
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


def _plant_spec_drafts_ignored(monkeypatch):
    real = mamba_base.BaseMambaMetadataBuilder.split

    def without_drafts(self, common, producer=""):              # a verify row of 1 + d tokens is no decode
        drafts = common.num_decode_draft_tokens_cpu
        if drafts is not None:
            common = common.replace(num_decode_draft_tokens_cpu=torch.zeros_like(drafts))
        return real(self, common, producer)
    monkeypatch.setattr(mamba_base.BaseMambaMetadataBuilder, "split", without_drafts)


def _patch_spec_fields(monkeypatch, change_common=None, change_fields=None):
    real = mamba_base.BaseMambaMetadataBuilder.spec_fields

    def patched(self, common, s):
        fields = real(self, change_common(common) if change_common else common, s)
        return change_fields(fields) if change_fields else fields
    monkeypatch.setattr(mamba_base.BaseMambaMetadataBuilder, "spec_fields", patched)


def _plant_spec_accepted_of_the_row_before(monkeypatch):       # accepted counts one row off
    _patch_spec_fields(monkeypatch, lambda c: c.replace(num_accepted_tokens=c.num_accepted_tokens.roll(1)))


def _plant_spec_accepted_from_query_len(monkeypatch):          # vLLM's fallback when the kwarg is missing
    _patch_spec_fields(monkeypatch, lambda c: c.replace(num_accepted_tokens=torch.diff(c.query_start_loc)))


def _plant_spec_state_column_0_only(monkeypatch):              # [D, 1] where vLLM has [D, 1 + k]
    _patch_spec_fields(monkeypatch, change_fields=lambda f: {
        **f, "state_indices_tensor_d": f["state_indices_tensor_d"][:, :1]})


def _plant_spec_one_token_rows_accepted_2(monkeypatch):        # rows without drafts start from column 1
    _patch_spec_fields(monkeypatch, lambda c: c.replace(num_accepted_tokens=torch.where(
        c.num_decode_draft_tokens_cpu < 0, 2, c.num_accepted_tokens).to(torch.int32)))


def _patch_align_spec_columns(monkeypatch, first_column):
    """spec_columns in align mode gathering 1 + k columns from first_column(seq_lens, query_lens, bs) [D, 1]."""
    real = mamba_base.BaseMambaMetadataBuilder.spec_columns

    def patched(self, common, d):
        if self.mamba_block_size is None:
            return real(self, common, d)
        k1 = 1 + self.num_speculative_tokens
        query_lens = torch.diff(common.query_start_loc)[:d]
        cols = first_column(common.seq_lens[:d], query_lens, self.mamba_block_size) + torch.arange(k1)
        return torch.gather(common.block_table_tensor[:d], 1, cols)
    monkeypatch.setattr(mamba_base.BaseMambaMetadataBuilder, "spec_columns", patched)


def _plant_align_spec_columns_0_to_k(monkeypatch):            # the "none" layout: columns 0..k
    _patch_align_spec_columns(monkeypatch, lambda seq, q, bs: torch.zeros_like(seq, dtype=torch.int64)[:, None])


def _plant_align_spec_column_of_first_token(monkeypatch):      # the verify row's first token, not its last draft
    _patch_align_spec_columns(monkeypatch, lambda seq, q, bs: ((seq - q) // bs).to(torch.int64)[:, None])


@pytest.mark.parametrize("plant, caught_by", [
    (_plant_chunk_boundary, ["mamba2_cs16", "mamba2_cs64", "mamba2_cs256"]),
    (_plant_initial_state_flag, ["mamba1", "mamba2_cs64", "short_conv", "gdn"]),
    (_plant_decode_rule, ["mamba1", "mamba2_cs16", "short_conv", "gdn"]),
    (_plant_gdn_chunk_size, ["gdn"]),
    (_plant_align_column_of_next_token, ["mamba1_bs16", "mamba2_cs16_bs64", "mamba2_cs256_bs16", "short_conv_bs64",
                                         "gdn_bs16", "gdn_bs64", "mamba2_cs16_bs16_k3", "gdn_bs64_k1"]),
    (_plant_align_column_0, ["mamba1_bs64", "mamba2_cs64_bs16", "short_conv_bs16", "gdn_bs64", "short_conv_bs64_k3",
                             "gdn_bs16_k1"]),
    (_plant_align_decodes_only, ["mamba1_bs16", "mamba2_cs64_bs64", "short_conv_bs64", "gdn_bs16",
                                 "mamba2_cs64_bs16_k1", "gdn_bs64_k3"]),
    (_plant_spec_drafts_ignored, ["mamba2_cs16_k3", "mamba2_cs256_k1", "short_conv_k3", "gdn_k1", "gdn_k3",
                                  "mamba2_cs256_bs64_k3", "gdn_bs16_k3"]),
    (_plant_spec_accepted_of_the_row_before, ["mamba2_cs64_k3", "short_conv_k1", "gdn_k3", "gdn_k1",
                                              "short_conv_bs16_k3"]),
    (_plant_spec_accepted_from_query_len, ["mamba2_cs16_k1", "short_conv_k3", "gdn_k3"]),
    (_plant_spec_state_column_0_only, ["mamba2_cs256_k3", "short_conv_k1", "gdn_k1", "gdn_k3", "short_conv_bs16_k1",
                                       "gdn_bs64_k3"]),
    (_plant_spec_one_token_rows_accepted_2, ["mamba2_cs16_k3", "short_conv_k1", "gdn_k3", "gdn_k1"]),
    (_plant_align_spec_columns_0_to_k, ["mamba2_cs16_bs16_k3", "mamba2_cs64_bs64_k1", "short_conv_bs16_k1",
                                        "short_conv_bs64_k3", "gdn_bs16_k3", "gdn_bs64_k1"]),
    (_plant_align_spec_column_of_first_token, ["mamba2_cs256_bs16_k1", "short_conv_bs64_k1", "gdn_bs16_k1",
                                               "gdn_bs64_k3"]),
], ids=lambda v: v.__name__.removeprefix("_plant_") if callable(v) else None)
def test_a_planted_builder_change_is_caught(plant, caught_by, monkeypatch):
    plant(monkeypatch)
    for name in caught_by:
        count, _ = mismatches(name, limit=0)
        assert count, f"{plant.__name__} went unnoticed by {name}"
