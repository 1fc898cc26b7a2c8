"""Block bookkeeping: ref-counts, the free list, and the prefix-cache index. Plain Python.

A block with ref-count 0 is free, whether or not it still holds cached data. The free list is
ordered for eviction (least recently freed first) and doubles as the prefix cache's LRU queue:
a free block that still carries a hash can be revived by a cache hit (O(1) removal from the
queue) until the pool needs it for new data, at which point its hash is dropped (an eviction).
With KV tiers (kvserve/cache/tiers) `on_evict` first receives the evicted blocks' ids and hashes,
while their contents are still intact, to copy them down.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.cache.kv_events import KVEventLog

logger = logging.getLogger("kvserve")


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    # Chained hash of the full block's tokens, set once the block is full and published.
    block_hash: bytes | None = None


# The pool tensors' block 0 is the null block: never allocated, never written, the target of
# padded block-table entries (vLLM v1's null block). Blocks handed out are 1..num_blocks.
NULL_BLOCK_ID = 0


def leading_block_ids(count: int) -> list[int]:
    """The first `count` block ids after the null block: the block table of work that runs on a
    pool no request uses yet (start-up calibration, the CUDA profiling pass)."""
    return list(range(NULL_BLOCK_ID + 1, NULL_BLOCK_ID + 1 + count))


class OutOfBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.blocks = [Block(i) for i in range(NULL_BLOCK_ID + 1, NULL_BLOCK_ID + 1 + num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, Block] = {}
        self.num_evictions = 0  # cached blocks whose contents were dropped to make room
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None
        self.events: KVEventLog | None = None  # prefix-cache events, for routers (kv_events.py)

    def attach_events(self, log: KVEventLog) -> None:
        """Record every later change of the cached hashes in `log`, starting from those cached now."""
        for block_hash in self.cached:
            log.stored(block_hash, None)
        self.events = log

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref-count > 0), vLLM's kv_cache_usage_perc."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[Block]:
        """Take `count` blocks from the head of the free queue, evicting their cached contents."""
        if count > len(self.free_queue):
            raise OutOfBlocksError(f"need {count} blocks, {len(self.free_queue)} free")
        taken, evicted = [], []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                evicted.append((block.block_id, block.block_hash))
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            taken.append(block)
        if evicted and self.on_evict is not None:
            try:
                self.on_evict(evicted)  # before anyone can write into the blocks
            except Exception:  # (a copy that could not be made: those blocks are only lost to the tiers)
                logger.warning("KV tiers: %d evicted blocks could not be copied down", len(evicted), exc_info=True)
        return taken

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def share(self, blocks: list[Block]) -> None:
        """Take one more reference on each block (prefix-cache hits); revive free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def publish(self, block: Block, block_hash: bytes, parent_hash: bytes | None = None,
                token_ids: tuple[int, ...] = ()) -> None:
        """Make a full block findable by its hash. If an identical block is already cached, the
        first one stays the canonical copy and this one simply remains private. `parent_hash` and
        `token_ids` only go into the event log."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.events is not None:
                self.events.stored(block_hash, parent_hash, token_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (vLLM's name). Only possible while no block is in use; returns
        False, changing nothing, otherwise. The server calls it after a failed step, whose
        published blocks may never have received their K/V."""
        if len(self.free_queue) != len(self.blocks):
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def unpublish(self, block: Block) -> None:
        """Make a block unfindable before its contents change (KV eviction compacts kept tokens)."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            if self.events is not None:
                self.events.removed(block.block_hash)
            block.block_hash = None

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each block, in the given order: blocks reaching zero join the
        tail of the free queue, so the ones released first are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} released more often than taken")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
