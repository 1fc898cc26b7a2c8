"""The `kv_eviction` request field of `kvserve serve`: a request under eviction is not bound by the
context length, and bad settings are a 400 with OpenAI's error body."""
from __future__ import annotations

import httpx
import pytest

TIMEOUT = httpx.Timeout(120)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", **body}, timeout=TIMEOUT)


def test_request_under_eviction_runs_past_the_context_length(tiny_server):
    body = {"prompt": "It is a truth universally acknowledged", "max_tokens": 1100, "ignore_eos": True,
            "temperature": 0}
    assert post(tiny_server, body).status_code == 400  # 1024-token model
    response = post(tiny_server, {**body, "kv_eviction": {"policy": "streaming", "budget": 128}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 1100


@pytest.mark.parametrize("kv_eviction, fragment", [
    ({"policy": "lru", "budget": 64}, "unknown KV eviction policy 'lru'"),
    ({"policy": "h2o"}, "needs a budget"),
    ({"policy": "h2o", "budget": 4096}, "at most max-model-len"),
    ({"policy": "streaming", "budget": 64, "window": 8}, "window"),
    ({"policy": "streaming", "budget": "lots"}, "budget"),
    ({"budget": 64}, "only apply(s) under a KV eviction policy"),  # this server runs none by default
])
def test_bad_kv_eviction_is_a_400(tiny_server, kv_eviction, fragment):
    response = post(tiny_server, {"prompt": "Hello", "max_tokens": 4, "kv_eviction": kv_eviction})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"], error


@pytest.mark.parametrize("policy", ["snapkv", "tova"])
def test_every_registered_policy_is_accepted(tiny_server, policy):
    body = {"prompt": "It is a truth universally acknowledged", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "kv_eviction": {"policy": policy, "budget": 64, "sink_tokens": 2}}
    response = post(tiny_server, body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 200
