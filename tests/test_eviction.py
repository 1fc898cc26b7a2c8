"""KV eviction without a model: which tokens each policy keeps, when the evictor fires, how a
block table is compacted (blocks returned, copy-on-write, hashes), the scheduler loop with
eviction (bounded blocks, no leak, preemption), prefix-cache isolation, settings validation."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.eviction import POLICIES, EvictionConfig, EvictionSpec
from kvserve.cache.eviction.compaction import plan_compaction
from kvserve.cache.eviction.config import resolve_eviction
from kvserve.cache.eviction.evictor import Evictor
from kvserve.cache.eviction.policies.h2o import H2OPolicy
from kvserve.cache.eviction.policies.streaming import StreamingPolicy
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.sampling_params import SamplingParams

BS = 4


def streaming(budget: int = 16, sinks: int = 2) -> EvictionConfig:
    return EvictionConfig("streaming", budget, sinks, budget - sinks)


def h2o(budget: int = 16, sinks: int = 2, recent: int = 4) -> EvictionConfig:
    return EvictionConfig("h2o", budget, sinks, recent)


# ---------------------------------------------------------------------------- policies
def test_streaming_keeps_sinks_and_the_newest_tokens():
    scores = StreamingPolicy().score(40)
    assert StreamingPolicy().select(scores, 24, sink=4, recent=10) == [0, 1, 2, 3, *range(20, 40)]


def test_h2o_evicts_the_lowest_scores_outside_sinks_and_recent_window():
    received = torch.tensor([0.0, 0.0, 5.0, 0.1, 9.0, 0.2, 7.0, 0.3, 0.0, 0.0])
    h2o_policy = H2OPolicy(10)
    h2o_policy.observe(received[None])
    scores = h2o_policy.score(10)
    # sinks 0-1 and recent 8-9 stay although they scored nothing; of 2..7 the best three stay.
    assert H2OPolicy().select(scores, 7, sink=2, recent=2) == [0, 1, 2, 4, 6, 8, 9]
    # Ties go to the older token.
    assert H2OPolicy().select(torch.zeros(6), 3, sink=0, recent=1) == [0, 1, 5]


def test_select_refuses_impossible_requests():
    with pytest.raises(ValueError):
        StreamingPolicy().select(torch.arange(10.0), 3, sink=2, recent=2)


# ---------------------------------------------------------------------------- evictor
def test_evictor_fires_past_budget_plus_one_block_and_drops_whole_blocks():
    ev = Evictor(BS, max_model_len=1000)
    cfg = streaming(budget=16)
    assert ev.limit(cfg) == 20
    assert ev.num_to_keep(cfg, 19, 1) is None  # 20 tokens: budget + one block is allowed
    assert ev.num_to_keep(cfg, 20, 1) == 16  # 21 -> drop 4 (one block's worth) -> 17 held
    assert ev.num_to_keep(cfg, 18, 8) == 10  # a chunk: 26 -> drop 8 -> 18 held
    # Near max-model-len the limit is the model's, and as many tokens go as needed.
    tight = Evictor(BS, max_model_len=17)
    assert tight.limit(cfg) == 17 and tight.num_to_keep(cfg, 17, 1) == 16


def test_evictor_counts_the_new_chunk_in_the_recent_window():
    ev = Evictor(BS, max_model_len=1000)
    cfg = h2o(budget=16, sinks=2, recent=6)
    kept = ev.select("r", cfg, 20, 4)  # keep 12: 2 sinks, 6 - 4 = 2 recent, 8 scored
    assert len(kept) == 12 and kept[:2] == [0, 1] and kept[-2:] == [18, 19]
    with pytest.raises(ValueError):
        ev.select("r", cfg, 10, cfg.max_chunk + 1)


def test_received_attention_follows_compaction():
    ev = Evictor(BS, max_model_len=1000)
    cfg = h2o()
    ev.observe("r", cfg, torch.arange(8.0)[None])
    ev.observe("r", cfg, torch.ones(1, 4))
    ev.compacted("r", [0, 2, 5])
    assert ev.policy("r").received[:4].tolist() == [1.0, 3.0, 5.0, 0.0]
    ev.forget("r")
    assert ev.policy("r") is None


# ---------------------------------------------------------------------------- compaction
def table(pool: BlockPool, count: int):
    return pool.allocate(count)


def test_streaming_compaction_refills_the_sink_block_and_frees_one():
    pool = BlockPool(16)
    blocks = table(pool, 5)  # 20 tokens
    kept = [0, 1, *range(6, 20)]  # 2 sinks, 4 tokens dropped
    plan = plan_compaction(pool, blocks, kept, BS)
    assert [b.block_id for b in plan.blocks] == [blocks[0].block_id, *[b.block_id for b in blocks[2:]]]
    # Only the sink block's tail is copied: old indices 6, 7 (block 1, offsets 2-3) -> offsets 2-3.
    assert plan.src_slots == [blocks[1].block_id * BS + 2, blocks[1].block_id * BS + 3]
    assert plan.dst_slots == [blocks[0].block_id * BS + 2, blocks[0].block_id * BS + 3]
    assert blocks[1].ref_cnt == 0 and pool.num_free_blocks == 12


def test_window_without_sinks_moves_nothing():
    pool = BlockPool(16)
    blocks = table(pool, 5)
    plan = plan_compaction(pool, blocks, list(range(8, 20)), BS)
    assert plan.src_slots == [] and plan.blocks == blocks[2:]
    assert pool.num_free_blocks == 13


def test_scattered_eviction_compacts_into_the_first_blocks():
    pool = BlockPool(16)
    blocks = table(pool, 5)
    kept = [0, 1, 3, 6, 7, 9, 12, 13, 15, 18, 19]  # 11 tokens -> 3 blocks
    plan = plan_compaction(pool, blocks, kept, BS)
    assert len(plan.blocks) == 3 and pool.num_free_blocks == 13
    slot = {j: plan.blocks[j // BS].block_id * BS + j % BS for j in range(len(kept))}
    moved = dict(zip(plan.dst_slots, plan.src_slots))
    for j, old in enumerate(kept):
        source = blocks[old // BS].block_id * BS + old % BS
        assert moved.get(slot[j], slot[j]) == source, f"new index {j} must hold old index {old}"


def test_shared_blocks_are_never_written():
    pool = BlockPool(16)
    blocks = table(pool, 5)
    pool.share([blocks[0]])  # e.g. a prefix-cache hit of another sequence
    plan = plan_compaction(pool, blocks, [0, 1, *range(6, 20)], BS)
    first = plan.blocks[0]
    assert first is not blocks[0], "the shared sink block must be copied, not rewritten"
    assert blocks[0].ref_cnt == 1  # still the other sequence's
    written = {slot // BS for slot in plan.dst_slots}
    assert written == {first.block_id}
    assert sorted(plan.dst_slots) == [first.block_id * BS + i for i in range(BS)]


def test_partly_filled_shared_block_is_not_reused_as_the_tail():
    pool = BlockPool(16)
    blocks = table(pool, 3)
    pool.share([blocks[1]])
    plan = plan_compaction(pool, blocks, [4, 5], BS)  # tail of a shared block: new tokens follow
    assert plan.blocks[0] is not blocks[1] and len(plan.dst_slots) == 2


def test_rewritten_blocks_lose_their_hash_released_ones_keep_it():
    pool = BlockPool(16)
    blocks = table(pool, 5)
    for i, block in enumerate(blocks):
        pool.publish(block, bytes([i]))
    plan_compaction(pool, blocks, [0, 1, *range(6, 20)], BS)
    assert blocks[0].block_hash is None and pool.lookup(bytes([0])) is None  # sink block rewritten
    assert pool.lookup(bytes([1])) is blocks[1]  # freed untouched: still a valid cached block
    assert pool.lookup(bytes([2])) is blocks[2]  # taken over as it is


def test_compaction_without_a_free_block_changes_nothing():
    pool = BlockPool(5)
    blocks = table(pool, 5)
    pool.share(blocks)  # every block shared: the rewritten one needs a fresh block
    assert plan_compaction(pool, blocks, [0, 1, *range(6, 20)], BS) is None
    assert all(b.ref_cnt == 2 for b in blocks) and pool.num_free_blocks == 0


# ---------------------------------------------------------------------------- scheduler + manager
def evicting_request(rid: str, prompt_len: int, max_tokens: int, config: EvictionConfig, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eviction=config)


def make_scheduler(num_blocks: int, budget: int = 64, max_model_len: int = 64, prefix_caching: bool = False,
                   namespace: str = "x") -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, prefix_caching, namespace, evictor=Evictor(BS, max_model_len))
    return Scheduler(SchedulerConfig(16, budget, max_model_len), kv)


def drive(sched: Scheduler, watch: list[Request], max_steps: int = 10_000) -> int:
    """Run the scheduler like the engine (without a model); returns the most blocks any watched
    request held after a step's allocation."""
    most = 0
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return most
        scheduled = sched.schedule()
        assert scheduled, "no progress"
        sched.kv.take_moves()
        for r in watch:
            most = max(most, len(sched.kv.block_ids(r.request_id)))
            if r.status == RequestStatus.RUNNING:
                assert len(sched.kv.block_ids(r.request_id)) == math.ceil(
                    (r.num_kv_tokens + next(s.num_new_tokens for s in scheduled if s.request is r)) / BS)
        sched.update(scheduled, {s.request.request_id: 7 for s in scheduled if s.samples})
    raise AssertionError("did not finish")


