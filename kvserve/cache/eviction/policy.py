"""The interface of a KV eviction policy, after kvpress's "press" (a scoring function over what
the layer saw): each step the policy *observes* the attention its sequence's queries paid to the
cached tokens, folds it into a state of its own, and when tokens must go it *scores* the cached
tokens; the best of them are kept.

A policy is one object per evicting sequence (its state lives on it) and one module under
`kvserve/cache/eviction/policies/`: a subclass with a `name` found there is registered at
import (policies/__init__.py), and the engine flags, the HTTP `kv_eviction.policy` check and
`kvserve eval --long-context` follow the registry. The model stays policy-agnostic: it reports
the softmax probabilities of the query rows the policy asks for (`observes`), summed over all
layers and query heads, and nothing else.

A sequence under eviction keeps its first `sink` tokens and its `recent` newest tokens whatever
their score; the score ranks the tokens in between, and the best of them fill the rest of the
budget. One block table is shared by all layers, so a token is kept or dropped in every layer
and head at once: per-head or per-layer scores are aggregated into one per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class ObservedRows:
    """Which attention a policy observes each step: the softmax probabilities of the step's last
    `last` query rows (None: all of them), summed over layers and query heads, reported as one
    [cache_len] vector per query row, or as their sum (`summed`, a single row)."""

    last: int | None = None
    summed: bool = False

    def span(self, num_queries: int) -> tuple[int, int]:
        """(first observed query row, rows reported) for a step of `num_queries` queries."""
        first = 0 if self.last is None else max(num_queries - self.last, 0)
        return first, 1 if self.summed else num_queries - first


class EvictionPolicy:
    """One evicting sequence's policy and its state. `capacity` is the most tokens the sequence
    holds (state vectors are indexed by cache index up to it); `device` is where the model's
    observations arrive."""

    name: ClassVar[str]
    # False: the policy keeps only sinks and a recent window (streaming); its recent window is
    # then budget - sinks and nothing is scored.
    scored_share: ClassVar[bool] = True
    # The attention the model reports each step (None: none; `observe` is never called).
    observes: ClassVar[ObservedRows | None] = None

    def __init__(self, capacity: int = 0, device: torch.device | str = "cpu"):
        self.capacity = capacity
        self.device = torch.device(device)

    @classmethod
    def default_recent(cls, room: int) -> int:
        """The recent window when the request gives none; `room` is budget - sinks. Default:
        half of it (H2O's even split between heavy hitters and recent tokens, Zhang et al. 2023,
        section 5)."""
        return room // 2

    def observe(self, attention: torch.Tensor) -> None:
        """Fold one step's observed attention, float32 [rows, seq_len] as `observes` describes
        (cache indices 0..seq_len-1; seq_len counts this step's tokens), into the state."""

    def compacted(self, kept: torch.Tensor) -> None:
        """The cache now holds the `kept` old cache indices (long tensor, sorted) at 0..len-1:
        permute the state the same way."""

    def score(self, cache_len: int) -> torch.Tensor:
        """Float scores [cache_len] of the cached tokens (by cache index); higher is kept first."""
        raise NotImplementedError

    @staticmethod
    def select(scores: torch.Tensor, num_keep: int, sink: int, recent: int) -> list[int]:
        """Sorted cache indices of the `num_keep` tokens to keep: indices [0, sink), the last
        `recent`, and the highest-scoring of the rest (ties: the older token)."""
        length = scores.shape[0]
        if not 0 <= sink + recent <= num_keep <= length:
            raise ValueError(f"cannot keep {num_keep} of {length} tokens with {sink} sinks and {recent} recent")
        middle_end = length - recent
        heavy = num_keep - sink - recent
        order = torch.argsort(scores[sink:middle_end], descending=True, stable=True)[:heavy]
        chosen = (order + sink).sort().values.tolist()
        return [*range(sink), *chosen, *range(middle_end, length)]


def by_cache_index(vector: torch.Tensor, kept: torch.Tensor) -> None:
    """Compact a state tensor indexed by cache index in its last dimension, in place: kept[i]'s
    entry moves to i, the rest becomes zero (tokens not yet cached have observed nothing)."""
    moved = vector[..., kept.to(vector.device)]
    vector.zero_()[..., : kept.shape[0]] = moved
