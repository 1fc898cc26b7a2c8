"""The closed-loop driver of the multi-turn workload, and its per-turn report.

Unlike the open-loop request list of `bench serve`, a session's next turn exists only once the
server has answered the previous one: each session is a loop (send the conversation, wait for the
whole streamed answer, think, append, repeat), and the sessions run concurrently. Session starts
follow --request-rate/--burstiness (all at once by default); --max-concurrency bounds requests in
flight. A failed turn ends its session (the conversation cannot go on without the answer).

Reported: vLLM's serving metrics over all turns, the same per turn number (turn k's prompt holds
k-1 earlier exchanges, so TTFT per turn shows what reusing them saves), and the prefix-cache hit
rate per tier from the server's /metrics counters over the run.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
from tqdm import tqdm

from kvserve.bench.client import ClientConfig, http_session, send_request, served_max_model_len
from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import (METRIC_TITLES, RequestResult, compute_metrics, distributions_to_dict,
                                   metrics_to_dict, parse_goodput, parse_percentile_args, percentile_key)
from kvserve.bench.multi_turn import MultiTurnWorkload, count_prompt_tokens
from kvserve.bench.report import format_serving_table
from kvserve.bench.serve import LoadConfig, RunOutput, run_info, send_times, warm_up
from kvserve.bench.server_metrics import MetricsSampler, ServerSample, samples_to_dicts, summarize


@dataclass
class TurnResult:
    session: int  # 0-based
    turn: int  # 1-based
    messages: list[dict[str, str]]  # the conversation sent
    result: RequestResult


@dataclass
class MultiTurnRun:
    turns: list[TurnResult]  # by session, then turn: the same order in every run, so outputs compare
    duration: float
    sessions_cut_short: int  # sessions that stopped at a failed turn
    server_samples: list[ServerSample] = field(default_factory=list)

    def as_run_output(self) -> RunOutput:
        return RunOutput([t.result for t in self.turns], self.duration, self.server_samples)


async def run_sessions(config: ClientConfig, workload: MultiTurnWorkload, load: LoadConfig,
                       count_prompt: Callable[[list[dict[str, str]]], int],
                       metrics_url: str | None = None) -> MultiTurnRun:
    """Run every session to its last turn (or first failure). `count_prompt(messages)` estimates a
    prompt's tokens for servers that report no usage (after the run: tokenizing while requests
    stream would delay the timing of other sessions' chunks). /metrics is read at the start and the end
    (and every --metrics-interval between, when it is positive) for the counters' deltas."""
    load.validate()
    opts = workload.options
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with http_session(load.request_timeout) as client:
        max_model_len = await served_max_model_len(client, config)
        if max_model_len is not None:  # fail before any turn rather than cut every session short
            opts.check_fits(max_model_len)
        if load.num_warmups:
            warmups = [SampleRequest(p, 0, opts.output_len) for p in workload.warmup_prompts]
            await warm_up(client, config, warmups, load.num_warmups, limit)
        t0 = time.perf_counter()
        sampler = MetricsSampler(client, metrics_url, load.metrics_interval, t0) if metrics_url else None
        sampler_task = None
        # the counters' baseline is read before any turn is sent, so the deltas hold every turn
        if sampler is not None and await sampler.sample_once() and load.metrics_interval > 0:
            sampler_task = asyncio.create_task(sampler.run())
        bar = tqdm(total=opts.num_requests, disable=not load.progress, desc="Turns", file=sys.stderr)
        done: list[TurnResult] = []

        async def send(sample: SampleRequest) -> RequestResult:
            if limit is None:
                return await send_request(client, config, sample, t0)
            async with limit:
                return await send_request(client, config, sample, t0)

        async def session(index: int, at: float) -> bool:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            answers: list[str] = []
            for turn in range(opts.turns):
                messages = workload.conversation(index, answers)
                sample = SampleRequest(messages[-1]["content"], 0, opts.output_len, messages)
                result = await send(sample)
                done.append(TurnResult(index, turn + 1, messages, result))
                bar.update(1)
                if not result.success:
                    bar.update(opts.turns - turn - 1)
                    return False
                answers.append(result.generated_text)
                if turn + 1 < opts.turns and opts.think_time > 0:
                    await asyncio.sleep(opts.think_time)
            return True

        starts = send_times(opts.sessions, load.request_rate, load.burstiness, load.seed)
        finished = await asyncio.gather(*(session(i, at) for i, at in enumerate(starts)))
        duration = time.perf_counter() - t0
        bar.close()
        if sampler is not None:
            sampler.stop()
            if sampler_task is not None:
                await sampler_task
            if sampler.samples:
                await sampler.sample_once()  # the counters right after the last turn
    done.sort(key=lambda t: (t.session, t.turn))
    for t in done:
        if not t.result.prompt_len:  # the server reported no usage
            t.result.prompt_len = count_prompt(t.messages)
    return MultiTurnRun(done, duration, sum(not ok for ok in finished), sampler.samples if sampler else [])


