"""Automatic prefix caching: the hash chain, LRU reuse, salt isolation, hit accounting, and
end-to-end equality with caching off on a pool small enough to evict."""
from __future__ import annotations

import random

from kvserve import LLM, SamplingParams
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)


def manager(num_blocks: int = 16, enabled: bool = True, namespace: str = "bfloat16") -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enabled, namespace)


def run_prefill(kv: KVCacheManager, request: Request) -> list:
    """Admit a request as the scheduler does: look up hits, allocate the rest."""
    hits = kv.find_cached_prefix(request)
    assert kv.allocate(request, request.num_tokens - len(hits) * BS, hits)
    request.num_computed_tokens = request.num_tokens
    return hits


# ---------------------------------------------------------------------------- hash chain
def test_block_hash_depends_on_the_whole_prefix():
    kv = manager()
    a = kv.block_hashes(req("a", [1, 2, 3, 4, 5, 6, 7, 8]))
    b = kv.block_hashes(req("b", [9, 2, 3, 4, 5, 6, 7, 8]))
    assert len(a) == 2
    assert a[0] != b[0]
    assert a[1] != b[1], "same tokens in block 1 must not match after a different block 0"
    assert kv.block_hashes(req("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == a  # partial block not hashed


def test_namespace_and_salt_enter_the_hash():
    tokens = [1, 2, 3, 4]
    base = manager(namespace="bfloat16").block_hashes(req("a", tokens))
    assert manager(namespace="int8").block_hashes(req("a", tokens)) != base
    assert manager(namespace="bfloat16").block_hashes(req("a", tokens, salt="tenant-1")) != base


# ---------------------------------------------------------------------------- lookups
def test_hit_reuses_blocks_and_always_recomputes_the_last_token():
    kv = manager()
    first = req("a", list(range(12)))  # exactly 3 full blocks
    assert run_prefill(kv, first) == []
    second = req("b", list(range(12)))
    hits = run_prefill(kv, second)
    # The last token's logits are needed, so at most 2 of the 3 identical blocks are reused.
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]
    assert all(b.ref_cnt == 2 for b in hits)
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]


def test_prefix_shorter_than_a_block_gets_no_hit_and_no_error():
    kv = manager()
    run_prefill(kv, req("a", [1, 2, 3]))
    assert kv.find_cached_prefix(req("b", [1, 2, 3])) == []
    assert kv.find_cached_prefix(req("c", [1, 2])) == []


def test_salt_isolates_tenants():
    kv = manager()
    run_prefill(kv, req("a", list(range(9)), salt="alice"))
    assert kv.find_cached_prefix(req("b", list(range(9)), salt="bob")) == []
    assert len(kv.find_cached_prefix(req("c", list(range(9)), salt="alice"))) == 2


def test_freed_blocks_stay_cached_until_the_pool_needs_them():
    kv = manager(num_blocks=4)
    a = req("a", list(range(8)) + [100])  # 2 full blocks + 1 partial
    run_prefill(kv, a)
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    hits = kv.find_cached_prefix(req("b", list(range(8)) + [200]))
    assert len(hits) == 2, "freed blocks with a hash are still findable"
    # The pool hands out the never-used block, then a's blocks in release order: the partial
    # tail (no hash), then block 1 (an eviction); block 0, the head, survives longest.
    kv.pool.allocate(3)
    assert kv.pool.num_evictions == 1
    assert len(kv.find_cached_prefix(req("c", list(range(8)) + [200]))) == 1
    kv.pool.allocate(1)
    assert kv.pool.num_evictions == 2
    assert kv.find_cached_prefix(req("d", list(range(8)) + [200])) == []


def test_release_order_is_tail_first_so_the_shared_head_survives_longest():
    kv = manager(num_blocks=8)
    a = req("a", list(range(12)) + [99])
    run_prefill(kv, a)
    ids = kv.block_ids("a")
    kv.free(a)
    assert list(kv.pool.free_queue)[-4:] == list(reversed(ids))
    kv.pool.allocate(6)  # the 4 never-used blocks, a's partial tail, then its last full block
    survivors = kv.find_cached_prefix(req("b", list(range(12)) + [7]))
    assert [b.block_id for b in survivors] == ids[:2]


