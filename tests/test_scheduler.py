"""Block pool, block manager and scheduler, with no model: tokens are made up, the 'model' is a
loop that appends a fixed token for every request that samples."""
import pytest

from kvserve.cache.block_pool import BlockPool, OutOfBlocksError
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerConfig
from kvserve.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, prompt_len: int, max_tokens: int, start_token: int = 0, priority: int = 0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(range(start_token, start_token + prompt_len)), params, priority=priority)


def make_scheduler(num_blocks: int, max_num_seqs: int = 16, budget: int = 64, max_model_len: int = 256,
                   prefix_caching: bool = False, policy: str = "fcfs", chunked_prefill: bool = True,
                   long_prefill: int = 0) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, prefix_caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, policy, chunked_prefill, long_prefill), kv)


def step_and_sample(sched: Scheduler) -> list:
    scheduled = sched.schedule()
    sched.update(scheduled, {s.request.request_id: 7 for s in scheduled if s.samples})
    return scheduled


def first_scheduled_order(steps: list[list[tuple[str, int]]]) -> list[str]:
    order = []
    for step in steps:
        order.extend(rid for rid, _ in step if rid not in order)
    return order


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[list[tuple[str, int]]]:
    """Drive the scheduler like the engine would; returns each step's (request id, tokens) list."""
    steps = []
    while sched.has_unfinished():
        scheduled = sched.schedule()
        assert scheduled, "scheduler made no progress"
        steps.append([(s.request.request_id, s.num_new_tokens) for s in scheduled])
        sampled = {s.request.request_id: 7 for s in scheduled if s.samples}
        sched.update(scheduled, sampled)
        assert len(steps) < max_steps
    return steps


# ---------------------------------------------------------------------------- block pool
def test_pool_allocate_release_and_ref_counts():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free_blocks == 2 and a.ref_cnt == b.ref_cnt == 1
    pool.share([a])
    assert a.ref_cnt == 2
    pool.release([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0 and pool.num_free_blocks == 3
    pool.release([a])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    with pytest.raises(OutOfBlocksError):
        pool.allocate(5)
    with pytest.raises(AssertionError):
        pool.release([a])


def test_pool_usage_is_fraction_of_referenced_blocks():
    pool = BlockPool(8)
    pool.allocate(2)
    assert pool.usage == pytest.approx(0.25)


# ---------------------------------------------------------------------------- scheduler
def test_all_requests_finish_with_their_token_counts_and_no_leak():
    sched = make_scheduler(num_blocks=64)
    reqs = [make_request(f"r{i}", 5 + 3 * i, 4 + i) for i in range(6)]
    for r in reqs:
        sched.add(r)
    run_to_completion(sched)
    for i, r in enumerate(reqs):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == 4 + i
    assert sched.kv.pool.num_free_blocks == 64
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)


def test_token_budget_mixes_decodes_and_chunked_prefill():
    sched = make_scheduler(num_blocks=64, budget=10)
    sched.add(make_request("short", 3, 5))
    first = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in first] == [("short", 3)]
    sched.update(first, {"short": 7})
    sched.add(make_request("long", 25, 2))
    second = sched.schedule()
    # The running decode takes 1 token, the new prompt gets the remaining 9 (a chunk of 25).
    assert [(s.request.request_id, s.num_new_tokens) for s in second] == [("short", 1), ("long", 9)]
    assert second[0].samples and not second[1].samples


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it_whole():
    sched = make_scheduler(num_blocks=64, budget=10, chunked_prefill=False)
    sched.add(make_request("short", 3, 3))
    step_and_sample(sched)
    sched.add(make_request("long", 10, 2, start_token=20))
    sched.add(make_request("behind", 2, 2, start_token=40))  # would fit, but waits behind "long" (FIFO)
    steps = run_to_completion(sched)
    # While "short" decodes, 9 tokens are left per step: "long" (10) waits, then takes a whole step.
    assert steps[0] == [("short", 1)] and steps[1] == [("short", 1)] and steps[2] == [("long", 10)]
    assert steps[3] == [("long", 1), ("behind", 2)]
    assert all(n in (1, 10) for step in steps for rid, n in step if rid == "long")


