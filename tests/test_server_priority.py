"""`--scheduling-policy priority` (vLLM's): a request's `priority` (or an X-Vllm-Priority header)
decides which waiting request runs first; under the default fcfs a priority other than 0 is
refused, never ignored. Real server processes (tiny random llama) and the offline `LLM`."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_process import TINY_ENGINE_OPTIONS, TINY_SERVER_ARGS

from kvserve import LLM, SamplingParams

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Mr. Darcy"}], "max_tokens": 2}


def wait_for(condition, timeout_s: float = 30.0):
    """Poll until condition() is truthy (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


@pytest.mark.parametrize("path, body, headers", [
    ("/v1/chat/completions", {**CHAT, "priority": 3}, {}),
    ("/v1/completions", {"model": "tiny", "prompt": "Mr. Darcy", "max_tokens": 2, "priority": -1}, {}),
    ("/v1/chat/completions", CHAT, {"X-Vllm-Priority": "2"}),
    ("/v1/responses", {"model": "tiny", "input": "Mr. Darcy", "max_output_tokens": 2, "priority": 1}, {}),
    ("/v1/embeddings", {"model": "tiny", "input": "Mr. Darcy", "priority": 5}, {}),
])
def test_fcfs_refuses_a_priority_it_would_ignore(tiny_server, path, body, headers):
    response = httpx.post(f"{tiny_server.base_url}{path}", json=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "Priority scheduling is not enabled" in error["message"]
    assert "--scheduling-policy priority" in error["message"]
    assert error["param"] == "priority"


def test_priority_zero_and_bad_values(tiny_server):
    url = tiny_server.base_url
    assert httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "priority": 0}, timeout=60).status_code == 200
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"X-Vllm-Priority": "0"},
                      timeout=60).status_code == 200
    not_int = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"X-Vllm-Priority": "high"}, timeout=60)
    assert not_int.status_code == 400 and "X-Vllm-Priority header must be an integer" in not_int.text
    for value in (1.5, "1", 1 << 63):
        assert httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "priority": value},
                          timeout=60).status_code == 400
    anthropic = httpx.post(f"{url}/v1/messages", json={**CHAT, "priority": 2}, timeout=60)
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert "Priority scheduling is not enabled" in anthropic.json()["error"]["message"]


def test_the_most_urgent_waiting_request_runs_first(server_factory, tiny_llama):
    """One sequence at a time: while a long stream runs, a lax request (priority 10) and then an
    urgent one (priority -1 by header, overriding its body's 10) queue; when the stream ends the
    urgent one is admitted first and answers first, though it arrived last."""
    server = server_factory(str(tiny_llama), *TINY_SERVER_ARGS, "--scheduling-policy", "priority",
                            "--max-num-seqs", "1")
    url = server.base_url
    finished: list[str] = []

    def send(name: str, headers: dict[str, str]) -> None:
        body = {"model": "tiny", "prompt": f"{name} said", "max_tokens": 8, "ignore_eos": True, "priority": 10}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        finished.append(name)

    long = {"model": "tiny", "prompt": "Elizabeth", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=120) as stream:
        lines = stream.iter_lines()
        assert sum(1 for _, line in zip(range(4), lines) if line.startswith("data: ")) >= 2  # it runs
        lax = threading.Thread(target=send, args=("lax", {}))
        lax.start()
        assert wait_for(lambda: server.metrics()["kvserve:num_requests_waiting"] == 1), "the lax request never queued"
        urgent = threading.Thread(target=send, args=("urgent", {"X-Vllm-Priority": "-1"}))
        urgent.start()
        assert wait_for(lambda: server.metrics()["kvserve:num_requests_waiting"] == 2), "the urgent one never queued"
    # Leaving the block aborts the stream: its place goes to the most urgent waiting request.
    lax.join(120)
    urgent.join(120)
    assert finished == ["urgent", "lax"]


def test_offline_generate_orders_prompts_by_priority(tiny_llama):
    order: list[int] = []

    def params(index: int) -> SamplingParams:
        def note_first_step(ids: list[int], row):
            if not ids:  # the request's first sampled token: it was scheduled now
                order.append(index)
            return row
        return SamplingParams(max_tokens=2, ignore_eos=True, logits_processors=[note_first_step])

    llm = LLM(str(tiny_llama), **TINY_ENGINE_OPTIONS, max_num_seqs=1, scheduling_policy="priority")
    outputs = llm.generate(["a", "b", "c", "d"], [params(i) for i in range(4)], use_tqdm=False,
                           priority=[3, 0, 3, -2])
    assert order == [3, 1, 0, 2] and [len(o.outputs[0].token_ids) for o in outputs] == [2] * 4
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False, priority=[1])
    fcfs = LLM(str(tiny_llama), **TINY_ENGINE_OPTIONS)
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        fcfs.generate(["a"], SamplingParams(max_tokens=1), use_tqdm=False, priority=1)
