"""Sampling parameters with vLLM's names, defaults and validation."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.cache.eviction.config import EvictionSpec

if TYPE_CHECKING:
    import torch

MAX_STOP_STRINGS = 64
MAX_BAD_WORDS = 1024  # each is matched against a request's output every step
# vLLM's --max-logprobs default: the most `logprobs` / `prompt_logprobs` a request may ask for.
DEFAULT_MAX_LOGPROBS = 20
# Integers handed to torch (seeds, top_k) must fit in int64.
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
# The smallest normal float32: a top_p below it is raised to it (validate).
FLOAT32_TINY = 1.1754943508222875e-38


class LogitsProcessor(Protocol):
    """Reshapes one request's next-token logits (vLLM's per-request logits processor).

    Called once per generated token with the token ids generated so far (a fresh list, prompt
    excluded) and that request's float32 logits row [vocab] (the model's vocabulary, which may be
    padded past the tokenizer's); returns the row, modified in place or a new tensor of the same
    shape. Set -inf to ban a token. Runs before penalties, min_tokens, temperature and top-k/top-p/
    min-p, so a banned token stays banned whatever the other settings (vLLM v0's order).
    A processor may set an attribute `done = True` once it will leave every later row alone: it is
    not called again, and speculative decoding may draft for its request from then on.
    """

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor: ...


def active_processors(params: "SamplingParams") -> list[LogitsProcessor]:
    """The request's logits processors that are not `done` (LogitsProcessor)."""
    return [p for p in params.logits_processors if not getattr(p, "done", False)]


@dataclass
class StructuredOutputsParams:
    """Constrain the output (vLLM's structured outputs): to a JSON schema (`json`), a regular
    expression (`regex`), one of a list of strings (`choice`), a grammar (`grammar`: Lark or GBNF
    text) or any JSON object (`json_object`). Exactly one is set. `disable_any_whitespace` (on by
    default) lets JSON carry no free whitespace, so a small model cannot pad until max_tokens.
    `starts_after_token_id`: the output is free until this token (a reasoning model's `</think>`),
    constrained after it, as vLLM enforces a grammar only once the reasoning has ended."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True
    starts_after_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [name for name, value in (("json", self.json), ("regex", self.regex), ("choice", self.choice),
                                          ("grammar", self.grammar), ("json_object", self.json_object or None))
                 if value is not None]
        if len(given) > 1:  # vLLM's texts
            raise ValueError(f"You can only use one kind of structured outputs constraint but multiple are "
                             f"specified: {', '.join(given)}.")
        if not given:
            raise ValueError("You must use one kind of structured outputs constraint but none are specified.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text).")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError("structured_outputs.regex must be a string.")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError("structured_outputs.grammar must be a string (Lark or GBNF).")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


def check_truncate_prompt_tokens(keep: object) -> None:
    """ValueError unless `keep` is None, -1 or an integer >= 1 (vLLM's text)."""
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or not (keep >= 1 or keep == -1)):
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {keep!r}")


@dataclass
class SamplingParams:
    """What to generate for one prompt. Greedy when temperature is 0.

    Defaults follow vLLM: max_tokens 16, temperature 1.0, top_p 1.0, top_k 0 (off), min_p 0.0.
    `logprobs=k` returns the chosen token's log-probability plus the k most likely, computed on
    the model's raw distribution (before penalties and temperature), like vLLM v1.
    `prompt_logprobs=k` returns every prompt token's log-probability given the tokens before it,
    plus the k most likely there (RequestOutput.prompt_logprobs); such a request recomputes its
    whole prompt (no prefix-cache hit). Both are bounded by the engine's --max-logprobs; -1 asks
    for the whole vocabulary (vLLM's), which needs --max-logprobs -1.
    `max_tokens=0` (a kvserve extension; vLLM wants at least 1) computes the prompt only, e.g. for
    its prompt logprobs, and finishes with "length" without sampling a token.
    `kv_eviction` overrides the engine's KV eviction settings for this request: a dict with any of
    policy, budget, sink_tokens, recent_tokens (or just a policy name, e.g. "none").
    `logit_bias` ({token id: bias}, OpenAI's and vLLM's): added to those tokens' logits before
    penalties, temperature and truncation (the HTTP API clamps biases to [-100, 100] as vLLM does).
    `truncate_prompt_tokens` (vLLM's): keep only the prompt's last k tokens (left truncation); -1:
    the last max-model-len.
    `allowed_token_ids` (vLLM's): sample only among these tokens. `bad_words` (vLLM's): words never
    generated, bare or after a space (kvserve/engine/token_bans.py says how they are matched).
    `logits_processors` (Python only, not an API field) run in order on this request's logits
    before any other transformation; logprobs stay those of the raw distribution. A processor
    that raises fails its request (finish reason "error"), not the batch. With n > 1 every sample
    gets its own deep copy of the list, so a processor may keep per-sequence state (define
    `__deepcopy__` to share heavy read-only parts, e.g. a compiled grammar); with n == 1 the
    objects given are used as they are.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    kv_eviction: EvictionSpec | dict[str, Any] | str | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        self.kv_eviction = EvictionSpec.parse(self.kv_eviction)
        if self.seed == -1:  # vLLM's spelling of "no seed"
            self.seed = None
        self.logits_processors = list(self.logits_processors or [])
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, (list, tuple)):
            self.bad_words = list(self.bad_words)
        if self.top_k == -1:  # vLLM's older spelling of "off"
            self.top_k = 0
        self.validate()
        if self.allowed_token_ids is not None:  # each id once: the list's length is bounded by the vocabulary
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))

    def validate(self) -> None:
        """Raise ValueError with a message naming the field for any value vLLM would refuse."""
        def finite(name: str) -> float:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return value

        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if finite("temperature") < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < finite("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_p < FLOAT32_TINY:
            # the sampler's float32 would round it to 0, which masks every token; any top_p this
            # small keeps only the most likely token, and so does the smallest normal float32
            self.top_p = FLOAT32_TINY
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0 <= finite("min_p") <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2 <= finite("presence_penalty") <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2 <= finite("frequency_penalty") <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if finite("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be at least 0 (0: the prompt only), got {self.max_tokens}.")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        # The upper bound is the engine's (--max-logprobs), checked when the request is added.
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < -1):
                raise ValueError(f"{name} must be non-negative, or -1 for the whole vocabulary, got {value!r}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}.")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings.")
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams.")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {self.logit_bias!r}.")
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool):
                    raise ValueError(f"logit_bias keys must be token ids, got {token!r}.")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                    raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {token}.")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or any(
                    not isinstance(t, int) or isinstance(t, bool) for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {self.allowed_token_ids!r:.80}")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty: it would allow no token.")
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of words (non-blank strings), got {self.bad_words!r:.80}")
        if self.bad_words is not None and len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words are allowed, got {len(self.bad_words)}.")
        if any(not callable(p) for p in self.logits_processors):
            raise ValueError("logits_processors must be callables (output_token_ids, logits) -> logits.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Any of the repetition, presence and frequency penalties set."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def for_child(self, index: int) -> "SamplingParams":
        """The parameters of the index-th of n samples: one sample each, seeds kept distinct, and
        with n > 1 a copy of the logits processors of its own (they may keep per-sequence state).
        Seeds wrap within int64, so every 64-bit seed takes any n (as vLLM's range)."""
        seed = None if self.seed is None else (self.seed + index - INT64_MIN) % 2 ** 64 + INT64_MIN
        processors = self.logits_processors
        if self.n > 1 and processors:
            try:
                processors = copy.deepcopy(processors)
            except Exception as exc:
                raise ValueError(f"n={self.n} gives each sample its own copy of logits_processors, but they "
                                 f"cannot be deep-copied ({type(exc).__name__}: {exc}).") from exc
        child = replace(self, n=1, logits_processors=processors)
        child.seed = seed  # after replace, whose __post_init__ would read a wrapped -1 as "no seed"
        return child
