"""`kvserve bench serve`: send a workload to an OpenAI-compatible server at a chosen arrival rate
and concurrency, stream every response, and report vLLM's serving metrics.

Arrivals follow vLLM: with --request-rate R and --burstiness k, the gaps between requests are
Gamma(shape=k, scale=1/(R*k)): mean 1/R always; k = 1 is a Poisson process, k < 1 burstier,
k > 1 more regular. R = inf sends everything at once (then --max-concurrency bounds what is in flight).

`--dataset-name multi-turn` is a closed-loop chat workload instead (kvserve/bench/multi_turn.py and
multi_turn_run.py): the arrival schedule then starts sessions, not requests.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from kvserve.bench.client import ClientConfig, check_endpoint, http_session, send_request, served_models
from kvserve.bench.datasets import (MULTI_TURN, SampleRequest, add_dataset_args, build_dataset, check_dataset_args,
                                    load_tokenizer)
from kvserve.bench.metrics import RequestResult, compute_metrics, metrics_to_dict, parse_goodput, parse_percentile_args
from kvserve.bench.multi_turn import MultiTurnWorkload, build_multi_turn, options_from_args
from kvserve.bench.report import format_serving_table, save_json
from kvserve.bench.server_metrics import MetricsSampler, ServerSample, samples_to_dicts, summarize

logger = logging.getLogger(__name__)


@dataclass
class LoadConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    num_warmups: int = 0
    seed: int = 0
    metrics_interval: float = 0.5  # seconds between /metrics samples; 0 = do not sample
    request_timeout: float = 600.0
    progress: bool = True

    def validate(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be positive (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be positive, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if self.num_warmups < 0 or not self.metrics_interval >= 0 or not 0 < self.request_timeout < math.inf:
            raise ValueError("--num-warmups and --metrics-interval must be >= 0, --request-timeout > 0")


@dataclass
class RunOutput:
    results: list[RequestResult]
    duration: float
    server_samples: list[ServerSample] = field(default_factory=list)
    client_cpu: float | None = None  # seconds of the client thread's CPU time while the requests ran


# A client busy this much of one core may have slowed the run it measured (it reads every event in
# one Python thread).
CLIENT_CPU_WARNING = 0.8


def send_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: the first at 0, then Gamma gaps."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


async def warm_up(client: aiohttp.ClientSession, config: ClientConfig, samples: list[SampleRequest], n: int,
                  limit: asyncio.Semaphore | None) -> None:
    async def one(i: int) -> RequestResult:
        if limit is None:
            return await send_request(client, config, samples[i % len(samples)], time.perf_counter())
        async with limit:
            return await send_request(client, config, samples[i % len(samples)], time.perf_counter())

    results = await asyncio.gather(*(one(i) for i in range(n)))
    if not any(r.success for r in results):
        raise ValueError(f"every warm-up request failed; the first error: {results[0].error}")


async def run_load(config: ClientConfig, samples: list[SampleRequest], load: LoadConfig,
                   metrics_url: str | None = None) -> RunOutput:
    """Send `samples` on the arrival schedule, at most `max_concurrency` at a time; sample the
    server's /metrics meanwhile."""
    load.validate()
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with http_session(load.request_timeout) as client:
        if load.num_warmups:
            await warm_up(client, config, samples, load.num_warmups, limit)
        t0, cpu0 = time.perf_counter(), time.thread_time()  # this thread runs the whole client
        sampler = None
        sampler_task = None
        if metrics_url and load.metrics_interval > 0:
            sampler = MetricsSampler(client, metrics_url, load.metrics_interval, t0)
            sampler_task = asyncio.create_task(sampler.run())
        bar = tqdm(total=len(samples), disable=not load.progress, desc="Requests", file=sys.stderr)

        async def one(sample: SampleRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            if limit is None:
                result = await send_request(client, config, sample, t0)
            else:
                async with limit:
                    result = await send_request(client, config, sample, t0)
            bar.update(1)
            return result

        times = send_times(len(samples), load.request_rate, load.burstiness, load.seed)
        results = await asyncio.gather(*(one(s, at) for s, at in zip(samples, times)))
        duration, client_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        bar.close()
        if sampler is not None:
            sampler.stop()
            await sampler_task
            if sampler.samples:
                await sampler.sample_once()  # the state right after the last request
        return RunOutput(list(results), duration, sampler.samples if sampler else [], client_cpu)


def add_client_args(parser: argparse.ArgumentParser, with_target: bool = True) -> None:
    """Flags for where to send requests (`serve` only) and how (`serve` and `compare`)."""
    if with_target:
        t = parser.add_argument_group("server")
        t.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's root URL")
        t.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
        t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="sent as a Bearer token (default: $OPENAI_API_KEY)")
        t.add_argument("--tokenizer", default=None,
                       help="tokenizer for the workload (HF dir, GGUF, cached hub id; default: --model if it is "
                            "one of those, else kvserve's default model)")
    c = parser.add_argument_group("load")
    c.add_argument("--endpoint", default=None,
                   help="/v1/completions (default) or /v1/chat/completions (default and required for multi-turn)")
    c.add_argument("--request-rate", type=float, default=math.inf, help="requests per second, or inf (default)")
    c.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the arrival gaps (1 = Poisson)")
    c.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    c.add_argument("--num-warmups", type=int, default=0, help="requests sent (and not counted) before the run")
    c.add_argument("--ignore-eos", action="store_true",
                   help="ask the server to generate exactly max_tokens (multi-turn always does)")
    c.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a byte before a request fails")
    o = parser.add_argument_group("metrics")
    o.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    o.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (ms)")
    o.add_argument("--metrics-interval", type=float, default=0.5,
                   help="seconds between samples of the server's /metrics (0 = off)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def load_config_from_args(args: argparse.Namespace) -> LoadConfig:
    config = LoadConfig(args.request_rate, args.burstiness, args.max_concurrency, args.num_warmups, args.seed,
                        args.metrics_interval, args.request_timeout, not args.disable_tqdm)
    config.validate()
    return config


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server (kvserve, vLLM, SGLang, llama.cpp)")
    add_client_args(p)
    add_dataset_args(p, num_prompts=100, input_len="512", output_len="128", multi_turn=True)
    r = p.add_argument_group("results")
    r.add_argument("--label", default=None, help="a name for this run in the result file")
    r.add_argument("--save-result", default=None, metavar="PATH", help="write the result JSON (vLLM's keys) here")
    r.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    p.set_defaults(func=run_serve_cli)


def _tokenizer_for(args: argparse.Namespace, model: str) -> Any:
    from kvserve.model.loader import ModelLoadError

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    try:
        return load_tokenizer(model)
    except ModelLoadError:
        logger.warning("model %r is not a local path or cached hub id; using kvserve's default tokenizer for the "
                       "workload (pass --tokenizer to match the server's)", model)
        return load_tokenizer(None)


def run_info(args: argparse.Namespace, config: ClientConfig, load: LoadConfig) -> dict[str, Any]:
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if config.chat else "openai",
        "endpoint_type": "openai-chat" if config.chat else "openai",
        "label": getattr(args, "label", None),
        "model_id": config.model,
        "tokenizer_id": getattr(args, "tokenizer", None),
        "base_url": config.base_url,
        "endpoint": config.endpoint,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
    }


