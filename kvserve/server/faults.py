"""Fault injection, for the reliability tests against a real server process. Off unless the
environment variable KVSERVE_FAULT_INJECTION is set (to anything but "" or "0"): only then does
`POST /debug/faults` exist, and only then are the engine's methods wrapped.

    POST /debug/faults {"kind": "step", "count": 1}   the next forward pass raises (recoverable:
                                                      the requests in that step fail, the rest go on)
    POST /debug/faults {"kind": "abort", "count": 1}  the next abort (freeing a request's blocks)
                                                      raises: the engine state is unknown, so the
                                                      engine stops, /health turns 503, the process
                                                      exits with status 1
    POST /debug/faults {"kind": "delay", "count": 5, "seconds": 0.2}
                                                      each of the next 5 forward passes first sleeps
                                                      0.2 s (a slow step, as a long prefill is);
                                                      replaces the delays still pending

The step fault raises from inside `LLMEngine.step`, after scheduling (blocks allocated, full
blocks published to the prefix cache) and before any token is appended: the state a real failure
of the forward pass (a kernel error, an out-of-memory) leaves behind. Under --async-scheduling it
raises from the launch of the next forward pass, the step in flight still to be reported.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field

from kvserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvserve.server")

FAULT_INJECTION_ENV = "KVSERVE_FAULT_INJECTION"
FaultKind = Literal["step", "abort", "delay"]


class InjectedFault(RuntimeError):
    """Raised where a fault was armed through /debug/faults."""


def fault_injection_enabled(environ: dict[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(FAULT_INJECTION_ENV, "")
    return value.strip() not in ("", "0")


class FaultInjector:
    """Counters of armed faults, set from the event loop and consumed on the engine thread."""

    def __init__(self) -> None:
        self._armed: dict[str, int] = {"step": 0, "abort": 0, "delay": 0}
        self.delay_s = 0.0
        self._lock = threading.Lock()

    def arm(self, kind: FaultKind, count: int, seconds: float = 0.0) -> dict[str, int]:
        with self._lock:
            if kind == "delay":  # replaces the delays still pending
                self._armed[kind], self.delay_s = count, seconds
            else:
                self._armed[kind] += count
            return dict(self._armed)

    def _take(self, kind: str) -> bool:
        with self._lock:
            if self._armed[kind] == 0:
                return False
            self._armed[kind] -= 1
            return True

    def _wrap(self, kind: str, fn: Callable[..., Any], what: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if kind == "step" and self._take("delay"):
                time.sleep(self.delay_s)
            if self._take(kind):
                raise InjectedFault(f"injected fault in {what}")
            return fn(*args, **kwargs)
        return wrapper

    def install(self, engine: LLMEngine) -> None:
        """Wrap the engine's forward pass and its abort on this engine object only."""
        # launch: the forward pass of both loops (ModelRunner.execute calls it)
        engine.runner.launch = self._wrap("step", engine.runner.launch, "the forward pass")
        engine.abort_request = self._wrap("abort", engine.abort_request, "abort_request")
        logger.warning("Fault injection is enabled (%s): POST /debug/faults makes the engine fail. "
                       "Never set it in production.", FAULT_INJECTION_ENV)


class FaultRequest(BaseModel):
    kind: FaultKind
    count: int = Field(default=1, ge=1, le=1000)
    seconds: float = Field(default=0.0, ge=0.0, le=60.0)  # "delay" only


def add_fault_injection(app: FastAPI, engine: LLMEngine) -> None:
    """Install the injector on `engine` (before the engine thread starts) and add its route."""
    injector = FaultInjector()
    injector.install(engine)

    @app.post("/debug/faults")
    async def arm_fault(body: FaultRequest) -> dict[str, dict[str, int]]:
        return {"armed": injector.arm(body.kind, body.count, body.seconds)}
