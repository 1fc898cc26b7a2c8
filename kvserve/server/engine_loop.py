"""The engine in its own thread, driven from asyncio.

    HTTP handlers (event loop)                       engine thread
    submit() ──_Add──┐                          ┌──> LLMEngine.add_request
    close()  ──_Abort┼──> commands (SimpleQueue) ┼──> LLMEngine.abort_request (blocks freed now)
                     └───────────────────────────┘    LLMEngine.step() ──> outputs
    RequestStream <──── loop.call_soon_threadsafe(deliver) <──────────────────┘
                  (the outputs its reader wants: every token, every N, or the last)
    fresh_state() ──_Snapshot──> (after the commands, before the next step) engine_state ──> .state

The dashboard's state (kvserve/server/dashboard.py) is copied by the engine thread itself, when a
client asks and never unasked, so reading it never races a step.

`LLMEngine` is not thread-safe: only the engine thread touches it. It sleeps on the command
queue while it has nothing to do (no busy spin) and otherwise steps as fast as it can, taking
every queued command before each step, so new requests join the running batch at once
(continuous batching) and aborts free their blocks within one step. Torch releases the GIL inside
its kernels, so the event loop keeps serving HTTP while a step runs.

Failures (README "Guarantees"):
- A step that raises is recoverable: the requests that had started (running, or finished inside
  the failed step) fail with an EngineError (a 500, or an SSE error event), their blocks return to
  the pool and the prefix cache is emptied (the failed step may have published blocks whose K/V it
  never wrote); requests still queued run on the next step. If no request had started, the
  queued ones fail instead, so a request that breaks scheduling cannot fail every step. Under
  --async-scheduling the outputs of the step completed before the failure are delivered first
  (LLMEngine.take_salvaged_outputs): a request that step finished succeeds.
- Unrecoverable: a FatalEngineError (a tensor-parallel worker lost, in a step or while idle),
  MAX_CONSECUTIVE_FAILED_STEPS failed steps in a row (a broken device), or an
  exception anywhere else in the engine thread (e.g. while an abort frees blocks), or blocks still
  in use after the failed requests were freed. The thread stops, every request fails, /health
  turns 503 and `on_dead` runs (`kvserve serve` then exits with status 1 so a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

from kvserve.engine.errors import FatalEngineError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.request import RequestStatus
from kvserve.engine.state_view import EngineState, engine_state
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.metrics import EngineSnapshot, ServerMetrics
from kvserve.server.request_log import RequestLog

logger = logging.getLogger("kvserve.server")

Batch = list[tuple[int, RequestOutput]]


# Failed steps in a row (no step succeeding in between) after which the engine is given up.
MAX_CONSECUTIVE_FAILED_STEPS = 3


class EngineError(RuntimeError):
    """The engine failed while running a request (details are in the server log)."""

    status = 500  # the HTTP status the client gets


class EngineDeadError(EngineError):
    """The engine thread has stopped; no request can be served."""


class ShuttingDownError(EngineError):
    """The server's shutdown grace period ended before the request finished."""

    status = 503


@dataclass(frozen=True)
class PromptSpec:
    token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0