def resolve_endpoint(args: argparse.Namespace) -> str:
    """--endpoint, defaulting by workload: chat for multi-turn (which needs it), else completions."""
    multi_turn = args.dataset_name == MULTI_TURN
    endpoint = args.endpoint or ("/v1/chat/completions" if multi_turn else "/v1/completions")
    check_endpoint(endpoint)
    if multi_turn and not endpoint.rstrip("/").endswith("chat/completions"):
        raise ValueError(f"--dataset-name multi-turn sends chat conversations: --endpoint must be "
                         f"/v1/chat/completions, got {endpoint!r}")
    return endpoint


def check_workload(args: argparse.Namespace) -> None:
    """ValueError for workload flags that cannot describe a workload, before a tokenizer loads."""
    if args.dataset_name == MULTI_TURN:
        options_from_args(args)
    else:
        check_dataset_args(args)


def build_workload(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest] | MultiTurnWorkload:
    """The request list the dataset flags describe, or the multi-turn sessions' texts."""
    if args.dataset_name != MULTI_TURN:
        return build_dataset(args, tokenizer)
    return build_multi_turn(tokenizer, options_from_args(args), args.dataset_path, args.seed, args.num_warmups)


def client_config(args: argparse.Namespace, base_url: str, endpoint: str, model: str,
                  api_key: str | None) -> ClientConfig:
    """How to send requests; the multi-turn workload always asks for exact answer lengths."""
    return ClientConfig(base_url, endpoint, model, api_key, args.ignore_eos or args.dataset_name == MULTI_TURN)


