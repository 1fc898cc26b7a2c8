"""Log-probabilities of given tokens under the model's raw distribution, with their ranks and the
top-k alternatives: what the sampler reports for a sampled token and what prompt logprobs
report for every prompt token (vLLM's `logprobs` and `prompt_logprobs`).

Prompt logprobs need a row per prompt token; `prompt_token_logprobs` takes them from the final
hidden states a slice of rows at a time, so a long prefill chunk never holds its whole
[tokens, vocab] float32 logits (nor their log-softmax) at once.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Logits elements per slice of prompt rows (each slice holds its float32 logits and log-softmax).
SLICE_ELEMENTS = 1 << 22


@dataclass
class TokenLogprobs:
    """Per row: the given token's logprob and rank (1 = most likely), and the top k (best first)."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def packed_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """`logits` float32 [rows, vocab], `token_ids` [rows] on the same device: row i's log-softmax
    at token_ids[i], that token's rank, and the k largest entries (k = 0: none), packed on the
    device as float64 [rows, 2 + 2k] (exact for float32 values and for token ids), so that the
    results reach the host in one copy (`unpack_token_logprobs`)."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True)
    k = min(k, logits.shape[1])
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], ranks[:, :0])
    return torch.cat((chosen.double(), ranks.double(), top_vals.double(), top_ids.double()), dim=1)


def unpack_token_logprobs(packed: np.ndarray) -> TokenLogprobs:
    k = (packed.shape[1] - 2) // 2
    return TokenLogprobs(packed[:, 0].tolist(), (packed[:, 1].astype(np.int64) + 1).tolist(),
                         packed[:, 2 + k:].astype(np.int64).tolist(), packed[:, 2:2 + k].tolist())


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> TokenLogprobs:
    """`packed_token_logprobs`, on the host."""
    return unpack_token_logprobs(packed_token_logprobs(logits, token_ids, k).cpu().numpy())


def prompt_token_logprobs(hidden: torch.Tensor, targets: list[int], k: int,
                          compute_logits: Callable[[torch.Tensor], torch.Tensor],
                          vocab_size: int) -> TokenLogprobs:
    """Row i of `hidden` (the final hidden state at some position) scores `targets[i]` (the token
    that follows it): the LM head and log-softmax run on slices of at most SLICE_ELEMENTS logits."""
    step = max(1, SLICE_ELEMENTS // vocab_size)
    target_tensor = torch.as_tensor(targets, dtype=torch.long).to(hidden.device, non_blocking=True)
    result = TokenLogprobs([], [], [], [])
    for start in range(0, len(targets), step):
        part = token_logprobs(compute_logits(hidden[start:start + step]), target_tensor[start:start + step], k)
        result.logprobs += part.logprobs
        result.ranks += part.ranks
        result.top_ids += part.top_ids
        result.top_logprobs += part.top_logprobs
    return result
