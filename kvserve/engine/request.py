"""One sequence being generated, as the scheduler sees it: tokens, progress, status."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.cache.eviction.config import EvictionConfig
from kvserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token, a stop string or a completed grammar
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    def __init__(self, value: str) -> None:
        # A plain attribute, not a property: read for every sequence every step.
        self.finished = value not in ("waiting", "running")


@dataclass(eq=False)
class Request:
    """A single sequence. `n > 1` fans out into one Request per sample sharing the prompt.

    The one invariant the scheduler works with (vLLM v1's): `num_computed_tokens` catches up with
    `num_tokens`. Prefill, chunked prefill, prefix-cache hits, recompute after preemption and
    decode are all the same motion; a token is sampled whenever the two meet.

    With KV eviction (`eviction` set), `num_evicted_tokens` of the computed tokens have left the
    cache: the pool holds `num_kv_tokens` of them, and a new token's position is its index there.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # --scheduling-policy priority: lower is served first (vLLM's)
    token_ids: list[int] = field(init=False)
    _output_ids: list[int] = field(init=False, repr=False)  # token_ids after the prompt, kept as they come
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Tokens of this request found in the prefix cache when it was first scheduled.
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    error: str | None = None  # why it failed, set by the sampler when a logits processor raised
    eviction: EvictionConfig | None = None  # resolved by the engine on arrival; None: no eviction
    num_evicted_tokens: int = 0
    # With params.prompt_logprobs: prompt positions [0, this) have had the logprob of the token
    # after them computed (kept across preemption, so a recompute does not report them twice).
    prompt_logprobs_done: int = 0
    # Async scheduling: tokens sampled by a launched step whose ids have not reached the host yet
    # (not in token_ids; num_computed_tokens already counts the step that samples them).
    num_pending_tokens: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when first admitted (not reset by preemption)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt logprobs are asked for and not all computed: such a request takes no
        prefix-cache hit (a cached position would have no logits), as in vLLM."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs_done < self.num_prompt_tokens - 1
    # Structured outputs: this sequence's place in its grammar (set by the engine on arrival); the
    # sampler masks its logits and advances it with each sampled token.
    grammar: GrammarMatcher | None = None
    # params.bad_words as token sequences (engine.token_bans; tokenized by the engine on arrival)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose K/V this sequence holds in the pool (its cache length)."""
        return self.num_computed_tokens - self.num_evicted_tokens

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self._output_ids = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        p = self.params
        # Whether async scheduling must wait for its tokens before launching its next step: prompt
        # logprobs and KV eviction plan on the host, and a prefill-only request (max_tokens 0)
        # finishes when the step computing its prompt's end reports.
        self.needs_host_tokens = bool(self.eviction is not None or p.prompt_logprobs is not None or p.max_tokens == 0)

    @property
    def num_tokens(self) -> int:
        """Tokens whose ids the host knows (pending ones not counted)."""
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the scheduler counts with: the known ones and the pending ones."""
        return len(self.token_ids) + self.num_pending_tokens

    def stops_with_pending(self, max_model_len: int) -> bool:
        """True when its pending tokens certainly end it (max_tokens or the context limit), so it
        is not scheduled again: the step that receives them finishes it."""
        if not self.num_pending_tokens:
            return False
        return (self.num_output_tokens + self.num_pending_tokens >= self.max_tokens
                or (self.eviction is None and self.num_scheduled_tokens >= max_model_len))

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens: the sequence's own list, read without a copy each step (not to be changed)."""
        return self._output_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens  # resolved to a number by the engine on arrival

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._output_ids.append(token_id)

    def discard_last_tokens(self, count: int) -> None:
        """Drop the last `count` generated tokens (speculative decoding: those after a stop string)."""
        if count:
            del self.token_ids[-count:]
            del self._output_ids[-count:]

    def is_stop_token(self, token: int) -> bool:
        """Whether sampling `token` ends the request (before min_tokens the sampler masks these)."""
        return (not self.params.ignore_eos and token in self.eos_token_ids) or token in self.params.stop_token_ids

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """After a token was appended: the finishing status, if generation must stop."""
        n_out = self.num_output_tokens
        last = self.token_ids[-1]
        if self.grammar is not None and self.grammar.finished:  # the output is complete
            return RequestStatus.FINISHED_STOPPED
        if n_out >= self.params.min_tokens and self.is_stop_token(last):
            if self.params.ignore_eos or last not in self.eos_token_ids:
                self.stop_reason = last  # one of the request's stop_token_ids, not the model's end
            return RequestStatus.FINISHED_STOPPED
        # Under eviction max-model-len bounds the cache, not the sequence.
        if n_out >= self.max_tokens or (self.eviction is None and self.num_tokens >= max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None
