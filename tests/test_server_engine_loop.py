"""The engine thread behind the server, with the app served in-process (uvicorn in a thread) so a
test can make one engine step fail: only the requests in flight fail (a 500, or an SSE error event
then [DONE] once streaming has started), their blocks return to the pool, and the server goes on
serving. Also: the idle engine thread sleeps instead of spinning."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from server_process import TINY_ENGINE_OPTIONS, free_port

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.api import ServerConfig, build_app


@pytest.fixture(scope="module")
def served(tiny_llama):
    engine = LLMEngine(EngineArgs(model=str(tiny_llama), **TINY_ENGINE_OPTIONS))
    fault = threading.Event()
    real_step = engine.step

    def step():
        if fault.is_set():  # fail exactly one step
            fault.clear()
            raise RuntimeError("injected fault")
        return real_step()

    engine.step = step
    app = build_app(engine, ServerConfig(["tiny"]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(url + "/health").status_code == 200
    yield SimpleNamespace(url=url, fault=fault, async_engine=app.state.engine)
    server.should_exit = True
    thread.join(15)


def all_blocks_free(served) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snap = served.async_engine.snapshot
        if snap.num_running == 0 and snap.num_free_blocks == snap.num_blocks:
            return True
        time.sleep(0.02)
    return False


def completion(served, **overrides) -> httpx.Response:
    body = {"prompt": "Mr. Darcy", "max_tokens": 4, "temperature": 0, **overrides}
    return httpx.post(served.url + "/v1/completions", json=body, timeout=60)


def test_failed_step_fails_a_waiting_request_with_500_then_serving_continues(served):
    served.fault.set()
    response = completion(served, max_tokens=50)
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "RuntimeError" in error["message"]
    assert "injected fault" not in error["message"]  # details stay in the server log
    assert all_blocks_free(served)
    assert completion(served).status_code == 200
    assert served.async_engine.healthy


def test_failed_step_mid_stream_sends_an_error_event_then_done(served):
    request = {"prompt": "Elizabeth", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", served.url + "/v1/completions", json=request, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    served.fault.set()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error"
    assert all("error" not in json.loads(e) for e in events[:-2])
    assert len(events) < 500
    assert all_blocks_free(served)
    assert completion(served).status_code == 200


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_idle_engine_thread_sleeps(served):
    assert completion(served).status_code == 200
    [thread] = [t for t in threading.enumerate() if t.name == "kvserve-engine"]

    def cpu_ticks() -> int:
        fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    start = cpu_ticks()
    time.sleep(1.0)
    # A spinning thread would burn ~one tick per 1/CLK_TCK s; a sleeping one burns none.
    assert cpu_ticks() - start <= os.sysconf("SC_CLK_TCK") // 10
