"""H2O, heavy-hitter oracle (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", arXiv:2306.14048): a few tokens receive most of
the attention throughout generation; keep those "heavy hitters" and a window of recent tokens.

Score: the attention a cached token has received so far, accumulated over every query since it
entered the cache (prompt chunks and decode steps), summed over all layers and all query heads.
The paper keeps a set per head and layer; here a block table is shared by all layers and heads
(block i of a sequence is the same physical block in every layer's pool), so a token is kept or
evicted everywhere at once and its score is the sum over all of them. Scores follow their
tokens when the cache is compacted; a token that arrived through a prefix-cache hit starts at
zero. Sinks (first tokens) are always kept too: with them H2O runs past the trained context
under the same position scheme as StreamingLLM (position = place in the cache).
"""
from __future__ import annotations

import torch

from kvserve.cache.eviction.policy import EvictionPolicy


class H2OPolicy(EvictionPolicy):
    name = "h2o"
    uses_attention = True

    def score(self, cache_len: int, received_attention: torch.Tensor | None) -> torch.Tensor:
        return received_attention[:cache_len].float()
