"""Serving metrics on synthetic streams with known timings, vLLM's table layout and JSON keys,
goodput, arrival times, and the /metrics parser."""
import math

import numpy as np
import pytest

from kvserve.bench.metrics import (RequestResult, compute_metrics, metrics_to_dict, parse_goodput,
                                   parse_percentile_args)
from kvserve.bench.report import format_serving_table
from kvserve.bench.serve import send_times
from kvserve.bench.server_metrics import ServerSample, parse_metrics, summarize


def known_results() -> list[RequestResult]:
    # A: sent at 0.0, tokens at 0.1 .. 0.5 (5 tokens), done at 0.5  -> TTFT 100 ms, TPOT 100 ms
    a = RequestResult(prompt_len=10, success=True, start=0.0, ttft=0.1, latency=0.5, itl=[0.1] * 4,
                      token_times=[0.1, 0.2, 0.3, 0.4, 0.5], output_tokens=5, generated_text="a b c d e")
    # B: sent at 0.2, tokens at 0.4, 1.2, 1.6 (3 tokens), done at 1.6 -> TTFT 200 ms, TPOT 600 ms
    b = RequestResult(prompt_len=30, success=True, start=0.2, ttft=0.2, latency=1.4, itl=[0.8, 0.4],
                      token_times=[0.4, 1.2, 1.6], output_tokens=3, generated_text="x y z")
    failed = RequestResult(prompt_len=50, success=False, start=0.3, error="HTTP 500: boom")
    return [a, b, failed]


def test_metrics_from_known_timings():
    m = compute_metrics(known_results(), duration=2.0, count_tokens=None, percentiles=[50, 99],
                        goodput={"ttft": 150})
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input, m.total_output) == (40, 8)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(24.0)
    assert m.request_goodput == pytest.approx(0.5)  # only A meets TTFT <= 150 ms
    ttft, tpot, itl, e2el = (m.distributions[k] for k in ("ttft", "tpot", "itl", "e2el"))
    assert ttft.mean == pytest.approx(150) and ttft.median == pytest.approx(150) and ttft.std == pytest.approx(50)
    assert tpot.mean == pytest.approx((100 + 600) / 2)
    assert itl.mean == pytest.approx(np.mean([100, 100, 100, 100, 800, 400]))
    assert itl.median == pytest.approx(100)
    assert itl.percentiles[99] == pytest.approx(np.percentile([100, 100, 100, 100, 800, 400], 99))
    assert e2el.mean == pytest.approx((500 + 1400) / 2)
    assert m.max_output_tokens_per_s == 6  # second [0, 1) holds A's five tokens and B's first
    assert m.max_concurrent_requests == 2
    assert m.errors == ["", "", "HTTP 500: boom"]
    assert m.output_lens == [5, 3, 0] and m.ttfts == [0.1, 0.2, 0.0]


def test_output_tokens_counted_by_tokenizer_when_server_reports_none():
    r = RequestResult(prompt_len=4, success=True, ttft=0.1, latency=0.4, itl=[0.1, 0.2], token_times=[0.1, 0.2, 0.4],
                      generated_text="one two three four")
    m = compute_metrics([r], 1.0, count_tokens=lambda text: len(text.split()), percentiles=[99])
    assert m.total_output == 4
    assert m.distributions["tpot"].mean == pytest.approx(300 / 3)
    m = compute_metrics([r], 1.0, count_tokens=None, percentiles=[99])  # no tokenizer: one token per chunk
    assert m.total_output == 3


def test_back_to_back_requests_do_not_overlap():
    rs = [RequestResult(success=True, start=s, latency=1.0, ttft=0.5, output_tokens=1) for s in (0.0, 1.0, 2.0)]
    assert compute_metrics(rs, 3.0, None, [99]).max_concurrent_requests == 1


def test_vllm_json_keys():
    m = compute_metrics(known_results(), 2.0, None, [90, 99.9], goodput=None)
    d = metrics_to_dict(m, ["ttft", "tpot", "itl", "e2el"])
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p90_ttft_ms", "p99.9_ttft_ms", "mean_tpot_ms",
                "p99.9_itl_ms", "median_e2el_ms"):
        assert key in d, key
    assert d["request_goodput"] is None
    assert d["mean_ttft_ms"] == pytest.approx(150)
    assert "p99_itl_ms" not in d  # only the percentiles asked for


