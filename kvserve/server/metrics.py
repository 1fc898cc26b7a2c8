"""Prometheus metrics with vLLM's names (prefix `kvserve:`, label `model_name`) and the periodic
one-line log of throughput and KV usage. Everything here is fed by the engine thread; the
prometheus-client objects are thread-safe, so /metrics reads them from the event loop."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.cache.tiers.tiered_store import TierUsage
from kvserve.engine.speculative import SpeculationStats
from kvserve.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("kvserve.server")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)


def powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 8, 16, 32, ... up to `limit`, and `limit` (vLLM's iteration_tokens_total buckets)."""
    values, value = [1], 8
    while value < limit:
        values.append(value)
        value *= 2
    return tuple(values + [limit]) if limit > 1 else (1,)


def one_two_five(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    values, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(values)
            values.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters after a step, read on the engine thread."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache, since start
    prefix_hits: int  # of which found
    num_preemptions: int
    external_queries: int = 0  # prompt tokens looked up in the KV tiers past the pool, since start
    external_hits: int = 0  # of which found there
    tier_hits: dict[str, int] = field(default_factory=dict)  # tokens loaded per tier ("host", "disk")
    tiers: TierUsage | None = None  # None: no KV tiers
    speculation: SpeculationStats | None = None  # None: no speculative decoding

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


@dataclass
class _SampleTimes:
    """One sequence of a request (n > 1: each counts as a request, as vLLM's child requests do)."""

    first_token: float | None = None
    last_token: float = 0.0
    num_tokens: int = 0
    done: bool = False


@dataclass
class _RequestTimes:
    arrival: float
    max_tokens: int | None = None  # the request's, as the engine resolved it
    samples: dict[int, _SampleTimes] = field(default_factory=dict)


@dataclass
class _Interval:
    """What happened since the last log line."""

    start: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    active: bool = False


@dataclass
class ServerMetrics:
    model_name: str
    log_interval_s: float | None = 5.0  # None: no periodic log line (--disable-log-stats); metrics still count
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    max_model_len: int = 8192  # the token-count histograms' last bucket
    max_num_batched_tokens: int = 8192  # iteration_tokens_total's last bucket

    def __post_init__(self) -> None:
        labels, r = ["model_name"], self.registry

        def gauge(name: str, doc: str):
            return Gauge(f"kvserve:{name}", doc, labels, registry=r).labels(self.model_name)

        def counter(name: str, doc: str):
            return Counter(f"kvserve:{name}", doc, labels, registry=r).labels(self.model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"kvserve:{name}", doc, labels, buckets=buckets, registry=r).labels(self.model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (1 = full).")
        self.num_blocks = gauge("kv_cache_num_blocks", "KV-cache blocks in the pool.")
        self.num_free_blocks = gauge("kv_cache_num_free_blocks", "KV-cache blocks not held by any request "
                                     "(free, possibly still holding reusable prefix-cache data).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.external_queries = counter("external_prefix_cache_queries", "Prompt tokens looked up in the KV "
                                        "offload tiers (host memory, disk) after missing the pool.")
        self.external_hits = counter("external_prefix_cache_hits", "Prompt tokens found in the KV offload tiers.")
        self._tier_hits = Counter("kvserve:prefix_cache_tier_hits", "Prompt tokens loaded from each KV "
                                  "offload tier.", labels + ["tier"], registry=r)
        self.tier_used = Gauge("kvserve:kv_offload_tier_used_bytes", "Bytes held by each KV offload tier.",
                               labels + ["tier"], registry=r)
        self.tier_capacity = Gauge("kvserve:kv_offload_tier_capacity_bytes", "Size bound of each KV offload "
                                   "tier.", labels + ["tier"], registry=r)
        # Speculative decoding (vLLM's spec_decode_* counters)
        self.spec_drafts = counter("spec_decode_num_drafts", "Decodes that carried draft tokens.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_accepted_per_position = Counter(
            "kvserve:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            labels + ["position"], registry=r)
        self.preemptions = counter("num_preemptions", "Sequences preempted (blocks freed, recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (prefilled).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter("kvserve:request_success", "Completions finished, by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive generated tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS)
        # Per finished request, vLLM's phases: queued (arrival to first scheduled), prefill (to the
        # first token), decode (first token to last), inference (first scheduled to last token).
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      E2E_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.", E2E_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token.",
                                        E2E_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "A request's mean time between its "
                              "generated tokens.", TPOT_BUCKETS)
        token_buckets = one_two_five(self.max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.",
                                                   token_buckets)
        self.max_tokens_param = histogram("request_params_max_tokens", "The max_tokens of each request.",
                                          token_buckets)
        self.n_param = histogram("request_params_n", "The n of each request.", (1, 2, 5, 10, 20))
        self.max_generation_tokens = histogram("request_max_num_generation_tokens", "The most tokens one "
                                               "sequence of a request generated.", token_buckets)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens per engine step (prompts whose "
                                          "first token came, and generated tokens).",
                                          powers_of_two(self.max_num_batched_tokens))
        self._times: dict[str, _RequestTimes] = {}
        self._last: EngineSnapshot | None = None
        self._interval = _Interval(start=0.0)
        self._prompt_tokens_total = 0  # the counters' values as plain ints, for the dashboard
        self._generation_tokens_total = 0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ fed by the engine thread
    def _mark_active(self, now: float) -> None:
        """Work started: an interval that was idle restarts now, so idle time never dilutes a rate."""
        if not self._interval.active and self.log_interval_s is not None:
            self._interval = _Interval(start=now, active=True)

    def on_arrival(self, request_id: str, arrival_time: float, max_tokens: int | None = None) -> None:
        self._times[request_id] = _RequestTimes(arrival_time, max_tokens)
        self._mark_active(arrival_time)

    def on_outputs(self, outputs: list[RequestOutput], now: float, step: bool = True) -> None:
        """Count what `outputs` report (`step`: one engine step's, else an abort's or a failure's).
        Each sequence of an n > 1 request counts as a request of its own (vLLM's child requests):
        its prompt, first token, latencies and finish; n and the longest sequence, once."""
        generated = prompt = 0
        for out in outputs:
            times = self._times.get(out.request_id)
            if times is None:
                continue
            for completion in out.outputs:
                sample = times.samples.setdefault(completion.index, _SampleTimes())
                if sample.done:
                    continue
                new = len(completion.token_ids) - sample.num_tokens
                if new > 0:
                    if sample.first_token is None:
                        sample.first_token = now
                        self.ttft.observe(now - times.arrival)
                        prompt += len(out.prompt_token_ids)
                    else:
                        self.itl.observe(now - sample.last_token)
                    generated += new
                    sample.num_tokens, sample.last_token = len(completion.token_ids), now
                if completion.finish_reason is not None or out.finished:
                    sample.done = True
                    if sample.first_token is None and completion.finish_reason == "length":
                        prompt += len(out.prompt_token_ids)  # prefill only (max_tokens 0): computed, no token
                    self._observe_finished(out, completion, times, sample, now)
            if out.finished:
                self.n_param.observe(len(out.outputs))
                self.max_generation_tokens.observe(max(len(c.token_ids) for c in out.outputs))
                del self._times[out.request_id]
        if prompt:
            self._count_prompt(prompt)
        if generated:
            self.generation_tokens.inc(generated)
            self._generation_tokens_total += generated
            self._interval.generation_tokens += generated
        if step and prompt + generated:
            self.iteration_tokens.observe(prompt + generated)

    def _observe_finished(self, out: RequestOutput, completion: CompletionOutput, times: _RequestTimes,
                          sample: _SampleTimes, now: float) -> None:
        """A finished sequence's latency, phase times and sizes (vLLM's request_* histograms). The
        phases end at its last token (vLLM's), so an abort's wait after it counts only in e2e."""
        self.e2e.observe(now - times.arrival)
        self._success.labels(self.model_name, completion.finish_reason or "abort").inc()
        scheduled = out.first_scheduled_time
        end = sample.last_token if sample.first_token is not None else now
        if scheduled is not None:  # else aborted while it waited: no queue time to speak of
            self.queue_time.observe(max(0.0, scheduled - times.arrival))
            self.inference_time.observe(max(0.0, end - scheduled))
            if sample.first_token is not None:
                self.prefill_time.observe(max(0.0, sample.first_token - scheduled))
        if sample.first_token is not None:
            self.decode_time.observe(end - sample.first_token)
            # (vLLM's: 0 for a sequence of one token)
            self.tpot.observe((end - sample.first_token) / (sample.num_tokens - 1) if sample.num_tokens > 1 else 0.0)
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(len(completion.token_ids))
        if times.max_tokens is not None:
            self.max_tokens_param.observe(times.max_tokens)

    def _count_prompt(self, tokens: int) -> None:
        """A request's prompt was computed: /metrics' counter, the dashboard's total and the log line's."""
        self.prompt_tokens.inc(tokens)
        self._prompt_tokens_total += tokens
        self._interval.prompt_tokens += tokens

    def token_totals(self) -> tuple[int, int]:
        """Prompt and generation tokens counted since start (engine thread)."""
        return self._prompt_tokens_total, self._generation_tokens_total

    def forget(self, request_id: str) -> None:
        """Stop tracking a request whose final output never came (lost with a failed step)."""
        self._times.pop(request_id, None)

    def on_snapshot(self, snap: EngineSnapshot, now: float) -> None:
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.kv_usage.set(snap.kv_usage)
        self.num_blocks.set(snap.num_blocks)
        self.num_free_blocks.set(snap.num_free_blocks)
        last = self._last
        if last is not None:
            self.prefix_queries.inc(snap.prefix_queries - last.prefix_queries)
            self.prefix_hits.inc(snap.prefix_hits - last.prefix_hits)
            self.preemptions.inc(snap.num_preemptions - last.num_preemptions)
            self.external_queries.inc(snap.external_queries - last.external_queries)
            self.external_hits.inc(snap.external_hits - last.external_hits)
            for tier, tokens in snap.tier_hits.items():
                self._tier_hits.labels(self.model_name, tier).inc(tokens - last.tier_hits.get(tier, 0))
            if snap.speculation is not None:
                self._count_speculation(snap.speculation, last.speculation)
        if snap.tiers is not None:
            for tier, used, capacity in (("host", snap.tiers.host_used_bytes, snap.tiers.host_capacity_bytes),
                                         ("disk", snap.tiers.disk_used_bytes, snap.tiers.disk_capacity_bytes)):
                if capacity:
                    self.tier_used.labels(self.model_name, tier).set(used)
                    self.tier_capacity.labels(self.model_name, tier).set(capacity)
        self._last = snap
        if snap.num_running or snap.num_waiting:
            self._mark_active(now)
        if self._interval.active and now - self._interval.start >= self.log_interval_s:
            self._log(snap, now)

    def _count_speculation(self, now: SpeculationStats, last: SpeculationStats) -> None:
        self.spec_drafts.inc(now.num_drafts - last.num_drafts)
        self.spec_draft_tokens.inc(now.num_draft_tokens - last.num_draft_tokens)
        self.spec_accepted_tokens.inc(now.num_accepted_tokens - last.num_accepted_tokens)
        for position, (count, before) in enumerate(zip(now.accepted_per_position, last.accepted_per_position)):
            self._spec_accepted_per_position.labels(self.model_name, str(position)).inc(count - before)

    def seconds_until_log(self, now: float) -> float | None:
        """How long an idle engine may sleep before the pending log line is due (None: none)."""
        if not self._interval.active:
            return None
        return max(0.0, self._interval.start + self.log_interval_s - now)

    def _log(self, snap: EngineSnapshot, now: float) -> None:
        elapsed = max(now - self._interval.start, 1e-9)
        queries = snap.prefix_queries  # the hit rate is cumulative since start, as the counters are
        hit_rate = 100.0 * snap.prefix_hits / queries if queries else 0.0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    self._interval.prompt_tokens / elapsed, self._interval.generation_tokens / elapsed,
                    snap.num_running, snap.num_waiting, 100.0 * snap.kv_usage, hit_rate)
        if snap.tiers is not None:
            logger.info("KV offload tiers: %s, external prefix cache hit rate: %.1f%% (host %d, disk %d tokens), "
                        "dropped writes: %d%s", _tier_usage(snap.tiers),
                        100.0 * snap.external_hits / snap.external_queries if snap.external_queries else 0.0,
                        snap.tier_hits.get("host", 0), snap.tier_hits.get("disk", 0), snap.tiers.dropped_writes,
                        " (disk writes stopped)" if snap.tiers.disk_writes_stopped else "")
        spec = snap.speculation
        if spec is not None and spec.num_drafts:
            rates = ", ".join(f"{count / spec.num_drafts:.2f}" for count in spec.accepted_per_position)
            logger.info("Speculative decoding: mean acceptance length %.2f, accepted %d of %d draft tokens "
                        "(%.1f%%), per-position acceptance rate %s (since start)",
                        1 + spec.num_accepted_tokens / spec.num_drafts, spec.num_accepted_tokens,
                        spec.num_draft_tokens, 100.0 * spec.num_accepted_tokens / spec.num_draft_tokens, rates)
        # Still busy: the next interval starts active; if idle, the next arrival restarts it.
        self._interval = _Interval(start=now, active=bool(snap.num_running or snap.num_waiting))


def _tier_usage(usage: TierUsage) -> str:
    parts = []
    for name, used, capacity in (("host", usage.host_used_bytes, usage.host_capacity_bytes),
                                 ("disk", usage.disk_used_bytes, usage.disk_capacity_bytes)):
        if capacity:
            parts.append(f"{name} {100.0 * used / capacity:.1f}% of {capacity / (1 << 30):.2f} GiB")
    return ", ".join(parts)
