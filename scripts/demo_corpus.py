"""The demo models' corpus: English text that every Python install ships, so retraining needs no
download. Documents are the `pydoc_data.topics` entries (the language reference's topics, ~465 KB)
and the module docstrings of the standard library (~180 KB, read with `ast`, nothing imported).
Every 10th document (in sorted order) is held out. Bytes are tokenised like `ByteTokenizer`:
bos = 1, byte b -> b + 3, eos = 2 after each document.
"""
from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

BOS, EOS, OFFSET = 1, 2, 3
HELD_OUT_EVERY = 10
_SKIP_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "__pycache__", "ensurepip",
              "turtledemo"}


def topic_documents() -> list[tuple[str, str]]:
    import pydoc_data.topics
    return [(f"topic:{k}", v) for k, v in sorted(pydoc_data.topics.topics.items())]


def docstring_documents(min_chars: int = 200) -> list[tuple[str, str]]:
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith((".", "config-")))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            try:
                with open(path, encoding="utf-8") as f:
                    doc = ast.get_docstring(ast.parse(f.read()))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            if doc and len(doc) >= min_chars:
                docs.append((f"module:{os.path.relpath(path, stdlib)}", doc))
    return docs


@dataclass
class Split:
    name: str
    documents: list[tuple[str, str]]

    def tokens(self) -> np.ndarray:
        out: list[int] = []
        for _, text in self.documents:
            out.append(BOS)
            out.extend(b + OFFSET for b in text.encode("utf-8"))
            out.append(EOS)
        return np.asarray(out, dtype=np.int64)

    @property
    def num_bytes(self) -> int:
        return sum(len(t.encode("utf-8")) for _, t in self.documents)


def build_corpus() -> dict[str, Split]:
    """train, heldout_topics, heldout_docstrings."""
    splits: dict[str, list] = {"train": [], "heldout_topics": [], "heldout_docstrings": []}
    for kind, docs in (("topics", topic_documents()), ("docstrings", docstring_documents())):
        for i, doc in enumerate(docs):
            splits[f"heldout_{kind}" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"].append(doc)
    return {k: Split(k, v) for k, v in splits.items()}


def describe(corpus: dict[str, Split]) -> dict:
    """What to record next to a checkpoint: sizes and a hash of each split."""
    import platform
    info = {"python": platform.python_version(), "held_out_every": HELD_OUT_EVERY, "splits": {}}
    for name, split in corpus.items():
        digest = hashlib.sha256(split.tokens().astype(np.int16).tobytes()).hexdigest()
        info["splits"][name] = {"documents": len(split.documents), "bytes": split.num_bytes,
                                "sha256_of_token_ids_int16": digest}
    return info
