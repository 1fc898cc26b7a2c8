"""StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
arXiv:2309.17453): keep the first few tokens, which soak up attention whatever they say (the
"attention sinks"), and a window of the most recent tokens; drop everything in between.

As a policy: nothing is observed and the score is recency, so whatever budget is left after
the sinks goes to the newest tokens. Positions are assigned by position in the cache, as the
paper prescribes (see kvserve/cache/eviction/positions.py), so the model never sees a position
beyond the budget and generation can run far past its trained context.
"""
from __future__ import annotations

import torch

from kvserve.cache.eviction.policy import EvictionPolicy


class StreamingPolicy(EvictionPolicy):
    name = "streaming"
    scored_share = False

    @classmethod
    def default_recent(cls, room: int) -> int:
        return room

    def score(self, cache_len: int) -> torch.Tensor:
        return torch.arange(cache_len, dtype=torch.float32)