def benchmark(args: argparse.Namespace, config: ClientConfig, samples: list[SampleRequest] | MultiTurnWorkload,
              load: LoadConfig, tokenizer: Any) -> tuple[dict[str, Any], RunOutput, str]:
    """Run one workload against one server; returns (result JSON, raw run, printed table)."""
    if isinstance(samples, MultiTurnWorkload):
        from kvserve.bench.multi_turn_run import multi_turn_benchmark  # it builds on this module

        return multi_turn_benchmark(args, config, samples, load, tokenizer)
    selected, percentiles = parse_percentile_args(args.percentile_metrics, args.metric_percentiles)
    goodput = parse_goodput(args.goodput) if args.goodput else None
    run = asyncio.run(run_load(config, samples, load, config.base_url.rstrip("/") + "/metrics"))
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    metrics = compute_metrics(run.results, run.duration, count, percentiles, goodput)
    server = summarize(run.server_samples)
    busy = run.client_cpu / run.duration if run.duration > 0 else 0.0
    table = format_serving_table(metrics, selected, load.request_rate, load.max_concurrency, server, busy)
    if busy > CLIENT_CPU_WARNING:
        logger.warning("the client was busy %.0f%% of one core while the requests ran: its own speed may have "
                       "limited this measurement (give it a core the server does not use)", 100 * busy)
    result = {**run_info(args, config, load), **metrics_to_dict(metrics, selected),
              "client_cpu_seconds": run.client_cpu,
              "server_metrics": {**server, "samples": samples_to_dicts(run.server_samples)}}
    return result, run, table


def failure_summary(result: dict[str, Any]) -> str | None:
    """One line for the exit message when requests failed, naming the commonest error."""
    errors = [e for e in result["errors"] if e]
    if not errors:
        return None
    common = max(set(errors), key=errors.count)
    return (f"{result['failed']} of {result['completed'] + result['failed']} requests failed "
            f"({errors.count(common)}x: {common})")


def run_serve_cli(args: argparse.Namespace) -> int:
    endpoint = resolve_endpoint(args)
    load = load_config_from_args(args)
    parse_percentile_args(args.percentile_metrics, args.metric_percentiles)  # fail before any work
    if args.goodput:
        parse_goodput(args.goodput)
    check_workload(args)  # fail before any work
    model = args.model
    if model is None:
        models = served_models(args.base_url, args.api_key)
        if not models:
            raise ValueError(f"{args.base_url}/v1/models lists no model; pass --model")
        model = models[0]
    tokenizer = _tokenizer_for(args, model)
    samples = build_workload(args, tokenizer)
    config = client_config(args, args.base_url, endpoint, model, args.api_key)
    result, run, table = benchmark(args, config, samples, load, tokenizer)
    print(table)
    if args.save_result:
        print(f"Result saved to {save_json(args.save_result, result)}")
    if args.plot:
        from kvserve.bench.plots import plot_run

        for path in plot_run(run, args.plot):
            print(f"Plot saved to {path}")
    problem = failure_summary(result)
    if problem:
        print(f"kvserve bench serve: error: {problem}", file=sys.stderr)
        return 1
    return 0