def test_a_long_prefill_is_capped_only_while_others_are_eligible():
    alone = make_scheduler(num_blocks=64, budget=32, long_prefill=8)
    alone.add(make_request("long", 100, 2))
    assert [(s.request.request_id, s.num_new_tokens) for s in alone.schedule()] == [("long", 32)]
    shared = make_scheduler(num_blocks=64, budget=32, long_prefill=8)
    shared.add(make_request("long", 100, 2))
    shared.add(make_request("short", 6, 2, start_token=200))
    assert [(s.request.request_id, s.num_new_tokens) for s in shared.schedule()] == [("long", 8), ("short", 6)]
    steps = run_to_completion(shared)
    last_short = max(i for i, step in enumerate(steps) if any(rid == "short" for rid, _ in step))
    # capped while "short" decodes beside it; alone again, it takes the whole budget
    assert all(n <= 8 for step in steps[:last_short + 1] for rid, n in step if rid == "long")
    assert ("long", 32) in steps[last_short + 1]


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    for i in range(4):
        sched.add(make_request(f"r{i}", 4, 3))
    scheduled = sched.schedule()
    assert len(scheduled) == 2 and len(sched.waiting) == 2


def test_fcfs_admission_order():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    for i in range(3):
        sched.add(make_request(f"r{i}", 4, 2))
    assert first_scheduled_order(run_to_completion(sched)) == ["r0", "r1", "r2"]


def test_preemption_of_newest_running_request_when_pool_runs_dry():
    # 6 blocks of 4 tokens; two requests each growing to 12 tokens (3 blocks) would fit exactly,
    # three cannot: the newest is preempted (recompute) and still finishes.
    sched = make_scheduler(num_blocks=6)
    reqs = [make_request(f"r{i}", 4, 8) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert reqs[2].num_preemptions > 0 and reqs[0].num_preemptions == 0
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert sched.kv.pool.num_free_blocks == 6


def test_preempted_request_goes_back_to_the_front_of_the_queue():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2)
    a, b, c = make_request("a", 4, 12), make_request("b", 4, 12), make_request("c", 4, 1)
    for r in (a, b):
        sched.add(r)
    sched.update(sched.schedule(), {"a": 7, "b": 7})
    sched.add(c)
    while b.num_preemptions == 0:
        scheduled = sched.schedule()
        sched.update(scheduled, {s.request.request_id: 7 for s in scheduled if s.samples})
    assert list(sched.waiting)[:2] == [b, c]


def test_finish_frees_blocks_immediately():
    sched = make_scheduler(num_blocks=16)
    r = make_request("r", 10, 5)
    sched.add(r)
    sched.schedule()
    assert sched.kv.pool.num_free_blocks == 16 - 3
    sched.finish(r, RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 16 and r.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished()


def test_waiting_request_can_be_aborted():
    sched = make_scheduler(num_blocks=16, max_num_seqs=1)
    a, b = make_request("a", 4, 5), make_request("b", 4, 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(b, RequestStatus.FINISHED_ABORTED)
    assert list(sched.waiting) == []


def test_stop_token_and_eos_finish_with_stop_status():
    sched = make_scheduler(num_blocks=16)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=(9,))
    s2 = Request("s", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[8]))
    sched.add(r)
    sched.add(s2)
    scheduled = sched.schedule()
    sched.update(scheduled, {"r": 9, "s": 8})
    assert r.status == s2.status == RequestStatus.FINISHED_STOPPED
    assert s2.stop_reason == 8
    assert sched.kv.pool.num_free_blocks == 16


def test_max_model_len_ends_generation():
    sched = make_scheduler(num_blocks=64, max_model_len=10)
    r = make_request("r", 6, 100)
    sched.add(r)
    run_to_completion(sched)
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


# ---------------------------------------------------------------------------- priority policy
def test_priority_policy_admits_lower_values_first_and_equals_by_arrival():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1, policy="priority")
    for rid, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -1), ("e", 0)):
        sched.add(make_request(rid, 4, 2, priority=priority))
    assert first_scheduled_order(run_to_completion(sched)) == ["d", "b", "e", "a", "c"]


