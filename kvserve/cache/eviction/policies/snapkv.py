"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You Are Looking for Before Generation",
arXiv:2404.14469): the queries at the end of a prompt (the "observation window") already attend
to what generation will need; keep the tokens they attend to most, smoothed by 1-D pooling so
that a kept token brings its neighbours, plus the window itself.

The paper compresses a prompt once, with a window of 32 queries and pooling of kernel 7, top-k
per head. Here the policy runs at every eviction event, the window being the last `WINDOW`
queries the sequence has issued (rows of prompt chunks and decode steps alike): it observes
each step's last `WINDOW` query rows one by one, keeps the latest `WINDOW` of them (their
columns permuted with the cache), and scores a token by the attention those rows pay it, summed
over rows, layers and query heads (one keep-set for all of them: the block table is shared),
then average-pooled over neighbouring cache indices. Recent window by default: `WINDOW` tokens,
the observation window the paper always keeps; the rest of the budget after the sinks is scored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.cache.eviction.policy import EvictionPolicy, ObservedRows, by_cache_index

WINDOW = 32  # observation window, in queries (the paper's setting)
KERNEL = 7  # pooling kernel over cache indices (the paper's setting)


class SnapKVPolicy(EvictionPolicy):
    name = "snapkv"
    observes = ObservedRows(last=WINDOW)

    def __init__(self, capacity: int = 0, device: torch.device | str = "cpu"):
        super().__init__(capacity, device)
        self.rows = torch.zeros(0, capacity, dtype=torch.float32, device=self.device)  # oldest first

    @classmethod
    def default_recent(cls, room: int) -> int:
        return min(WINDOW, room)

    def observe(self, attention: torch.Tensor) -> None:
        new = F.pad(attention, (0, self.capacity - attention.shape[1]))
        self.rows = torch.cat((self.rows, new))[-WINDOW:]

    def compacted(self, kept: torch.Tensor) -> None:
        by_cache_index(self.rows, kept)

    def score(self, cache_len: int) -> torch.Tensor:
        votes = self.rows[:, :cache_len].sum(dim=0)
        return F.avg_pool1d(votes[None, None], KERNEL, stride=1, padding=KERNEL // 2)[0, 0]
