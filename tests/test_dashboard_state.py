"""The dashboard's view of the engine (issue 25): the block pool copied into the four states that
add up to /metrics' counts, each running request holding ceil(its cached tokens / block size)
blocks, a shared prefix showing as blocks with ref-count > 1, every block free or cached once
the requests are done, and no token of anyone's prompt or output in the view."""
from __future__ import annotations

import json
import time

import pytest

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.pool_snapshot import PUBLISHED_BIT, BlockState, snapshot_pool
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.state_view import engine_state
from kvserve.sampling_params import SamplingParams

BS = 8


def test_every_block_is_in_exactly_one_state():
    pool = BlockPool(10)
    a = pool.allocate(4)  # blocks 1..4
    pool.publish(a[0], b"h0")
    pool.publish(a[3], b"h3")
    pool.share(a[:2])  # blocks 1, 2: ref-count 2
    pool.release([a[3]])  # block 4: free with its hash (cached for reuse)
    snap = snapshot_pool(pool)
    assert snap.first_block_id == 1 and snap.num_blocks == 10
    assert [int(s) & 3 for s in snap.states[:5]] == [BlockState.SHARED, BlockState.SHARED, BlockState.USED,
                                                     BlockState.CACHED, BlockState.FREE]
    assert [bool(s & PUBLISHED_BIT) for s in snap.states[:5]] == [True, False, False, True, False]
    assert list(snap.ref_counts[:5]) == [2, 2, 1, 0, 0]
    counts = snap.counts()
    assert counts == {BlockState.FREE: 6, BlockState.CACHED: 1, BlockState.USED: 1, BlockState.SHARED: 2}
    assert counts[BlockState.FREE] + counts[BlockState.CACHED] == pool.num_free_blocks


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", block_size=BS, kv_cache_memory="8MiB",
                                max_model_len=256, max_num_batched_tokens=256))


def test_running_requests_shared_prefixes_and_the_drained_pool(engine, tiny_tokenizer):
    prefix = list(range(100, 100 + 5 * BS))  # five full blocks both prompts share
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(prefix + [7, 8, 9], params, "first")
    engine.step()  # "first" is prefilled and publishes its full blocks
    engine.add_request(prefix + [11, 12], params, "second")
    engine.step()
    state = engine_state(engine, step=2)
    assert state.block_size == BS and not state.waiting
    views = {r.request_id: r for r in state.running}
    assert set(views) == {"first", "second"}
    refs = {state.pool.first_block_id + i: int(c) for i, c in enumerate(state.pool.ref_counts)}
    for view in views.values():
        assert len(view.block_ids) == -(-view.kv_tokens // BS)
        assert view.prompt_tokens + view.output_tokens >= view.kv_tokens > view.prompt_tokens - 1
    second = views["second"]
    assert second.cached_tokens == 5 * BS
    assert second.block_ids[:5] == views["first"].block_ids[:5]
    assert all(refs[b] == 2 for b in second.block_ids[:5]) and second.shared_blocks == 5
    assert all(refs[b] == 1 for b in second.block_ids[5:])
    counts = state.pool.counts()
    assert counts[BlockState.SHARED] == 5
    assert counts[BlockState.FREE] + counts[BlockState.CACHED] == engine.num_free_blocks
    assert sum(counts.values()) == engine.num_blocks

    while engine.has_unfinished_requests():
        engine.step()
    drained = engine_state(engine, step=99).pool.counts()
    assert drained[BlockState.USED] == drained[BlockState.SHARED] == 0
    assert drained[BlockState.CACHED] > 0  # the published blocks stay findable


def test_the_server_view_carries_ids_and_counts_never_tokens(engine):
    from kvserve.server.dashboard import _request_json

    secret = [501, 502, 503] * 6
    engine.add_request(secret, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "tenant-a")
    engine.step()
    state = engine_state(engine, step=1)
    body = [_request_json(r, state.kv_cache_dtype) for r in (*state.running, *state.waiting)]
    assert body[0]["id"] == "tenant-a" and body[0]["prompt_tokens"] == len(secret)
    assert "501, 502, 503" not in json.dumps(body)
    assert set(body[0]) == {"id", "status", "prompt_tokens", "output_tokens", "cached_tokens", "kv_tokens",
                            "num_blocks", "shared_blocks", "blocks", "kv_cache_dtype", "eviction",
                            "evicted_tokens", "preemptions"}
    assert body[0]["blocks"] == engine.kv_manager.block_ids("tenant-a")
    while engine.has_unfinished_requests():
        engine.step()


def test_every_answer_carrying_one_snapshot_gives_it_the_same_time(engine, monkeypatch):
    """The page draws an answer unless its snapshot is older than the one shown (two polls can
    answer out of order). During a long step every answer carries the last snapshot, so they
    must all give it the same time, however long each took to build: derived per answer, a slow
    answer followed by quick ones read as newer than them, and the page never showed the step
    running (the browser test's flaky wait)."""
    from types import SimpleNamespace

    from kvserve.server.dashboard import state_json
    from kvserve.server.engine_loop import StateSnapshot

    snap = StateSnapshot(engine_state(engine, step=3), time.monotonic(), time.time(), 0, 0, 0.0)
    server = SimpleNamespace(step_started_at=time.monotonic() - 2, steps_completed=3)  # step 4 running 2 s
    pool_type = type(snap.engine.pool)
    counts = pool_type.counts

    def slow_counts(pool):
        time.sleep(0.01)
        return counts(pool)

    monkeypatch.setattr(pool_type, "counts", slow_counts)
    slow = state_json(snap, server, "tiny")
    monkeypatch.setattr(pool_type, "counts", counts)
    quick = state_json(snap, server, "tiny")
    assert quick["time"] == slow["time"] == round(snap.taken_at_wall, 4)
    assert quick["engine"]["step_running_s"] > slow["engine"]["step_running_s"] > 1
