"""The interface every tier implements: one block's bytes, keyed by its chained hash."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BlockStore(ABC):
    """A bounded store of whole KV blocks. `get` returns a 1-D uint8 tensor of the block's bytes
    or None (a miss: absent, or present but failing a check); `put` may silently drop a block
    (full, or the tier disabled itself)."""

    name: str

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
