"""Hugging Face Hub ids (`LLM("org/name")`): a repo resolved to a snapshot folder in the Hub cache, as vLLM does.

Only the files the loader reads are fetched, never pickles (`*.bin`, `*.pt`, `*.pth`: unpickling runs code):
config.json, generation_config.json, the tokenizer files, and the weights: `model.safetensors`, or
`model.safetensors.index.json` and then exactly the shards its weight map lists (a repo that also ships,
say, a consolidated copy of the same weights does not cost a second download). Files land in the Hub cache
(`download_dir`, else HF_HUB_CACHE / HF_HOME) as `snapshot_download` lays them out: `.../snapshots/<commit sha>`,
so a second load reads them from there.

Offline: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) read from the environment at call time, because
huggingface_hub reads it once, at import, or `local_files_only=True`: the cache only, no request.

Every failure is one line (a `toolkit.errors` exception) naming the repo, the revision, the cache folder
and the way out; huggingface_hub's own messages span several lines and do not say what to do next.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, get_cached_repo_tree, snapshot_download
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from toolkit.errors import CheckpointError, ToolkitError, UnknownModelError

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)
CONFIG_FILES = ("config.json", "generation_config.json")
MODEL_FILES = (*CONFIG_FILES, SAFE_WEIGHTS, SAFE_INDEX, *TOKENIZER_FILES)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
SHORT_SHA = 7
# `org/name`: what the Hub accepts (word characters, '-', '.'; no '--' or '..'), so that a mistyped preset
# or a missing path ('./x', '/a/b', 'a/b/c') keeps the UnknownModelError that lists the presets
_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")


@dataclass(frozen=True)
class HubSource:
    """Where a model loaded by Hub id came from: the revision asked for (None: the default branch), the
    commit it resolved to, and its snapshot folder in the cache."""
    repo_id: str
    revision_requested: str | None
    commit_sha: str
    folder: str

    @property
    def label(self) -> str:
        """`org/name@<short sha>`, as titles show it."""
        return f"{self.repo_id}@{self.commit_sha[:SHORT_SHA]}"


def is_repo_id(name: str) -> bool:
    """Whether `name` has the `org/name` shape of a Hub repo id (checked only after presets and folders)."""
    return _REPO_ID.fullmatch(name) is not None and "--" not in name and ".." not in name


def cache_dir(download_dir: str | os.PathLike | None = None) -> str:
    """The folder snapshots go to: `download_dir`, else huggingface_hub's (HF_HUB_CACHE / HF_HOME)."""
    return str(Path(download_dir if download_dir is not None else constants.HF_HUB_CACHE).expanduser())


def offline_variable() -> str | None:
    """The variable that keeps the Hub offline now (read from os.environ at call time), else None. Also
    HF_HUB_OFFLINE when huggingface_hub was imported with it set: its client then refuses every request."""
    for var in OFFLINE_VARIABLES:
        if os.environ.get(var, "").strip().upper() in constants.ENV_VARS_TRUE_VALUES:
            return var
    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def fetch_model(repo_id: str, *, revision: str | None = None, download_dir: str | os.PathLike | None = None,
                local_files_only: bool = False) -> HubSource:
    """The snapshot of `repo_id` at `revision` with config, tokenizer and safetensors weights; the shards of a
    sharded checkpoint are fetched once its index is in, at the same commit. Raises UnknownModelError (not
    cached offline, no such repo, gated, no such revision) or CheckpointError (no safetensors weights)."""
    source = _snapshot(repo_id, revision, download_dir, local_files_only, MODEL_FILES)
    folder = Path(source.folder)
    if (folder / SAFE_INDEX).is_file():
        _snapshot(repo_id, source.commit_sha, download_dir, local_files_only, _shards(folder / SAFE_INDEX),
                  requested=revision)
    elif not (folder / SAFE_WEIGHTS).is_file():
        raise CheckpointError(_no_weights(source, download_dir))
    return source


def fetch_tokenizer(repo_id: str, *, revision: str | None = None, download_dir: str | os.PathLike | None = None,
                    local_files_only: bool = False) -> HubSource:
    """The snapshot of `repo_id` with its tokenizer files only (`LLM(tokenizer="org/name")`)."""
    return _snapshot(repo_id, revision, download_dir, local_files_only, TOKENIZER_FILES)


