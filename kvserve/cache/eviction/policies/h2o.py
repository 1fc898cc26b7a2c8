"""H2O, heavy-hitter oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", arXiv:2306.14048): a few tokens receive most of
the attention throughout generation; keep those "heavy hitters" and a window of recent tokens.

Observes every query row of every step (prompt chunks and decode steps), summed; the state is
the attention each cached token has received so far, summed over all layers and all query
heads, and that is the score. The paper keeps a set per head and layer; here a block table is
shared by all layers and heads, so a token is kept or evicted everywhere at once and its score
is the sum over all of them. Scores follow their tokens when the cache is compacted; a token
that arrived through a prefix-cache hit starts at zero. Sinks (first tokens) are always kept
too: with them H2O runs past the trained context under the same position scheme as
StreamingLLM (position = place in the cache). Recent window: half of budget - sinks.
"""
from __future__ import annotations

import torch

from kvserve.cache.eviction.policy import EvictionPolicy, ObservedRows, by_cache_index


class H2OPolicy(EvictionPolicy):
    name = "h2o"
    observes = ObservedRows(last=None, summed=True)

    def __init__(self, capacity: int = 0, device: torch.device | str = "cpu"):
        super().__init__(capacity, device)
        self.received = torch.zeros(capacity, dtype=torch.float32, device=self.device)

    def observe(self, attention: torch.Tensor) -> None:
        self.received[: attention.shape[1]] += attention[0]

    def compacted(self, kept: torch.Tensor) -> None:
        by_cache_index(self.received, kept)

    def score(self, cache_len: int) -> torch.Tensor:
        return self.received[:cache_len].float()
