"""Continuous batching with one token budget per step. Plain Python: no tensors, no model.

Each step the scheduler decides how many tokens every request advances (its output is plain
data, `ScheduledRequest`s). Running requests go first in arrival order (FCFS): a decode takes one
token of the budget, an unfinished prefill takes as much as is left (chunked prefill). Waiting
requests then join while the budget, `max_num_seqs` and free blocks allow (without chunked
prefill, vLLM's `--no-enable-chunked-prefill`, only while the budget holds the whole prompt; the
first that does not fit waits, and those behind it). With `long_prefill_token_threshold` (vLLM's
`--long-prefill-token-threshold`) a request advances at most that many tokens a step while
another request runs or waits, so that one long prompt does not take every step's budget from
the others' prefills. When the pool runs
dry, the most recently admitted running request is preempted by recompute: its blocks are freed
and it goes back to the front of the waiting queue (vLLM's policy; never an OOM).

Under the priority policy (vLLM's `--scheduling-policy priority`) the waiting queue is ordered by
(priority, arrival time), lower values first, a preempted request going back to its place in that
order, and the victim when the pool runs dry is the running request with the highest (priority,
arrival time): the least urgent, newest first. As in vLLM, priority orders admission and victims;
a waiting request never preempts a running one, and running requests take the budget in
admission order.

A request that asks for prompt logprobs takes no prefix-cache hit until they are computed (the
skipped positions would have no logits); a request with max_tokens 0 finishes with "length" once
its prompt is computed, without a token sampled.

A request under KV eviction advances at most budget - sinks tokens per step, and allocating its
blocks first lets its policy drop tokens (`KVCacheManager.make_room`, kvserve/cache/eviction). A
preempted one is recomputed from its whole token history with the policy applied again
between chunks, which need not reproduce the uninterrupted run bit for bit.

With KV tiers, a waiting request's prefix lookup continues below the pool; one whose blocks are
still being read from disk is passed over until they are in, unless nothing else can run.

Async scheduling (vLLM v1's; the engine drives it): step N+1 is scheduled while step N runs, so a
request's token from N is still on the device. `advance` counts a launched step at once: its
computed tokens, and one pending token per request it samples; the next decode reads that token
on the device. `update(..., advanced=True)` later turns pending tokens into known ones. A request
whose pending tokens certainly end it is not scheduled again; one that stops on a token (EOS, a
stop string) has computed one token too many, which is discarded.

Speculative decoding (--speculative-config, speculative.py): a decode may carry draft tokens,
computed after its last token in the same step. They take only what the step leaves once every
running and admitted request has its tokens, budget and free blocks: a decode whose drafts do not
fit runs without them, and drafts never preempt. `update` counts as computed only the positions
of the drafts the samples confirmed; a rejected draft's slot is written again by the next step.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass

from kvserve.cache.kv_cache_manager import NO_TIER_HIT, KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.speculative import Drafter


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"  # or "priority" (SCHEDULING_POLICIES)
    chunked_prefill: bool = True  # False: a prompt is computed in one step, or waits
    long_prefill_token_threshold: int = 0  # > 0: a prefill chunk's cap while others are eligible


SCHEDULING_POLICIES = ("fcfs", "priority")


def urgency(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower first, then earlier arrival."""
    return request.priority, request.arrival_time


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # drafts included
    draft_token_ids: list[int] | tuple[()] = ()  # speculative decoding: computed after the request's last token

    @property
    def samples(self) -> bool:
        """True if this step reaches the end of the request's known tokens (a token is sampled);
        never for a prefill-only request (max_tokens 0)."""
        r = self.request
        # (Request.num_scheduled_tokens and max_tokens, spelled out: this runs for every request every step)
        return (r.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids)
                == len(r.token_ids) + r.num_pending_tokens and r.params.max_tokens != 0)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, drafter: Drafter | None = None):
        self.config = config
        self.kv = kv_manager
        self.drafter = drafter  # speculative decoding (--speculative-config), None: off
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_needing_host_tokens = 0  # unfinished requests with `needs_host_tokens` (no overlap while any)
        # Work outside the queue waiting for free blocks (an embedding, LLMEngine.embed_when_room):
        # while any waits, no request is admitted, so the running ones free the blocks it needs.
        self.held_for: set[str] = set()
        if config.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {config.policy!r}")
        self.by_priority = config.policy == "priority"

    # ------------------------------------------------------------------ queue management
    def add(self, request: Request) -> None:
        self._enqueue(request, front=False)
        self.num_needing_host_tokens += request.needs_host_tokens

    def _enqueue(self, request: Request, front: bool) -> None:
        """FCFS: at the back (new) or the front (preempted). Priority: at its place in the order,
        after the requests that compare equal."""
        if self.by_priority:
            self.waiting.insert(bisect.bisect_right(self.waiting, urgency(request), key=urgency), request)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and return its blocks to the pool at once."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.num_needing_host_tokens -= request.needs_host_tokens
        self.kv.free(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_evicted_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def _victim(self) -> Request:
        """The running request to preempt: the newest (FCFS), or the least urgent (priority; of
        equals, the latest admitted)."""
        if self.by_priority:
            return max(reversed(self.running), key=urgency)
        return self.running[-1]

    def preempt_running(self) -> int:
        """Preempt every running request (newest first, so the queue keeps their order): their
        blocks go back to the pool and they recompute when scheduled again. Returns how many."""
        victims = list(reversed(self.running))
        for request in victims:
            self._preempt(request)
        return len(victims)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        # (vLLM's rule: alone, a long prompt may take the whole budget; chunking off, it never is cut)
        cap = self.config.long_prefill_token_threshold \
            if self.config.chunked_prefill and len(self.running) + len(self.waiting) > 1 else 0

        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            remaining = request.num_scheduled_tokens - request.num_computed_tokens
            if remaining == 0 or (request.num_pending_tokens and request.stops_with_pending(self.config.max_model_len)):
                continue  # (async scheduling) all in flight, or its pending token ends it
            if cap and remaining > cap:
                remaining = cap
            num_new = min(remaining, budget, self.kv.max_new_tokens(request))
            while not self.kv.allocate(request, num_new):
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                # (priority: the victim may have been scheduled earlier in this loop; its tokens
                # go back to the budget)
                for index, item in enumerate(scheduled):
                    if item.request is victim:
                        budget += item.num_new_tokens
                        del scheduled[index]
                        break
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new

        # New requests wait while anything was preempted this step: admitting them would only
        # take blocks the preempted (older) requests need to resume. A request whose prefix blocks
        # are still being read from the disk tier is passed over (others go first) until they are in.
        index, loading = 0, []
        while (index < len(self.waiting) and not preempted and not self.held_for and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[index]
            if request.num_pending_tokens:  # preempted with a token in flight: resumes once it arrives
                index += 1
                continue
            # A request that still needs prompt logprobs recomputes its whole prompt; the blocks it
            # writes are still published for others.
            cached = [] if request.needs_prompt_logprobs else self.kv.find_cached_prefix(request)
            # The lookup goes on below the pool (KV tiers), if there are any.
            loaded = NO_TIER_HIT if request.needs_prompt_logprobs else self.kv.fetch_tier_prefix(request, len(cached))
            if loaded is None:
                loading.append(request)
                index += 1
                continue
            num_cached = (len(cached) + loaded.num_blocks) * self.kv.block_size
            if request.num_tokens - num_cached > budget and not self.config.chunked_prefill:
                break  # (vLLM's rule: it and those behind it wait for a step with room for its prompt)
            num_new = min(request.num_tokens - num_cached, cap or budget, budget,
                          self.kv.max_new_tokens(request, num_cached))
            if not self.kv.allocate(request, num_new, cached, loaded):
                break
            del self.waiting[index]
            if request.num_preemptions == 0 and not request.needs_prompt_logprobs:
                # (recomputing its own blocks is not a cache hit; a prompt-logprobs request looked nothing up)
                request.num_cached_tokens = num_cached
                self.kv.record_lookup(request.num_tokens, len(cached) * self.kv.block_size, loaded)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        if not scheduled and loading and self.kv.wait_for_tier_loads(loading[0]):
            return self.schedule()  # nothing else to run: wait for the disk instead of spinning
        if self.drafter is not None and budget > 0 and not preempted:
            self._add_drafts(scheduled, budget)
        return scheduled

    def _add_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        """Speculative decoding: the decodes take drafts from what the step left, budget and free
        blocks, in scheduling order; none while more requests run than disable_by_batch_size.
        Each draft is a row to sample: the step samples at most max_num_seqs rows (the batch a
        CUDA memory profile samples). None in a step with a decode under KV eviction: the runner
        packs that decode between the others and the verifying chunks, whose rows the backends
        attend as one run of decodes from the first row."""
        limit = self.drafter.config.disable_by_batch_size
        if limit is not None and len(self.running) > limit:
            return
        if any(item.request.eviction is not None and item.num_new_tokens == 1 for item in scheduled):
            return
        rows = self.config.max_num_seqs - sum(1 for item in scheduled if item.samples)
        for index, item in enumerate(scheduled):
            if min(budget, rows) <= 0:
                break
            if item.num_new_tokens != 1 or not item.samples:
                continue
            drafts = self.drafter.drafts(item.request, min(budget, rows))
            if drafts and self.kv.allocate(item.request, 1 + len(drafts)):
                scheduled[index] = ScheduledRequest(item.request, 1 + len(drafts), drafts)
                budget -= len(drafts)
                rows -= len(drafts)

    def advance(self, scheduled: list[ScheduledRequest]) -> None:
        """Async scheduling: count a launched step before its tokens are known (module docstring)."""
        for item in scheduled:
            request = item.request
            if item.samples:
                request.num_pending_tokens += 1
            request.num_computed_tokens += item.num_new_tokens

    def update(self, scheduled: list[ScheduledRequest], sampled: dict[str, int],
               advanced: bool = False, accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance requests after the forward pass (unless `advance` counted the step at launch);
        append sampled tokens (after a request's `accepted` drafts, whose positions count as
        computed; the rejected ones' do not); return the requests that finished (their blocks
        are already back in the pool). A request the sampler failed (`error` set) finishes with
        status error and without the token; one that finished meanwhile (aborted, or stopped by
        the step before) gets nothing."""
        finished = []
        for item in scheduled:
            request = item.request
            token = sampled.get(request.request_id)
            kept = accepted.get(request.request_id, ()) if accepted else ()
            if not advanced:
                request.num_computed_tokens += item.num_new_tokens - len(item.draft_token_ids) + len(kept)
            else:
                if token is not None:
                    request.num_pending_tokens -= 1
                if request.status.finished:
                    continue
            if token is None:
                if request.max_tokens == 0 and request.num_computed_tokens == request.num_tokens:
                    self.finish(request, RequestStatus.FINISHED_LENGTH)  # prefill only: the prompt is computed
                    finished.append(request)
                continue
            if request.error is not None:  # the sampler failed it (a logits processor raised)
                self.finish(request, RequestStatus.FINISHED_ERROR)
                finished.append(request)
                continue
            for draft in kept:  # (speculative.accept_drafts ends them before any stop token)
                request.append_token(draft)
            request.append_token(token)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self.finish(request, status)
                finished.append(request)
        return finished
