"""vLLM's logging, docs and URL flags on a real server process (tiny random llama): per-request log
lines (`--enable-log-requests`, `--enable-log-outputs`, `--max-log-len`), no access log
(`--disable-uvicorn-access-log`), no OpenAPI routes (`--disable-fastapi-docs`), usage on every
streamed chunk (`--enable-force-include-usage`), paths under a proxy's prefix (`--root-path`);
and the defaults, which log no request."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
from server_process import TINY_SERVER_ARGS

FLAGS = ("--enable-log-requests", "--enable-log-outputs", "--max-log-len", "12", "--disable-log-stats",
         "--disable-uvicorn-access-log", "--disable-fastapi-docs", "--enable-force-include-usage",
         "--root-path", "/llm")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Mr. Darcy"}], "max_tokens": 16,
        "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def logged(server_factory, tiny_llama):
    return server_factory(str(tiny_llama), *TINY_SERVER_ARGS, *FLAGS)


def log_after(server, start: int, pattern: str, timeout_s: float = 10.0) -> str:
    """The server's log written since `start` bytes, once it holds `pattern` (or the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = server.log_path.read_bytes()[start:].decode(errors="replace")
        if re.search(pattern, text) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


def test_requests_and_their_outputs_are_logged_cut_to_max_log_len(logged):
    start = len(logged.log_path.read_bytes())
    reply = httpx.post(f"{logged.base_url}/v1/chat/completions", json=CHAT, timeout=60).json()
    text = reply["choices"][0]["message"]["content"]
    log = log_after(logged, start, r"Generated response")
    received = re.search(r"Received request (chatcmpl-\S+): params: SamplingParams\((.*)\)", log)
    assert received and "max_tokens=16" in received.group(2), log
    generated = re.search(r"Generated response (chatcmpl-\S+): output: (.*), finish_reason: length", log)
    assert generated and generated.group(1) == received.group(1), log
    assert generated.group(2) == repr(text[:12])
    assert '"POST /v1/chat/completions HTTP/1.1" 200' not in log  # no access log


def test_no_docs_routes(logged, tiny_server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{logged.base_url}{path}").status_code == 404
    assert httpx.get(f"{tiny_server.base_url}/openapi.json").status_code == 200


def test_requests_come_with_the_root_path_or_without_it(logged):
    for prefix in ("/llm", ""):
        assert httpx.get(f"{logged.base_url}{prefix}/health").status_code == 200
        reply = httpx.post(f"{logged.base_url}{prefix}/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200, reply.text
    assert httpx.get(f"{logged.base_url}/llmx/health").status_code == 404  # a prefix is whole path segments


def test_the_api_key_check_sees_the_path_routing_dispatches_on():
    from kvserve.server.errors import dispatched_path

    def path(p: str, root: str = "") -> str:
        return dispatched_path({"path": p, "root_path": root})

    assert path("/llm/health", "/llm") == "/health" and path("/health", "/llm") == "/health"
    assert path("/llmhealth", "/llm") == "/llmhealth" and path("/llm", "/llm") == "/"
    assert path("/v1/models") == "/v1/models"


def test_forced_usage_on_every_chunk_and_at_the_end(logged):
    for path, body in (("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": "tiny", "prompt": "Mr. Darcy", "max_tokens": 6})):
        response = httpx.post(f"{logged.base_url}{path}", json={**body, "stream": True}, timeout=60)
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        assert all(c["usage"] is not None for c in chunks), chunks
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == body["max_tokens"]


def test_the_default_server_logs_no_request(tiny_server):
    start = len(tiny_server.log_path.read_bytes())
    httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json={**CHAT, "max_tokens": 2}, timeout=60)
    log = log_after(tiny_server, start, r'"POST /v1/chat/completions HTTP/1.1" 200')
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log  # the access log, on by default
    assert "Received request" not in log and "Generated response" not in log


@pytest.mark.parametrize("flags, message", [
    (("--enable-log-outputs",), "--enable-log-outputs requires --enable-log-requests"),
    (("--root-path", "llm/"), "--root-path must start with / and not end with one"),
])
def test_bad_logging_flags_are_one_line_errors(tiny_llama, flags, message):
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", str(tiny_llama), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1]
