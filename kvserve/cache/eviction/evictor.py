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

Per-request state: for policies that score by received attention (H2O), the attention each
cached token has received, indexed by cache index and permuted when the cache is compacted.
"""
from __future__ import annotations

import torch

from kvserve.cache.eviction import POLICIES
from kvserve.cache.eviction.config import EvictionConfig


class Evictor:
    def __init__(self, block_size: int, max_model_len: int, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.policies = {name: cls() for name, cls in POLICIES.items()}
        self._received: dict[str, torch.Tensor] = {}

    def limit(self, config: EvictionConfig) -> int:
        """Most tokens a sequence with this config holds at any time."""
        return min(config.budget + self.block_size, self.max_model_len)

    def uses_attention(self, config: EvictionConfig) -> bool:
        return self.policies[config.policy].uses_attention

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
        policy = self.policies[config.policy]
        received = self._received_vector(request_id, config)[:cache_len] if policy.uses_attention else None
        return policy.select(policy.score(cache_len, received), keep, config.sink_tokens, recent)

    # ------------------------------------------------------------------ received attention (H2O)
    def _received_vector(self, request_id: str, config: EvictionConfig) -> torch.Tensor:
        vector = self._received.get(request_id)
        if vector is None:
            vector = torch.zeros(self.limit(config), dtype=torch.float32, device=self.device)
            self._received[request_id] = vector
        return vector

    def add_received_attention(self, request_id: str, config: EvictionConfig, attention: torch.Tensor) -> None:
        """Add one step's received attention [seq_len] (cache indices 0..seq_len-1)."""
        self._received_vector(request_id, config)[: attention.shape[0]] += attention

    def received_attention(self, request_id: str) -> torch.Tensor | None:
        return self._received.get(request_id)

    def compacted(self, request_id: str, kept: list[int]) -> None:
        """The cache now holds `kept` (old cache indices) at indices 0..len(kept)-1."""
        vector = self._received.get(request_id)
        if vector is not None:
            moved = vector[torch.tensor(kept, dtype=torch.long, device=vector.device)]
            vector.zero_()[: len(kept)] = moved

    def forget(self, request_id: str) -> None:
        self._received.pop(request_id, None)
