"""SIGTERM while requests stream (issue 9, #5), each test against its own `kvserve serve` process:
the server stops accepting connections at once, lets the streams in flight finish within
--shutdown-timeout (then fails what is left with an SSE error event and [DONE]) and exits 0; a
second SIGTERM exits at once with status 128 + 15."""
from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
from server_process import ServerProcess

TINY = ("--dtype", "float32", "--kv-cache-memory", "8MiB")


@dataclass
class Stream:
    """One streamed completion read on its own thread."""

    url: str
    max_tokens: int
    events: list[str] = field(default_factory=list)
    error: str | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        body = {"prompt": "It is a truth universally acknowledged", "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
        self.started.set()

    def join(self) -> "Stream":
        self.thread.join(60)
        return self

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def completion_tokens(self) -> int | None:
        usage = [json.loads(e)["usage"] for e in self.events[:-1] if json.loads(e).get("usage")]
        return usage[-1]["completion_tokens"] if usage else None


def start_streams(server: ServerProcess, count: int, max_tokens: int) -> list[Stream]:
    streams = [Stream(server.base_url, max_tokens) for _ in range(count)]
    for s in streams:
        assert s.started.wait(60) and s.error is None, s.error
    return streams


def refuses_connections(server: ServerProcess) -> bool:
    """True once a new connection is refused, or closed unanswered: one accepted just as the
    listening socket closed is idle when shutdown closes the idle connections."""
    try:
        httpx.get(server.base_url + "/health", timeout=2)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


def kv_event_messages(server: ServerProcess, into: list[dict]) -> threading.Thread:
    """A thread reading the server's KV-event stream's messages into `into` until it ends;
    returned once the first one (Hello) is in."""
    first = threading.Event()

    def read() -> None:
        with httpx.stream("GET", server.base_url + "/v1/kv_events", timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    into.append(json.loads(line[5:]))
                    first.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    assert first.wait(30), "no message on the KV-event stream"
    return thread


def test_sigterm_stops_accepting_lets_streams_finish_and_exits_0(tiny_llama, tmp_path):
    """...and the KV-event stream ends with Draining (a router then sends nothing new here and
    lets these streams finish)."""
    server = ServerProcess.start([str(tiny_llama), *TINY, "--shutdown-timeout", "60"], tmp_path)
    try:
        streams = start_streams(server, 3, max_tokens=900)
        events: list[dict] = []
        reader = kv_event_messages(server, events)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not refuses_connections(server):
            assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
            time.sleep(0.02)
        streaming_when_refused = sum(not s.done for s in streams)
        for s in streams:
            s.join()
            assert s.error is None and s.done and s.completion_tokens == 900, (s.error, s.events[-2:])
        assert streaming_when_refused > 0  # the refusal came while requests were still streaming
        assert server.process.wait(timeout=30) == 0
        assert "SIGTERM: shutting down" in server.log()
        reader.join(30)
        assert events[0]["type"] == "Hello" and events[-1]["type"] == "Draining", events[-2:]
    finally:
        server.stop()


def test_streams_still_running_when_the_grace_period_ends_get_an_error_event(tiny_llama, tmp_path):
    server = ServerProcess.start([str(tiny_llama), *TINY, "--shutdown-timeout", "0"], tmp_path)
    try:
        [stream] = start_streams(server, 1, max_tokens=1000)
        server.process.send_signal(signal.SIGTERM)
        stream.join()
        assert stream.error is None and stream.done
        error = json.loads(stream.events[-2])["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]
        assert server.process.wait(timeout=30) == 0
    finally:
        server.stop()


def test_a_second_sigterm_exits_at_once(tiny_llama, tmp_path):
    # One sequence at a time: three streams of 1,000 tokens keep the server busy for seconds.
    server = ServerProcess.start([str(tiny_llama), *TINY, "--shutdown-timeout", "60", "--max-num-seqs", "1"],
                                 tmp_path)
    try:
        streams = [Stream(server.base_url, 1000) for _ in range(3)]
        assert streams[0].started.wait(60)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=10) == 128 + signal.SIGTERM
        assert not all(s.join().done for s in streams)  # it did not wait for them
        assert "SIGTERM again: exiting now" in server.log()
    finally:
        server.stop()
