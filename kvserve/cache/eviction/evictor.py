"""When a sequence under eviction must drop tokens, how many, and which (its policy decides).

Tokens held. A sequence may hold its budget plus one block: when the tokens about to be written
would take it past `budget + block_size` (or past max-model-len), it drops a multiple of the
block size (the fewest that bring it back to the budget, or more if max-model-len requires).
Dropping whole blocks' worth at a time keeps eviction to one event per block of decoding, and
for streaming it means the window's blocks move as they are (only the sink block's tail is
refilled). The tokens of the step being computed count towards the recent window, so a prefill
chunk of n tokens keeps max(recent - n, 0) older recent tokens; a chunk is at most
budget - sinks tokens. Held tokens never exceed min(budget + block_size, max-model-len), so a
sequence holds at most ceil(budget / block_size) + 1 blocks.

Per-request state: each evicting sequence has its own policy object (policy.py), created on
first use, fed the attention the model observed for it each step (`observe`), compacted with
the cache and dropped when the request leaves.
"""
from __future__ import annotations

import torch

from kvserve.cache.eviction import POLICIES
from kvserve.cache.eviction.config import EvictionConfig
from kvserve.cache.eviction.policy import EvictionPolicy


class Evictor:
    def __init__(self, block_size: int, max_model_len: int, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self._policies: dict[str, EvictionPolicy] = {}  # request id -> its policy and state

    def limit(self, config: EvictionConfig) -> int:
        """Most tokens a sequence with this config holds at any time."""
        return min(config.budget + self.block_size, self.max_model_len)

    def prefix_hit_room(self, config: EvictionConfig) -> int:
        """Most prompt tokens a prefix hit may skip for a sequence with this config, so that it
        evicts as if it had computed them itself: its first chunk after the hit ends where an
        uncached first chunk ends (KVCacheManager.max_new_tokens), and that chunk holds every row
        its policy observes before evicting. Streaming observes nothing (a chunk less a token), a
        policy that observes the last rows needs that many in the chunk, one that sums every row
        (H2O) takes no hit."""
        observes = POLICIES[config.policy].observes
        if observes is None:
            return config.max_chunk - 1
        if observes.last is None:
            return 0
        return max(0, config.max_chunk - observes.last)

    def observed_rows(self, config: EvictionConfig, num_queries: int) -> tuple[int, int, bool] | None:
        """What the model must report for a step of `num_queries` queries of a sequence with this
        config: (first observed query row, rows reported, whether they are summed into one), or
        None when its policy observes nothing."""
        observes = POLICIES[config.policy].observes
        if observes is None:
            return None
        return (*observes.span(num_queries), observes.summed)

    def num_to_keep(self, config: EvictionConfig, cache_len: int, num_new: int) -> int | None:
        """How many of `cache_len` cached tokens to keep before `num_new` are written (None: all)."""
        total = cache_len + num_new
        if total <= self.limit(config):
            return None
        evict = max(total - self.limit(config), (total - config.budget) // self.block_size * self.block_size)
        return cache_len - evict

    def select(self, request_id: str, config: EvictionConfig, cache_len: int, num_new: int) -> list[int] | None:
        """Sorted cache indices to keep so that `num_new` more tokens fit; None if no eviction is due."""
        if num_new > config.max_chunk:
            raise ValueError(f"a step of {num_new} tokens exceeds budget - sink_tokens = {config.max_chunk}")
        keep = self.num_to_keep(config, cache_len, num_new)
        if keep is None:
            return None
        recent = min(max(config.recent_tokens - num_new, 0), keep - config.sink_tokens)
        policy = self.policy(request_id, config)
        return policy.select(policy.score(cache_len), keep, config.sink_tokens, recent)

    def policy(self, request_id: str, config: EvictionConfig | None = None) -> EvictionPolicy | None:
        """The request's policy object (created with `config` if it has none yet; None without)."""
        policy = self._policies.get(request_id)
        if policy is None and config is not None:
            policy = POLICIES[config.policy](self.limit(config), self.device)
            self._policies[request_id] = policy
        return policy

    def observe(self, request_id: str, config: EvictionConfig, attention: torch.Tensor) -> None:
        """One step's observed attention [rows, seq_len] (cache indices 0..seq_len-1)."""
        self.policy(request_id, config).observe(attention)

    def compacted(self, request_id: str, kept: list[int]) -> None:
        """The cache now holds `kept` (old cache indices) at indices 0..len(kept)-1."""
        policy = self._policies.get(request_id)
        if policy is not None:
            policy.compacted(torch.tensor(kept, dtype=torch.long, device=self.device))

    def forget(self, request_id: str) -> None:
        self._policies.pop(request_id, None)
