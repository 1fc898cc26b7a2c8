"""Per-request block tables on top of the block pool, with automatic prefix caching.

Prefix caching (as in vLLM v1 / SGLang's radix cache, at block granularity): a *full* block is
identified by a chained SHA-256 hash,

    hash(block i) = sha256(hash(block i-1) || token ids of block i)
    hash(block -1) = sha256(namespace || cache_salt)

so two blocks match only if every token before them matches too, under the same KV storage
layout (the namespace) and the same tenant salt. SHA-256 makes accidental collisions
practically impossible, so a hit is not re-checked token by token. Partial blocks are never
published; a published block is never written again (new tokens always go to later blocks).

KV eviction (kvserve/cache/eviction): a sequence with an eviction policy stores its keys before
RoPE, so its blocks live in their own hash namespace (they never match blocks of ordinary
sequences). Until its first eviction its cache is a true prefix and its blocks are published as
usual; `make_room` then drops tokens and compacts the table, and from then on nothing of it is
published (blocks it shared before stay valid for the others: they are never rewritten).
Its cache then holds fewer tokens than it has computed: `num_computed_tokens -
num_evicted_tokens`, which is what block counts and positions follow.

KV tiers (kvserve/cache/tiers): with a `TieredStore`, a published block the pool reclaims is
copied down first, and the prefix lookup continues past the pool's longest hit into the tiers
(`fetch_tier_prefix`); `allocate` writes the fetched blocks into fresh pool blocks and publishes
them, so the rest of the engine sees an ordinary prefix hit. Sequences under KV eviction use the
tiers as they use the pool: only the blocks they published before their first eviction (under
their own keys-before-RoPE root), and no more of a hit than admission allows without evicting.

Sliding-window attention (Mistral v0.1: every layer sees the last `window` tokens): the leading
blocks no query will attend to again go back to the pool as the sequence moves on (vLLM's
sliding-window manager), so a sequence holds about window + one step's tokens, however long.
Their block-table entries stay (the attention masks those positions; a table only grows); a
prefix hit that starts out of the window shares, or loads from the tiers, only its blocks
inside it. The blocks released stay cached, findable by their hashes, until the pool reuses them.
"""
from __future__ import annotations

import hashlib
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin from Python 3.11 on
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvserve.cache.block_pool import NULL_BLOCK_ID, Block, BlockPool
from kvserve.cache.eviction.compaction import plan_compaction
from kvserve.cache.eviction.config import EvictionConfig
from kvserve.cache.eviction.evictor import Evictor
from kvserve.cache.kv_events import KVEventLog
from kvserve.cache.tiers import TieredStore

logger = logging.getLogger("kvserve")

# Extra key of the root hash for sequences that store keys before RoPE (evicting sequences).
KEYS_BEFORE_ROPE = "keys-before-rope"
# A disk read that has not finished by then is a miss: the request goes on without those blocks.
TIER_LOAD_TIMEOUT_S = 10.0
# The table entry of a block out of a request's sliding window that it never held (a prefix hit's
# block no longer cached, or a tier block not loaded): the pool's null block, never allocated.
_NOT_HELD = Block(NULL_BLOCK_ID)


def root_hash(namespace: str, cache_salt: str | None, keys_before_rope: bool = False) -> bytes:
    """The hash every chain starts from: the pool's namespace (its KV storage layout), the tenant
    salt, and whether keys are stored before RoPE. Routers compute it with the namespace a replica
    publishes, so their hashes equal the replica's."""
    layout = KEYS_BEFORE_ROPE if keys_before_rope else ""
    return hashlib.sha256(f"{namespace}\x00{cache_salt or ''}\x00{layout}".encode()).digest()


def chain_block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """One full block's hash from its parent's hash and its tokens (int64, native byte order)."""
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


