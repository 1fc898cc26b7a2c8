"""Load scenarios that check the server's guarantees from the outside, over HTTP. The reliability
tests (tests/test_reliability_*.py, which put this folder on sys.path in tests/conftest.py) run them
at CI size, benchmarks/soak.py at full size for minutes. Not part of the package: they only drive
a server.

- `overload`: every request at once (rate inf), ignore_eos; each must finish with exactly
  max_tokens tokens: no failure, no 5xx, whatever the KV pool's size.
- `aborts`: concurrent streams; every `abort_every`-th client leaves, alternately right after the
  response headers (before any token) and after two events (mid-stream); the others must receive
  exactly their tokens ([DONE], usage, and the expected text when given).
- `HealthMonitor` polls /health from a thread meanwhile; `wait_drained` then checks the pool
  through /metrics: nothing running or waiting, free blocks == total blocks.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvserve.bench.datasets import BOOK_PATH as BOOK

MAX_FAILURES_KEPT = 20
Prompt = str | list[int]  # text, or token ids


def book_prompts(count: int, words_per_prompt: int, offset: int = 0) -> list[str]:
    """`count` distinct prompts: consecutive slices of the bundled novel (no shared prefixes)."""
    words = BOOK.read_text().split()
    start = offset * words_per_prompt
    return [" ".join(words[(start + i * words_per_prompt + j) % len(words)] for j in range(words_per_prompt))
            for i in range(count)]


@dataclass
class ScenarioResult:
    name: str
    requests: int
    completed: int = 0  # finished with exactly the expected tokens
    aborted: int = 0  # clients that left on purpose
    num_failures: int = 0
    failures: list[str] = field(default_factory=list)  # the first MAX_FAILURES_KEPT, for the report
    statuses: Counter = field(default_factory=Counter)
    wall_s: float = 0.0

    def fail(self, reason: str) -> None:
        self.num_failures += 1
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append(reason)

    @property
    def http_5xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def _client(base_url: str, concurrency: int, headers: dict[str, str] | None, timeout: float) -> httpx.AsyncClient:
    # One fresh connection per request: no keep-alive connection can be closed under a request.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits)


def _body(prompt: Prompt, max_tokens: int, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def overload(base_url: str, prompts: list[Prompt], max_tokens: int, headers: dict[str, str] | None = None,
                   timeout: float = 600.0) -> ScenarioResult:
    result = ScenarioResult("overload", len(prompts))

    async def one(client: httpx.AsyncClient, prompt: Prompt) -> None:
        try:
            response = await client.post("/v1/completions", json=_body(prompt, max_tokens, stream=False))
        except httpx.HTTPError as exc:
            result.fail(f"{type(exc).__name__}: {exc}")
            return
        result.statuses[response.status_code] += 1
        if response.status_code != 200:
            result.fail(f"HTTP {response.status_code}: {response.text[:300]}")
            return
        data = response.json()
        tokens, reason = data["usage"]["completion_tokens"], data["choices"][0]["finish_reason"]
        if tokens != max_tokens or reason != "length":
            result.fail(f"{tokens} tokens (finish_reason {reason}), expected {max_tokens}")
            return
        result.completed += 1

    start = time.monotonic()
    async with _client(base_url, len(prompts), headers, timeout) as client:
        await asyncio.gather(*(one(client, p) for p in prompts))
    result.wall_s = time.monotonic() - start
    return result


async def aborts(base_url: str, prompts: list[Prompt], max_tokens: int, abort_every: int = 10,
                 expected: dict[str, str] | None = None, headers: dict[str, str] | None = None,
                 timeout: float = 600.0) -> ScenarioResult:
    """`expected`: text prompt -> the text its stream must deliver (greedy, so known beforehand)."""
    result = ScenarioResult("aborts", len(prompts))

    async def one(client: httpx.AsyncClient, i: int, prompt: Prompt) -> None:
        leave_after = None if i % abort_every else (0 if (i // abort_every) % 2 == 0 else 2)  # events read
        text, usage, done, events = "", None, False, 0
        try:
            async with client.stream("POST", "/v1/completions", json=_body(prompt, max_tokens, stream=True)) as r:
                result.statuses[r.status_code] += 1
                if r.status_code != 200:
                    result.fail(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                    return
                if leave_after == 0:  # leaving the block without reading drops the connection
                    result.aborted += 1
                    return
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.fail(f"error event: {event['error']['message']}")
                        return
                    text += "".join(c["text"] for c in event["choices"])
                    usage = event.get("usage") or usage
                    events += 1
                    if events == leave_after:
                        result.aborted += 1
                        return
        except httpx.HTTPError as exc:
            result.fail(f"{type(exc).__name__}: {exc}")
            return
        tokens = usage["completion_tokens"] if usage else None
        if not done or tokens != max_tokens:
            result.fail(f"stream ended with{'' if done else 'out'} [DONE] after {tokens} tokens, "
                        f"expected {max_tokens}")
        elif expected is not None and text != expected[prompt]:
            result.fail(f"wrong text for prompt {i}: {text[:60]!r} != {expected[prompt][:60]!r}")
        else:
            result.completed += 1

    start = time.monotonic()
    async with _client(base_url, len(prompts), headers, timeout) as client:
        await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))
    result.wall_s = time.monotonic() - start
    return result


class BackgroundPoller:
    """`with Poller(...) as p:` runs `_run` on a daemon thread until the block ends; `_run` loops
    until `self._stop` is set, waiting on it between polls."""

    def __init__(self, name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        raise NotImplementedError


class HealthMonitor(BackgroundPoller):
    """`with HealthMonitor(url) as health:` polls GET /health every `interval` s from a thread, on
    a new connection each time, and records every answer that is not a 200 within `timeout`."""

    def __init__(self, base_url: str, interval: float = 0.2, timeout: float = 10.0):
        super().__init__("health-monitor")
        self.url = base_url + "/health"
        self.interval, self.timeout = interval, timeout
        self.checks = 0
        self.failures: list[str] = []
        self.max_latency_s = 0.0

    def _run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=self.timeout, limits=limits) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    status = client.get(self.url).status_code
                    if status != 200:
                        self.failures.append(f"HTTP {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.max_latency_s = max(self.max_latency_s, time.monotonic() - start)
                self.checks += 1
                self._stop.wait(self.interval)


def read_metrics(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """kvserve's samples as {"name": value}, or {"name{label=value}": value} for labels other than
    model_name (e.g. `kvserve:request_success_total{finished_reason=abort}`)."""
    text = httpx.get(base_url + "/metrics", headers=headers, timeout=30).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("kvserve:"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


@dataclass(frozen=True)
class PoolState:
    running: int
    waiting: int
    num_blocks: int
    num_free_blocks: int

    @property
    def drained(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.num_free_blocks == self.num_blocks


def pool_state(base_url: str, headers: dict[str, str] | None = None) -> PoolState:
    m = read_metrics(base_url, headers)
    return PoolState(int(m["kvserve:num_requests_running"]), int(m["kvserve:num_requests_waiting"]),
                     int(m["kvserve:kv_cache_num_blocks"]), int(m["kvserve:kv_cache_num_free_blocks"]))


def wait_drained(base_url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> PoolState:
    """The pool once drained, or its last state when `timeout` passes first (the caller checks)."""
    deadline = time.monotonic() + timeout
    while True:
        state = pool_state(base_url, headers)
        if state.drained or time.monotonic() > deadline:
            return state
        time.sleep(0.05)