def test_table_layout_matches_vllm():
    m = compute_metrics(known_results(), 2.0, None, [99], goodput={"ttft": 150})
    server = summarize([ServerSample(0.0, 0.1, 1, 0, 0, 0, 0), ServerSample(1.0, 0.6, 2, 3, 2, 100, 40)])
    table = format_serving_table(m, ["ttft", "tpot", "itl"], request_rate=math.inf, max_concurrency=4, server=server)
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     2         " in lines
    assert "Maximum request concurrency:             4         " in lines
    assert "Request goodput (req/s):                 0.50      " in lines
    assert "Mean TTFT (ms):                          150.00    " in lines
    assert "P99 TTFT (ms):" in table and "Median ITL (ms):" in table
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert "E2EL" not in table  # not selected
    assert "Request rate configured" not in table  # inf is not a configured rate
    assert "Peak KV cache usage (%):                 60.00     " in lines
    assert "Prefix cache hit rate (%):               40.00     " in lines


def test_goodput_and_percentile_flag_parsing():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)
    assert parse_percentile_args("ttft,e2el", "50,99.9") == (["ttft", "e2el"], [50.0, 99.9])
    with pytest.raises(ValueError, match="percentile-metrics"):
        parse_percentile_args("ttft,latency", "99")
    with pytest.raises(ValueError, match="metric-percentiles"):
        parse_percentile_args("ttft", "0")


def test_arrival_times():
    assert send_times(5, math.inf, 1.0, 0) == [0.0] * 5
    poisson = np.diff(send_times(4001, 10.0, 1.0, seed=1))
    assert poisson.mean() == pytest.approx(0.1, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.1)  # exponential gaps: CV = 1
    bursty = np.diff(send_times(4001, 10.0, 0.25, seed=1))
    regular = np.diff(send_times(4001, 10.0, 4.0, seed=1))
    assert bursty.mean() == pytest.approx(0.1, rel=0.1) and regular.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # Gamma: CV = 1 / sqrt(shape)
    assert regular.std() / regular.mean() == pytest.approx(0.5, rel=0.1)
    assert send_times(10, 3.0, 1.0, seed=4) == send_times(10, 3.0, 1.0, seed=4)


def test_prometheus_parsing_kvserve_and_vllm_names():
    page = "\n".join([
        "# TYPE kvserve:kv_cache_usage_perc gauge",
        'kvserve:kv_cache_usage_perc{model_name="m"} 0.25',
        "# TYPE kvserve:num_requests_running gauge",
        'kvserve:num_requests_running{model_name="m"} 3',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{model_name="m",engine="0"} 2',
        'vllm:num_requests_waiting{model_name="m",engine="1"} 5',
        "# TYPE kvserve:num_preemptions counter",
        'kvserve:num_preemptions_total{model_name="m"} 4',
        "# TYPE kvserve:prefix_cache_hits counter",
        'kvserve:prefix_cache_hits_total{model_name="m"} 30',
        "# TYPE process_cpu_seconds counter",
        "process_cpu_seconds_total 12.5",
    ]) + "\n"
    s = parse_metrics(page, t=1.5)
    assert (s.t, s.kv_cache_usage, s.running, s.waiting, s.preemptions, s.prefix_hits) == (1.5, 0.25, 3, 7, 4, 30)
    assert s.prefix_queries is None
    assert parse_metrics("# TYPE other gauge\nother 1\n", 0.0) is None


def test_summarize_counters_as_differences():
    samples = [ServerSample(0.0, 0.0, 0, 0, 5, 100, 10), ServerSample(1.0, 0.9, 8, 4, 7, 300, 110),
               ServerSample(2.0, 0.3, 2, 0, 9, 500, 210)]
    s = summarize(samples)
    assert s["max_kv_cache_usage"] == 0.9 and s["mean_kv_cache_usage"] == pytest.approx(0.4)
    assert s["max_num_requests_running"] == 8 and s["max_num_requests_waiting"] == 4
    assert s["num_preemptions"] == 4
    assert s["prefix_cache_hit_rate"] == pytest.approx(200 / 400)
    assert summarize([])["max_kv_cache_usage"] is None
