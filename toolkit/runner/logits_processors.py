"""The logits processors of SamplingParams that read or edit a row's vocabulary: repetition,
presence and frequency penalties (from token counts kept on the device), logit_bias,
allowed_token_ids, bad_words and min_tokens (sparse edits built on the host). vLLM's order and
meanings (vllm/v1/sample/sampler.py): allowed ids, bad words, min_tokens, logit bias, penalties;
then the sampler's temperature, min_p, top-k and top-p.

Token counts per request row (`TokenCounts`), on the device and updated with each step's kept
samples, never rebuilt from the history: a request's prompt (and, resumed after preemption, its
outputs so far) is uploaded once when the runner admits it. A verify row's logits row j also
counts the drafts before it (the tokens its position follows if they are kept), so every position
sees the counts of exactly the tokens before it: the tokens do not depend on speculation, batching,
chunking or preemption (the sampler is keyed on position)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.host import to_device


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties (and transformers' RepetitionPenaltyLogitsProcessor for the first):

        logits   float32 [L, V]
        counts   int32 [L, V]: occurrences of each token in the row's output before its position
        in_prompt bool [L, V]: the token occurs in the prompt
        repetition, presence, frequency  float32 [L] (1, 0, 0: off)

    A token of the prompt or the output gets logit / repetition when positive, else logit * repetition;
    then each output token loses presence once and frequency per occurrence. Returns a new tensor."""
    seen = in_prompt | (counts > 0)
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens whose probability is below min_p times the most likely one's get -inf (vLLM's
    min_p, transformers' MinPLogitsWarper); logits float32 [L, V] (temperature applied), min_p [L]."""
    probs = torch.softmax(logits, dim=-1)
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


