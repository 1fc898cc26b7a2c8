"""A streaming client for any OpenAI-compatible server (kvserve, vLLM, SGLang, llama.cpp): one
request per call, timed chunk by chunk from the server-sent events.

On aiohttp, as vLLM's and SGLang's benchmark clients are: a client that reads every token's event
must cost far less per event than the server's own work, or a fast server is measured at the
client's speed (BENCHMARKS.md, "The benchmark client's own cost")."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvserve.bench.datasets import SampleRequest
from kvserve.bench.metrics import RequestResult

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # more request fields (e.g. priority)

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
    body.update(config.extra_body)
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


def http_session(request_timeout: float | None = None) -> aiohttp.ClientSession:
    """One session for a run: unlimited connections, kept alive; `request_timeout` seconds at
    most between two reads of a response (None: no limit), 30 s to connect; proxies from the
    environment (HTTP_PROXY, NO_PROXY), as httpx and vLLM's client take them. Call it inside the
    event loop that uses it."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=True,
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0,
                                                               sock_read=request_timeout))


async def send_request(session: aiohttp.ClientSession, config: ClientConfig, sample: SampleRequest,
                       t0: float) -> RequestResult:
    """Send one streamed request and time it. Never raises for server or network failures: they
    come back as `success=False` with the error text."""
    result = RequestResult(prompt_len=sample.prompt_len, expected_output_len=sample.expected_output_len)
    start = time.perf_counter()
    result.start = start - t0
    stream = _Stream(result, config.chat, start, t0)
    try:
        async with session.post(config.url, json=payload(config, sample), headers=config.headers()) as response:
            if response.status != 200:
                result.error = error_message(response.status, await response.read())
                return result
            pending = b""
            async for block in response.content.iter_any():
                if stream.over:  # read on to the end, so the connection can be kept for another request
                    continue
                if b"\n" not in block:
                    pending += block
                    continue
                *lines, pending = (pending + block).split(b"\n")
                stream.read(lines)
            if not stream.over:
                stream.read([pending])
            if stream.failed:
                return result
    except aiohttp.ConnectionTimeoutError:
        result.error = f"timed out connecting to {config.url} ({session.timeout.sock_connect} s)"
        return result
    except asyncio.TimeoutError:
        if not stream.over or stream.failed:  # else only the end after [DONE] was slow: the answer is whole
            result.error = f"timed out (no reply for {session.timeout.sock_read} s) waiting for {config.url}"
            return result
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc or 'request failed'} ({config.url})"
        return result
    except (ValueError, TypeError, AttributeError) as exc:  # a data line that is not a JSON object
        result.error = f"malformed event stream: {exc}"
        return result
    result.latency = (stream.ended or time.perf_counter()) - start
    if not stream.pieces:  # e.g. an immediate end-of-sequence: the only "token" is the end
        result.ttft = result.latency
    result.generated_text = "".join(stream.pieces)
    result.success = True
    return result


class _Stream:
    """A streamed response's events as they arrive: each chunk's text timed (TTFT, ITL), usage
    read, an error event kept."""

    def __init__(self, result: RequestResult, chat: bool, start: float, t0: float):
        self.result, self.chat, self.start, self.t0 = result, chat, start, t0
        self.last = start
        self.pieces: list[str] = []
        self.over = False  # [DONE] or an error event came
        self.ended: float | None = None  # when [DONE] came: the response's end, as far as timing goes
        self.failed = False  # an error event came

    def read(self, lines: list[bytes]) -> None:
        """Handle complete lines, up to the end of the stream ([DONE] or an error event)."""
        result = self.result
        for line in lines:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[5:].strip()
            if data == b"[DONE]":
                self.over, self.ended = True, time.perf_counter()
                return
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                result.error = str(err.get("message", err) if isinstance(err, dict) else err) or "an error event"
                self.over = self.failed = True
                return
            now = time.perf_counter()
            text = _chunk_text(chunk, self.chat)
            if text:
                if not self.pieces:
                    result.ttft = now - self.start
                else:
                    result.itl.append(now - self.last)
                self.last = now
                self.pieces.append(text)
                result.token_times.append(now - self.t0)
            usage = chunk.get("usage")
            if usage:
                result.output_tokens = usage.get("completion_tokens", result.output_tokens)
                result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
                details = usage.get("prompt_tokens_details")
                if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                    result.cached_tokens = details["cached_tokens"]


async def list_models(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> list[str]:
    """Model ids from GET /v1/models. Raises ValueError with a one-line reason when unreachable."""
    url = base_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=30.0)) as response:
            status, body = response.status, await response.read()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ValueError(f"cannot reach the server at {base_url} ({type(exc).__name__}: {exc or 'no answer'}); "
                         "is it running? (check --base-url)") from None
    if status != 200:
        raise ValueError(f"GET {url} failed: {error_message(status, body)}")
    try:
        return [m["id"] for m in json.loads(body).get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"GET {url} did not return an OpenAI model list") from None


def served_models(base_url: str, api_key: str | None) -> list[str]:
    """list_models from outside an event loop (a CLI's start)."""
    async def listed() -> list[str]:
        async with http_session() as session:
            return await list_models(session, base_url, api_key)

    return asyncio.run(listed())


async def served_max_model_len(session: aiohttp.ClientSession, config: ClientConfig) -> int | None:
    """The model's `max_model_len` from GET /v1/models (vLLM and kvserve list it); None when the
    server does not say or cannot be asked."""
    url = config.base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=config.headers(), timeout=aiohttp.ClientTimeout(total=30.0)) as response:
            entries = (await response.json(content_type=None)).get("data", []) if response.status == 200 else []
        lengths = [m.get("max_model_len") for m in entries if m.get("id") == config.model]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
        return None
    return lengths[0] if lengths and isinstance(lengths[0], int) else None
