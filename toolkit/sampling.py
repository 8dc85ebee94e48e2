"""SamplingParams (validated on construction), seeds, and the sampling rule the runner's Sampler
(toolkit/runner/sampler.py) follows.

Sampling is keyed on position, as in vLLM's Model Runner V2, so no scheduling decision (batch
composition, chunk size, preemption, warmup) can change a request's tokens:

    token = argmax_v( logits[v] / T  (top-k and top-p applied)  +  gumbel(seed, position, v) )

- `position` is the index the sampled token will take in the request's sequence (its prompt
  length for the first output token).
- `gumbel(s, p, v) = -log(-log(u))` with `u = min((bits + 0.5) / 2**24, 1 - 2**-24)` (float32: the
  largest `bits` would round to u = 1, an infinite noise) and `bits` the top 24 bits of
  `hash32(s, p, v)`, a counter-based integer hash ("lowbias32", toolkit/kernels/gumbel_ref.py) chained over the seed's
  two 32-bit words, the position and the token id. It is a pure function: nothing is drawn from a
  generator, so partial-prefill rows, preempted and resumed requests and batch neighbours leave it
  untouched, and the integer part is bit-identical on every device.
- `seed` is the request's own, or for an unseeded request one derived once at arrival from the
  LLM's seed and an arrival counter (`derive_seed`) that warmup requests do not advance.
- Greedy when temperature == 0. A positive temperature below `MIN_TEMPERATURE` (1e-2) is raised to
  it (vLLM's floor), so a tiny temperature cannot overflow. top-k (0 or -1: off) and top-p (1.0: off)
  are applied as vLLM does: keep the k largest logits (ties at the k-th kept), then the smallest set
  of most likely tokens whose probability reaches top_p.
- `min_tokens`: until a request has that many output tokens, its EOS ids (unless `ignore_eos`) and
  `stop_token_ids` get logit -inf before the rule above (vLLM's min-tokens logits processor); its
  position keys it, as it keys the noise.

Logprobs (`logprobs`, `prompt_logprobs`) are of the model's raw distribution, vLLM's default
("raw_logprobs"): log_softmax of the fp32 logits before the min_tokens mask, temperature, top-k and
top-p. `n` samples of one prompt are its children: child i has the seed `seed + i` (mod 2**64, as
vLLM gives `seed + index`), so child i reproduces a lone request with that seed.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from toolkit.errors import InvalidRequestError

MIN_TEMPERATURE = 1e-2
MAX_SEED = 2**64 - 1


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops: vLLM's fields, names and meanings, validated
    when constructed (a bad value raises InvalidRequestError naming the field). The sampling rule
    is in this module's docstring; `explicit_fields` records which fields the caller passed (a
    model's generation config fills the others)."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0            # 0 or -1: off
    top_p: float = 1.0        # 1.0: off
    seed: int | None = None   # 0 .. 2**64-1; -1 or None: derived from the LLM's seed
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False   # keep a stop token's / stop string's text in `text`
    n: int = 1                                 # samples of the prompt (children sharing its prefill)
    logprobs: int | None = None                # per output token: its logprob, rank and the top k
    prompt_logprobs: int | None = None         # per prompt token (after the first): the same
    stop: list[str] | str | None = None        # stop strings, matched on the detokenized output
    min_tokens: int = 0                        # no EOS / stop id / stop string before this many tokens
    repetition_penalty: float = 1.0            # > 0; tokens of the prompt and the output: / (logit > 0) or *
    presence_penalty: float = 0.0              # [-2, 2]; subtracted once from each token the output holds
    frequency_penalty: float = 0.0             # [-2, 2]; subtracted per occurrence in the output
    min_p: float = 0.0                         # [0, 1]; drop tokens less likely than min_p x the most likely
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit
    allowed_token_ids: list[int] | None = None     # only these can be sampled
    bad_words: list[str] | None = None         # words never generated (their last token is banned after the rest)
    skip_special_tokens: bool = True           # the output text leaves special tokens out

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an int; 0 or -1 disables it")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if self.seed == -1:                   # vLLM: -1 means "no seed"
            self.seed = None
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", f"must be None, -1 or an int in [0, {MAX_SEED}]")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be a bool")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise bad("stop_token_ids", "must be a list of non-negative ints")
        self.stop_token_ids = list(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative ints")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise bad("include_stop_str_in_output", "must be a bool")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an int >= 1 (the number of samples of the prompt)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise bad(name, "must be None or an int >= 0 (how many top tokens to return beside "
                                "the chosen one; 0: the chosen token's logprob only)")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, bytes) or not hasattr(self.stop, "__iter__"):
            raise bad("stop", "must be a str or a list of non-empty strs")
        self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a str or a list of non-empty strs")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an int in [0, max_tokens={self.max_tokens}]")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0 (1.0: off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_number(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be a number in [-2, 2] (0: off)")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be a number in [0, 1] (0: off)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    is_int(t) and t >= 0 and is_number(b) for t, b in self.logit_bias.items()):
                raise bad("logit_bias", "must be a dict of token id (int >= 0) -> finite number")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if isinstance(allowed, (str, bytes, dict)) or not hasattr(allowed, "__iter__"):
                raise bad("allowed_token_ids", "must be a non-empty list of token ids (ints >= 0)")
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(is_int(t) and t >= 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be a non-empty list of token ids (ints >= 0)")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                self.bad_words = [self.bad_words]
            if isinstance(self.bad_words, (bytes, dict)) or not hasattr(self.bad_words, "__iter__"):
                raise bad("bad_words", "must be a list of non-empty strs")
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
                raise bad("bad_words", "must be a list of non-empty strs")
        if not isinstance(self.skip_special_tokens, bool):
            raise bad("skip_special_tokens", "must be a bool")

    @property
    def penalized(self) -> bool:
        """Any of repetition, presence or frequency penalty on (they read the request's tokens)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """`bad_words` as token sequences (vLLM's `_bad_words_token_ids`), set by the engine that
        queues the request (`tokenize_bad_words`: it knows the tokenizer)."""
        return getattr(self, "_bad_words_token_ids", [])

    @property
    def explicit_fields(self) -> frozenset[str]:
        """The fields the caller passed to the constructor (a generation config's defaults fill the
        others: `LLM(generation_config="auto")`); every field for an object made otherwise."""
        return getattr(self, "_explicit", frozenset(f.name for f in dataclasses.fields(self)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


_PRIVATE = ("_explicit", "_bad_words_token_ids")     # attributes set beside the fields


def _record_explicit_fields(cls: type) -> type:
    """Wrap the dataclass __init__ so that an object knows which fields its caller passed."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for private in _PRIVATE:            # SamplingParams(**vars(other)) passes them: not fields
            kwargs.pop(private, None)
        object.__setattr__(self, "_explicit", frozenset(names[:len(args)]) | frozenset(kwargs))
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


