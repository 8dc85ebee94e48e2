"""Sharded loading (issue 27, point 2): `load_model(folder, tp=TPGroup(r, N))` reads only rank r's
slices from the safetensors files and gives what `shard_model(load_model(folder), TPGroup(r, N))`
gives, for every architecture and both demo models. No process group: loading does no collectives.

The reads are counted by wrapping `safe_open`: a rank reads each sharded parameter's kept entries
exactly (by contiguous runs), the rest whole, and never the whole-file reader."""
from __future__ import annotations

import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from toolkit.distributed import SINGLE, TPGroup
from toolkit.errors import CheckpointError
from toolkit.layers.parallel import SourceSlice, source_slice
from toolkit.models import DEMO_MODELS, CausalLM, get_model_class, load_model, save_hf_folder
from toolkit.models import lazy_checkpoint as lazy
from toolkit.models.loader import SAFE_INDEX, SAFE_WEIGHTS
from toolkit.models.tensor_parallel import shard_model

CPU = dict(dtype=torch.float32, device=torch.device("cpu"))
PRESETS = ["tiny-llama", "tiny-mamba", "tiny-falcon-mamba", "tiny-mamba2", "tiny-bamba", "tiny-lfm2", "tiny-jamba",
           "tiny-granite-hybrid", "tiny-nemotron-h", "tiny-falcon-h1", "tiny-zamba2", "tiny-qwen3-next",
           "tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-olmo-hybrid",
           "tiny-kimi-linear", "tiny-lfm2-moe", "tiny-minimax", "tiny-lfm3", "tiny-xlstm"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Every preset saved as a HF folder (seed 0), and the demo models' shipped folders."""
    out = {name: save_hf_folder(load_model(name, seed=0, **CPU), tmp_path_factory.mktemp(name)) for name in PRESETS}
    return out | {name: path for name, path in DEMO_MODELS.items()}


def assert_same_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    """Same parameter and buffer names (tied copies included), shapes, dtypes and values."""
    for what in ("named_parameters", "named_buffers"):
        a = dict(getattr(got, what)(remove_duplicate=False))
        b = dict(getattr(want, what)(remove_duplicate=False))
        assert a.keys() == b.keys(), what
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name", PRESETS + list(DEMO_MODELS))
def test_sharded_load_equals_the_shards_of_the_whole(folders, name):
    for r in range(2):
        tp = TPGroup(r, 2)
        got = load_model(folders[name], tp=tp, **CPU).model
        assert got.tp == tp and shard_model(got, tp) is got          # already sharded: a no-op
        assert_same_model(got, shard_model(load_model(folders[name], **CPU).model, tp))


def test_kv_heads_replicated_over_four_ranks(folders):
    for r in range(4):
        tp = TPGroup(r, 4)
        got = load_model(folders["tiny-llama"], tp=tp, **CPU).model
        assert got.model.layers[0].self_attn.num_kv_heads == 1
        assert_same_model(got, shard_model(load_model(folders["tiny-llama"], **CPU).model, tp))


def test_a_sharded_model_refuses_another_group(folders):
    model = load_model(folders["tiny-llama"], tp=TPGroup(0, 2), **CPU).model
    with pytest.raises(ValueError, match="already sharded for rank 0 of 2"):
        shard_model(model, TPGroup(1, 2))


class Counting:
    """`safe_open` that counts the elements each read returns, by stored tensor name."""

    def __init__(self, reads: dict[str, list[tuple[str, int]]]) -> None:
        self.reads = reads

    def __call__(self, path: str, framework: str) -> Any:
        reads = self.reads

        class Handle:
            def __init__(self) -> None:
                self.inner = safe_open(path, framework=framework)

            def __enter__(self) -> Handle:
                self.inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)

            def keys(self) -> list[str]:
                return self.inner.keys()

            def get_tensor(self, name: str) -> torch.Tensor:
                t = self.inner.get_tensor(name)
                reads.setdefault(name, []).append(("whole", t.numel()))
                return t

            def get_slice(self, name: str) -> Any:
                view = self.inner.get_slice(name)

                class View:
                    get_shape, get_dtype = view.get_shape, view.get_dtype

                    def __getitem__(self, key: Any) -> torch.Tensor:
                        t = view[key]
                        reads.setdefault(name, []).append(("slice", t.numel()))
                        return t

                return View()

        return Handle()