def test_fcfs_policy_keeps_arrival_order_whatever_the_priorities():
    sched = make_scheduler(num_blocks=64, max_num_seqs=1)
    for rid, priority in (("a", 5), ("b", 0), ("c", -1)):
        sched.add(make_request(rid, 4, 2, priority=priority))
    assert first_scheduled_order(run_to_completion(sched)) == ["a", "b", "c"]


def test_priority_policy_preempts_the_least_urgent_running_request_not_the_newest():
    # As test_preemption_of_newest_running_request_when_pool_runs_dry, but the newest request is
    # urgent: FCFS would preempt it, the priority policy preempts the least urgent one instead.
    results = {}
    for policy in ("fcfs", "priority"):
        sched = make_scheduler(num_blocks=6, policy=policy)
        first, lax = make_request("first", 4, 8, priority=0), make_request("lax", 4, 8, priority=5)
        urgent = make_request("urgent", 4, 8, priority=1)
        sched.add(first)
        sched.add(lax)
        step_and_sample(sched)
        sched.add(urgent)  # admitted last: the newest running request
        run_to_completion(sched)
        assert all(r.num_output_tokens == 8 for r in (first, lax, urgent))
        assert sched.kv.pool.num_free_blocks == 6 and first.num_preemptions == 0
        results[policy] = (lax.num_preemptions, urgent.num_preemptions)
    assert results["fcfs"][0] == 0 and results["fcfs"][1] > 0
    assert results["priority"][0] > 0 and results["priority"][1] == 0


def test_priority_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    """The least urgent request runs first in admission order, so it has been scheduled (and its
    blocks allocated) by the time an urgent one finds the pool dry and preempts it: it must leave
    the step's batch, and its tokens the budget."""
    sched = make_scheduler(num_blocks=5, max_num_seqs=2, budget=16, policy="priority")
    lax, urgent = make_request("lax", 4, 12, priority=9), make_request("urgent", 4, 12, start_token=40)
    sched.add(lax)
    step_and_sample(sched)
    sched.add(urgent)
    waiting = make_request("waiting", 4, 1, start_token=80, priority=3)  # no room: max_num_seqs is 2
    sched.add(waiting)
    while lax.num_preemptions == 0:
        scheduled = sched.schedule()
        assert all(s.request.status == RequestStatus.RUNNING for s in scheduled)
        assert sum(s.num_new_tokens for s in scheduled) <= 16
        sched.update(scheduled, {s.request.request_id: 7 for s in scheduled if s.samples})
    assert [s.request for s in scheduled] == [urgent]
    assert list(sched.waiting) == [waiting, lax]  # back in its place by priority, not at the front
    run_to_completion(sched)
    assert lax.num_output_tokens == urgent.num_output_tokens == 12 and urgent.num_preemptions == 0
    assert sched.kv.pool.num_free_blocks == 5


def test_a_victim_preempted_in_the_step_that_scheduled_it_leaves_no_unwritten_block_cached():
    """allocate publishes the blocks a step fills before the step runs. A priority victim taken
    out of the step that scheduled it never writes them, so they leave the prefix cache: resumed,
    it finds only the tokens it had computed (before, the hashes of its last chunk stayed over
    memory nobody wrote, and it read that as its K/V)."""
    sched = make_scheduler(num_blocks=10, max_num_seqs=8, budget=12, max_model_len=40, prefix_caching=True,
                           policy="priority", long_prefill=8)
    lax = make_request("lax", 36, 4, start_token=100, priority=1)
    sched.add(lax)
    step_and_sample(sched)
    sched.add(make_request("urgent", 3, 3, start_token=1))
    computed = lax.num_computed_tokens
    while lax.num_preemptions == 0:
        computed = lax.num_computed_tokens
        scheduled = step_and_sample(sched)
    assert lax not in [s.request for s in scheduled]  # preempted after its chunk was scheduled
    while lax.status != RequestStatus.RUNNING:
        scheduled = sched.schedule()
        if lax.status == RequestStatus.RUNNING:
            assert 0 < lax.num_computed_tokens <= computed  # its prefix hit: what it had written
        sched.update(scheduled, {s.request.request_id: 7 for s in scheduled if s.samples})
    run_to_completion(sched)
    assert lax.num_output_tokens == 4 and sched.kv.pool.num_free_blocks == 10


def test_unknown_scheduling_policy_is_refused():
    with pytest.raises(ValueError, match="fcfs, priority"):
        make_scheduler(num_blocks=4, policy="lifo")