@pytest.mark.parametrize("config", [streaming(16, 2), h2o(16, 2, 4), streaming(16, 0)])
def test_long_sequence_holds_bounded_blocks_and_leaks_nothing(config):
    sched = make_scheduler(num_blocks=64, budget=10, max_model_len=32)
    request = evicting_request("long", 100, 60, config)  # 160 tokens through a 16-token budget
    sched.add(request)
    most = drive(sched, [request])
    assert request.status == RequestStatus.FINISHED_LENGTH and request.num_output_tokens == 60
    assert most <= math.ceil(config.budget / BS) + 2
    assert request.num_evicted_tokens > 100
    assert sched.kv.pool.num_free_blocks == 64 and all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_preempted_evicting_request_restarts_from_its_history():
    sched = make_scheduler(num_blocks=9, budget=64, max_model_len=32)
    first = evicting_request("a", 20, 30, streaming(16, 2))
    second = evicting_request("b", 20, 30, streaming(16, 2), start=100)
    sched.add(first)
    sched.add(second)
    drive(sched, [first, second])
    assert sched.num_preemptions > 0
    assert first.num_output_tokens == second.num_output_tokens == 30
    assert sched.kv.pool.num_free_blocks == 9


def test_without_eviction_max_model_len_still_stops_generation():
    sched = make_scheduler(num_blocks=64, max_model_len=32)
    plain = Request("p", list(range(20)), SamplingParams(max_tokens=100, ignore_eos=True))
    evicting = evicting_request("e", 20, 100, streaming(16, 2))
    sched.add(plain)
    sched.add(evicting)
    drive(sched, [plain, evicting])
    assert plain.num_tokens == 32 and evicting.num_output_tokens == 100