def counted_load(monkeypatch, folder: Path, tp: TPGroup) -> tuple[torch.nn.Module, dict[str, list[tuple[str, int]]]]:
    reads: dict[str, list[tuple[str, int]]] = {}
    monkeypatch.setattr(lazy, "safe_open", Counting(reads))

    def whole_file(*args: object, **kwargs: object) -> None:
        raise AssertionError("the whole-file reader was called")

    monkeypatch.setattr("safetensors.torch.load_file", whole_file)
    return load_model(folder, tp=tp, **CPU).model, reads


def kept(p: torch.Tensor) -> int:
    """Elements of its checkpoint tensor a parameter holds (padding and zeros read nothing)."""
    sel = source_slice(p)
    if sel is None:
        return p.numel()
    if sel.zeros:
        return 0
    return math.prod(size if i is None else int((i >= 0).sum()) for size, i in zip(p.shape, sel.index))


def sharded_on_meta(folder: Path, tp: TPGroup) -> CausalLM:
    """The model sharded on the meta device: its parameters' selections (`tp_source`)."""
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = get_model_class(config)(config)
    return shard_model(model, tp)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-jamba", "tiny-nemotron-h", "demo-hybrid"])
def test_each_rank_reads_only_its_slices(folders, monkeypatch, name):
    """Per rank: the elements read are exactly those the parameters keep (fused experts from their
    per-expert tensors, by slices too), under 0.65 of the checkpoint; tiny-llama name by name, each
    sharded parameter in one read per contiguous run of what it keeps."""
    total = sum(t.numel() for t in load_file(folders[name] / SAFE_WEIGHTS).values())
    for r in range(2):
        with monkeypatch.context() as m:
            _, reads = counted_load(m, folders[name], TPGroup(r, 2))
        meta = sharded_on_meta(folders[name], TPGroup(r, 2))
        read = sum(n for calls in reads.values() for _, n in calls)
        assert read < 0.65 * total, (r, read, total)
        skip = {"lm_head.weight"} if meta.is_tied else set()
        assert read == sum(kept(p) for k, p in meta.state_dict(keep_vars=True).items() if k not in skip), r
        if name == "tiny-llama":
            for k, p in meta.named_parameters():
                sel = source_slice(p)
                calls = reads.get(k, [])
                assert sum(n for _, n in calls) == kept(p), k
                if sel is None:
                    assert [how for how, _ in calls] == ["whole"], k
                else:
                    runs = math.prod(len(lazy.runs(i[i >= 0])) for i in sel.index if i is not None)
                    assert [how for how, _ in calls] == ["slice"] * (0 if sel.zeros else runs), k


def test_elements_read_by_a_llama_rank(folders, monkeypatch):
    """The numbers behind the report: tiny-llama, 2 ranks."""
    total = sum(t.numel() for t in load_file(folders["tiny-llama"] / SAFE_WEIGHTS).values())
    per_rank = []
    for r in range(2):
        with monkeypatch.context() as m:
            _, reads = counted_load(m, folders["tiny-llama"], TPGroup(r, 2))
        per_rank.append(sum(n for calls in reads.values() for _, n in calls))
    print(f"tiny-llama: {per_rank} elements read per rank of {total}")
    assert all(n < 0.65 * total for n in per_rank)


