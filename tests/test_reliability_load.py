"""Overload and client aborts against a real `kvserve serve` process (issue 9, #1 and #2).

The server's KV pool holds 104 blocks of 16 tokens (1,664 tokens, `--kv-cache-memory 832KiB` at
512 bytes per token for the tiny float32 llama): about 5% of the overload's 1,000 requests x
(~20 prompt + 16 generated) tokens, so the scheduler must preempt over and over. The overload
runs at full size (1,000 requests at once); benchmarks/soak.py repeats both scenarios for minutes.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest

from scenarios import HealthMonitor, aborts, book_prompts, overload, read_metrics, wait_drained

SERVER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "832KiB", "--max-model-len", "128",
               "--served-model-name", "tiny")
NUM_REQUESTS = 1000
MAX_TOKENS = 16
ABORT_MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama):
    return server_factory(str(tiny_llama), *SERVER_ARGS)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_1000_requests_at_once_into_a_pool_of_5_percent_all_complete(server):
    url = server.base_url
    before = read_metrics(url)
    with HealthMonitor(url, interval=0.1) as health:
        result = asyncio.run(overload(url, book_prompts(NUM_REQUESTS, 14), MAX_TOKENS))
    assert result.failures == [] and result.num_failures == 0
    assert result.completed == NUM_REQUESTS and result.statuses == {200: NUM_REQUESTS}
    assert health.failures == [] and health.checks >= 5, (health.failures, health.checks)

    state = wait_drained(url)
    assert state.drained, state
    after = read_metrics(url)
    assert delta(after, before, "kvserve:num_preemptions_total") > 0
    assert delta(after, before, "kvserve:request_success_total{finished_reason=length}") == NUM_REQUESTS
    assert after["kvserve:kv_cache_usage_perc"] == 0.0
    workload_tokens = (delta(after, before, "kvserve:prompt_tokens_total")
                       + delta(after, before, "kvserve:generation_tokens_total"))
    assert delta(after, before, "kvserve:generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    pool_tokens = state.num_blocks * 16
    assert 0.03 <= pool_tokens / workload_tokens <= 0.06, (pool_tokens, workload_tokens)


def reference_texts(url: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy text, one request at a time (float32: batching does not change it)."""
    texts = {}
    for prompt in prompts:
        response = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
        assert response.status_code == 200, response.text
        texts[prompt] = response.json()["choices"][0]["text"]
    return texts


def test_100_streams_with_every_10th_client_leaving_the_rest_get_exactly_their_tokens(server):
    url = server.base_url
    distinct = book_prompts(7, 12, offset=5000)
    expected = reference_texts(url, distinct, ABORT_MAX_TOKENS)
    prompts = [distinct[i % len(distinct)] for i in range(100)]
    before = read_metrics(url)
    with HealthMonitor(url) as health:
        result = asyncio.run(aborts(url, prompts, ABORT_MAX_TOKENS, abort_every=10, expected=expected))
    assert result.failures == []
    assert result.aborted == 10 and result.completed == 90
    assert health.failures == []

    state = wait_drained(url)
    assert state.drained, state  # no block leaked by the ten aborted requests
    after = read_metrics(url)
    aborted = delta(after, before, "kvserve:request_success_total{finished_reason=abort}")
    finished = delta(after, before, "kvserve:request_success_total{finished_reason=length}")
    # Every request ends once, as abort or length. The engine may run ahead of a stream's delivery:
    # a client leaving after its second event can leave after its request's last token was
    # generated, and that request rightly ends "length". Those leaving before any event abort theirs.
    assert aborted + finished == 100 and finished >= 90 and aborted >= 5, (aborted, finished)
    # The server then serves new requests normally.
    assert reference_texts(url, distinct[:1], ABORT_MAX_TOKENS) == {distinct[0]: expected[distinct[0]]}


def test_a_disconnect_frees_the_request_blocks_at_once(server):
    url = server.base_url
    before = read_metrics(url)
    body = {"prompt": "It is a truth universally acknowledged", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break  # leaving the block closes the connection mid-stream
    state = wait_drained(url, timeout=5)
    after = read_metrics(url)
    assert state.drained, state
    assert delta(after, before, "kvserve:request_success_total{finished_reason=abort}") == 1
    assert delta(after, before, "kvserve:generation_tokens_total") < 100  # stopped early, not run to the end