# ---------------------------------------------------------------------------- prefix cache
def test_evicting_blocks_live_in_their_own_hash_namespace():
    kv = KVCacheManager(32, BS, True, "x", evictor=Evictor(BS, 64))
    plain = Request("p", list(range(12)), SamplingParams())
    evicting = evicting_request("e", 12, 4, streaming(16, 2))
    assert set(kv.block_hashes(plain)).isdisjoint(kv.block_hashes(evicting))


def test_after_its_first_eviction_a_sequence_publishes_nothing_and_shared_blocks_stay_valid():
    sched = make_scheduler(num_blocks=64, budget=64, max_model_len=64, prefix_caching=True)

    def step():
        scheduled = sched.schedule()
        sched.kv.take_moves()
        sched.update(scheduled, {s.request.request_id: 7 for s in scheduled if s.samples})

    first = evicting_request("a", 12, 40, streaming(16, 2))
    sched.add(first)
    step()  # prefill: 3 full blocks published
    assert len(sched.kv.pool.cached) == 3
    twin = evicting_request("b", 12, 40, streaming(60, 2))  # same prompt and layout: shares 2 blocks
    sched.add(twin)
    step()
    assert twin.num_cached_tokens == 8
    shared = list(sched.kv.req_blocks["b"][:2])
    while first.num_evicted_tokens == 0:
        step()
    before = set(sched.kv.pool.cached)
    for _ in range(20):
        step()
    assert twin.num_evicted_tokens == 0 and twin.status == RequestStatus.RUNNING
    new_blocks = [b for h, b in sched.kv.pool.cached.items() if h not in before]
    assert new_blocks and all(b in sched.kv.req_blocks["b"] for b in new_blocks), \
        "only the twin (not evicted yet) may publish"
    # The evicted sequence did not rewrite the blocks it shared: still cached, same contents.
    assert sched.kv.req_blocks["a"][0] not in shared
    for block in shared:
        assert block.block_hash is not None and sched.kv.pool.lookup(block.block_hash) is block