def test_a_checkpoint_in_two_files_loads_sharded(folders, tmp_path):
    tensors = load_file(folders["tiny-jamba"] / SAFE_WEIGHTS)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file, metadata={"format": "pt"})
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    (tmp_path / "config.json").write_text((folders["tiny-jamba"] / "config.json").read_text())
    for r in range(2):
        tp = TPGroup(r, 2)
        assert_same_model(load_model(tmp_path, tp=tp, **CPU).model,
                          shard_model(load_model(folders["tiny-jamba"], **CPU).model, tp))


def _rewrite(src: Path, dst: Path, change) -> Path:
    tensors = load_file(src / SAFE_WEIGHTS)
    change(tensors)
    dst.mkdir()
    save_file(tensors, dst / SAFE_WEIGHTS, metadata={"format": "pt"})
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _error(folder: Path, tp: TPGroup) -> str:
    with pytest.raises(CheckpointError) as err:
        load_model(folder, tp=tp, **CPU)
    return str(err.value)


def test_a_bad_checkpoint_raises_the_same_error_sharded(folders, tmp_path):
    """Missing and misshapen tensors are checked against the full shapes in the files; NaN / Inf
    only where the rank reads."""
    src = folders["tiny-llama"]
    q = "model.layers.0.self_attn.q_proj.weight"
    missing = _rewrite(src, tmp_path / "missing", lambda t: t.pop(q))
    misshapen = _rewrite(src, tmp_path / "misshapen", lambda t: t.update({q: t[q][:-1]}))
    for folder, message in ((missing, "missing tensors: " + q), (misshapen, "misshapen tensors: " + q)):
        whole = _error(folder, SINGLE)
        assert message in whole
        assert _error(folder, TPGroup(0, 2)) == _error(folder, TPGroup(1, 2)) == whole

    def nan_in_rank_1(t: dict[str, torch.Tensor]) -> None:
        t[q][-1, 0] = float("nan")                      # the last output row: rank 1's heads

    nan = _rewrite(src, tmp_path / "nan", nan_in_rank_1)
    assert f"NaN or Inf weights in {q} (1 of " in _error(nan, TPGroup(1, 2))
    load_model(nan, tp=TPGroup(0, 2), **CPU)              # rank 0 does not read that row


def test_refused_before_any_read(folders, monkeypatch):
    reads: dict[str, list[tuple[str, int]]] = {}
    monkeypatch.setattr(lazy, "safe_open", Counting(reads))
    with pytest.raises(ValueError, match=r"attention heads \(4\) must be divisible by tensor parallel size \(3\)"):
        load_model(folders["tiny-llama"], tp=TPGroup(0, 3), **CPU)
    assert not reads


def test_a_selection_through_joins_reads_the_same_entries(tmp_path):
    """torch.stack of torch.cat of stored tensors (a fused expert tensor), an unordered selection
    with padding: the entries read equal the eager tensor's, zeros where padded."""
    a, b = torch.randn(4, 6), torch.randn(3, 6)
    save_file({"a": a, "b": b}, tmp_path / "t.safetensors")
    index = (torch.tensor([1]), torch.tensor([5, 0, 1, 6, -1]), torch.tensor([2, 3]))
    eager = torch.stack([torch.cat([a, b]), torch.cat([b, a])])
    want = eager[1][[5, 0, 1, 6, 0]][:, [2, 3]].unsqueeze(0)
    want[:, -1] = 0
    with ExitStack() as stack:
        t = lazy.open_checkpoint([tmp_path / "t.safetensors"], stack)
        joined = torch.stack([torch.cat([t["a"], t["b"]]), torch.cat([t["b"], t["a"]])])
        assert joined.shape == eager.shape
        assert torch.equal(lazy.read(joined, SourceSlice(index)), want)
        assert torch.equal(lazy.read(joined, None), eager)
        assert torch.equal(lazy.read(joined, SourceSlice((None,) * 3, zeros=True)), torch.zeros_like(eager))
        with pytest.raises(TypeError, match="only torch.cat and torch.stack"):
            torch.add(t["a"], 1)
