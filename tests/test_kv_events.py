"""Prefix-cache events (kvserve/cache/kv_events.py): the log replayed over a snapshot equals the
pool's cached hashes, a reader too far behind is told to resynchronise, and a router computes
the same hashes as the manager."""
from __future__ import annotations

from kvserve.cache.kv_cache_manager import KVCacheManager, prompt_block_hashes, root_hash
from kvserve.cache.kv_events import CLEARED, REMOVED, STORED, KVEventLog
from kvserve.engine.request import Request
from kvserve.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4, ignore_eos=True), cache_salt=salt)


def run_and_free(kv: KVCacheManager, request: Request) -> None:
    hits = kv.find_cached_prefix(request)
    assert kv.allocate(request, request.num_tokens - len(hits) * BS, hits)
    request.num_computed_tokens = request.num_tokens
    kv.free(request)


def replay(events, start: set[bytes]) -> set[bytes]:
    hashes = set(start)
    for event in events:
        if event.kind == STORED:
            hashes.add(event.block_hash)
        elif event.kind == REMOVED:
            hashes.discard(event.block_hash)
        else:
            hashes.clear()
    return hashes


def test_events_replayed_equal_the_pools_cached_hashes_through_evictions_and_a_reset():
    kv = KVCacheManager(6, BS, True, "float32")
    log = KVEventLog()
    kv.pool.attach_events(log)
    seen = []
    for i in range(5):  # 8-token prompts into 6 blocks: later ones evict earlier ones
        run_and_free(kv, req(f"r{i}", [i] * 8 + [100 + i]))
        seen.extend(log.since(seen[-1].seq if seen else 0))
        assert replay(seen, set()) == set(kv.pool.cached) == log.snapshot().block_hashes
    assert any(e.kind == REMOVED for e in seen), "the small pool must have evicted"
    first_stored = next(e for e in seen if e.kind == STORED)
    assert first_stored.parent_hash is None and first_stored.token_ids == (0, 0, 0, 0)
    second = seen[seen.index(first_stored) + 1]
    assert second.kind == STORED and second.parent_hash == first_stored.block_hash
    assert [e.seq for e in seen] == list(range(1, len(seen) + 1))
    assert kv.pool.reset_prefix_cache()
    assert log.since(seen[-1].seq)[-1].kind == CLEARED and not log.snapshot().block_hashes


def test_a_reader_behind_the_ring_resynchronises_from_the_snapshot():
    kv = KVCacheManager(64, BS, True, "float32")
    log = KVEventLog(capacity=3)
    kv.pool.attach_events(log)
    run_and_free(kv, req("a", list(range(20))))  # 5 blocks stored, only 3 kept in the ring
    assert log.since(0) is None
    snap = log.snapshot()
    assert snap.block_hashes == set(kv.pool.cached) and snap.seq == 5
    run_and_free(kv, req("b", list(range(50, 58))))
    assert replay(log.since(snap.seq), snap.block_hashes) == set(kv.pool.cached)
    assert log.since(snap.seq + 100) is None  # a number from another log (a restarted replica)


def test_router_side_hashes_equal_the_managers():
    kv = KVCacheManager(16, BS, True, "int8")
    tokens = list(range(11))
    for salt in (None, "tenant"):
        ours = prompt_block_hashes(root_hash("int8", salt), tokens, BS)
        assert ours == kv.block_hashes(req(f"x{salt}", tokens, salt))
        assert len(ours) == 2


def test_attaching_late_publishes_what_is_already_cached():
    kv = KVCacheManager(16, BS, True, "float32")
    run_and_free(kv, req("a", list(range(9))))
    log = KVEventLog()
    kv.pool.attach_events(log)
    assert log.snapshot().block_hashes == set(kv.pool.cached) and len(kv.pool.cached) == 2
