"""Loading by Hugging Face Hub id (`LLM("org/name")`, toolkit/models/hub.py) against a loopback Hub: a
ThreadingHTTPServer on 127.0.0.1 that answers the requests huggingface_hub's `snapshot_download` makes
(`/api/models/<repo>[/revision/<rev>]`, `/api/models/<repo>/tree/<rev>`, HEAD and GET
`/<repo>/resolve/<rev>/<file>`, errors as the Hub's `X-Error-Code` headers) and records each one.

Repos served: org/tiny (two commits of tiny-llama with different weights: `main` and the tag `v1`, plus a
pytorch_model.bin and a README that must never be fetched), org/sharded (an index, its two shards and a
decoy consolidated copy), org/gated, org/pickles (a .bin only), org/custom (a config with auto_map), org/tok
(tokenizer files only)."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import unquote, urlsplit

import huggingface_hub.constants as hf_constants
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from toolkit import LLM, SamplingParams, cli, demo, doctor
from toolkit.errors import CheckpointError, UnknownModelError, UnsupportedArchitectureError
from toolkit.models import MODEL_REGISTRY, load_model, save_hf_folder
from toolkit.models.hub import HubSource, fetch_model
from toolkit.models.loader import tokenizer_folder
from toolkit.widgets import StepInspector

SHA_A, SHA_B = hashlib.sha1(b"tiny v1").hexdigest(), hashlib.sha1(b"tiny main").hexdigest()
F32 = dict(dtype=torch.float32, device="cpu")
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=2, max_num_batched_tokens=32)
WORDS = ["<unk>", "<s>", "</s>", *"the a hybrid model mixes attention and mamba layers".split()]
PROMPT = "the hybrid model mixes"
BAD_TOKEN_REPO = "org/private"
MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


# ---- the loopback Hub ---------------------------------------------------------------------------------

@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]        # sha -> path -> content
    refs: dict[str, str]                         # branch or tag -> sha
    gated: bool = False

    def resolve(self, revision: str) -> str | None:
        return self.refs.get(revision) or (revision if revision in self.commits else None)


@dataclass
class FakeHub:
    repos: dict[str, Repo]
    log: list[tuple[str, str]] = field(default_factory=list)    # (method, path) of every request
    url: str = ""


def files_asked(entries: list[tuple[str, str]], method: str | None = None) -> list[str]:
    """The repo files asked for in these log entries (HEAD or GET on /resolve/), as repo:path."""
    hits = [(m, RESOLVE.match(path)) for m, path in entries]
    return [f"{unquote(h[1])}:{unquote(h[3])}" for m, h in hits if h and method in (None, m)]


INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
TREE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class Handler(BaseHTTPRequestHandler):
    """The Hub's answers, as huggingface_hub 2.4 reads them: JSON `sha` and `siblings`, the tree as a list
    of files, and for a file X-Repo-Commit, ETag and Content-Length (no redirect: no CDN here)."""
    server: ThreadingHTTPServer

    def log_message(self, *args) -> None:          # quiet: the test output stays readable
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        hub: FakeHub = self.server.hub
        path = urlsplit(self.path).path
        hub.log.append((self.command, path))
        if path.startswith(f"/api/models/{BAD_TOKEN_REPO}"):   # what the Hub says to a revoked token
            return self._error(401, None, "Invalid credentials in Authorization header")
        for pattern, serve in ((INFO, self._info), (TREE, self._tree), (RESOLVE, self._file)):
            hit = pattern.match(path)
            if hit:
                repo = hub.repos.get(unquote(hit[1]))
                if repo is None:
                    return self._error(404, "RepoNotFound")
                sha = repo.resolve(unquote(hit[2] or "main"))
                if sha is None:
                    return self._error(404, "RevisionNotFound")
                return serve(repo, sha, hit, body)
        self._error(404, "RepoNotFound")

    def _info(self, repo: Repo, sha: str, hit: re.Match, body: bool) -> None:
        files = repo.commits[sha]
        self._send(json.dumps({"id": unquote(hit[1]), "sha": sha, "private": False, "gated": repo.gated and "auto",
                               "siblings": [{"rfilename": p} for p in sorted(files)]}).encode(), {}, body)

    def _tree(self, repo: Repo, sha: str, hit: re.Match, body: bool) -> None:
        files = repo.commits[sha]
        listing = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                   for p, b in sorted(files.items())]
        self._send(json.dumps(listing).encode(), {}, body)

    def _file(self, repo: Repo, sha: str, hit: re.Match, body: bool) -> None:
        if repo.gated:
            return self._error(403, "GatedRepo", "Access to this model is restricted: accept the conditions")
        content = repo.commits[sha].get(unquote(hit[3]))
        if content is None:
            return self._error(404, "EntryNotFound", extra={"X-Repo-Commit": sha})
        self._send(content, {"X-Repo-Commit": sha, "ETag": f'"{hashlib.sha256(content).hexdigest()}"'}, body)

    def _send(self, content: bytes, headers: dict[str, str], body: bool) -> None:
        self.send_response(200)
        for k, v in {"Content-Length": str(len(content)), "Content-Type": "application/octet-stream",
                     **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(content)

    def _error(self, status: int, code: str | None, message: str = "", extra: dict | None = None) -> None:
        self.send_response(status)
        for k, v in {"X-Error-Code": code, "X-Error-Message": message or code, "Content-Length": "0",
                     **(extra or {})}.items():
            if v is not None:
                self.send_header(k, v)
        self.end_headers()


# ---- the models it serves -----------------------------------------------------------------------------

def _tokenizer_files(folder: Path) -> None:
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def _model_folder(root: Path, name: str, seed: int) -> Path:
    """tiny-llama with weights from `seed`, saved as transformers does, with a tokenizer and a generation config."""
    folder = save_hf_folder(load_model("tiny-llama", seed=seed, **F32), root / name)
    _tokenizer_files(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _sharded(files: dict[str, bytes], root: Path) -> dict[str, bytes]:
    """The same checkpoint as an index and two shards, plus a consolidated copy the index does not list."""
    tensors = load_file(root / "a" / "model.safetensors")
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    out = {k: v for k, v in files.items() if k != "model.safetensors"}
    for name, names in shards.items():
        save_file({k: tensors[k] for k in names}, str(root / name), metadata={"format": "pt"})
        out[name] = (root / name).read_bytes()
    out["model.safetensors.index.json"] = json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, names in shards.items() for k in names}}).encode()
    out["consolidated.safetensors"] = files["model.safetensors"]
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("hub_models")
    return SimpleNamespace(root=root, a=_model_folder(root, "a", seed=1), b=_model_folder(root, "b", seed=0))


@pytest.fixture(scope="module")
def hub(folders) -> Iterator[FakeHub]:
    """The loopback Hub, and huggingface_hub pointed at it: HF_ENDPOINT for anything that reads the
    environment, and the constants huggingface_hub computed from it at import; online (conftest sets
    HF_HUB_OFFLINE=1 and TRANSFORMERS_OFFLINE=1 before huggingface_hub is imported)."""
    a, b = _files(folders.a), _files(folders.b)
    decoys = {"pytorch_model.bin": b"not a pickle: must never be fetched", "README.md": b"# tiny"}
    config = json.loads(a["config.json"])
    repos = {
        "org/tiny": Repo({SHA_A: a | decoys, SHA_B: b | decoys}, {"main": SHA_B, "v1": SHA_A}),
        "org/sharded": Repo({SHA_A: _sharded(a, folders.root)}, {"main": SHA_A}),
        "org/gated": Repo({SHA_A: a}, {"main": SHA_A}, gated=True),
        "org/pickles": Repo({SHA_A: {"config.json": a["config.json"], **decoys}}, {"main": SHA_A}),
        "org/custom": Repo({SHA_A: a | {"config.json": json.dumps(
            config | {"auto_map": {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}).encode()}},
            {"main": SHA_A}),
        "org/tok": Repo({SHA_A: {k: v for k, v in a.items() if k.startswith("tokenizer")} | decoys}, {"main": SHA_A}),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.hub = FakeHub(repos, url=f"http://127.0.0.1:{server.server_port}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", server.hub.url)
        mp.setattr(hf_constants, "ENDPOINT", server.hub.url)
        mp.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                   server.hub.url + "/{repo_id}/resolve/{revision}/{filename}")
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        mp.delenv("TRANSFORMERS_OFFLINE", raising=False)
        yield server.hub
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def first_load(hub, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """`LLM("org/tiny")` into an empty cache, once for the module: the engine and the requests it made."""
    cache = tmp_path_factory.mktemp("hub_cache")
    start = len(hub.log)
    llm = LLM("org/tiny", download_dir=str(cache), inspect="metadata", **ENGINE)
    yield SimpleNamespace(llm=llm, cache=cache, requests=hub.log[start:])
    llm.shutdown()


def _greedy(llm: LLM) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids


def _embedding(model) -> torch.Tensor:
    return model.state_dict()["model.embed_tokens.weight"]


# ---- loading ------------------------------------------------------------------------------------------

def test_hub_id_downloads_once_and_runs_as_its_folder_then_loads_offline_with_no_request(
        hub, first_load, folders, monkeypatch):
    llm = first_load.llm
    folder = first_load.cache / "models--org--tiny" / "snapshots" / SHA_B
    assert llm.hub_source == HubSource("org/tiny", None, SHA_B, str(folder))
    gets = files_asked(first_load.requests, "GET")
    assert sorted(gets) == sorted(f"org/tiny:{f}" for f in MODEL_FILES)       # each file fetched once
    assert llm.tokenizer_dir == str(folder) and llm.init_args["revision"] is None
    with LLM(str(folders.b), inspect="off", **ENGINE) as local:
        assert _greedy(llm) == _greedy(local)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")    # read when loading; huggingface_hub's constant stays False
    before = len(hub.log)
    with LLM("org/tiny", download_dir=str(first_load.cache), inspect="off", **ENGINE) as again:
        assert len(hub.log) == before, hub.log[before:]
        assert again.hub_source.commit_sha == SHA_B
        assert torch.equal(_embedding(again.model), _embedding(llm.model))


def test_only_config_generation_tokenizer_and_safetensors_files_are_requested(hub, first_load):
    asked = {f.split(":", 1)[1] for f in files_asked(first_load.requests)}
    assert asked == MODEL_FILES                     # no pytorch_model.bin, no README.md
    assert not [p for _, p in hub.log if p.endswith((".bin", ".pt", ".pth"))]


def test_revision_pins_a_commit(hub, folders, tmp_path):
    expected = {"v1": _embedding(load_model(str(folders.a), **F32).model),
                None: _embedding(load_model(str(folders.b), **F32).model)}
    assert not torch.equal(expected["v1"], expected[None])     # the two commits differ
    for revision, sha, weights in (("v1", SHA_A, "v1"), (SHA_A, SHA_A, "v1"), (None, SHA_B, None)):
        loaded = load_model("org/tiny", revision=revision, download_dir=tmp_path, **F32)
        assert loaded.hub == HubSource("org/tiny", revision, sha, str(tmp_path / "models--org--tiny/snapshots" / sha))
        assert loaded.source == loaded.hub.folder
        assert torch.equal(_embedding(loaded.model), expected[weights]), revision
    # a commit sha is not resolved again (no /api/models/org/tiny/revision/<sha>): it cannot move
    assert not [p for _, p in hub.log if p.endswith(f"/revision/{SHA_A}")]


def test_a_sharded_repo_fetches_its_index_and_only_the_shards_it_lists(hub, folders, tmp_path):
    start = len(hub.log)
    loaded = load_model("org/sharded", download_dir=tmp_path, **F32)
    assert torch.equal(_embedding(loaded.model), _embedding(load_model(str(folders.a), **F32).model))
    asked = {f.split(":", 1)[1] for f in files_asked(hub.log[start:], "GET")}
    assert {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"} <= asked and "consolidated.safetensors" not in asked


def test_tokenizer_argument_takes_another_repos_tokenizer_files_only(hub, first_load, tmp_path):
    start = len(hub.log)
    with LLM("org/tiny", tokenizer="org/tok", download_dir=str(first_load.cache), inspect="off", **ENGINE) as llm:
        assert llm.tokenizer_dir == str(first_load.cache / "models--org--tok" / "snapshots" / SHA_A)
        assert llm.tokenizer.encode("the model") == [3, 6] and llm.init_args["tokenizer"] == "org/tok"
    asked = files_asked(hub.log[start:])     # the model is in the cache: only org/tok's tokenizer files
    assert set(asked) == {"org/tok:tokenizer.json", "org/tok:tokenizer_config.json"}
    with pytest.raises(UnknownModelError, match="a preset: presets have no tokenizer files"):
        tokenizer_folder("tiny-llama")


@pytest.mark.parametrize("name, kind", [("tiny-llama", "a preset"), ("{folder}", "a local folder")])
def test_revision_or_download_dir_with_a_preset_or_folder_is_refused(name, kind, folders):
    name = str(folders.b) if name == "{folder}" else name
    with pytest.raises(ValueError, match=f"revision='v1' given for '{re.escape(name)}', {kind}"):
        load_model(name, revision="v1", **F32)
    with pytest.raises(ValueError, match="download_dir="):
        load_model(name, download_dir="/tmp/x", **F32)


# ---- failures: one line each, naming what was tried, the cache and the way out --------------------------

def _refusal(err_type: type, name: str, cache: Path, **kw) -> str:
    with pytest.raises(err_type) as err:
        load_model(name, download_dir=cache, **kw, **F32)
    message = str(err.value)
    assert "\n" not in message and name in message, message
    return message


def test_offline_and_not_cached(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(hub.log)
    message = _refusal(UnknownModelError, "org/tiny", tmp_path)
    assert f"not cached in {tmp_path}" in message and "HF_HUB_OFFLINE is set" in message
    assert "unset HF_HUB_OFFLINE or download it once online" in message and len(hub.log) == before
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(UnknownModelError, match="local_files_only=True .*download it once online") as err:
        fetch_model("org/tiny", download_dir=tmp_path, local_files_only=True)
    assert "\n" not in str(err.value) and len(hub.log) == before


@pytest.mark.parametrize("name, revision, err_type, words", [
    ("org/nothing", None, UnknownModelError, ["neither a preset", "repository not found", "hf auth login"]),
    ("org/gated", None, UnknownModelError, ["gated repo", "accept its licence", "hf auth login", "HF_TOKEN"]),
    ("org/tiny", "no-such-branch", UnknownModelError, ["has no revision 'no-such-branch'"]),
    ("org/pickles", None, CheckpointError, ["only pickle weights (pytorch_model.bin)", "safetensors only"]),
    (BAD_TOKEN_REPO, None, UnknownModelError, ["HTTP 401", "HF_TOKEN / `hf auth login`"]),
])
def test_hub_refusals_are_one_line(hub, tmp_path, name, revision, err_type, words):
    start = len(hub.log)
    message = _refusal(err_type, name, tmp_path, revision=revision)
    assert all(w in message for w in words), message
    assert str(tmp_path) in message and (hub.url in message or err_type is not UnknownModelError)
    assert not [f for f in files_asked(hub.log[start:]) if f.endswith(".bin")]


def test_custom_code_config_is_refused_naming_the_supported_architectures(hub, tmp_path):
    message = _refusal(UnsupportedArchitectureError, "org/custom", tmp_path)
    assert "auto_map: AutoModelForCausalLM" in message and "custom code" in message
    assert all(arch in message for arch in MODEL_REGISTRY)
    folder = tmp_path / "local"      # the same refusal for a plain folder (the loader's check)
    shutil.copytree(tmp_path / "models--org--custom" / "snapshots" / SHA_A, folder)
    with pytest.raises(UnsupportedArchitectureError, match="auto_map"):
        load_model(str(folder), **F32)


def test_names_that_are_not_repo_ids_keep_the_unknown_model_error(hub):
    start = len(hub.log)
    for name in ("tiny-nothing", "/no/such/folder", "./missing", "a/b/c"):
        with pytest.raises(UnknownModelError, match="neither a preset, a shipped demo model nor an existing folder; "
                                                    "presets: "):
            load_model(name, **F32)
    assert len(hub.log) == start


# ---- where the resolved repo and commit show ------------------------------------------------------------

def test_inspector_demo_and_doctor_show_the_repo_and_commit(first_load, monkeypatch, capsys):
    llm = first_load.llm
    llm.generate(PROMPT, SamplingParams(max_tokens=1))
    ins = StepInspector(llm)
    assert repr(ins).startswith(f"StepInspector('org/tiny@{SHA_B[:7]}', ")
    assert f"StepInspector org/tiny@{SHA_B[:7]} (" in ins._repr_html_()
    assert demo.hub_line(llm.hub_source) == (f"hub   org/tiny at commit {SHA_B} (the default branch), files in "
                                             f"{llm.hub_source.folder}")
    assert f"(cache {hf_constants.HF_HUB_CACHE}, HF_HUB_OFFLINE unset" in doctor.hub_note()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE set: cache only" in doctor.hub_note()
    assert cli.main(["demo", "--model", "tiny-llama", "--revision", "v1"]) == 2
    assert "revision='v1' given for 'tiny-llama', a preset" in capsys.readouterr().err