# ---------------------------------------------------------------------------- async scheduling
def run_overlapped(sched: Scheduler, token_of=lambda request: 7, max_steps: int = 10_000) -> list[list[tuple[str, int]]]:
    """Drive the scheduler as the engine does under --async-scheduling: step N+1 is scheduled and
    advanced before step N's tokens are handed back."""
    steps, in_flight = [], None
    while sched.has_unfinished() or in_flight is not None:
        scheduled = sched.schedule()
        steps.append([(s.request.request_id, s.num_new_tokens) for s in scheduled])
        for s in scheduled:  # a decode's input token is known unless the step in flight samples it
            assert s.request.num_computed_tokens + s.num_new_tokens <= s.request.num_scheduled_tokens
        sampled = {s.request.request_id: token_of(s.request) for s in scheduled if s.samples}
        sched.advance(scheduled)
        if in_flight is not None:
            sched.update(*in_flight, advanced=True)
        in_flight = (scheduled, sampled) if scheduled else None
        assert len(steps) < max_steps
    return steps


def test_async_scheduling_counts_a_step_at_launch_and_gives_the_same_tokens():
    sched = make_scheduler(num_blocks=64, budget=8)
    requests = [make_request(f"r{i}", 5 + 3 * i, max_tokens=4 + i, start_token=10 * i) for i in range(4)]
    for r in requests:
        sched.add(r)
    steps = run_overlapped(sched)
    for i, r in enumerate(requests):
        assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7] * (4 + i)
        assert r.num_pending_tokens == 0
    # never past max_tokens: a request whose pending token ends it is not scheduled again
    scheduled_decodes = sum(n for step in steps for rid, n in step if rid == "r0") - 5
    assert scheduled_decodes == 4 - 1
    assert sched.kv.pool.num_free_blocks == 64


def test_async_scheduling_discards_the_token_after_a_stop():
    """A request that stops on a token had its next decode launched already; that token is dropped."""
    sched = make_scheduler(num_blocks=64)
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=[9]))
    sched.add(r)
    outputs = iter([5, 6, 9, 4, 4, 4])
    run_overlapped(sched, token_of=lambda request: next(outputs))
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [5, 6, 9]
    assert r.num_pending_tokens == 0 and sched.kv.pool.num_free_blocks == 64


def test_async_scheduling_resumes_a_preempted_request_once_its_token_arrives():
    sched = make_scheduler(num_blocks=6, budget=16)
    a, b = make_request("a", 8, max_tokens=12), make_request("b", 8, max_tokens=12, start_token=50)
    sched.add(a)
    sched.add(b)
    held_back = []
    orig_schedule = sched.schedule

    def schedule():
        scheduled = orig_schedule()
        held_back.extend(r.request_id for r in sched.waiting if r.num_pending_tokens)
        return scheduled

    sched.schedule = schedule
    run_overlapped(sched)
    assert sched.num_preemptions > 0 and "b" in held_back
    for r in (a, b):
        assert r.output_token_ids == [7] * 12 and r.num_pending_tokens == 0
    assert sched.kv.pool.num_free_blocks == 6


def test_requests_needing_host_tokens_are_counted_until_they_finish():
    sched = make_scheduler(num_blocks=16)
    plain = make_request("plain", 4, max_tokens=2)
    prompt_logprobs = Request("plp", [1, 2], SamplingParams(max_tokens=2, prompt_logprobs=1))
    prefill_only = Request("pre", [1, 2], SamplingParams(max_tokens=0))
    processed = Request("proc", [1, 2], SamplingParams(max_tokens=2, logits_processors=[lambda ids, row: row],
                                                       frequency_penalty=0.5, logprobs=2))
    assert prompt_logprobs.needs_host_tokens and prefill_only.needs_host_tokens
    assert not plain.needs_host_tokens and not processed.needs_host_tokens  # sampled after the step before
    for r in (plain, prompt_logprobs, prefill_only, processed):
        sched.add(r)
    assert sched.num_needing_host_tokens == 2
    sched.finish(prompt_logprobs, RequestStatus.FINISHED_ABORTED)
    run_to_completion(sched)
    assert sched.num_needing_host_tokens == 0
