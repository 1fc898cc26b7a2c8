"""The host-memory tier: a bounded LRU of block copies in CPU memory (pinned when the pool is on
CUDA, so copies to and from the GPU run asynchronously). What overflows goes to `on_evict`
(the disk tier, when there is one)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from kvserve.cache.tiers.block_store import BlockStore


class HostTier(BlockStore):
    name = "host"

    def __init__(self, capacity_bytes: int, block_nbytes: int, pin_memory: bool = False,
                 on_evict: Callable[[bytes, torch.Tensor], None] | None = None):
        self.max_blocks = capacity_bytes // block_nbytes
        self.block_nbytes = block_nbytes
        self.pin_memory = pin_memory
        self.on_evict = on_evict
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        data = self._blocks.get(block_hash)
        if data is not None:
            self._blocks.move_to_end(block_hash)
        return data

    def discard(self, block_hash: bytes) -> None:
        if self._blocks.pop(block_hash, None) is not None:
            self._removed(block_hash)

    def put(self, block_hash: bytes, data: torch.Tensor) -> None:
        """Keep a copy of `data` (any device); the least recently used block overflows."""
        if self.max_blocks == 0:
            if self.on_evict is not None:
                self.on_evict(block_hash, data)
            return
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)
            return
        while len(self._blocks) >= self.max_blocks:
            old_hash, old = self._blocks.popitem(last=False)
            self._removed(old_hash)
            if self.on_evict is not None:
                self.on_evict(old_hash, old)
        copy = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=self.pin_memory)
        copy.copy_(data.view(-1), non_blocking=self.pin_memory)
        self._blocks[block_hash] = copy
        self._stored(block_hash)

    def held_hashes(self) -> list[bytes]:
        return list(self._blocks)

    def items(self) -> list[tuple[bytes, torch.Tensor]]:
        return list(self._blocks.items())

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.block_nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.max_blocks * self.block_nbytes
