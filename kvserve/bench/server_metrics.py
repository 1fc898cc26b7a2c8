"""Sample a server's Prometheus `/metrics` while a benchmark runs: KV cache usage, running and
waiting requests, preemptions and prefix-cache counters over time.

kvserve exports vLLM's metric names under its own prefix (`kvserve:kv_cache_usage_perc`, ...);
vLLM's own (`vllm:...`) are read the same way. `kv_cache_usage_perc` is a fraction (1 = full),
as in vLLM. Servers without these metrics (llama.cpp, SGLang) simply yield no samples.

Prefix-cache counters are prompt tokens: `prefix_cache_queries`/`prefix_cache_hits` for the
device pool, `external_prefix_cache_*` for a KV connector (vLLM's names), and kvserve's
`prefix_cache_tier_hits{tier="host"|"disk"}` for its offload tiers. A tier's hit rate is its hits
over the pool's queries (every prompt token looked up), so pool + host + disk is the fraction of
prompt tokens not computed. A server without the tier counters gets no tier rates (None).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PREFIXES = ("kvserve:", "vllm:")
# metric name without prefix (and without a counter's _total) -> ServerSample field
FIELDS = {
    "kv_cache_usage_perc": "kv_cache_usage",
    "gpu_cache_usage_perc": "kv_cache_usage",  # vLLM v0's name
    "num_requests_running": "running",
    "num_requests_waiting": "waiting",
    "num_preemptions": "preemptions",
    "prefix_cache_queries": "prefix_queries",
    "prefix_cache_hits": "prefix_hits",
    "external_prefix_cache_queries": "external_queries",
    "external_prefix_cache_hits": "external_hits",
}
TIER_HITS = "prefix_cache_tier_hits"  # labelled by tier; one ServerSample field per tier
TIERS = ("host", "disk")


@dataclass
class ServerSample:
    t: float  # seconds since the benchmark began
    kv_cache_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    external_queries: float | None = None
    external_hits: float | None = None
    host_hits: float | None = None  # kvserve's offload tiers
    disk_hits: float | None = None


def parse_metrics(text: str, t: float) -> ServerSample | None:
    """One sample from a Prometheus text page; values summed over label sets (vLLM labels by
    model and engine). None when the page holds none of the known metrics."""
    sample = ServerSample(t)
    found = False
    for family in text_string_to_metric_families(text):
        if any(family.name == p + TIER_HITS for p in PREFIXES):
            # the server has tiers: a tier with no hits yet (no labelled sample) has 0
            found = True
            for tier in TIERS:
                setattr(sample, f"{tier}_hits", getattr(sample, f"{tier}_hits") or 0.0)
        for s in family.samples:
            prefix = next((p for p in PREFIXES if s.name.startswith(p)), None)
            if prefix is None:
                continue
            name = s.name[len(prefix):].removesuffix("_total")
            field_name = FIELDS.get(name)
            if name == TIER_HITS and s.labels.get("tier") in TIERS:
                field_name = f"{s.labels['tier']}_hits"
            if field_name is None:
                continue
            found = True
            setattr(sample, field_name, (getattr(sample, field_name) or 0.0) + float(s.value))
    return sample if found else None


class MetricsSampler:
    """Polls `url` every `interval` seconds until `stop()`; keeps every parsed sample. If the very
    first poll fails (no /metrics, not Prometheus text, none of the known names) sampling ends
    quietly; a later failure (a slow reply under load) only loses that sample."""

    def __init__(self, client: aiohttp.ClientSession, url: str, interval: float, t0: float):
        self.client, self.url, self.interval, self.t0 = client, url, interval, t0
        self.samples: list[ServerSample] = []
        self.unavailable: str | None = None
        self._stop = asyncio.Event()

    async def sample_once(self) -> bool:
        try:
            async with self.client.get(self.url, timeout=aiohttp.ClientTimeout(total=10.0)) as response:
                response.raise_for_status()
                text = await response.text()
            sample = parse_metrics(text, time.perf_counter() - self.t0)
        except Exception as exc:  # any failure just means: no server metrics for this run
            self.unavailable = f"{type(exc).__name__}: {exc}"
            return False
        if sample is None:
            self.unavailable = "no kvserve:/vllm: metrics on the page"
            return False
        self.samples.append(sample)
        return True

    async def run(self) -> None:
        while not self._stop.is_set():
            if not await self.sample_once() and not self.samples:
                logger.info("not sampling %s (%s)", self.url, self.unavailable)
                return
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()


def summarize(samples: list[ServerSample]) -> dict[str, Any]:
    """Peaks and totals over the run (counters as the difference between last and first sample)."""
    def values(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    def delta(name: str) -> float | None:
        v = values(name)
        return v[-1] - v[0] if v else None

    usage, running, waiting = values("kv_cache_usage"), values("running"), values("waiting")
    queries, hits = delta("prefix_queries"), delta("prefix_hits")
    ext_queries, ext_hits = delta("external_queries"), delta("external_hits")

    def share(part: float | None, whole: float | None) -> float | None:
        return part / whole if whole and part is not None else None

    return {
        "num_samples": len(samples),
        "max_kv_cache_usage": max(usage) if usage else None,
        "mean_kv_cache_usage": sum(usage) / len(usage) if usage else None,
        "max_num_requests_running": max(running) if running else None,
        "mean_num_requests_running": sum(running) / len(running) if running else None,
        "max_num_requests_waiting": max(waiting) if waiting else None,
        "num_preemptions": delta("preemptions"),
        "prefix_cache_hit_rate": share(hits, queries),  # the pool's
        "host_prefix_cache_hit_rate": share(delta("host_hits"), queries),
        "disk_prefix_cache_hit_rate": share(delta("disk_hits"), queries),
        "external_prefix_cache_hit_rate": share(ext_hits, ext_queries),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "host_prefix_cache_hits": delta("host_hits"),
        "disk_prefix_cache_hits": delta("disk_hits"),
    }


def samples_to_dicts(samples: list[ServerSample]) -> list[dict[str, Any]]:
    return [asdict(s) for s in samples]
