"""Soak test: the reliability scenarios of tests/test_reliability_load.py at full size, over and
over for N minutes against one `kvserve serve`, then a summary (and exit status 1 if any
guarantee broke).

Each round: 1,000 completions at once (ignore_eos) into a KV pool sized to ~5% of their tokens,
then 100 concurrent streams of which every 10th client leaves (alternately before its first
token and mid-stream). After each round the pool must drain: nothing running or waiting and
every block free. /health is polled throughout and /metrics sampled for the peak KV usage.

    python benchmarks/soak.py --minutes 5                               # the bundled default model
    python benchmarks/soak.py --minutes 2 --model DIR --server-args "--dtype float32"
    python benchmarks/soak.py --minutes 1 --base-url http://127.0.0.1:8000   # a running server
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvserve.bench.launcher import kvserve_serve_command, running_server
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec
from kvserve.cache.sizing import bytes_per_block
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import select_device, select_dtype
from kvserve.model.loader import load_model_config

from scenarios import (BackgroundPoller, HealthMonitor, Prompt, ScenarioResult, aborts,  # benchmarks/scenarios.py
                       book_prompts, overload, pool_state, read_metrics, wait_drained)


@dataclass
class Totals:
    rounds: int = 0
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    failures: int = 0
    http_5xx: int = 0
    undrained_rounds: int = 0  # rounds after which blocks stayed in use (a leak)
    failure_samples: list[str] = field(default_factory=list)

    def add(self, result: ScenarioResult) -> None:
        self.requests += result.requests
        self.completed += result.completed
        self.aborted += result.aborted
        self.failures += result.num_failures
        self.http_5xx += result.http_5xx
        self.failure_samples += result.failures[:3]


class PeakKVUsage(BackgroundPoller):
    """Samples kvserve:kv_cache_usage_perc every `interval` s on a thread; keeps the maximum."""

    def __init__(self, base_url: str, headers: dict[str, str] | None, interval: float = 0.25):
        super().__init__("peak-kv-usage")
        self.base_url, self.headers, self.interval = base_url, headers, interval
        self.peak = 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, read_metrics(self.base_url, self.headers)["kvserve:kv_cache_usage_perc"])
            except Exception:  # a slow /metrics under load only loses this sample
                pass


def pool_bytes(args: argparse.Namespace) -> int:
    """KV budget holding `pool_fraction` of one overload round's tokens (prompt words x
    tokens_per_word + max_tokens per request), at least one max-model-len sequence."""
    engine = EngineArgs.from_cli_args(args.engine)
    config, _ = load_model_config(engine.model)
    kv_format = make_kv_format(engine.kv_cache_dtype, select_dtype(engine.dtype, select_device(engine.device)))
    spec = KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, engine.block_size)
    per_request = args.prompt_words * args.tokens_per_word + args.max_tokens
    blocks = max(int(args.pool_fraction * args.requests * per_request / engine.block_size),
                 -(-engine.max_model_len // engine.block_size))
    return blocks * bytes_per_block(spec, kv_format)


async def fitting(url: str, headers: dict[str, str] | None, texts: list[str], max_tokens: int) -> list[Prompt]:
    """Each text, or its first token ids where text + max_tokens would pass the server's
    max_model_len (a slice of the novel can tokenize long): every request must be servable."""
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as client:
        limit = (await client.get("/v1/models")).json()["data"][0]["max_model_len"] - max_tokens
        gate = asyncio.Semaphore(32)

        async def fit(text: str) -> Prompt:
            async with gate:
                ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
            return text if len(ids) <= limit else ids[:limit]

        return list(await asyncio.gather(*(fit(t) for t in texts)))


def prompts(url: str, headers: dict[str, str] | None, count: int, words: int, offset: int,
            max_tokens: int) -> list[Prompt]:
    return asyncio.run(fitting(url, headers, book_prompts(count, words, offset), max_tokens))


def workload_tokens(after: dict[str, float], before: dict[str, float]) -> float:
    return sum(after[name] - before[name] for name in ("kvserve:prompt_tokens_total",
                                                       "kvserve:generation_tokens_total"))


def soak(url: str, args: argparse.Namespace, headers: dict[str, str] | None) -> dict:
    totals = Totals()
    before = read_metrics(url, headers)
    overload_tokens = 0.0  # prompt + generated tokens of the first overload round
    deadline = time.monotonic() + 60 * args.minutes
    start = time.monotonic()
    with HealthMonitor(url) as health, PeakKVUsage(url, headers) as peak:
        while totals.rounds == 0 or time.monotonic() < deadline:
            offset = totals.rounds * args.requests
            burst = asyncio.run(overload(url, prompts(url, headers, args.requests, args.prompt_words, offset,
                                                      args.max_tokens), args.max_tokens, headers))
            totals.add(burst)
            if totals.rounds == 0:
                overload_tokens = workload_tokens(read_metrics(url, headers), before)
            stream_prompts = prompts(url, headers, args.streams, args.prompt_words, offset + args.requests,
                                     args.abort_max_tokens)
            streams = asyncio.run(aborts(url, stream_prompts, args.abort_max_tokens, args.abort_every,
                                         headers=headers))
            totals.add(streams)
            drained = wait_drained(url, headers, timeout=30).drained
            totals.undrained_rounds += not drained
            totals.rounds += 1
            print(f"round {totals.rounds}: overload {burst.completed}/{burst.requests} in {burst.wall_s:.0f} s, "
                  f"aborts {streams.completed} done + {streams.aborted} left in {streams.wall_s:.0f} s, "
                  f"failures {burst.num_failures + streams.num_failures}, drained {drained}", flush=True)
    after = read_metrics(url, headers)
    final = pool_state(url, headers)
    return {
        **{k: v for k, v in asdict(totals).items() if k != "failure_samples"},
        "minutes": round((time.monotonic() - start) / 60, 1),
        "preemptions": after["kvserve:num_preemptions_total"] - before["kvserve:num_preemptions_total"],
        "peak_kv_usage": peak.peak,
        "pool_blocks": final.num_blocks,
        "tokens_per_round": round(workload_tokens(after, before) / totals.rounds),
        "pool_tokens_vs_overload_tokens": round(final.num_blocks * args.engine.block_size / overload_tokens, 3),
        "leaked_blocks": final.num_blocks - final.num_free_blocks,
        "running_after": final.running, "waiting_after": final.waiting,
        "health_checks": health.checks, "health_failures": len(health.failures),
        "max_health_latency_s": round(health.max_latency_s, 3),
        "failure_samples": totals.failure_samples[:10] + health.failures[:5],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="keep starting rounds until this much time passed")
    parser.add_argument("--base-url", help="soak a running server instead of starting `kvserve serve`")
    parser.add_argument("--api-key", help="the server's --api-key, if any")
    parser.add_argument("--server-args", default="", help="extra `kvserve serve` arguments (quoted)")
    parser.add_argument("--requests", type=int, default=1000, help="overload: requests sent at once")
    parser.add_argument("--max-tokens", type=int, default=16, help="overload: tokens per request")
    parser.add_argument("--prompt-words", type=int, default=14)
    parser.add_argument("--tokens-per-word", type=float, default=1.4, help="to size the pool before the run")
    parser.add_argument("--pool-fraction", type=float, default=0.05, help="KV pool / one overload round's tokens")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--streams", type=int, default=100, help="aborts: concurrent streams")
    parser.add_argument("--abort-every", type=int, default=10)
    parser.add_argument("--abort-max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--log", type=Path, default=Path("soak-server.log"))
    engine = argparse.ArgumentParser(add_help=False)
    EngineArgs.add_cli_args(engine)
    args, rest = parser.parse_known_args()
    args.engine = engine.parse_args(rest + shlex.split(args.server_args))
    args.engine.max_model_len = args.engine.max_model_len or args.max_model_len
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None

    print(f"kvserve soak, {platform.node()} ({platform.machine()}, Python {platform.python_version()}), "
          f"{time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    if args.base_url:
        summary = soak(args.base_url.rstrip("/"), args, headers)
    else:
        budget = pool_bytes(args)
        server_args = [*rest, *shlex.split(args.server_args), "--kv-cache-memory", str(budget),
                       "--max-model-len", str(args.engine.max_model_len)]
        if args.api_key:
            server_args += ["--api-key", args.api_key]
        print("kvserve serve " + " ".join(server_args), flush=True)
        with running_server(kvserve_serve_command, server_args, args.log, timeout=600) as url:
            summary = soak(url, args, headers)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    ok = (summary["failures"] == summary["http_5xx"] == summary["undrained_rounds"] == 0
          and summary["leaked_blocks"] == 0 and summary["health_failures"] == 0)
    print("PASS" if ok else "FAIL: a guarantee broke (see failure_samples)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