SamplingParams = _record_explicit_fields(SamplingParams)


def copy_params(params: SamplingParams, **changes) -> SamplingParams:
    """`dataclasses.replace` (validated again) that keeps which fields the caller had set (and the
    bad words' token ids)."""
    out = dataclasses.replace(params, **changes)
    object.__setattr__(out, "_explicit", params.explicit_fields | frozenset(changes))
    if params.bad_words_token_ids and "bad_words" not in changes:
        object.__setattr__(out, "_bad_words_token_ids", params.bad_words_token_ids)
    return out


def tokenize_bad_words(params: SamplingParams, encode: Callable[[str], list[int]]) -> None:
    """Set `params.bad_words_token_ids` as vLLM does: each word encoded without special tokens,
    as written (leading spaces stripped) and with one leading space when that makes a different
    first token of the same length (a word in the middle of a text). `encode(text)` adds no
    special tokens."""
    out: list[list[int]] = []
    for word in params.bad_words or []:
        plain = encode(word.lstrip())
        if plain:
            out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    object.__setattr__(params, "_bad_words_token_ids", out)


def child_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of an `n` > 1 request whose seed is `seed` (vLLM: seed + index)."""
    return (seed + index) & MAX_SEED


def check_seed(seed: object) -> None:
    """An LLM's seed: an int in [0, MAX_SEED]."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r}: must be an int in [0, {MAX_SEED}]")


def derive_seed(llm_seed: int, arrival_index: int) -> int:
    """The seed of an unseeded request: splitmix64 of (LLM seed, arrival counter), in [0, 2**64)."""
    def splitmix64(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & MAX_SEED
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MAX_SEED
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MAX_SEED
        return z ^ (z >> 31)
    return splitmix64(splitmix64(llm_seed & MAX_SEED) ^ (arrival_index & MAX_SEED))