class RequestStream:
    """The outputs of one HTTP request (one engine request per prompt), read on the event loop.

    `every` says which outputs the engine thread hands over (`_due`): 1, each step's; N > 1, a
    prompt's first token at once, then each time N more tokens have come (`--stream-interval`,
    SGLang's option of that name: fewer, larger SSE events); 0, only the finished outputs (a
    response that is not streamed reads nothing else). Finished outputs always come. Outputs are
    cumulative, so skipping some loses no token. Metrics see every step's outputs regardless.

    Iterating yields batches `[(prompt_index, RequestOutput)]`: the latest cumulative output of
    each prompt that advanced since the previous batch (a slow reader skips intermediate states,
    never tokens). Iteration ends when every prompt has finished, raises `EngineError` if the
    engine failed, and ends early after `close()`. `close()` aborts whatever is unfinished;
    call it in a `finally`.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list[str], every: int = 1):
        self._engine = engine
        self.request_ids = request_ids
        self.every = every
        self._handed_tokens: dict[str, int] = {}  # engine thread only: tokens of the last output handed over
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = set(request_ids)
        self._pending: dict[int, RequestOutput] = {}
        self._error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        # The reader's wait for more, a bare future: an asyncio.Event costs a look-up of the
        # running loop (a getpid system call) each time it waits, once per token of every stream.
        self._waiter: asyncio.Future[None] | None = None
        self._accepted: asyncio.Future[None] = self._loop.create_future()
        self._closed = False

    # -- called on the engine thread
    def _due(self, output: RequestOutput) -> bool:
        """Whether this output goes to the reader (see the class docstring)."""
        if output.finished or self.every == 1:
            return True
        if self.every == 0:
            return False
        tokens = max((len(c.token_ids) for c in output.outputs), default=0)  # per choice, whatever `n`
        handed = self._handed_tokens.get(output.request_id)
        if tokens == 0 or (handed is not None and tokens - handed < self.every):
            return False
        self._handed_tokens[output.request_id] = tokens
        return True

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
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self._unfinished.clear()
        self._error = exc
        self._reject(exc)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the reader's side
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Batch:
        while not self._pending and self._error is None:
            if self._closed or not self._unfinished:
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            await self._waiter
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
        self._wake()


@dataclass
class _Add:
    stream: RequestStream
    specs: list[PromptSpec]
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _FailAll:
    error: EngineError


@dataclass
class _Fatal:
    """The engine reported it cannot run (a tensor-parallel worker died while it was idle)."""

    message: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between two steps; its result or error goes to `future`."""

    fn: Callable
    future: asyncio.Future


@dataclass
class _Snapshot:
    """Take an `EngineState` before the next step (wakes an idle engine)."""


@dataclass(frozen=True)
class StateSnapshot:
    """The engine's state between two steps, with the server's token totals at the same moment."""

    engine: EngineState
    taken_at: float  # time.monotonic()
    # time.time() at the same moment: the snapshot's identity for clients (the page draws a
    # snapshot unless it is older than the one shown), so the same for every answer that carries it.
    taken_at_wall: float
    prompt_tokens: int  # since start
    generation_tokens: int
    cost_s: float  # engine-thread time spent taking it (what watching costs the engine)


