"""Server pieces without a model: path normalisation for the API key, the body limit on chunked
uploads, and the metrics' periodic log line."""
from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.auth import APIKeyMiddleware, normalise_path
from kvserve.server.body_limit import BodySizeLimitMiddleware
from kvserve.server.metrics import EngineSnapshot, ServerMetrics


@pytest.mark.parametrize("raw, expected", [
    ("/health", "/health"), ("/HEALTH/", "/health"), ("//health//", "/health"), ("/%68ealth", "/health"),
    ("/%2568ealth", "/health"), ("/v1%2Fmodels", "/v1/models"), ("/", "/"), ("", "/"),
])
def test_normalise_path(raw, expected):
    assert normalise_path(raw) == expected


async def _echo_length(request: Request) -> PlainTextResponse:
    return PlainTextResponse(str(len(await request.body())))


def _call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(go())


def test_body_limit_counts_chunked_uploads():
    app = BodySizeLimitMiddleware(Starlette(routes=[Route("/", _echo_length, methods=["POST"])]), max_bytes=1000)

    def chunks(n: int):
        async def gen():
            for _ in range(n):
                yield b"x" * 100
        return gen()

    assert _call(app, "POST", "/", content=b"x" * 1000).text == "1000"
    assert _call(app, "POST", "/", content=chunks(10)).text == "1000"  # no Content-Length: counted as read
    response = _call(app, "POST", "/", content=chunks(11))
    assert response.status_code == 413 and "1000 bytes" in response.json()["error"]["message"]
    assert _call(app, "POST", "/", content=b"x" * 1001).status_code == 413


def test_api_key_middleware_denies_by_default():
    inner = Starlette(routes=[Route("/{path:path}", _echo_length, methods=["GET", "POST"])])
    app = APIKeyMiddleware(inner, "k")
    assert _call(app, "GET", "/anything").status_code == 401
    assert _call(app, "GET", "/anything", headers={"Authorization": "Bearer k"}).status_code == 200
    assert _call(app, "GET", "/health").status_code == 200
    assert _call(app, "GET", "/anything", headers=[("Authorization", "Bearer k"),
                                                   ("Authorization", "Bearer k")]).status_code == 401
    with pytest.raises(ValueError):
        APIKeyMiddleware(inner, "")


def _snapshot(running: int = 0, free: int = 10, queries: int = 0, hits: int = 0, preemptions: int = 0):
    return EngineSnapshot(num_running=running, num_waiting=0, num_blocks=10, num_free_blocks=free,
                          prefix_queries=queries, prefix_hits=hits, num_preemptions=preemptions)


def _output(request_id: str, num_tokens: int, finish_reason: str | None) -> RequestOutput:
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), finish_reason)
    return RequestOutput(request_id, None, [1, 2, 3], [completion], finish_reason is not None)


def test_dashboard_totals_count_prefill_only_prompts_as_metrics_does():
    """A prompt computed without a token (max_tokens 0) counts in /metrics and in the dashboard's totals
    alike (the page compares the two to know it read both at one step)."""
    metrics = ServerMetrics("m", log_interval_s=5.0)
    metrics.on_arrival("prefill-only", arrival_time=0.0)
    metrics.on_outputs([_output("prefill-only", 0, "length")], now=0.5)
    metrics.on_arrival("r", arrival_time=1.0)
    metrics.on_outputs([_output("r", 2, "length")], now=1.5)
    assert metrics.token_totals() == (6, 2)
    assert 'kvserve:prompt_tokens_total{model_name="m"} 6.0' in metrics.render().decode()


def test_a_finished_requests_phases_are_observed():
    """vLLM's request_* histograms: queued 10 -> 11, first token at 12, finished at 15 with 4 tokens."""
    metrics = ServerMetrics("m", log_interval_s=5.0)
    metrics.on_arrival("r", arrival_time=10.0, max_tokens=8)
    metrics.on_outputs([_output("r", 1, None)], now=12.0)
    done = _output("r", 4, "length")
    done.first_scheduled_time = 11.0
    metrics.on_outputs([done], now=15.0)

    def total(name: str) -> float:
        return metrics.registry.get_sample_value(f"kvserve:{name}_sum", {"model_name": "m"})

    assert total("request_queue_time_seconds") == 1.0 and total("request_prefill_time_seconds") == 1.0
    assert total("request_decode_time_seconds") == 3.0 and total("request_inference_time_seconds") == 4.0
    assert total("request_time_per_output_token_seconds") == 1.0
    assert total("request_prompt_tokens") == 3 and total("request_generation_tokens") == 4
    assert total("request_params_max_tokens") == 8 and total("request_params_n") == 1


