"""TOVA, token omission via attention (Oren et al. 2024, "Transformers are Multi-State RNNs",
arXiv:2401.06104): when the cache is full, drop the token the current query attends to least.
No accumulated history: only the latest query's attention counts.

Here the policy observes the last query row of each step (a decode's query, or a prompt chunk's
last one) and scores a cached token by that row's attention to it, summed over all layers and
query heads (the paper averages over heads per layer; one keep-set for all layers here, as the
block table is shared). It runs before the step's new tokens are written, so "current" is the
query of the step just computed, which attended to every token now cached. Recent window by
default: none, as in the paper (attention keeps what it needs; the step's own new tokens are
never evicted); the sinks are kept as for every policy here.
"""
from __future__ import annotations

import torch

from kvserve.cache.eviction.policy import EvictionPolicy, ObservedRows, by_cache_index


class TOVAPolicy(EvictionPolicy):
    name = "tova"
    observes = ObservedRows(last=1)

    def __init__(self, capacity: int = 0, device: torch.device | str = "cpu"):
        super().__init__(capacity, device)
        self.latest = torch.zeros(capacity, dtype=torch.float32, device=self.device)

    @classmethod
    def default_recent(cls, room: int) -> int:
        return 0

    def observe(self, attention: torch.Tensor) -> None:
        self.latest.zero_()[: attention.shape[1]] = attention[-1]

    def compacted(self, kept: torch.Tensor) -> None:
        by_cache_index(self.latest, kept)

    def score(self, cache_len: int) -> torch.Tensor:
        return self.latest[:cache_len]