def _snapshot(repo_id: str, revision: str | None, download_dir: str | os.PathLike | None, local_files_only: bool,
              patterns: Iterable[str], requested: str | None = None) -> HubSource:
    """`snapshot_download` of the files named in `patterns` (exact names: nothing else matches), its
    errors made one line. `requested`: the revision the user asked for, when `revision` is its commit."""
    cache = cache_dir(download_dir)
    offline = local_files_only or offline_variable() is not None
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=list(patterns),
                                   local_files_only=offline)
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError) as err:
        raise _hub_error(err, repo_id, revision, cache, local_files_only) from err
    return HubSource(repo_id, requested if requested is not None else revision, Path(folder).name, folder)


def _at(repo_id: str, revision: str | None) -> str:
    return f"'{repo_id}'" + (f" (revision '{revision}')" if revision is not None else "")


def _hub_error(err: Exception, repo_id: str, revision: str | None, cache: str, local_files_only: bool) -> ToolkitError:
    """The one-line error for a failed snapshot_download. GatedRepoError is checked before its base class
    RepositoryNotFoundError."""
    hub, what = constants.ENDPOINT, _at(repo_id, revision)
    if isinstance(err, LocalEntryNotFoundError):
        variable = offline_variable()
        if local_files_only or variable is not None:
            mode = f"{variable} is set" if variable is not None else "local_files_only=True"
            return UnknownModelError(f"{what} is not cached in {cache} and {mode} (cache only): unset "
                                     f"{variable or 'HF_HUB_OFFLINE'} or download it once online")
        cause = type(err.__cause__).__name__ if err.__cause__ is not None else "no answer"
        return UnknownModelError(f"{what} is not cached in {cache} and {hub} could not be reached ({cause}): check "
                                 "the connection or HF_ENDPOINT, then retry")
    if isinstance(err, GatedRepoError):
        return UnknownModelError(f"{what} is a gated repo on {hub}: accept its licence at {hub}/{repo_id} and log in "
                                 f"(`hf auth login` or HF_TOKEN), then retry (cache {cache})")
    if isinstance(err, RepositoryNotFoundError):
        return UnknownModelError(f"'{repo_id}' is neither a preset, a shipped demo model, an existing folder nor a "
                                 f"model repo on {hub} (repository not found; a private repo needs `hf auth login` or "
                                 f"HF_TOKEN; cache {cache})")
    if isinstance(err, RevisionNotFoundError):
        return UnknownModelError(f"'{repo_id}' on {hub} has no revision '{revision}' (a branch, tag or commit sha): "
                                 f"check it, or leave revision unset for the default branch (cache {cache})")
    if isinstance(err, HfHubHTTPError):      # a bad token (401), a disabled repo, the Hub down, ...
        status = err.response.status_code if err.response is not None else "?"
        return UnknownModelError(f"{hub} refused {what} (HTTP {status}: {str(err).strip().splitlines()[0]}): check "
                                 f"HF_TOKEN / `hf auth login` and the connection, then retry (cache {cache})")
    return UnknownModelError(f"'{repo_id}' is not a valid Hub repo id: {str(err).splitlines()[0]}")


def _shards(index: Path) -> list[str]:
    """The shard files a safetensors index lists, each once."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{index}: unreadable safetensors index ({type(e).__name__}: {e})") from e


def _no_weights(source: HubSource, download_dir: str | os.PathLike | None) -> str:
    """Why a snapshot has no weights the loader reads, from the repo's file listing (cached by the download)."""
    cache = cache_dir(download_dir)
    try:
        listed = [f.path for f in get_cached_repo_tree(source.repo_id, revision=source.commit_sha, cache_dir=cache)]
    except CachedRepoTreeNotFoundError:
        listed = []
    pickles = sorted(p for p in listed if p.endswith(PICKLE_SUFFIXES))
    other = sorted(p for p in listed if p.endswith(".safetensors"))
    where = f"Hub repo {source.label} (cache {cache})"
    if other:
        return (f"{where} has safetensors ({', '.join(other[:5])}) but neither {SAFE_WEIGHTS} nor {SAFE_INDEX}, "
                "the layouts runnerscope reads")
    if pickles:
        return (f"{where} has only pickle weights ({', '.join(pickles[:5])}); runnerscope reads safetensors only "
                f"(never pickles): pick a revision or repo with {SAFE_WEIGHTS}")
    return f"{where} has no weights ({SAFE_WEIGHTS} or {SAFE_INDEX}); runnerscope reads safetensors only"
