"""Perplexity, KL divergence and top-1 agreement through the real paged KV cache.

The text is cut into windows of `context_len + score_len` tokens. Each window is fed to
`LLMEngine.score` in chunks of `chunk_size` tokens, so every chunk attends to the K/V that the
earlier chunks stored in the pool, quantized or not; with chunks that do not fill a block, the
formats' partially-filled-block path (scales growing as a block fills) is exercised as in decode.
The last `score_len` next-token predictions of each window are scored:

* perplexity: exp(mean negative log-likelihood of the actual next tokens);
* KL(P_ref || P): mean over positions of the KL divergence from the reference (full-precision
  cache) next-token distribution to this configuration's;
* top-1 agreement: share of positions where both distributions have the same argmax.

The reference distributions are kept in float32 (4 * vocab bytes per scored token).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class ScoringConfig:
    num_tokens: int = 2048  # scored predictions in all
    context_len: int = 512  # tokens before the scored part of each window
    score_len: int = 512  # scored predictions per window
    chunk_size: int = 24  # tokens per forward pass (not a multiple of the block size, on purpose)

    def __post_init__(self) -> None:
        for name in ("num_tokens", "context_len", "score_len", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class FidelityResult:
    perplexity: float
    mean_kl: float  # nats per token, vs the reference; 0 for the reference itself
    top1_agreement: float  # in [0, 1]
    num_tokens: int


def make_windows(token_ids: list[int], config: ScoringConfig) -> list[list[int]]:
    """Consecutive, non-overlapping windows of context + scored tokens from the start of the text."""
    length = config.context_len + config.score_len
    count = math.ceil(config.num_tokens / config.score_len)
    if count * length > len(token_ids):
        raise ValueError(f"the text has {len(token_ids)} tokens; {count} windows of {length} tokens need "
                         f"{count * length}: use a longer text or fewer --num-tokens")
    return [token_ids[i * length:(i + 1) * length] for i in range(count)]


def window_logprobs(engine: LLMEngine, window: list[int], config: ScoringConfig) -> torch.Tensor:
    """float32 log-probabilities [score_len, vocab] of the window's scored next-token predictions."""
    logits = engine.score(window, config.chunk_size)
    scored = logits[config.context_len - 1:len(window) - 1]
    return torch.log_softmax(scored.float(), dim=-1)


class FidelityMeter:
    """Accumulates one configuration's scores window by window against stored reference log-probs."""

    def __init__(self) -> None:
        self.nll = 0.0
        self.kl = 0.0
        self.agree = 0
        self.count = 0

    def add(self, logprobs: torch.Tensor, targets: torch.Tensor, reference: torch.Tensor) -> None:
        self.nll -= logprobs.gather(1, targets[:, None]).sum().item()
        # KL(P_ref || P) = sum_v p_ref(v) (log p_ref(v) - log p(v)); kl_div takes (log P, log P_ref).
        self.kl += torch.nn.functional.kl_div(logprobs, reference, reduction="sum", log_target=True).item()
        self.agree += (logprobs.argmax(-1) == reference.argmax(-1)).sum().item()
        self.count += targets.shape[0]

    def result(self) -> FidelityResult:
        return FidelityResult(math.exp(self.nll / self.count), self.kl / self.count, self.agree / self.count,
                              self.count)


def measure_fidelity(engine: LLMEngine, windows: list[list[int]], config: ScoringConfig,
                     reference: list[torch.Tensor] | None) -> tuple[FidelityResult, list[torch.Tensor]]:
    """Score every window. With `reference=None` this engine is the reference: its log-probs are
    returned to compare the other configurations against."""
    meter = FidelityMeter()
    kept = []
    device = engine.device
    for i, window in enumerate(windows):
        logprobs = window_logprobs(engine, window, config)
        targets = torch.tensor(window[config.context_len:], device=logprobs.device)
        ref = logprobs if reference is None else reference[i].to(device)
        meter.add(logprobs, targets, ref)
        if reference is None:
            kept.append(logprobs)
    return meter.result(), kept
