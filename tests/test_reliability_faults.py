"""Engine faults (issue 9, #7), injected through KVSERVE_FAULT_INJECTION's /debug/faults into real
`kvserve serve` processes: a failed step fails only the requests it was running (a 500, or an SSE
error event and [DONE]; on /v1/messages, Anthropic's error event) while queued requests still run,
the prefix cache is not left pointing at blocks the failed step never wrote, and an unrecoverable
failure (an abort that cannot free its blocks; failed steps in a row) turns /health 503 and makes
the process exit with status 1. A slow first step (an injected delay) shows that a chat stream's
first chunk waits for its first token."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient
from server_process import ServerProcess

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.api import ServerConfig, build_app
from kvserve.server.engine_loop import MAX_CONSECUTIVE_FAILED_STEPS
from kvserve.server.faults import FAULT_INJECTION_ENV, fault_injection_enabled
from scenarios import book_prompts, pool_state, read_metrics, wait_drained

FAULTS_ON = {FAULT_INJECTION_ENV: "1"}
TINY = ("--dtype", "float32", "--kv-cache-memory", "8MiB", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama):
    """One sequence at a time, so a second request waits in the queue while the first runs."""
    return server_factory(str(tiny_llama), *TINY, "--max-num-seqs", "1", env=FAULTS_ON)


def arm(url: str, kind: str, count: int = 1) -> None:
    response = httpx.post(url + "/debug/faults", json={"kind": kind, "count": count}, timeout=10)
    assert response.status_code == 200, response.text


def complete(url: str, prompt: str, max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **extra})


def data_lines(lines) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_failed_step_fails_the_running_stream_while_the_queued_request_runs(server):
    fail_the_running_stream_while_the_queued_request_runs(server.base_url)


def test_under_async_scheduling_too(server_factory, tiny_llama):
    """The fault fires on the overlapped loop's launch; the step in flight is reported first."""
    async_server = server_factory(str(tiny_llama), *TINY, "--max-num-seqs", "1", "--async-scheduling",
                                  env=FAULTS_ON)
    fail_the_running_stream_while_the_queued_request_runs(async_server.base_url)


