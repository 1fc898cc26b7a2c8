"""The engine in its own thread, driven from asyncio.

    HTTP handlers (event loop)                       engine thread
    submit() ──_Add──┐                          ┌──> LLMEngine.add_request
    close()  ──_Abort┼──> commands (SimpleQueue) ┼──> LLMEngine.abort_request (blocks freed now)
                     └───────────────────────────┘    LLMEngine.step() ──> outputs
    RequestStream <──── loop.call_soon_threadsafe(deliver) <──────────────────┘

`LLMEngine` is not thread-safe: only the engine thread touches it. It sleeps on the command
queue while it has nothing to do (no busy spin) and otherwise steps as fast as it can, taking
every queued command before each step, so new requests join the running batch at once
(continuous batching) and aborts free their blocks within one step. Torch releases the GIL inside
its kernels, so the event loop keeps serving HTTP while a step runs.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.metrics import EngineSnapshot, ServerMetrics

logger = logging.getLogger("kvserve.server")

Batch = list[tuple[int, RequestOutput]]


class EngineError(RuntimeError):
    """The engine failed while running a request (details are in the server log)."""


class EngineDeadError(EngineError):
    """The engine thread has stopped; no request can be served."""


@dataclass(frozen=True)
class PromptSpec:
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None


class RequestStream:
    """The outputs of one HTTP request (one engine request per prompt), read on the event loop.

    Iterating yields batches `[(prompt_index, RequestOutput)]`: the latest cumulative output of
    each prompt that advanced since the previous batch (a slow reader skips intermediate states,
    never tokens). Iteration ends when every prompt has finished, raises `EngineError` if the
    engine failed, and ends early after `close()`. `close()` aborts whatever is unfinished;
    call it in a `finally`.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = set(request_ids)
        self._pending: dict[int, RequestOutput] = {}
        self._error: BaseException | None = None
        self._wakeup = asyncio.Event()
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closed = False

    # -- called on the event loop by the engine thread (through call_soon_threadsafe)
    def _accept(self) -> None:
        if not self._accepted.done():
            self._accepted.set_result(None)

    def _reject(self, exc: BaseException) -> None:
        self._unfinished.clear()
        if not self._accepted.done():
            self._accepted.set_exception(exc)

    def _put(self, output: RequestOutput) -> None:
        if self._closed:
            return
        self._pending[self._index[output.request_id]] = output
        if output.finished:
            self._unfinished.discard(output.request_id)
        self._wakeup.set()

    def _fail(self, exc: BaseException) -> None:
        self._unfinished.clear()
        self._error = exc
        self._reject(exc)
        self._wakeup.set()

    # -- the reader's side
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Batch:
        while not self._pending and self._error is None:
            if self._closed or not self._unfinished:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        if self._error is not None:
            raise self._error
        batch = sorted(self._pending.items())
        self._pending.clear()
        return batch

    def close(self) -> None:
        """Stop reading; abort every unfinished prompt (its blocks return to the pool)."""
        if self._closed:
            return
        self._closed = True
        if self._unfinished:
            self._engine.abort(sorted(self._unfinished))
            self._unfinished.clear()
        self._wakeup.set()


@dataclass
class _Add:
    stream: RequestStream
    specs: list[PromptSpec]
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # orders "engine died" against new submissions
        self.dead: BaseException | None = None
        self.snapshot = self._take_snapshot()  # replaced (never mutated) by the engine thread
        if metrics is not None:  # the baseline the counters' increments are measured from
            metrics.on_snapshot(self.snapshot, time.monotonic())

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    async def submit(self, specs: list[PromptSpec], request_ids: list[str]) -> RequestStream:
        """Queue one engine request per prompt. Returns once the engine has accepted them all;
        raises the engine's ValueError (bad input, context too long) if it refused any, in which
        case none of them runs."""
        stream = RequestStream(self, request_ids)
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError("the engine has stopped")
            self._commands.put(_Add(stream, specs, time.monotonic()))
        try:
            await stream._accepted
        except BaseException:
            stream.close()
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(list(request_ids)))

    # ------------------------------------------------------------------ engine thread
    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _run(self) -> None:
        try:
            while True:
                for command in self._next_commands():
                    if command is _STOP:
                        return
                    if isinstance(command, _Add):
                        self._add(command)
                    else:
                        self._abort(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                self.snapshot = self._take_snapshot()
                if self.metrics is not None:
                    self.metrics.on_snapshot(self.snapshot, time.monotonic())
        except BaseException as exc:  # a bug or an unrecoverable engine state
            logger.exception("the engine thread stopped")
            with self._lock:
                self.dead = exc
            self._fail_all(EngineDeadError("the engine has stopped"), abort=False)
            while not self._commands.empty():
                command = self._commands.get_nowait()
                if isinstance(command, _Add):
                    self._post(command.stream._fail, EngineDeadError("the engine has stopped"))

    def _next_commands(self) -> list:
        """Every queued command; blocks while the engine is idle (waking for a due log line)."""
        commands = []
        if not self.engine.has_unfinished_requests():
            timeout = self.metrics.seconds_until_log(time.monotonic()) if self.metrics else None
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while not self._commands.empty():
            commands.append(self._commands.get_nowait())
        return commands

    def _add(self, command: _Add) -> None:
        added = []
        try:
            for rid, spec in zip(command.stream.request_ids, command.specs):
                self.engine.add_request({"prompt_token_ids": spec.token_ids}, spec.params, rid, spec.cache_salt)
                added.append(rid)
        except Exception as exc:  # ValueError: bad input, reported to the client as a 400
            for rid in added:
                self.engine.abort_request(rid)
            self._post(command.stream._reject, exc)
            return
        for rid in added:
            self._streams[rid] = command.stream
            if self.metrics is not None:
                self.metrics.on_arrival(rid, command.arrival_time)
        self._post(command.stream._accept)

    def _abort(self, command: _Abort) -> None:
        for rid in command.request_ids:
            self._streams.pop(rid, None)
            output = self.engine.abort_request(rid)
            if output is not None and self.metrics is not None:
                self.metrics.on_outputs([output], time.monotonic())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            self._fail_all(EngineError(f"the engine failed while generating ({type(exc).__name__}); "
                                       f"see the server log"), abort=True)
            return
        if self.metrics is not None:
            self.metrics.on_outputs(outputs, time.monotonic())
        by_stream: dict[RequestStream, list[RequestOutput]] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            by_stream[stream].append(output)
        if by_stream:
            self._post(_deliver, by_stream)

    def _fail_all(self, error: EngineError, abort: bool) -> None:
        streams = set(self._streams.values())
        if abort:  # free their blocks; if even this fails, the engine thread gives up
            for rid in list(self._streams):
                self.engine.abort_request(rid)
        self._streams.clear()
        for stream in streams:
            self._post(stream._fail, error)

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_blocks=e.kv_manager.pool.num_blocks, num_free_blocks=e.kv_manager.pool.num_free_blocks,
            prefix_queries=e.kv_manager.stats.queries, prefix_hits=e.kv_manager.stats.hits,
            num_preemptions=e.scheduler.num_preemptions)


def _deliver(by_stream: dict[RequestStream, list[RequestOutput]]) -> None:
    for stream, outputs in by_stream.items():
        for output in outputs:
            stream._put(output)