_STOP = object()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:  # on the event loop
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None, request_log: RequestLog | None = None):
        self.engine = engine
        self.metrics = metrics
        self.request_log = request_log  # --enable-log-requests (request_log.py)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # orders "engine died" against new submissions
        self.dead: BaseException | None = None
        # Called on the event loop once the engine thread has stopped for good.
        self.on_dead: Callable[[BaseException], None] | None = None
        self._failed_steps = 0  # consecutive; engine thread only
        # Written by the engine thread only; the event loop reads them (plain attribute reads).
        self.steps_completed = 0
        self.step_started_at: float | None = None  # set while a step runs
        # The dashboard's state: one snapshot request in flight at a time (event loop only).
        self.state: StateSnapshot | None = None
        self._state_waiter: asyncio.Future[None] | None = None
        self.snapshot = self._take_snapshot()  # replaced (never mutated) by the engine thread
        if metrics is not None:  # the baseline the counters' increments are measured from
            metrics.on_snapshot(self.snapshot, time.monotonic())

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the streams."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()
        parallel = getattr(self.engine, "parallel", None)
        if parallel is not None:  # a worker lost while idle stops the engine too, not only the next step
            parallel.on_failure = lambda message: self._commands.put(_Fatal(message))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; then flush the engine's KV tiers to disk (only once the thread
        has stopped: the engine is not thread-safe; and not after the engine died, when cached
        blocks may hold K/V a failed step never wrote)."""
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        if self.dead is not None:
            return
        try:
            self.engine.close()
        except Exception:
            logger.exception("flushing the KV tiers at shutdown failed")

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    async def submit(self, specs: list[PromptSpec], request_ids: list[str], every: int = 1) -> RequestStream:
        """Queue one engine request per prompt. Returns once the engine has accepted them all;
        raises the engine's ValueError (bad input, context too long) if it refused any, in which
        case none of them runs. `every`: which outputs the stream is handed (RequestStream)."""
        stream = RequestStream(self, request_ids, every)
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

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`fn(engine)` run on the engine thread between two steps (the engine is not thread-safe),
        its result returned here; what it raises is raised here."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError("the engine has stopped")
            self._commands.put(_Call(fn, future))
        return await future

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(_Abort(list(request_ids)))

    async def fresh_state(self, wait_s: float) -> StateSnapshot | None:
        """Ask the engine thread for a snapshot between its next two steps and wait up to `wait_s`
        for it; past that (a long step is running) return the latest one, None if there is none
        yet. Concurrent callers share one request, so polling clients add at most one snapshot
        per step."""
        if self._state_waiter is None or self._state_waiter.done():
            with self._lock:
                if self.dead is not None:
                    raise EngineDeadError("the engine has stopped")
                self._state_waiter = asyncio.get_running_loop().create_future()
                self._commands.put(_Snapshot())
        try:
            await asyncio.wait_for(asyncio.shield(self._state_waiter), wait_s)
        except asyncio.TimeoutError:
            pass
        return self.state

    def _publish_state(self, state: StateSnapshot) -> None:  # on the event loop
        self.state = state
        if self._state_waiter is not None and not self._state_waiter.done():
            self._state_waiter.set_result(None)

    def fail_all(self, error: EngineError) -> None:
        """Abort every request in flight, failing its stream with `error` (end of a shutdown grace)."""
        self._commands.put(_FailAll(error))

    # ------------------------------------------------------------------ engine thread
    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _run(self) -> None:
        try:
            while True:
                want_state = False
                for command in self._next_commands():
                    if command is _STOP:
                        return
                    if isinstance(command, _Add):
                        self._add(command)
                    elif isinstance(command, _Abort):
                        self._abort(command)
                    elif isinstance(command, _Snapshot):
                        want_state = True
                    elif isinstance(command, _Call):
                        self._call(command)
                    elif isinstance(command, _Fatal):
                        raise FatalEngineError(command.message)
                    else:
                        self._fail_all(command.error, abort=True)
                if want_state:  # after this batch's commands, with /metrics brought to the same moment
                    self._update_metrics()
                    self._post(self._publish_state, self._take_state())
                if self.engine.has_unfinished_requests():
                    self._step()
                self._update_metrics()
        except BaseException as exc:  # a bug or an unrecoverable engine state
            logger.exception("the engine thread stopped")
            with self._lock:
                self.dead = exc
            self._fail_all(EngineDeadError("the engine has stopped"), abort=False)
            while not self._commands.empty():
                command = self._commands.get_nowait()
                if isinstance(command, _Add):
                    self._post(command.stream._fail, EngineDeadError("the engine has stopped"))
                elif isinstance(command, _Call):
                    self._post(_settle, command.future, None, EngineDeadError("the engine has stopped"))
            if self.on_dead is not None:
                self._post(self.on_dead, exc)

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

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self.engine)
        except Exception as exc:  # the caller's error (bad input), not the engine's
            self._post(_settle, command.future, None, exc)
        else:
            self._post(_settle, command.future, result, None)

    def _add(self, command: _Add) -> None:
        added = []
        try:
            for rid, spec in zip(command.stream.request_ids, command.specs):
                self.engine.add_request({"prompt_token_ids": spec.token_ids}, spec.params, rid, spec.cache_salt,
                                        priority=spec.priority)
                added.append(rid)
                if self.request_log is not None:
                    self.request_log.received(rid, spec.token_ids, spec.params, self.engine.tokenizer.decode)
        except Exception as exc:  # ValueError: bad input, reported to the client as a 400
            for rid in added:
                self.engine.abort_request(rid)
            self._post(command.stream._reject, exc)
            return
        for rid in added:
            self._streams[rid] = command.stream
            if self.metrics is not None:
                sequences = self.engine.output_processor.sequences(rid)  # max_tokens as the engine resolved it
                self.metrics.on_arrival(rid, command.arrival_time,
                                        sequences[0].params.max_tokens if sequences else None)
        self._post(command.stream._accept)

    def _abort(self, command: _Abort) -> None:
        for rid in command.request_ids:
            self._streams.pop(rid, None)
            output = self.engine.abort_request(rid)
            if output is not None and self.metrics is not None:
                self.metrics.on_outputs([output], time.monotonic(), step=False)
            if output is not None and self.request_log is not None:
                self.request_log.finished(output)

    def _step(self) -> None:
        self.step_started_at = time.monotonic()
        try:
            outputs = self.engine.step()
        except FatalEngineError:
            raise  # nothing to recover: the engine thread stops (module docstring)
        except Exception as exc:
            self._recover(exc)
            return
        finally:
            self.steps_completed += 1
            self.step_started_at = None
        self._failed_steps = 0
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams (a finished request's stream is done)."""
        if self.metrics is not None:
            self.metrics.on_outputs(outputs, time.monotonic())
        by_stream: dict[RequestStream, list[RequestOutput]] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                if self.request_log is not None:
                    self.request_log.finished(output)
            if stream._due(output):
                by_stream[stream].append(output)
        if by_stream:
            self._post(_deliver, by_stream)

    def _recover(self, exc: Exception) -> None:
        """After a failed step: fail the requests it touched, keep the queued ones (module docstring)."""
        self._failed_steps += 1
        if self._failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise RuntimeError(f"{self._failed_steps} engine steps failed in a row") from exc
        self._deliver(self.engine.take_salvaged_outputs())  # a step completed before the failure
        started = {s for rid, s in self._streams.items() if not self.engine.is_queued(rid)}
        victims = started or set(self._streams.values())
        logger.error("engine step failed; failing %d of %d requests in flight", len(victims),
                     len(set(self._streams.values())), exc_info=exc)
        error = EngineError(f"the engine failed while generating ({type(exc).__name__}); see the server log")
        for rid in [rid for rid, stream in self._streams.items() if stream in victims]:
            del self._streams[rid]
            output = self.engine.abort_request(rid, RequestStatus.FINISHED_ERROR)
            if self.metrics is not None:
                if output is not None:
                    self.metrics.on_outputs([output], time.monotonic(), step=False)
                else:  # it finished inside the failed step; that output was lost with the step
                    self.metrics.forget(rid)
        for stream in victims:
            self._post(stream._fail, error)
        if not self.engine.kv_manager.pool.reset_prefix_cache():
            raise RuntimeError("KV blocks are still in use after the failed step's requests were freed")

    def _fail_all(self, error: EngineError, abort: bool) -> None:
        streams = set(self._streams.values())
        if abort:  # free their blocks; if even this fails, the engine thread gives up
            for rid in list(self._streams):
                output = self.engine.abort_request(rid)
                if output is not None and self.metrics is not None:
                    self.metrics.on_outputs([output], time.monotonic(), step=False)
        self._streams.clear()
        for stream in streams:
            self._post(stream._fail, error)

    def _update_metrics(self) -> None:
        self.snapshot = self._take_snapshot()
        if self.metrics is not None:
            self.metrics.on_snapshot(self.snapshot, time.monotonic())

    def _take_state(self) -> StateSnapshot:
        start = time.perf_counter()
        prompt, generation = self.metrics.token_totals() if self.metrics is not None else (0, 0)
        state = engine_state(self.engine, self.steps_completed)
        return StateSnapshot(state, time.monotonic(), time.time(), prompt, generation, time.perf_counter() - start)

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=len(e.scheduler.running), num_waiting=len(e.scheduler.waiting),
            num_blocks=e.kv_manager.pool.num_blocks, num_free_blocks=e.kv_manager.pool.num_free_blocks,
            prefix_queries=e.kv_manager.stats.queries, prefix_hits=e.kv_manager.stats.hits,
            num_preemptions=e.scheduler.num_preemptions,
            external_queries=e.kv_manager.stats.external_queries, external_hits=e.kv_manager.stats.external_hits,
            tier_hits=dict(e.kv_manager.stats.tier_hits),
            tiers=e.tiers.usage() if e.tiers is not None else None,
            speculation=None if e.drafter is None else e.drafter.stats.copy())


def _deliver(by_stream: dict[RequestStream, list[RequestOutput]]) -> None:
    for stream, outputs in by_stream.items():
        for output in outputs:
            stream._put(output)