def per_turn(run: MultiTurnRun, num_turns: int, sessions: int, count_tokens: Callable[[str], int] | None,
             selected: list[str], percentiles: list[float]) -> list[dict[str, Any]]:
    """One entry per turn number: requests sent, completed and failed, mean prompt and output
    tokens, the share of prompt tokens the server reported cached (usage.prompt_tokens_details;
    None when it reports none), and the selected metrics' mean/median/std/percentiles (vLLM's key
    names; None for a turn no request of which completed)."""
    rows = []
    for turn in range(1, num_turns + 1):
        results = [t.result for t in run.turns if t.turn == turn]
        m = compute_metrics(results, run.duration, count_tokens, percentiles)
        ok = [i for i, r in enumerate(results) if r.success]
        cached = [(r.cached_tokens, r.prompt_len) for r in results if r.success and r.cached_tokens is not None]
        prompt_total = sum(n for _, n in cached)
        rows.append({"turn": turn, "sent": len(results), "not_sent": sessions - len(results),
                     "completed": m.completed, "failed": m.failed,
                     "mean_input_tokens": float(np.mean([m.input_lens[i] for i in ok])) if ok else None,
                     "mean_output_tokens": float(np.mean([m.output_lens[i] for i in ok])) if ok else None,
                     "cached_prompt_fraction": sum(c for c, _ in cached) / prompt_total if prompt_total else None,
                     **{k: (v if m.completed else None) for k, v in distributions_to_dict(m, selected).items()}})
    return rows


def _cell(value: float | None, fmt: str = ".2f") -> str:
    return "n/a" if value is None else format(value, fmt)


def format_turn_table(rows: list[dict[str, Any]], selected: list[str], percentiles: list[float]) -> str:
    """Per turn number: completed requests, mean prompt tokens, the share of them cached, then mean
    and the highest asked percentile of each selected metric (ms)."""
    top = percentile_key(max(percentiles))
    head = ["Turn", "Done", "In tok", "Cached %"]
    for name in selected:
        short = METRIC_TITLES[name][0]
        head += [f"Mean {short}", f"P{top} {short}"]
    lines = [" ".join(f"{h:>11}" for h in head)]
    for row in rows:
        cached = row["cached_prompt_fraction"]
        cells = [str(row["turn"]), f"{row['completed']}/{row['sent']}", _cell(row["mean_input_tokens"], ".0f"),
                 _cell(None if cached is None else 100 * cached, ".1f")]
        for name in selected:
            cells += [_cell(row[f"mean_{name}_ms"]), _cell(row[f"p{top}_{name}_ms"])]
        lines.append(" ".join(f"{c:>11}" for c in cells))
    width = len(lines[0])
    return "\n".join(["{s:{c}^{n}}".format(s=" Per turn (ms) ", n=width, c="-"), *lines])


def tier_hit_rates(server: dict[str, Any]) -> dict[str, float | None]:
    """Prompt tokens served from each tier over the run, as fractions of the prompt tokens looked up
    (None where the server does not export that tier's counter)."""
    rates = {"pool": server.get("prefix_cache_hit_rate"), "host": server.get("host_prefix_cache_hit_rate"),
             "disk": server.get("disk_prefix_cache_hit_rate")}
    known = [v for v in rates.values() if v is not None]
    rates["total"] = sum(known) if known else None
    return rates


def format_tier_table(rates: dict[str, float | None]) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Prefix cache hits by tier ", n=50, c="-")]
    for tier, label in (("pool", "device pool"), ("host", "host memory tier"), ("disk", "disk tier"),
                        ("total", "all tiers")):
        value = rates[tier]
        lines.append("{:<40} {:<10}".format(f"Hit rate, {label} (%):", _cell(None if value is None else 100 * value)))
    return "\n".join(lines)


def multi_turn_benchmark(args: argparse.Namespace, config: ClientConfig, workload: MultiTurnWorkload,
                         load: LoadConfig, tokenizer: Any) -> tuple[dict[str, Any], RunOutput, str]:
    """Run the sessions against one server; returns (result JSON, the turns as a RunOutput for the
    plots, printed tables)."""
    selected, percentiles = parse_percentile_args(args.percentile_metrics, args.metric_percentiles)
    goodput = parse_goodput(args.goodput) if args.goodput else None
    opts = workload.options
    run = asyncio.run(run_sessions(config, workload, load, lambda messages: count_prompt_tokens(tokenizer, messages),
                                   config.base_url.rstrip("/") + "/metrics"))
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    results = [t.result for t in run.turns]
    metrics = compute_metrics(results, run.duration, count, percentiles, goodput)
    server = summarize(run.server_samples)
    turns = per_turn(run, opts.turns, opts.sessions, count, selected, percentiles)
    rates = tier_hit_rates(server)
    table = "\n".join([format_serving_table(metrics, selected, load.request_rate, load.max_concurrency, server),
                       format_turn_table(turns, selected, percentiles), format_tier_table(rates), "=" * 50])
    info = run_info(args, config, load)
    info["num_prompts"] = len(results)
    result = {**info, **metrics_to_dict(metrics, selected),
              "multi_turn": {**asdict(opts), "sessions_completed": opts.sessions - run.sessions_cut_short,
                             "sessions_cut_short": run.sessions_cut_short},
              "sessions": [t.session for t in run.turns], "turns": [t.turn for t in run.turns],
              "per_turn": turns, "prefix_cache_hit_rate_by_tier": rates,
              "server_metrics": {**server, "samples": samples_to_dicts(run.server_samples)}}
    return result, run.as_run_output(), table