def fail_the_running_stream_while_the_queued_request_runs(url: str) -> None:
    [prompt_a, prompt_b] = book_prompts(2, 10, offset=300)
    expected_b = complete(url, prompt_b, 32).json()["choices"][0]["text"]
    before = read_metrics(url)
    body = {"prompt": prompt_a, "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as stream_a, \
            ThreadPoolExecutor(1) as pool:
        lines = stream_a.iter_lines()
        first = data_lines(next(lines) for _ in range(4))  # a couple of events: A is running
        b = pool.submit(complete, url, prompt_b, 32)
        wait_for(lambda: pool_state(url).waiting == 1)  # B queued behind A (--max-num-seqs 1)
        arm(url, "step")
        rest = data_lines(lines)
        response_b = b.result()
    events = first + rest
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "engine failed" in error["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert len(events) < 900
    assert response_b.status_code == 200 and response_b.json()["choices"][0]["text"] == expected_b
    assert wait_drained(url).drained
    after = read_metrics(url)
    assert after["kvserve:request_success_total{finished_reason=error}"] - \
        before.get("kvserve:request_success_total{finished_reason=error}", 0) == 1


def test_a_failed_step_ends_an_anthropic_stream_with_an_error_event(server):
    """/v1/messages re-tells chat's error event as Anthropic's `error` event (which its SDK raises),
    and sends neither message_delta nor message_stop after it."""
    url = server.base_url
    body = {"model": "tiny", "max_tokens": 900, "stream": True, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": book_prompts(1, 10, offset=500)[0]}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = [next(lines) for _ in range(9)]  # message_start, the text block's start, a delta
        arm(url, "step")
        received = [*first, *lines]
    events = [line.removeprefix("event: ") for line in received if line.startswith("event: ")]
    datas = data_lines(received)
    assert events[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert events[-1] == "error" and "message_stop" not in events and "message_delta" not in events
    error = json.loads(datas[-1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "engine failed" in error["error"]["message"]
    assert wait_drained(url).drained


def test_a_failed_step_ends_a_responses_stream_with_response_failed(server):
    """/v1/responses ends a stream the engine failed with OpenAI's response.failed (the event the
    openai-agents SDK and others stop on), the response `failed` with its error and the partial
    output; stored, GET shows it, and continuing from it is refused."""
    url = server.base_url
    body = {"model": "tiny", "max_output_tokens": 900, "stream": True, "temperature": 0, "ignore_eos": True,
            "input": book_prompts(1, 10, offset=520)[0]}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        first = [next(lines) for _ in range(15)]  # created, in_progress, the message's opening, deltas
        arm(url, "step")
        events = [json.loads(data) for data in data_lines([*first, *lines])]
    assert events[-1]["type"] == "response.failed"
    assert all(e["type"] not in ("error", "response.completed", "response.incomplete") for e in events)
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "engine failed" in failed["error"]["message"]
    assert failed["error"]["code"] == "server_error"
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    [message] = failed["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == streamed != ""
    stored = httpx.get(f"{url}/v1/responses/{failed['id']}", timeout=10).json()
    assert stored["status"] == "failed" and stored["error"] == failed["error"]
    follow_up = httpx.post(url + "/v1/responses", timeout=60, json={
        "model": "tiny", "input": "Go on", "max_output_tokens": 4, "previous_response_id": failed["id"]})
    assert follow_up.status_code == 400 and follow_up.json()["error"]["param"] == "previous_response_id"
    assert wait_drained(url).drained


def test_a_chat_streams_first_chunk_comes_with_its_first_token(server):
    """vLLM sends the role delta with the first token: a client that times the first chunk with
    choices (vLLM's benchmark does) then times the first token, and the chunk's usage counts the
    prompt's cached tokens as every later chunk does."""
    url = server.base_url
    body = {"messages": [{"role": "user", "content": book_prompts(1, 40, offset=500)[0]}], "max_tokens": 4,
            "temperature": 0}
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 200  # cache the prompt
    response = httpx.post(url + "/debug/faults", json={"kind": "delay", "count": 1, "seconds": 1.5}, timeout=10)
    assert response.status_code == 200, response.text
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=streamed, timeout=60) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        waited = time.monotonic() - start
        rest = data_lines(lines)
    assert waited >= 1.5
    chunks = [json.loads(first.removeprefix("data: "))] + [json.loads(event) for event in rest[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    cached = {chunk["usage"]["prompt_tokens_details"]["cached_tokens"] for chunk in chunks}
    assert len(cached) == 1 and cached.pop() > 0, cached


def test_a_failed_step_is_a_500_with_an_error_body_and_serving_continues(server):
    url = server.base_url
    arm(url, "step")
    response = complete(url, "Mr. Darcy", 8)
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "server_error"
    assert complete(url, "Mr. Darcy", 8).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


def test_a_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(server):
    """The failed prefill had published its full blocks (their K/V were to be written by that very
    step); after the failure the same prompt must be computed afresh, not read from them."""
    url = server.base_url
    [prompt] = book_prompts(1, 80, offset=40)
    reference = complete(url, prompt, 16, cache_salt="reference").json()["choices"][0]["text"]
    arm(url, "step")
    assert complete(url, prompt, 16, cache_salt="victim").status_code == 500
    again = complete(url, prompt, 16, cache_salt="victim").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["text"] == reference


def test_an_abort_that_cannot_free_its_blocks_stops_the_server_with_status_1(tiny_llama, tmp_path):
    server = ServerProcess.start([str(tiny_llama), *TINY], tmp_path, FAULTS_ON)
    try:
        arm(server.base_url, "abort")  # the next abort raises inside the engine thread
        body = {"prompt": "Elizabeth", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", server.base_url + "/v1/completions", json=body) as survivor:
                lines = survivor.iter_lines()
                next(lines)
                with client.stream("POST", server.base_url + "/v1/completions", json=body):
                    pass  # leaves at once: its abort is the one that fails
                events = data_lines(lines)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert server.process.wait(timeout=30) == 1
        log = server.log()
        assert "the engine thread stopped" in log and "injected fault in abort_request" in log
    finally:
        server.stop()


def test_fault_injection_is_off_without_the_environment_variable(tiny_server):
    response = httpx.post(tiny_server.base_url + "/debug/faults", json={"kind": "step"})
    assert response.status_code == 404
    assert not fault_injection_enabled({}) and not fault_injection_enabled({FAULT_INJECTION_ENV: "0"})
    assert fault_injection_enabled({FAULT_INJECTION_ENV: "1"})


def test_failed_steps_in_a_row_turn_health_503_and_call_on_dead(tiny_llama):
    """A step that fails again and again (a broken device) is unrecoverable: the engine thread
    stops, /health says 503 and `on_dead` (which makes `kvserve serve` exit 1) runs once."""
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB"))
    app = build_app(engine, ServerConfig(["tiny"], fault_injection=True))
    dead: list[BaseException] = []
    app.state.engine.on_dead = dead.append
    with TestClient(app) as client:
        assert client.post("/debug/faults", json={"kind": "step", "count": 99}).status_code == 200
        body = {"prompt": "Hi", "max_tokens": 4}
        statuses = [client.post("/v1/completions", json=body).status_code
                    for _ in range(MAX_CONSECUTIVE_FAILED_STEPS)]
        assert statuses == [500] * MAX_CONSECUTIVE_FAILED_STEPS
        wait_for(lambda: len(dead) == 1)
        assert client.get("/health").status_code == 503
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503 and "cannot take requests" in refused.json()["error"]["message"]
