"""Per-request block tables on top of the block pool, with automatic prefix caching.

Prefix caching (as in vLLM v1 / SGLang's radix cache, at block granularity): a *full* block is
identified by a chained SHA-256 hash,

    hash(block i) = sha256(hash(block i-1) || token ids of block i)
    hash(block -1) = sha256(namespace || cache_salt)

so two blocks match only if every token before them matches too, under the same KV storage
layout (the namespace) and the same tenant salt. SHA-256 makes accidental collisions
practically impossible, so a hit is not re-checked token by token. Partial blocks are never
published; a published block is never written again (new tokens always go to later blocks).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from kvserve.cache.block_pool import Block, BlockPool
from kvserve.engine.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, namespace: str = ""):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self.stats = PrefixCacheStats()
        self.req_blocks: dict[str, list[Block]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}

    # ------------------------------------------------------------------ hashing
    def block_hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else self._root_hash(request.cache_salt)
            tokens = np.asarray(request.token_ids[i * bs:(i + 1) * bs], dtype=np.int64)
            hashes.append(hashlib.sha256(parent + tokens.tobytes()).digest())
        return hashes

    def _root_hash(self, cache_salt: str | None) -> bytes:
        return hashlib.sha256(f"{self.namespace}\x00{cache_salt or ''}".encode()).digest()

    # ------------------------------------------------------------------ lookup / allocate / free
    def find_cached_prefix(self, request: Request) -> list[Block]:
        """Longest run of cached blocks matching the request's tokens from the start. Capped so
        at least the last token is recomputed: its logits are needed to sample."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_needed(self, request: Request, num_new_tokens: int, cached: list[Block] = ()) -> int:
        """Free blocks an allocation would consume (new blocks plus cached ones to revive)."""
        have = len(self.req_blocks.get(request.request_id, ())) + len(cached)
        total_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        new = max(0, -(-total_tokens // self.block_size) - have)
        return new + sum(1 for b in cached if b.ref_cnt == 0)

    def allocate(self, request: Request, num_new_tokens: int, cached: list[Block] = ()) -> bool:
        """Give the request room for `num_new_tokens` more tokens (after any cached prefix).
        Returns False, changing nothing, if the pool cannot supply the blocks."""
        if self.blocks_needed(request, num_new_tokens, cached) > self.pool.num_free_blocks:
            return False
        blocks = self.req_blocks.setdefault(request.request_id, [])
        self.pool.share(list(cached))
        blocks.extend(cached)
        total_tokens = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        blocks.extend(self.pool.allocate(max(0, -(-total_tokens // self.block_size) - len(blocks))))
        if self.enable_prefix_caching:
            # Publish blocks that this step fills completely; their K/V are written by this step's
            # forward pass, before any later step can schedule a request that reads them.
            full = total_tokens // self.block_size
            hashes = self.block_hashes(request)
            for block, block_hash in zip(blocks[:full], hashes[:full]):
                self.pool.publish(block, block_hash)
        return True

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first: the shared head of a prefix outlives its tail
        in the LRU queue."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.release(list(reversed(blocks)))
        self._req_hashes.pop(request.request_id, None)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]
