"""A streaming client for any OpenAI-compatible server (kvserve, vLLM, SGLang, llama.cpp): one
request per call, timed chunk by chunk from the server-sent events."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# httpx logs every request at INFO; a benchmark sends thousands.
logging.getLogger("httpx").setLevel(logging.WARNING)


@dataclass
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/" + self.endpoint.lstrip("/")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def check_endpoint(endpoint: str) -> None:
    if not endpoint.rstrip("/").endswith("completions"):
        raise ValueError(f"--endpoint must be an OpenAI completions endpoint ({' or '.join(ENDPOINTS)}), got {endpoint!r}")


def payload(config: ClientConfig, sample: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": sample.expected_output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.chat:
        body["messages"] = sample.messages or [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension, also understood by kvserve and SGLang
    return body


def error_message(status: int, body: bytes) -> str:
    """`HTTP 400: <message>` from an OpenAI-style error body, or the body's start."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message") if isinstance(err, dict) else None
        text = str(message or err)
    except ValueError:
        pass
    return f"HTTP {status}: {text[:300]}"


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, config: ClientConfig, sample: SampleRequest,
                       t0: float) -> RequestResult:
    """Send one streamed request and time it. Never raises for server or network failures: they
    come back as `success=False` with the error text."""
    result = RequestResult(prompt_len=sample.prompt_len, expected_output_len=sample.expected_output_len)
    start = time.perf_counter()
    result.start = start - t0
    last = start
    pieces: list[str] = []
    try:
        async with client.stream("POST", config.url, json=payload(config, sample), headers=config.headers()) as response:
            if response.status_code != 200:
                result.error = error_message(response.status_code, await response.aread())
                return result
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    result.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    return result
                now = time.perf_counter()
                text = _chunk_text(chunk, config.chat)
                if text:
                    if not pieces:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    pieces.append(text)
                    result.token_times.append(now - t0)
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                    result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
    except httpx.TimeoutException as exc:
        result.error = f"timed out ({type(exc).__name__}) waiting for {config.url}"
        return result
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc or 'request failed'} ({config.url})"
        return result
    except ValueError as exc:  # a data line that is not JSON
        result.error = f"malformed event stream: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if not pieces:  # e.g. an immediate end-of-sequence: the only "token" is the end
        result.ttft = result.latency
    result.generated_text = "".join(pieces)
    result.success = True
    return result


async def list_models(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> list[str]:
    """Model ids from GET /v1/models. Raises ValueError with a one-line reason when unreachable."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.get(url, headers=headers, timeout=30.0)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc or 'no answer'}); "
                         "is it running? (check --base-url)") from None
    if response.status_code != 200:
        raise ValueError(f"GET {url} failed: {error_message(response.status_code, response.content)}")
    try:
        return [m["id"] for m in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"GET {url} did not return an OpenAI model list") from None
