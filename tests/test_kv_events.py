"""Prefix-cache events (kvserve/cache/kv_events.py): the log replayed over a snapshot equals the
pool's cached hashes (and each offload tier's blocks), a reader too far behind is told to
resynchronise, and a router computes the same hashes as the manager."""
from __future__ import annotations

import random

import torch

from kvserve.cache.kv_cache_manager import KVCacheManager, prompt_block_hashes, root_hash
from kvserve.cache.kv_events import CLEARED, DISK, HOST, POOL, REMOVED, STORED, KVEventLog
from kvserve.cache.tiers import DiskTier
from kvserve.cache.tiers import disk as disk_module
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
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
    """The pool's hashes after `events` (a pool-only log), from `start`."""
    return replay_media(events, {"pool": start})["pool"]


def replay_media(events, start: dict[str, set[bytes]]) -> dict[str, set[bytes]]:
    state = {m: set(h) for m, h in start.items()}
    for event in events:
        held = state.setdefault(event.medium, set())
        if event.kind == STORED:
            held.add(event.block_hash)
        elif event.kind == REMOVED:
            held.discard(event.block_hash)
        else:
            held.clear()
    return state


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


def test_tier_moves_are_events_and_replay_to_each_tiers_real_contents(tiny_llama, tmp_path):
    """Pool evictions go down to the host tier, its overflow to disk: each move is a removed event
    in one medium and a stored one in the next, in one numbered sequence, and replaying the events
    gives exactly what the pool, the host tier and the disk directory hold."""
    block, token_bytes = 16, 512  # the tiny model in float32
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory=12 * block * token_bytes,
                                  max_model_len=128, kv_offloading_size=4 * block * token_bytes / (1 << 30),
                                  kv_offloading_disk_path=str(tmp_path / "kv")))
    try:
        log = KVEventLog()
        engine.kv_manager.attach_events(log)
        assert log.media == (POOL, HOST, DISK)
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 500) for _ in range(3 * block + 1)] for _ in range(8)]
        for i, prompt in enumerate(prompts):  # 8 x 3 blocks through a 12-block pool and a 4-block host tier
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), f"r{i}")
            while engine.has_unfinished_requests():
                engine.step()
        engine.tiers.writer.drain()
        events = log.since(0)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        state = replay_media(events, {})
        on_disk = {bytes.fromhex(p.name[:64]) for p in (tmp_path / "kv").rglob("*.kvb")}
        assert state[POOL] == set(engine.kv_manager.pool.cached)
        assert state[HOST] == set(engine.tiers.host.held_hashes()) and len(state[HOST]) == 4
        assert state[DISK] == on_disk and on_disk
        assert log.snapshot().by_medium == {m: frozenset(h) for m, h in state.items()}
        for upper, lower in ((POOL, HOST), (HOST, DISK)):  # a move: removed above, then stored below
            removed = [e for e in events if e.kind == REMOVED and e.medium == upper]
            assert any(e.block_hash == later.block_hash for e in removed for later in events
                       if later.seq > e.seq and later.kind == STORED and later.medium == lower), (upper, lower)
        # The first prompt's blocks left the pool and the host tier: they are on disk only now.
        first = engine.kv_manager.block_hashes(Request("x", prompts[0], SamplingParams(max_tokens=1)))
        assert all(h in state[DISK] and h not in state[POOL] | state[HOST] for h in first)
        # A prefix read back from the host tier goes into the pool and leaves the host's events too.
        held = set(engine.tiers.host.held_hashes())
        again = next(p for i, p in enumerate(prompts)
                     if set(engine.kv_manager.block_hashes(Request(f"y{i}", p, SamplingParams(max_tokens=1)))) & held)
        engine.add_request(again, SamplingParams(temperature=0, max_tokens=1), "again")
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.kv_manager.stats.tier_hits["host"] > 0
        state = replay_media(log.since(0), {})
        assert state[HOST] == set(engine.tiers.host.held_hashes()) != held
    finally:
        engine.close()


def test_the_disk_tiers_events_follow_its_files_through_the_size_bound_a_bad_file_and_a_restart(tmp_path):
    """A restarted server publishes the blocks already on disk; the size bound's removals, a
    damaged file and a file removed by another process are BlockRemoved events."""
    def files() -> set[bytes]:
        return {bytes.fromhex(p.name[:64]) for p in tmp_path.rglob("*.kvb")}

    tier = DiskTier(tmp_path, b"n" * 32, 10 * (disk_module.HEADER.size + 64), 64)
    tier.put(b"\xff" * 32, torch.zeros(64, dtype=torch.uint8))  # there before the server (re)started
    log = KVEventLog()
    tier.attach_events(log)
    assert log.snapshot().by_medium[DISK] == {b"\xff" * 32}
    for i in range(30):
        tier.put(bytes([i]) * 32, torch.full((64,), i, dtype=torch.uint8))
    assert log.snapshot().by_medium[DISK] == files() and len(files()) < 30
    assert any(e.kind == REMOVED and e.medium == DISK for e in log.since(0))
    victim = sorted(files())[0]
    with open(tier.path(victim), "r+b") as f:  # damaged: a miss, removed
        f.seek(disk_module.HEADER.size)
        f.write(b"\x01")
    gone = sorted(files())[1]
    tier.path(gone).unlink()  # removed by another process sharing the directory
    assert tier.get(victim) is None and tier.get(gone) is None
    assert log.snapshot().by_medium[DISK] == files() and not {victim, gone} & files()
