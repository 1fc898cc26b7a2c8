"""Per-request timings from a streamed response, and the aggregate serving metrics (vLLM's
definitions and JSON key names).

    TTFT  time to first token: request sent -> first streamed chunk with text
    TPOT  time per output token, excluding the first: (E2EL - TTFT) / (output tokens - 1), per request
    ITL   inter-token latency: the gap between successive streamed chunks (all requests pooled)
    E2EL  end-to-end latency: request sent -> last byte of the response
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds; `start` and `token_times` are on the
    benchmark's clock (seconds since it began)."""

    prompt_len: int = 0
    expected_output_len: int = 0
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    output_tokens: int | None = None  # from the server's usage report; None when it gave none
    cached_tokens: int | None = None  # prompt tokens the server did not compute (usage.prompt_tokens_details)
    generated_text: str = ""


@dataclass
class Distribution:
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile -> value

    @classmethod
    def of(cls, values_ms: list[float], percentiles: list[float]) -> "Distribution":
        arr = np.asarray(values_ms if values_ms else [0.0], dtype=np.float64)
        return cls(float(arr.mean()), float(np.median(arr)), float(arr.std()),
                   {p: float(np.percentile(arr, p)) for p in percentiles})


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    distributions: dict[str, Distribution]  # "ttft", "tpot", "itl", "e2el" in ms
    input_lens: list[int]
    output_lens: list[int]
    ttfts: list[float]  # seconds, per request (0 for failures), as vLLM saves them
    itls: list[list[float]]
    errors: list[str]
    generated_texts: list[str]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds), vLLM's --goodput."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes METRIC:MS pairs with METRIC in ttft, tpot, e2el; got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not 0 <= slos[name] < math.inf:
            raise ValueError(f"--goodput {item!r}: the limit must be a non-negative number of milliseconds")
    return slos


def _tpot(result: RequestResult, output_len: int) -> float | None:
    return (result.latency - result.ttft) / (output_len - 1) if output_len > 1 else None


def _peaks(results: list[RequestResult]) -> tuple[float, int]:
    """Highest output tokens in any whole second of the run (chunks counted at their arrival; a
    multi-token chunk counts once) and highest number of successful requests in flight at once."""
    ok = [r for r in results if r.success]
    times = [t for r in ok for t in r.token_times]
    peak_tokens = 0
    if times:
        counts = np.bincount(np.floor(np.asarray(times)).astype(np.int64))
        peak_tokens = int(counts.max())
    # at equal times an end sorts before a start: back-to-back requests do not overlap
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok])
    running = peak_running = 0
    for _, delta in events:
        running += delta
        peak_running = max(peak_running, running)
    return float(peak_tokens), peak_running


def compute_metrics(results: list[RequestResult], duration: float, count_tokens: Any | None,
                    percentiles: list[float], goodput: dict[str, float] | None = None) -> BenchmarkMetrics:
    """Aggregate the requests of one run. `count_tokens(text)` counts output tokens for servers
    that report no usage; `percentiles` are those reported (e.g. [99])."""
    input_lens, output_lens, ttfts, itls, tpots, e2els, errors, texts = [], [], [], [], [], [], [], []
    good = 0
    for r in results:
        texts.append(r.generated_text)
        errors.append(r.error)
        itls.append(list(r.itl))
        ttfts.append(r.ttft if r.success else 0.0)
        if not r.success:
            input_lens.append(0)
            output_lens.append(0)
            continue
        out = r.output_tokens if r.output_tokens is not None else (count_tokens(r.generated_text) if count_tokens else len(r.token_times))
        input_lens.append(r.prompt_len)
        output_lens.append(out)
        tpot = _tpot(r, out)
        if tpot is not None:
            tpots.append(tpot)
        e2els.append(r.latency)
        if goodput is not None:
            observed = {"ttft": r.ttft, "tpot": tpot or 0.0, "e2el": r.latency}
            good += all(observed[k] * 1000 <= limit for k, limit in goodput.items())
    completed = sum(r.success for r in results)
    ok_ttfts = [r.ttft for r in results if r.success]
    ok_itls = [x for r in results if r.success for x in r.itl]
    duration = max(duration, 1e-9)
    total_input, total_output = sum(input_lens), sum(output_lens)
    peak_tokens, peak_running = _peaks(results)
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    return BenchmarkMetrics(
        completed=completed,
        failed=len(results) - completed,
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / duration,
        request_goodput=good / duration if goodput is not None else None,
        output_throughput=total_output / duration,
        total_token_throughput=(total_input + total_output) / duration,
        max_output_tokens_per_s=peak_tokens,
        max_concurrent_requests=peak_running,
        distributions={"ttft": Distribution.of(ms(ok_ttfts), percentiles),
                       "tpot": Distribution.of(ms(tpots), percentiles),
                       "itl": Distribution.of(ms(ok_itls), percentiles),
                       "e2el": Distribution.of(ms(e2els), percentiles)},
        input_lens=input_lens, output_lens=output_lens, ttfts=ttfts, itls=itls, errors=errors,
        generated_texts=texts,
    )


def percentile_key(p: float) -> str:
    """vLLM writes p99 as "99" and p99.9 as "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def metrics_to_dict(m: BenchmarkMetrics, selected: list[str]) -> dict[str, Any]:
    """The result JSON with vLLM's keys (`mean_ttft_ms`, `p99_itl_ms`, `output_throughput`, ...)."""
    out: dict[str, Any] = {
        "duration": m.duration,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
        "input_lens": m.input_lens,
        "output_lens": m.output_lens,
        "ttfts": m.ttfts,
        "itls": m.itls,
        "generated_texts": m.generated_texts,
        "errors": m.errors,
    }
    out.update(distributions_to_dict(m, selected))
    return out


def distributions_to_dict(m: BenchmarkMetrics, selected: list[str]) -> dict[str, float]:
    """`mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ... for the selected metrics."""
    out: dict[str, float] = {}
    for name in selected:
        d = m.distributions[name]
        out[f"mean_{name}_ms"] = d.mean
        out[f"median_{name}_ms"] = d.median
        out[f"std_{name}_ms"] = d.std
        for p, value in d.percentiles.items():
            out[f"p{percentile_key(p)}_{name}_ms"] = value
    return out


def parse_percentile_args(metrics: str, percentiles: str) -> tuple[list[str], list[float]]:
    """`--percentile-metrics ttft,tpot,itl` and `--metric-percentiles 50,90,99`."""
    names = [n.strip() for n in metrics.split(",") if n.strip()]
    bad = [n for n in names if n not in METRIC_NAMES]
    if bad or not names:
        raise ValueError(f"--percentile-metrics takes a comma list of {', '.join(METRIC_NAMES)}; got {metrics!r}")
    try:
        ps = [float(p) for p in percentiles.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers like 50,90,99; got {percentiles!r}") from None
    if not ps or any(not 0 < p <= 100 for p in ps):
        raise ValueError(f"--metric-percentiles must be in (0, 100]; got {percentiles!r}")
    return names, ps
