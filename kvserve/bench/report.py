"""vLLM's "Serving Benchmark Result" table, and the result JSON file."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from kvserve.bench.metrics import METRIC_TITLES, BenchmarkMetrics, percentile_key

WIDTH = 50


def _line(label: str, value: Any, fmt: str = "") -> str:
    return "{:<40} {:<10}".format(label, format(value, fmt) if fmt else value)


def _rule(title: str = "", char: str = "-") -> str:
    return "{s:{c}^{n}}".format(s=title, n=WIDTH, c=char)


def format_serving_table(m: BenchmarkMetrics, selected: list[str], request_rate: float,
                         max_concurrency: int | None, server: dict[str, Any] | None = None,
                         client_busy: float | None = None) -> str:
    """The table vLLM's `bench serve` prints, line for line, plus how busy the client itself was
    (its CPU time over the run's duration, when measured) and a section for the server's sampled
    KV-cache metrics when there were any."""
    lines = [_rule(" Serving Benchmark Result ", "="),
             _line("Successful requests:", m.completed),
             _line("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if math.isfinite(request_rate):
        lines.append(_line("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [_line("Benchmark duration (s):", m.duration, ".2f"),
              _line("Total input tokens:", m.total_input),
              _line("Total generated tokens:", m.total_output),
              _line("Request throughput (req/s):", m.request_throughput, ".2f")]
    if m.request_goodput is not None:
        lines.append(_line("Request goodput (req/s):", m.request_goodput, ".2f"))
    lines += [_line("Output token throughput (tok/s):", m.output_throughput, ".2f"),
              _line("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f"),
              _line("Peak concurrent requests:", m.max_concurrent_requests, ".2f"),
              _line("Total Token throughput (tok/s):", m.total_token_throughput, ".2f")]
    if client_busy is not None:
        lines.append(_line("Client CPU (% of one core):", 100 * client_busy, ".2f"))
    for name in selected:
        short, title = METRIC_TITLES[name]
        d = m.distributions[name]
        lines.append(_rule(title))
        lines.append(_line(f"Mean {short} (ms):", d.mean, ".2f"))
        lines.append(_line(f"Median {short} (ms):", d.median, ".2f"))
        for p, value in d.percentiles.items():
            lines.append(_line(f"P{percentile_key(p)} {short} (ms):", value, ".2f"))
    if server and server.get("num_samples"):
        lines.append(_rule("Server (sampled /metrics)"))
        rows = [("Peak KV cache usage (%):", server["max_kv_cache_usage"], 100.0),
                ("Mean KV cache usage (%):", server["mean_kv_cache_usage"], 100.0),
                ("Peak running requests:", server["max_num_requests_running"], 1.0),
                ("Peak waiting requests:", server["max_num_requests_waiting"], 1.0),
                ("Preemptions:", server["num_preemptions"], 1.0),
                ("Prefix cache hit rate (%):", server["prefix_cache_hit_rate"], 100.0)]
        lines += [_line(label, value * scale, ".2f") for label, value, scale in rows if value is not None]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def save_json(path: str | os.PathLike, data: dict[str, Any]) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path