def prompt_block_hashes(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, as the manager computes them."""
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(chain_block_hash(hashes[-1] if hashes else root, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


class CachedSequence(Protocol):
    """What the manager knows of a sequence (the engine's Request is one): its id, its tokens, its
    tenant salt and eviction settings, and how much of it is in the cache. It writes only
    `num_evicted_tokens`, when it evicts for the sequence."""

    request_id: str
    token_ids: list[int]
    cache_salt: str | None
    eviction: EvictionConfig | None
    num_evicted_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_kv_tokens(self) -> int: ...


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the pool
    external_queries: int = 0  # prompt tokens not found in the pool, looked up in the tiers
    external_hits: int = 0  # of which found there
    tier_hits: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})  # tokens loaded per tier


@dataclass
class TierHit:
    """Blocks fetched from the tiers for a request: they continue its pool hit of `start` blocks."""

    start: int
    hashes: list[bytes] = field(default_factory=list)
    data: list = field(default_factory=list)  # one uint8 tensor per block
    tiers: list[str] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)


NO_TIER_HIT = TierHit(0)


@dataclass
class _TierLoad:
    """Disk reads in flight for a request: the blocks after its pool hit of `start` blocks."""

    start: int
    hashes: list[bytes]
    future: Future  # -> {hash: bytes} of the disk blocks read
    # The host-tier blocks among `hashes`, taken when the read started: the host tier may pass
    # them on to the disk meanwhile, and the hit must not stop there.
    held: dict[bytes, tuple[str, object]] = field(default_factory=dict)
    deadline: float = field(default_factory=lambda: time.monotonic() + TIER_LOAD_TIMEOUT_S)

    def result(self) -> dict:
        """The blocks read, or none once the deadline has passed (a stuck read is a miss), or when
        the read raised (logged; a miss too: the request computes those blocks)."""
        if not self.future.done() or self.future.cancelled():
            return {}
        if self.future.exception() is not None:
            logger.warning("KV disk tier: a read failed; its blocks are computed instead",
                           exc_info=self.future.exception())
            return {}
        return self.future.result()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, namespace: str = "",
                 evictor: Evictor | None = None, tiers: TieredStore | None = None, window: int | None = None):
        """`window`: the sliding window every layer attends within (None: full attention, or
        windows that differ between layers, as Gemma's interleaving; then nothing is released)."""
        self.pool = BlockPool(num_blocks)
        self.window = window
        self.tiers = tiers if enable_prefix_caching else None
        if self.tiers is not None:
            self.pool.on_evict = self.tiers.offload
        self._fetched: dict[str, TierHit] = {}  # tier blocks read for a request not yet admitted
        self._loading: dict[str, _TierLoad] = {}  # disk reads in flight, by request id
        self.evictor = evictor
        self._moves: dict[str, tuple[list[int], list[int]]] = {}  # eviction copies not yet carried out
        # The runner's move_tokens, set by the engine: a tier load into a block a compaction just
        # released first has the planned copies made (they may still read that block).
        self.carry_out_moves: Callable[[list[int], list[int]], None] | None = None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.namespace = namespace
        self.stats = PrefixCacheStats()
        self.req_blocks: dict[str, list[Block]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the same tables as block ids, kept in step
        self._req_hashes: dict[str, list[bytes]] = {}
        self._num_published: dict[str, int] = {}  # a request's leading full blocks already offered to the cache
        self._num_released: dict[str, int] = {}  # a request's leading blocks out of its sliding window, not held

    # ------------------------------------------------------------------ hashing
    def block_hashes(self, request: CachedSequence) -> list[bytes]:
        """Chained hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else self._root_hash(request)
            hashes.append(chain_block_hash(parent, request.token_ids[i * bs:(i + 1) * bs]))
        return hashes

    def _root_hash(self, request: CachedSequence) -> bytes:
        return root_hash(self.namespace, request.cache_salt, request.eviction is not None)

    # ------------------------------------------------------------------ lookup / allocate / free
    def find_cached_prefix(self, request: CachedSequence) -> list[Block]:
        """Longest run of cached blocks matching the request's tokens from the start. Capped so
        at least the last token is recomputed: its logits are needed to sample."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.block_hashes(request)[:self._max_prefix_blocks(request)]
        if not self._windowed(request):  # a run of cached blocks from the start
            hits = []
            for block_hash in hashes:
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                hits.append(block)
            return hits
        return self._windowed_prefix([self.pool.lookup(h) for h in hashes], request)

    def _windowed_prefix(self, found: list[Block | None], request: CachedSequence) -> list[Block]:
        """Sliding window: the longest hit whose blocks inside the window of its first query are
        cached (a chained hash names its whole prefix, so earlier blocks need not be; vLLM looks
        up sliding-window layers so too). Entries out of the window are placeholders, never taken."""
        run = 0  # cached blocks in a row ending at index k - 1
        best = 0
        for k, block in enumerate(found, start=1):
            run = run + 1 if block is not None else 0
            if run >= k - self.out_of_window(request, k * self.block_size):
                best = k
        gone = self.out_of_window(request, best * self.block_size)
        return [_NOT_HELD] * gone + found[gone:best]

    def _max_prefix_blocks(self, request: CachedSequence) -> int:
        """Most blocks a prefix hit (pool and tiers together) may cover: the last token is always
        computed, and under KV eviction the sequence must evict as it would have without the hit
        (Evictor.prefix_hit_room; admission needs no eviction: see max_new_tokens)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        if request.eviction is not None:
            max_blocks = min(max_blocks, self.evictor.prefix_hit_room(request.eviction) // self.block_size)
        return max_blocks

    def fetch_tier_prefix(self, request: CachedSequence, num_pool_blocks: int) -> TierHit | None:
        """The blocks right after the request's pool hit of `num_pool_blocks` that the tiers hold
        (longest run of consecutive hashes), read into memory; None while some are still being
        read from disk on the loader thread (ask again next step). Kept until the request is
        admitted or freed, so a request that waits for room reads them once: when its pool hit
        shrinks meanwhile (the pool reclaimed some of its blocks, so they just went down, into
        memory) or grows, the blocks read are reused and only the difference is looked up."""
        if self.tiers is None:
            return NO_TIER_HIT
        rid = request.request_id
        load = self._loading.get(rid)
        if load is not None:
            if not load.future.done() and time.monotonic() < load.deadline:
                return None
            del self._loading[rid]
            from_disk, fetched = load.result(), []
            for block_hash in load.hashes:
                if block_hash in load.held:
                    fetched.append(load.held[block_hash])
                elif block_hash in from_disk:
                    fetched.append(("disk", from_disk[block_hash]))
                else:
                    break
            if not fetched:  # a miss now (perhaps an I/O error): asked again next time
                return NO_TIER_HIT
            self._fetched[rid] = TierHit(load.start, load.hashes[:len(fetched)], [d for _, d in fetched],
                                         [t for t, _ in fetched])
        hit = self._fetched.get(rid)
        if hit is not None:
            hit = self._rebase(request, hit, num_pool_blocks)
            if hit is not None:
                self._fetched[rid] = hit
                return hit
        hashes = self.block_hashes(request)[num_pool_blocks:self._max_prefix_blocks(request)]
        where = self.tiers.lookup(hashes)
        hashes = hashes[:len(where)]
        if "disk" in where:
            disk = [h for h, tier in zip(hashes, where) if tier == "disk"]
            on_host = [h for h, tier in zip(hashes, where) if tier == "host"]
            held = dict(zip(on_host, self.tiers.fetch_from_memory(on_host) or ()))
            self._loading[rid] = _TierLoad(num_pool_blocks, hashes, self.tiers.read_disk_async(disk), held)
            return None
        fetched = self.tiers.fetch(hashes)
        if not fetched:
            return NO_TIER_HIT
        hit = TierHit(num_pool_blocks, hashes[:len(fetched)], [d for _, d in fetched], [t for t, _ in fetched])
        self._fetched[rid] = hit
        return hit

    def _rebase(self, request: CachedSequence, hit: TierHit, num_pool_blocks: int) -> TierHit | None:
        """`hit` made to start right after a pool hit of `num_pool_blocks`: blocks now in the pool
        dropped from its head; blocks the pool reclaimed since (between the new and the old pool
        hit: they are in the host tier or still queued for the disk) prepended from memory. None if
        that is not possible (a new lookup is needed)."""
        if num_pool_blocks >= hit.start:
            skip = num_pool_blocks - hit.start
            if skip >= hit.num_blocks:
                return None  # the pool now covers the whole hit: look again past it
            return TierHit(num_pool_blocks, hit.hashes[skip:], hit.data[skip:], hit.tiers[skip:])
        gap = self.block_hashes(request)[num_pool_blocks:hit.start]
        head = self.tiers.fetch_from_memory(gap)
        if head is None:
            return None
        return TierHit(num_pool_blocks, gap + hit.hashes, [d for _, d in head] + hit.data,
                       [t for t, _ in head] + hit.tiers)

    def wait_for_tier_loads(self, request: CachedSequence) -> bool:
        """Block until the request's disk reads finish; False if none were in flight."""
        load = self._loading.get(request.request_id)
        if load is None or load.future.done():
            return False
        try:
            load.future.result(timeout=max(0.0, load.deadline - time.monotonic()))
        except FutureTimeout:
            pass  # fetch_tier_prefix then treats it as a miss
        return True

    def out_of_window(self, request: CachedSequence, first_query: int) -> int:
        """Leading blocks no query from position `first_query` on attends to: all their positions
        are at most first_query - window (one position spare: a failed async step takes one back)."""
        if not self._windowed(request):
            return 0
        return max(0, (first_query - self.window) // self.block_size)

    def _windowed(self, request: CachedSequence) -> bool:
        return self.window is not None and request.eviction is None

    def blocks_needed(self, request: CachedSequence, num_new_tokens: int, cached: list[Block] = (),
                      num_loaded: int = 0) -> int:
        """Free blocks an allocation would consume (new blocks, tier blocks to load, cached ones to
        revive), none for blocks out of the sliding window."""
        have = len(self.req_blocks.get(request.request_id, ()))
        first_query = request.num_kv_tokens + (len(cached) + num_loaded) * self.block_size
        new = max(0, -(-(first_query + num_new_tokens) // self.block_size) - have - len(cached))
        if self.window is None:
            return new + sum(1 for b in cached if b.ref_cnt == 0)
        kept, skipped = self._window_split(self.out_of_window(request, first_query), have, len(cached), num_loaded)
        return max(0, new - skipped) + sum(1 for b in cached[kept:] if b.ref_cnt == 0)

    @staticmethod
    def _window_split(gone: int, have: int, num_cached: int, num_loaded: int) -> tuple[int, int]:
        """With `gone` leading blocks out of the window and `have` table entries already: the index
        of the first cached block to take, and how many tier blocks are out of the window (not loaded)."""
        kept = max(0, gone - have)
        return kept, min(max(0, kept - num_cached), num_loaded)

    def allocate(self, request: CachedSequence, num_new_tokens: int, cached: list[Block] = (),
                 loaded: TierHit = NO_TIER_HIT) -> bool:
        """Give the request room for `num_new_tokens` more tokens (after any cached prefix: pool
        blocks `cached`, then the tier blocks `loaded`, written into fresh blocks here), first
        letting an evicting request drop tokens (`make_room`). Returns False if the pool cannot
        supply the blocks, having changed nothing but a compaction that was due anyway."""
        if not cached and not loaded.num_blocks:
            if self._fits(request, num_new_tokens):
                return True
            if not self.make_room(request, num_new_tokens):
                return False
        rid = request.request_id
        num_loaded = loaded.num_blocks
        gone = 0  # leading blocks out of the sliding window
        if self.window is not None:
            gone = self.out_of_window(request, request.num_kv_tokens + (len(cached) + num_loaded) * self.block_size)
            self._release_out_of_window(rid, gone)  # before the count: the blocks it frees may serve this step
        if self.blocks_needed(request, num_new_tokens, cached, num_loaded) > self.pool.num_free_blocks:
            return False
        blocks = self.req_blocks.setdefault(rid, [])
        block_ids = self._req_block_ids.setdefault(rid, [])
        kept = skipped = 0  # the first cached block still in the window; tier blocks out of it
        if gone:
            kept, skipped = self._window_split(gone, len(blocks), len(cached), num_loaded)
            self._num_released[rid] = max(gone, self._num_released.get(rid, 0))
        if cached:
            self.pool.share(cached[kept:])
            blocks.extend(cached)
            block_ids.extend(b.block_id for b in cached)
        if skipped:
            blocks.extend([_NOT_HELD] * skipped)
            block_ids.extend([NULL_BLOCK_ID] * skipped)
        total_tokens = request.num_kv_tokens + (len(cached) + num_loaded) * self.block_size + num_new_tokens
        fresh = self.pool.allocate(max(0, -(-total_tokens // self.block_size) - len(blocks)))
        blocks.extend(fresh)
        block_ids.extend(b.block_id for b in fresh)
        if num_loaded > skipped:
            # The pool copied out anything it reclaimed for `fresh` already; a compaction's copies
            # planned this step may read from a block it released into `fresh`: they go first.
            if self._moves and self.carry_out_moves is not None:
                self.carry_out_moves(*self.take_moves())
            try:
                self.tiers.load([b.block_id for b in fresh[:num_loaded - skipped]], loaded.data[skipped:],
                                loaded.hashes[skipped:])
            except BaseException:
                self.free(request)  # it holds nothing again, as if never admitted
                raise
        if num_loaded:
            self._fetched.pop(rid, None)
        if self.enable_prefix_caching and request.num_evicted_tokens == 0:
            # Publish blocks that this step fills completely; their K/V are written by this step's
            # forward pass, before any later step can schedule a request that reads them.
            # Only the blocks filled since the last step (vLLM's rule: a block is offered once; one
            # whose twin is cached already stays private).
            full = total_tokens // self.block_size
            hashes = self.block_hashes(request)
            events = self.pool.events is not None
            first = self._num_published.get(rid, 0)
            self._num_published[rid] = max(first, min(full, len(blocks), len(hashes)))
            released = self._num_released.get(rid, 0) if self.window is not None else 0
            for i in range(max(first, released), min(full, len(blocks), len(hashes))):
                block, block_hash = blocks[i], hashes[i]
                if not events:
                    self.pool.publish(block, block_hash)
                elif block.block_hash is None:  # the event carries the block's parent and tokens
                    tokens = tuple(request.token_ids[i * self.block_size:(i + 1) * self.block_size])
                    self.pool.publish(block, block_hash, hashes[i - 1] if i else None, tokens)
        return True

    def _release_out_of_window(self, request_id: str, gone: int) -> None:
        """Give back the request's held blocks among its first `gone` (out of its sliding window),
        oldest first (the LRU evicts them first)."""
        released = self._num_released.get(request_id, 0)
        blocks = self.req_blocks.get(request_id, ())
        if gone > released and blocks:
            self.pool.release(blocks[released:min(gone, len(blocks))])
            self._num_released[request_id] = min(gone, len(blocks))

    def _fits(self, request: CachedSequence, num_new_tokens: int) -> bool:
        """True when the request's blocks already hold `num_new_tokens` more and no block fills up:
        nothing to allocate or publish (a decode's step, 15 times out of 16 with blocks of 16)."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is None or request.eviction is not None:
            return False
        end = request.num_kv_tokens + num_new_tokens
        return end <= len(blocks) * self.block_size and (end // self.block_size <= self._num_published.get(
            request.request_id, 0) or not self.enable_prefix_caching)

    # ------------------------------------------------------------------ eviction
    def max_new_tokens(self, request: CachedSequence, num_cached_tokens: int | None = None) -> int:
        """Most tokens the request may compute in one step: unbounded (sys.maxsize) without eviction.
        With eviction a step adds at most budget - sinks tokens (make_room evicts for them); on
        admission (`num_cached_tokens` = its prefix-cache hit) no more than fit without evicting,
        and the first chunk ends where it would without the hit (chunk boundaries decide what is
        evicted: a hit, or n > 1 samples sharing a prompt, must not change the tokens)."""
        if request.eviction is None:
            return sys.maxsize
        if num_cached_tokens is None:
            return request.eviction.max_chunk
        return min(request.eviction.max_chunk, self.evictor.limit(request.eviction)) - num_cached_tokens

    def make_room(self, request: CachedSequence, num_new_tokens: int) -> bool:
        """Called by `allocate`: if the request evicts and `num_new_tokens` more would exceed its limit,
        let its policy choose the tokens to keep and compact its blocks. Returns False, changing
        nothing, if the compaction needs a fresh block (copy-on-write) and none is free."""
        if request.eviction is None:
            return True
        cache_len = request.num_kv_tokens
        kept = self.evictor.select(request.request_id, request.eviction, cache_len, num_new_tokens)
        if kept is None:
            return True
        plan = plan_compaction(self.pool, self.req_blocks[request.request_id], kept, self.block_size)
        if plan is None:
            return False
        self.req_blocks[request.request_id] = plan.blocks
        self._req_block_ids[request.request_id] = [b.block_id for b in plan.blocks]
        src, dst = self._moves.setdefault(request.request_id, ([], []))
        src.extend(plan.src_slots)
        dst.extend(plan.dst_slots)
        request.num_evicted_tokens += cache_len - len(kept)
        self.evictor.compacted(request.request_id, kept)
        self._req_hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)  # nothing of it is published any more
        return True

    def take_moves(self) -> tuple[list[int], list[int]]:
        """Token copies (source slots, destination slots) planned since the last call; the runner
        carries them out before the next forward pass writes into the pool."""
        src, dst = [], []
        for s, d in self._moves.values():
            src.extend(s)
            dst.extend(d)
        self._moves.clear()
        return src, dst

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int, loaded: TierHit = NO_TIER_HIT) -> None:
        """Count one admitted request's lookup: `num_hit_tokens` found in the pool, then `loaded`
        from the tiers (counted only when tiers are on)."""
        self.stats.queries += num_query_tokens
        self.stats.hits += num_hit_tokens
        if self.tiers is not None:
            self.stats.external_queries += num_query_tokens - num_hit_tokens
            self.stats.external_hits += loaded.num_blocks * self.block_size
            for tier in loaded.tiers:
                self.stats.tier_hits[tier] += self.block_size

    def free(self, request: CachedSequence) -> None:
        """Release the request's blocks, tail first: the shared head of a prefix outlives its tail
        in the LRU queue. Blocks published ahead of the step that was to write them (`allocate`)
        leave the prefix cache when that step never ran: a request preempted in the step that
        scheduled it (a priority victim) would otherwise leave hashes over unwritten memory."""
        blocks = self.req_blocks.pop(request.request_id, [])
        released = self._num_released.pop(request.request_id, 0)  # out of the sliding window: gone already
        for block in blocks[max(released, request.num_kv_tokens // self.block_size):
                            self._num_published.get(request.request_id, 0)]:
            self.pool.unpublish(block)
        self._req_block_ids.pop(request.request_id, None)
        self.pool.release(list(reversed(blocks[released:])))
        self._req_hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)
        self._moves.pop(request.request_id, None)  # its blocks may be someone else's by now
        self._fetched.pop(request.request_id, None)
        load = self._loading.pop(request.request_id, None)
        if load is not None:
            load.future.cancel()  # a read not started yet is dropped; one under way finishes unused
        if self.evictor is not None:
            self.evictor.forget(request.request_id)

    def attach_events(self, log: KVEventLog) -> None:
        """Publish the prefix cache's changes in `log` (kv_events.py): the pool's, and the tiers'
        when there are tiers."""
        self.pool.attach_events(log)
        if self.tiers is not None:
            self.tiers.attach_events(log)

    def flush_tiers(self) -> int:
        """Write every published pool block and the host tier to the disk tier (at shutdown);
        returns the blocks written."""
        if self.tiers is None:
            return 0
        return self.tiers.flush([(b.block_id, h) for h, b in self.pool.cached.items()])

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.block_table(request_id))

    def held_block_ids(self, request_id: str) -> list[int]:
        """The blocks the request holds: its table without the entries out of its sliding window."""
        return self.block_table(request_id)[self._num_released.get(request_id, 0):]

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids, its own list (no copy, for the step being built; not to be changed).
        The list only grows while it is the request's: a compaction or a new allocation after the
        request was freed gives it a new list (the device block tables rely on this)."""
        return self._req_block_ids.get(request_id, [])
