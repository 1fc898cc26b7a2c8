"""What the engine is doing, as plain data: the block pool's snapshot plus, per running and waiting
request, its lengths and its blocks. Ids and counts only, never prompt or output tokens: several
tenants may share a server and this view is for its operator.

`engine_state` is called by the thread that owns the engine, between steps (the server's engine
thread, on demand); everything it returns is a copy that other threads may read freely.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kvserve.cache.pool_snapshot import PoolSnapshot, snapshot_pool
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.request import Request


@dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str  # "running" or "waiting"
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache on admission
    kv_tokens: int  # tokens whose K/V the request holds in the pool now
    block_ids: list[int]  # its block table, in order
    shared_blocks: int  # of which held by other requests too (ref-count > 1)
    eviction: str | None  # KV eviction policy, None without eviction
    evicted_tokens: int
    preemptions: int


@dataclass(frozen=True)
class EngineState:
    step: int  # engine steps completed when the snapshot was taken
    block_size: int
    kv_cache_dtype: str
    pool: PoolSnapshot
    running: list[RequestView]
    waiting: list[RequestView]
    num_preemptions: int  # since start
    prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int
    tiers: dict | None = None  # KV offload tiers: bytes used and bounds, tokens loaded per tier; None: off


def _view(engine: LLMEngine, request: Request, status: str, pool: PoolSnapshot) -> RequestView:
    block_ids = engine.kv_manager.held_block_ids(request.request_id)  # not those out of a sliding window
    rows = np.asarray(block_ids, dtype=np.int64) - pool.first_block_id
    shared = int(np.count_nonzero(pool.ref_counts[rows] > 1))
    return RequestView(
        request_id=request.request_id, status=status, prompt_tokens=request.num_prompt_tokens,
        output_tokens=request.num_output_tokens, cached_tokens=request.num_cached_tokens,
        kv_tokens=request.num_kv_tokens, block_ids=block_ids, shared_blocks=shared,
        eviction=request.eviction.policy if request.eviction is not None else None,
        evicted_tokens=request.num_evicted_tokens, preemptions=request.num_preemptions)


def engine_state(engine: LLMEngine, step: int) -> EngineState:
    """Copy the pool and the scheduler's queues; call only from the thread that steps `engine`."""
    pool = snapshot_pool(engine.kv_manager.pool)
    scheduler, stats = engine.scheduler, engine.kv_manager.stats
    return EngineState(
        step=step, block_size=engine.kv_manager.block_size, kv_cache_dtype=engine.kv_format.name, pool=pool,
        running=[_view(engine, r, "running", pool) for r in scheduler.running],
        waiting=[_view(engine, r, "waiting", pool) for r in scheduler.waiting],
        num_preemptions=scheduler.num_preemptions, prefix_queries=stats.queries, prefix_hits=stats.hits,
        tiers=None if engine.tiers is None else {
            **dataclasses.asdict(engine.tiers.usage()), "external_prefix_cache_queries": stats.external_queries,
            "external_prefix_cache_hits": stats.external_hits, "tier_hits": dict(stats.tier_hits)})
