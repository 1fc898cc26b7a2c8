"""Results of generation, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """A token's log-probability under the raw model, its rank in that distribution (1 = most
    likely) and its text: vLLM's `Logprob`."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# vLLM's prompt-logprobs shape: one entry per prompt token, None for the first (nothing precedes
# it); else {token id: Logprob} holding the prompt's own token first, then the top k
# (prompt_logprobs=k) by rank, the prompt token appearing once if it is among them.
PromptLogprobs = list[dict[int, Logprob] | None]
# vLLM's sample-logprobs shape: one entry per generated token, {token id: Logprob} holding the
# sampled token first, then the top k (logprobs=k) by rank, the sampled token appearing once.
SampleLogprobs = list[dict[int, Logprob]]


def sampled_logprob(entry: dict[int, Logprob]) -> tuple[int, Logprob]:
    """The sampled token of a sample-logprobs entry and its Logprob: the entry's first."""
    return next(iter(entry.items()))


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens of a logprobs entry, best first. A sampled token (the entry's
    first) tied with the k-th but left out of the top k ranks as high as it: the top k win."""
    sampled, _ = sampled_logprob(entry)
    return sorted(entry.items(), key=lambda item: (item[1].rank, item[0] == sampled))[:k]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None  # with SamplingParams.logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs (raw model), when logprobs were asked (vLLM's)."""
        if self.logprobs is None:
            return None
        return sum(sampled_logprob(entry)[1].logprob for entry in self.logprobs)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    # With SamplingParams.prompt_logprobs: every prompt token's entry, once the prompt is computed.
    prompt_logprobs: PromptLogprobs | None = None
    # On the finished output: when (time.monotonic) a sequence of it was first scheduled, None if
    # it never was (aborted while waiting). What /metrics' queue and prefill times count from.
    first_scheduled_time: float | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt, vLLM's shape: `.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
