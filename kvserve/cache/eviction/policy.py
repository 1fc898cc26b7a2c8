"""The interface of a KV eviction policy: `score` the cached tokens, `select` the ones to keep.

A sequence under eviction keeps its first `sink` tokens and its `recent` newest tokens
whatever their score; the policy's score ranks the tokens in between, and the best of them
fill the rest of the budget. Adding a policy (SnapKV, TOVA, ...) means one module with a
subclass that implements `score` (and sets `uses_attention` if it scores from the attention
each token receives), registered in `kvserve/cache/eviction/__init__.py`; the scheduler,
the block bookkeeping and the attention hooks stay as they are.
"""
from __future__ import annotations

from typing import ClassVar

import torch


class EvictionPolicy:
    name: ClassVar[str]
    # False: the policy keeps only sinks and a recent window (streaming); its recent window is
    # then budget - sinks and nothing is scored.
    scored_share: ClassVar[bool] = True
    # True: the engine accumulates, per cached token, the attention it receives (all layers,
    # all query heads, every query) and passes it to `score`.
    uses_attention: ClassVar[bool] = False

    def score(self, cache_len: int, received_attention: torch.Tensor | None) -> torch.Tensor:
        """Float scores [cache_len] of the cached tokens (by cache index); higher is kept first.
        `received_attention` [cache_len] is given when `uses_attention` is set."""
        raise NotImplementedError

    def select(self, scores: torch.Tensor, num_keep: int, sink: int, recent: int) -> list[int]:
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
