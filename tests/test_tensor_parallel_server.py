"""`kvserve serve --tensor-parallel-size 2`: it answers the openai client, and a worker killed
mid-request fails that request, turns /health 503 and ends the server with a non-zero status,
leaving no process behind."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai

from server_process import ServerProcess


def spawned_workers(pid: int) -> list[int]:
    """Child processes of `pid` started by multiprocessing's spawn (not its resource tracker)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            children.append(int(entry.name))
    return children


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_tp2_server_answers_then_fails_cleanly_when_a_worker_dies(tiny_llama, tmp_path):
    server = ServerProcess.start([str(tiny_llama), "--tensor-parallel-size", "2", "--dtype", "float32",
                                  "--kv-cache-memory", "8MiB", "--served-model-name", "tiny"], tmp_path)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("length", "stop") and reply.usage.completion_tokens > 0
        (worker,) = spawned_workers(server.process.pid)

        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 3:  # mid-request
                    os.kill(worker, signal.SIGKILL)
                    killed_at = time.monotonic()
        assert "error" in events[-1], events[-1]
        try:
            assert httpx.get(server.base_url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:  # already gone: the exit below is what matters
            pass
        assert server.process.wait(timeout=60) != 0
        assert time.monotonic() - killed_at < 60
        assert not alive(worker)
        assert spawned_workers(server.process.pid) == []
    finally:
        server.stop()


def test_sigterm_stops_every_rank(tiny_llama, tmp_path):
    """SIGTERM stops the workers too, and the server exits 0."""
    args = [str(tiny_llama), "--tensor-parallel-size", "2", "--dtype", "float32", "--kv-cache-memory", "8MiB"]
    server = ServerProcess.start(args, tmp_path)
    try:
        (worker,) = spawned_workers(server.process.pid)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        assert not alive(worker)
    finally:
        server.stop()
