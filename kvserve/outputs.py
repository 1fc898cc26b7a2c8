"""Results of generation, shaped like vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    token_id: int
    logprob: float
    # The most likely tokens at this position: [(token_id, logprob)], best first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RankedLogprob:
    """A prompt token's log-probability (given the tokens before it), its rank in that
    distribution (1 = most likely) and its text: vLLM's `Logprob`."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# vLLM's prompt-logprobs shape: one entry per prompt token, None for the first (nothing precedes
# it); else {token id: RankedLogprob} holding the prompt's own token first, then the top k
# (prompt_logprobs=k) by rank, the prompt token appearing once if it is among them.
PromptLogprobs = list[dict[int, RankedLogprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[Logprob] | None = None

    @property
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
