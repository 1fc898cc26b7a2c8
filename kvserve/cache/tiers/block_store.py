"""The interface every tier implements: one block's bytes, keyed by its chained hash."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvserve.cache.kv_events import KVEventLog


class BlockStore(ABC):
    """A bounded store of whole KV blocks. `get` returns a 1-D uint8 tensor of the block's bytes
    or None (a miss: absent, or present but failing a check); `put` may silently drop a block
    (full, or the tier disabled itself)."""

    name: str
    events: KVEventLog | None = None  # set by attach_events: what the tier holds, for routers

    def attach_events(self, log: KVEventLog) -> None:
        """Record every later change of the tier's blocks in `log` (medium = the tier's name),
        starting from the blocks it holds now."""
        log.add_medium(self.name)
        for block_hash in self.held_hashes():
            log.stored(block_hash, medium=self.name)
        self.events = log

    def _stored(self, block_hash: bytes) -> None:
        if self.events is not None:
            self.events.stored(block_hash, medium=self.name)

    def _removed(self, block_hash: bytes) -> None:
        if self.events is not None:
            self.events.removed(block_hash, medium=self.name)

    @abstractmethod
    def held_hashes(self) -> list[bytes]:
        """The hashes of the blocks the tier holds now."""

    @abstractmethod
    def contains(self, block_hash: bytes) -> bool: ...

    @abstractmethod
    def get(self, block_hash: bytes) -> torch.Tensor | None: ...

    @abstractmethod
    def put(self, block_hash: bytes, data: torch.Tensor) -> None: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...