def test_no_stats_line_without_an_interval(caplog):
    """--disable-log-stats: the counters go on, no periodic line, and an idle engine sleeps."""
    metrics = ServerMetrics("m", log_interval_s=None)
    metrics.on_snapshot(_snapshot(), now=0.0)
    with caplog.at_level(logging.INFO, logger="kvserve.server"):
        metrics.on_arrival("r", arrival_time=1.0)
        metrics.on_outputs([_output("r", 4, "length")], now=2.0)
        assert metrics.seconds_until_log(2.0) is None
        metrics.on_snapshot(_snapshot(queries=3), now=100.0)
    assert not caplog.records
    assert 'kvserve:generation_tokens_total{model_name="m"} 4.0' in metrics.render().decode()


def test_metrics_follow_a_request_and_log_once_per_interval(caplog):
    metrics = ServerMetrics("m", log_interval_s=5.0)
    metrics.on_snapshot(_snapshot(), now=0.0)
    assert metrics.seconds_until_log(0.0) is None  # idle: nothing to log, sleep until work arrives
    metrics.on_arrival("r", arrival_time=100.0)
    metrics.on_outputs([_output("r", 1, None)], now=100.5)
    metrics.on_snapshot(_snapshot(running=1, free=8, queries=3, hits=0), now=100.5)
    metrics.on_outputs([_output("r", 4, "length")], now=101.0)
    with caplog.at_level(logging.INFO, logger="kvserve.server"):
        metrics.on_snapshot(_snapshot(running=0, free=10, queries=3, hits=0, preemptions=1), now=101.0)
        assert not caplog.records  # the interval (which began at the arrival) is not over
        assert metrics.seconds_until_log(101.0) == pytest.approx(4.0)
        metrics.on_snapshot(_snapshot(queries=3, preemptions=1), now=105.0)
    [record] = caplog.records
    assert record.getMessage() == (
        "Avg prompt throughput: 0.6 tokens/s, Avg generation throughput: 0.8 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
    assert metrics.seconds_until_log(200.0) is None  # went idle after the line

    text = metrics.render().decode()
    for sample in ('kvserve:prompt_tokens_total{model_name="m"} 3.0',
                   'kvserve:generation_tokens_total{model_name="m"} 4.0',
                   'kvserve:request_success_total{finished_reason="length",model_name="m"} 1.0',
                   'kvserve:time_to_first_token_seconds_sum{model_name="m"} 0.5',
                   'kvserve:inter_token_latency_seconds_count{model_name="m"} 1.0',
                   'kvserve:e2e_request_latency_seconds_sum{model_name="m"} 1.0',
                   'kvserve:prefix_cache_queries_total{model_name="m"} 3.0',
                   'kvserve:num_preemptions_total{model_name="m"} 1.0',
                   'kvserve:kv_cache_usage_perc{model_name="m"} 0.0'):
        assert sample in text, sample


def test_a_stream_is_handed_its_first_token_then_every_n_and_the_last():
    """--stream-interval N (RequestStream._due): the first token at once, then each time N more per
    choice, and the finished output; 1 hands every step's; 0 (a response that is not streamed) only
    the finished one."""
    from kvserve.server.engine_loop import RequestStream

    async def handed(every: int, last: int) -> list[int]:
        stream = RequestStream(None, ["r"], every)
        return [n for n in range(last + 1) if stream._due(_output("r", n, "length" if n == last else None))]

    assert asyncio.run(handed(4, 10)) == [1, 5, 9, 10]
    assert asyncio.run(handed(4, 5)) == [1, 5]
    assert asyncio.run(handed(1, 3)) == [0, 1, 2, 3]
    assert asyncio.run(handed(0, 10)) == [10]


def test_the_server_freezes_its_start_up_heap_before_serving():
    """`kvserve serve` (and a tensor-parallel worker) calls settle_heap() once start-up is done: its objects
    leave the collector's full passes (gc.freeze) and the youngest generation's threshold rises.
    Run in a child process: freezing this test session's heap would outlive the test."""
    import subprocess
    import sys

    code = ("import gc; from kvserve.process_heap import settle_heap, GC_GENERATION0_THRESHOLD as T; "
            "assert gc.get_freeze_count() == 0; settle_heap(); "
            "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); assert gc.get_threshold()[0] == T > 700")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_sse_payloads_keep_line_separators_inside_the_json():
    """Pydantic writes U+2028, U+2029 and U+0085 raw; splitting the chat stream at them (as
    str.splitlines does) broke a /v1/messages or /v1/responses stream whose tokens held one."""
    from starlette.responses import StreamingResponse

    from kvserve.server.streaming import DONE, sse_payloads

    async def events():
        yield 'data: {"text": "a\u2028b\u2029c\u0085d"}\n\n'
        yield DONE

    async def read():
        return [payload async for payload in sse_payloads(StreamingResponse(events()))]

    assert asyncio.run(read()) == [{"text": "a\u2028b\u2029c\u0085d"}]


def test_the_response_store_never_forgets_a_background_response_still_running(monkeypatch):
    import kvserve.server.responses as responses

    monkeypatch.setattr(responses, "MAX_STORED", 2)
    serving = responses.ResponsesServing(chat=None)
    serving.background["running"] = object()  # its task, still going
    for name in ("running", "old", "new", "newer"):
        serving._store({"id": name}, [])
    assert list(serving.stored) == ["running", "newer"]  # the least recently used finished one went


def test_each_sequence_of_an_n_2_request_counts_as_a_request_as_vllms_children_do():
    """vLLM splits n > 1 into child requests: each has its prompt, first token, inter-token gaps,
    finish and time per output token counted; n and the longest sequence once per request; an
    engine step's tokens (prompts whose first token came, and generated ones) once per step."""
    metrics = ServerMetrics("m", log_interval_s=5.0, max_num_batched_tokens=64)

    def step(now: float, tokens: tuple[int, int], reasons: tuple[str | None, str | None]) -> None:
        completions = [CompletionOutput(i, "x" * n, list(range(n)), reason)
                       for i, (n, reason) in enumerate(zip(tokens, reasons))]
        out = RequestOutput("r", None, [1, 2, 3], completions, all(reasons))
        out.first_scheduled_time = 0.5
        metrics.on_outputs([out], now=now)

    metrics.on_arrival("r", arrival_time=0.0, max_tokens=3)
    step(1.0, (1, 1), (None, None))
    step(2.0, (2, 2), ("stop", None))
    step(3.0, (2, 3), ("stop", "length"))

    def value(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(f"kvserve:{name}", {"model_name": "m", **labels})

    assert value("request_success_total", finished_reason="stop") == 1
    assert value("request_success_total", finished_reason="length") == 1
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_max_tokens", "request_time_per_output_token_seconds"):
        assert value(f"{name}_count") == 2, name
    assert value("prompt_tokens_total") == 6 and value("generation_tokens_total") == 5
    assert value("inter_token_latency_seconds_count") == 3
    assert value("request_params_n_count") == 1 and value("request_max_num_generation_tokens_sum") == 3
    assert value("iteration_tokens_total_count") == 3 and value("iteration_tokens_total_sum") == 6 + 5
    assert value("e2e_request_latency_seconds_sum") == 2.0 + 3.0


def test_a_one_token_request_observes_a_time_per_output_token_of_0():
    metrics = ServerMetrics("m", log_interval_s=5.0)
    metrics.on_arrival("r", arrival_time=0.0)
    metrics.on_outputs([_output("r", 1, "length")], now=1.0)
    sample = metrics.registry.get_sample_value
    assert sample("kvserve:request_time_per_output_token_seconds_count", {"model_name": "m"}) == 1
    assert sample("kvserve:request_time_per_output_token_seconds_sum", {"model_name": "m"}) == 0