# ---------------------------------------------------------------------------- settings
def resolve(request: dict | None = None, max_model_len: int = 2048, **engine) -> EvictionConfig | None:
    return resolve_eviction(EvictionSpec.parse(request), EvictionSpec(**engine), max_model_len, POLICIES)


def test_settings_defaults_and_overrides():
    assert resolve() is None
    assert resolve(policy="streaming", budget=1024) == EvictionConfig("streaming", 1024, 4, 1020)
    assert resolve(policy="h2o", budget=1024) == EvictionConfig("h2o", 1024, 4, 510)
    assert resolve({"budget": 256, "sink_tokens": 0}, policy="streaming", budget=1024) == \
        EvictionConfig("streaming", 256, 0, 256)
    assert resolve({"policy": "none"}, policy="h2o", budget=1024) is None
    assert resolve("h2o", budget=64) == EvictionConfig("h2o", 64, 4, 30)


@pytest.mark.parametrize("request_spec, engine, fragment", [
    ({"policy": "lru"}, {}, "unknown KV eviction policy 'lru'"),
    ({"policy": "h2o"}, {}, "needs a budget"),
    ({"policy": "h2o", "budget": 4096}, {}, "at most max-model-len (2048)"),
    ({"policy": "h2o", "budget": 4}, {}, "more than sink_tokens (4)"),
    ({"policy": "h2o", "budget": 64, "sink_tokens": -1}, {}, "sink_tokens must be at least 0"),
    ({"policy": "h2o", "budget": 64, "recent_tokens": 61}, {}, "recent_tokens must be in [0, budget - sink_tokens]"),
    ({"recent_tokens": 10}, {"policy": "streaming", "budget": 64}, "streaming keeps sink_tokens + recent_tokens"),
    # settings with no policy to apply them to (the server started without --kv-eviction)
    ({"budget": 256}, {}, "kv_eviction.budget only apply(s) under a KV eviction policy"),
    ({"policy": "none", "sink_tokens": 0}, {"policy": "h2o", "budget": 64}, "kv_eviction.sink_tokens only apply"),
])
def test_bad_settings_are_refused_with_a_clear_message(request_spec, engine, fragment):
    with pytest.raises(ValueError) as info:
        resolve(request_spec, **engine)
    assert fragment in str(info.value)


@pytest.mark.parametrize("value, fragment", [
    ({"policy": "h2o", "window": 3}, "unknown key(s) 'window'"),
    ({"budget": "many"}, "kv_eviction.budget must be an integer"),
    ({"budget": True}, "kv_eviction.budget must be an integer"),
    ({"policy": 3}, "kv_eviction.policy must be a string"),
    (["h2o"], "kv_eviction must be an object"),
])
def test_sampling_params_check_the_kv_eviction_field(value, fragment):
    with pytest.raises(ValueError) as info:
        SamplingParams(kv_eviction=value)
    assert fragment in str(info.value)


# ---------------------------------------------------------------------------- positions
@pytest.mark.parametrize("rotated_format", [False, True])
def test_gathered_keys_are_rotated_to_their_cache_index(rotated_format):
    from kvserve.cache.eviction.positions import rope_gathered_keys
    from kvserve.cache.formats.rotation import hadamard_rotation

    torch.manual_seed(0)
    keys = torch.randn(2, 3, 10, 8)  # [kv_heads, batch, tokens, head_dim], stored before RoPE
    angles = torch.arange(10.0)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])[None]
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    signed_sin = torch.cat((-sin[:, :4], sin[:, 4:]), -1)
    # what the model computes for a key at position i: the reference's x cos + rotate_half(x) sin
    expected = keys * cos + torch.cat((-keys[..., 4:], keys[..., :4]), -1) * sin
    if rotated_format:  # the pool holds K·H; attention works in that basis
        basis = hadamard_rotation(8, torch.float32, torch.device("cpu"))
        torch.testing.assert_close(rope_gathered_keys(keys @ basis, cos, signed_sin, basis), expected @ basis)
    else:
        torch.testing.assert_close(rope_gathered_keys(keys, cos, signed_sin, None), expected)