class TokenCounts:
    """Per request row on the device: `in_prompt` bool [R, V] (the prompt's tokens) and `counts`
    int32 [R, V] (each token's occurrences in the output kept so far); a row is meaningful only
    while a penalized request holds it. Allocated with the runner, as vLLM's MRV2 allocates its
    penalty state (R x V x 5 bytes: 195 MB at 256 rows of a 152k vocabulary on a GPU), so that
    memory_report and warmup see it and a large batch fails at start, not at its first penalty."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device):
        self.device = device
        self.in_prompt = torch.zeros((max_num_reqs, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((max_num_reqs, vocab_size), dtype=torch.int32, device=device)
        self._pending: dict[int, tuple[Sequence[int], Sequence[int]]] = {}   # row -> (prompt, outputs)

    def add_request(self, req_idx: int, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Queue the row's tokens; uploaded (one copy for every row admitted) before its first sample."""
        self._pending[req_idx] = (prompt_ids, output_ids)

    def remove_request(self, req_idx: int) -> None:
        self._pending.pop(req_idx, None)

    def flush(self) -> None:
        """Write the queued rows: their prompt masks and output counts, from one host-to-device copy
        laid out [admitted rows | (row, prompt id) pairs | (row, output id) pairs] (host-known sizes:
        the device slices them without a sync)."""
        if not self._pending:
            return
        rows = list(self._pending)

        def pairs(kind: int) -> np.ndarray:             # [2 * n]: rows then ids
            ids = [np.asarray(self._pending[r][kind], dtype=np.int64).reshape(-1) for r in rows]
            return np.concatenate([np.repeat(np.array(rows, dtype=np.int64), [len(i) for i in ids]),
                                   *ids])

        prompt, output = pairs(0), pairs(1)
        packed = to_device(np.concatenate([np.array(rows, dtype=np.int64), prompt, output]), self.device)
        self._pending.clear()
        a, p, o = len(rows), len(prompt) // 2, len(output) // 2
        admitted = packed[:a]
        self.in_prompt[admitted] = False
        self.counts[admitted] = 0
        if p:
            self.in_prompt[packed[a:a + p], packed[a + p:a + 2 * p]] = True
        if o:
            at = a + 2 * p
            self.counts.index_put_((packed[at:at + o], packed[at + o:at + 2 * o]),
                                   torch.ones(o, dtype=torch.int32, device=self.device), accumulate=True)

    def rows(self, idx_mapping: torch.Tensor, drafts: torch.Tensor | None = None, max_drafts: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts int32 [L, V], in_prompt bool [L, V]) of the logits rows' requests (`idx_mapping`
        device int64 [L]). A step with drafts: `drafts` device int64 [L], the draft each logits row's
        sample is compared to (-1 after a row's last), `max_drafts` the most any row carries; logits
        row i then also counts the drafts of its request's rows before it (its position follows them)."""
        counts = self.counts[idx_mapping]
        if drafts is not None:
            index = torch.arange(len(idx_mapping), device=idx_mapping.device)
            for back in range(1, max_drafts + 1):        # the row `back` logits rows earlier
                src = (index - back).clamp(min=0)
                same = (index >= back) & (idx_mapping[src] == idx_mapping) & (drafts[src] >= 0)
                counts.scatter_add_(1, drafts[src].clamp(min=0)[:, None], same.to(torch.int32)[:, None])
        return counts, self.in_prompt[idx_mapping]

    def commit(self, idx_mapping: torch.Tensor, sampled: torch.Tensor, kept: torch.Tensor) -> None:
        """Count the step's kept samples: sampled int64 [L] at request rows idx_mapping [L], kept bool
        [L] (a sample thrown away: a partial prefill's, or a rejected draft's position)."""
        self.counts.index_put_((idx_mapping, sampled), kept.to(torch.int32), accumulate=True)


BAN, BIAS, ALLOW = 0, 1, 2      # kinds of a sparse edit


@dataclass
class RowEdits:
    """A request's static vocabulary edits (from its SamplingParams), kept by the sampler's row."""
    bias_ids: np.ndarray | None = None          # int64 [n]: logit_bias's tokens
    bias_values: np.ndarray | None = None       # float32 [n]
    allowed_ids: np.ndarray | None = None       # int64 [m]: allowed_token_ids
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences; the last is banned after the rest
    min_tokens_ids: tuple[int, ...] = ()        # banned at positions below min_len
    min_len: int = 0

    @property
    def empty(self) -> bool:
        return self.bias_ids is None and self.allowed_ids is None and not self.bad_words and not self.min_tokens_ids


def sparse_edits(row_edits: Sequence[RowEdits | None], positions: np.ndarray,
                 last_outputs: Callable[[int, int], Sequence[int]]) -> tuple[np.ndarray, tuple[int, int, int]] | None:
    """The host-built edits of a step's logits rows, or None when there are none: an int64 array
    [4, M] (logits row, token, kind, float32 bits of a bias) ordered bans | biases | allows, and
    the three counts (host-known: the device slices without a sync).
    `row_edits[i]`: logits row i's request's edits (None: none); `positions[i]`: the position its
    sample takes; `last_outputs(i, n)`: the last n output tokens before that position (fewer if the
    output is shorter; a verify row's drafts before it included)."""
    bans: list[tuple[int, int]] = []
    biases: list[tuple[int, int, int]] = []
    allows: list[tuple[int, int]] = []
    for i, edits in enumerate(row_edits):
        if edits is None:
            continue
        if edits.min_tokens_ids and positions[i] < edits.min_len:
            bans += [(i, t) for t in edits.min_tokens_ids]
        for word in edits.bad_words:        # vLLM's rule: its prefix must end the output so far
            if len(word) == 1 or list(last_outputs(i, len(word) - 1)) == list(word[:-1]):
                bans.append((i, word[-1]))
        if edits.bias_ids is not None:
            bits = edits.bias_values.view(np.int32).astype(np.int64)
            biases += [(i, int(t), int(b)) for t, b in zip(edits.bias_ids, bits)]
        if edits.allowed_ids is not None:
            allows += [(i, int(t)) for t in edits.allowed_ids]
    if not (bans or biases or allows):
        return None
    table = np.zeros((4, len(bans) + len(biases) + len(allows)), dtype=np.int64)
    at = 0
    for kind, entries in ((BAN, bans), (BIAS, biases), (ALLOW, allows)):
        if entries:
            block = np.array(entries, dtype=np.int64).T         # [2 or 3, n]
            table[:2, at:at + len(entries)] = block[:2]
            table[2, at:at + len(entries)] = kind
            if kind == BIAS:
                table[3, at:at + len(entries)] = block[2]
            at += len(entries)
    return table, (len(bans), len(biases), len(allows))


def apply_sparse_edits(logits: torch.Tensor, table: torch.Tensor, counts: tuple[int, int, int]) -> torch.Tensor:
    """`sparse_edits`' table (on the device) applied to logits float32 [L, V]: rows with allowed
    ids keep only those, banned tokens get -inf, biases are added. Returns a new tensor."""
    n_ban, n_bias, n_allow = counts
    out = logits.clone()
    if n_allow:
        rows, ids = table[0, n_ban + n_bias:], table[1, n_ban + n_bias:]
        allowed = torch.zeros_like(out, dtype=torch.bool)
        allowed[rows, ids] = True
        limited = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
        limited[rows] = True
        out = out.masked_fill(limited[:, None] & ~allowed, float("-inf"))
    if n_bias:
        rows, ids = table[0, n_ban:n_ban + n_bias], table[1, n_ban:n_ban + n_bias]
        values = table[3, n_ban:n_ban + n_bias].to(torch.int32).view(torch.float32)
        out.index_put_((rows, ids), values, accumulate=True)
    if n_ban:
        out.index_put_((table[0, :n_ban], table[1, :n_ban]),
                       torch.full((), float("-inf"), dtype=out.dtype, device=out.device))
    return out
