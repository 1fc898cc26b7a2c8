"""`kvserve serve --tensor-parallel-size 2`: it answers the openai client, and a worker killed
mid-request fails that request, turns /health 503 and ends the server with a non-zero status,
leaving no process behind. `--tensor-parallel-size 3` on the default model (slow) answers as one
process does."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvserve import LLM, SamplingParams
from server_process import ServerProcess


def spawned_workers(pid: int) -> list[int]:
    """Child processes of `pid` started by multiprocessing's spawn (not its resource tracker)."""
    return children(pid, b"spawn_main")


def children(pid: int, marker: bytes) -> list[int]:
    """Child processes of `pid` whose command line contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and marker in cmdline:
            found.append(int(entry.name))
    return found


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


def test_sigterm_to_the_process_group_drains_then_stops_every_rank(tiny_llama, tmp_path):
    """SIGTERM to every process of the group (systemd's default stop, `kill -TERM -PGID`): the
    request in flight still finishes (the workers ignore the signal; rank 0 stops them once it is
    done), the workers stop, and the server exits 0. A worker killed by the signal used to fail it."""
    args = [str(tiny_llama), "--tensor-parallel-size", "2", "--dtype", "float32", "--kv-cache-memory", "8MiB"]
    server = ServerProcess.start(args, tmp_path, new_session=True)
    try:
        (worker,) = spawned_workers(server.process.pid)
        body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        os.killpg(server.process.pid, signal.SIGTERM)
        assert events[-1]["choices"][0]["finish_reason"] == "length", events[-1]
        assert server.process.wait(timeout=30) == 0
        assert not alive(worker)
    finally:
        server.stop()


def test_data_parallel_replicas_of_tensor_parallel_engines(tiny_llama, tmp_path):
    """`serve --data-parallel-size 2 --tensor-parallel-size 2`: two replicas of two ranks each
    behind one front end answer as one single-process engine does, and SIGTERM stops all of them."""
    common = [str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--served-model-name", "tiny"]
    prompt = "The quick brown fox jumps over the lazy dog and then"
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    expected = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    del llm
    server = ServerProcess.start([*common, "--data-parallel-size", "2", "--tensor-parallel-size", "2"], tmp_path)
    try:
        replicas = children(server.process.pid, b"kvserve.cli")
        assert len(replicas) == 2
        workers = [w for r in replicas for w in spawned_workers(r)]
        assert len(workers) == 2, "one spawned worker per replica (rank 1 of each)"
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        for stream in (False, True, False, True):  # both replicas, whichever gets it
            if stream:
                text = "".join(c.choices[0].text for c in client.completions.create(
                    model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True) if c.choices)
            else:
                text = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
            assert text == expected
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while any(alive(p) for p in replicas + workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in replicas + workers)
    finally:
        server.stop()


@pytest.mark.slow
def test_tp3_server_on_the_default_model(tmp_path):
    """`kvserve serve --tensor-parallel-size 3` on the default model (9 query heads and 3 KV heads
    over 3 ranks) answers the openai client, streamed and not, with the text one process generates
    greedily. With the GGUF's dequantized weights (--quantization none), as the HF-parity tests: with
    its int4 weights one process takes the lean decode step, whose 8-bit activations can turn a
    last-bit difference of the ranks' summation order into another token (the tiny-model TP tests
    check quantized shards within a tolerance instead)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    common = ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "256", "--quantization", "none"]
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", max_model_len=256, quantization="none")
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0),
                                                         use_tqdm=False)]
    del llm
    server = ServerProcess.start([*common, "--tensor-parallel-size", "3", "--served-model-name", "smol"], tmp_path)
    try:
        log = server.log_path.read_text()
        assert "quantization none" in log, log
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
        for prompt, text in zip(prompts, expected):
            reply = client.completions.create(model="smol", prompt=prompt, max_tokens=8, temperature=0)
            assert reply.choices[0].text == text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="smol", prompt=prompts[0], max_tokens=8, temperature=0, stream=True) if c.choices)
        assert streamed == expected[0]
    finally:
        server.stop()