def test_hits_are_counted_in_tokens_and_not_for_a_preempted_request_recomputing_itself():
    kv = manager(num_blocks=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add(req("a", list(range(10))))
    sched.update(sched.schedule(), {"a": 1})
    sched.add(req("b", list(range(10))))
    sched.schedule()
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)
    a = next(r for r in sched.running if r.request_id == "a")
    sched._preempt(a)
    sched.schedule()  # a is readmitted and finds its own old blocks: not a hit
    assert (kv.stats.queries, kv.stats.hits) == (20, 8)


# ---------------------------------------------------------------------------- end to end
def _workload(tokenizer) -> list[dict]:
    rng = random.Random(0)
    prefixes = [tokenizer.encode(f"System prompt number {i}: " + "be brief and kind. " * (6 + 3 * i))
                for i in range(4)]
    prompts = []
    for i in range(24):
        question = tokenizer.encode(f" Question {i}: what about {rng.randint(0, 10**6)}?")
        prompts.append({"prompt_token_ids": prefixes[i % 4] + question})
    return prompts


def test_outputs_identical_with_caching_on_and_off_under_eviction(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False)
    per_block = off.engine.kv_cache.nbytes // off.engine.num_blocks
    # 40 blocks: about two prefixes' worth, so cached blocks are evicted and recomputed.
    on = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=str(40 * per_block), max_model_len=256,
             max_num_seqs=4, enable_prefix_caching=True)
    prompts = _workload(on.get_tokenizer())
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    outputs = on.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    kv = on.engine.kv_manager
    assert kv.stats.hits > 0
    assert kv.pool.num_evictions > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_n_samples_share_the_prompt_blocks(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    engine = llm.engine
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}
    engine.add_request(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    engine.step()
    tables = [engine.kv_manager.block_ids(r.request_id) for r in engine.scheduler.running]
    assert len(tables) == 3
    shared = set(tables[0][:2]) & set(tables[1][:2]) & set(tables[2][:2])
    assert len(shared) == 2, "the two full prompt blocks are computed once and shared"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_free_blocks == engine.num_blocks


def test_reset_prefix_cache_forgets_every_prefix_and_may_preempt_the_running(tiny_llama):
    """vLLM's `LLM.reset_prefix_cache`: a repeated prompt hits, after a reset it computes again;
    while a request holds blocks the reset is refused unless it preempts it, and the preempted
    request then finishes with the tokens it would have produced."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache()
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 0

    engine = llm.engine
    engine.add_request(prompt, greedy)
    for _ in range(3):
        engine.step()
    assert not engine.reset_prefix_cache() and engine.kv_manager.pool.cached, "refused: a request holds blocks"
    assert engine.reset_prefix_cache(reset_running_requests=True)
    assert not engine.kv_manager.pool.cached and engine.scheduler.num_preemptions == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].outputs[0].token_ids == first.outputs[0].token_ids


# ---------------------------------------------------------------------------- sliding window
def test_a_sliding_window_sequence_holds_only_its_window_and_released_blocks_stay_cached():
    """Window 8, blocks of 4, a pool of 5: decoding 40 tokens holds at most 4 blocks, each block
    goes back once, and the released blocks stay findable: a request whose hit starts out of
    its window needs only the hit's blocks inside it cached (the earlier ones are long reused),
    and takes only those."""
    kv = KVCacheManager(5, BS, True, "bfloat16", window=8)
    first = req("a", list(range(6)), max_tokens=40)
    assert kv.allocate(first, 6)
    first.num_computed_tokens = 6
    for token in range(100, 140):
        first.append_token(token)
        assert kv.allocate(first, 1)
        first.num_computed_tokens += 1
        assert len(kv.held_block_ids("a")) <= 4
    table = kv.block_table("a")
    assert len(table) == 12  # every position keeps its table entry
    assert kv.pool.num_free_blocks == 5 - len(kv.held_block_ids("a"))
    kv.free(first)
    assert kv.pool.num_free_blocks == 5  # each block released once
    second = req("b", first.token_ids[:36] + [1, 2], max_tokens=1)
    hits = kv.find_cached_prefix(second)
    # queries from position 36 see positions 29 on: blocks 7 and 8 must be cached, not 0..6
    assert [b.block_id for b in hits] == [0] * 7 + table[7:9]
    assert kv.allocate(second, 2, hits)
    assert kv.held_block_ids("b")[:2] == table[7:9] and len(kv.held_block_ids("b")) == 3
    second.num_computed_tokens = 38
    kv.free(second)
    assert kv.pool.num_free_blocks == 5 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
