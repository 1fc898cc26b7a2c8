"""Connection hygiene for `kvserve serve`: read timeouts and a connection limit that cannot lock
out /health.

uvicorn's HTTP/1.1 protocol (h11) times out only the idle gap after a response; a connection
that sends nothing, trickles its request head or stops sending its body is held forever, and
enough of them (no key needed) exhaust the process's file descriptors. This subclass adds:

- a header timeout: a request head must be complete within `header_timeout` of the connection
  opening or of the previous response;
- a body timeout: a request body may pause for at most `body_timeout` between reads;
- a connection limit below the file-descriptor limit. At the limit, a new connection closes the
  oldest connection that is waiting for a request head (the "slowloris" kind) instead of being
  refused, so /health from a fresh connection is answered while the limit is exhausted by idle
  clients; only when every connection is busy with a request does a new one get a 503.

Each kind of closing is logged once, on its first occurrence, not per connection.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("kvserve.server")

# File descriptors kept back from the connection limit (model files, logs, the tokenizer's).
RESERVED_FDS = 128


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float
    body_timeout: float
    max_connections: int


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as vLLM does); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 65536 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections() -> int:
    return max(16, raise_fd_limit() - RESERVED_FDS)


class _LogOnce:
    def __init__(self) -> None:
        self._said: set[str] = set()

    def __call__(self, kind: str, message: str) -> None:
        if kind not in self._said:
            self._said.add(kind)
            logger.warning("%s (logged once; later ones are not)", message)


# accept() and socket errors a flood repeats: out of descriptors or kernel memory.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
LOOP_ERROR_LOG_INTERVAL_S = 10.0


def install_loop_error_throttle(loop: asyncio.AbstractEventLoop,
                                interval_s: float = LOOP_ERROR_LOG_INTERVAL_S) -> None:
    """Log the event loop's out-of-resource errors (a descriptor flood makes asyncio report every
    failed accept() with a traceback) as one line per interval with their count; others as before."""
    previous = loop.get_exception_handler()
    state = {"count": 0, "logged_at": float("-inf")}

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
            state["count"] += 1
            now = loop.time()
            if now - state["logged_at"] >= interval_s:
                logger.warning("%s: %s (%d times since the last such line; logged at most every %g s)",
                               context.get("message", "event loop error"), exc.strerror, state["count"], interval_s)
                state["count"], state["logged_at"] = 0, now
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
                  b"content-length: %d\r\n\r\n%s")


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """An H11Protocol class enforcing `limits` (uvicorn.Config(http=...) takes a class)."""
    log_once = _LogOnce()
    # The connections waiting for a request head, oldest wait first: the limit closes the first one
    # in O(1), since a flood reaches the limit once per new connection.
    waiting_heads: OrderedDict[H11Protocol, None] = OrderedDict()
    busy_body = json.dumps({"error": {
        "message": f"the server holds its maximum of {limits.max_connections} connections, all busy with "
                   "requests; retry later", "type": "ServiceUnavailableError", "param": None, "code": 503}}).encode()

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._body_timer: asyncio.TimerHandle | None = None
            if len(self.connections) > limits.max_connections and not self._make_room():
                log_once("busy", f"connection limit ({limits.max_connections}, --max-connections) reached with "
                                 f"every connection busy: new connections get a 503")
                transport.write(_BUSY_RESPONSE % (len(busy_body), busy_body))
                transport.close()
                return
            self._arm_head_timer()

        def _make_room(self) -> bool:
            """Close the connection that has waited longest for a request head; False if none does."""
            while waiting_heads:
                oldest = next(iter(waiting_heads))
                if oldest._waiting_for_head():
                    log_once("limit", f"connection limit ({limits.max_connections}, --max-connections) reached: "
                                      f"closing the connections that have waited longest without sending a request")
                    oldest._close()
                    return True
                del waiting_heads[oldest]  # closing already: connection_lost cancels its timers
            return False

        def _waiting_for_head(self) -> bool:
            return not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete)

        def _close(self) -> None:
            self._cancel_timers()
            if not self.transport.is_closing():
                self.transport.close()

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(limits.header_timeout, self._head_timed_out)
                waiting_heads[self] = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            waiting_heads.pop(self, None)
            if self._waiting_for_head():
                log_once("header", f"closing connections that sent no complete request head within "
                                   f"{limits.header_timeout:g} s (--timeout-header)")
                self._close()

        def _body_timed_out(self) -> None:
            self._body_timer = None
            if self.flow.read_paused:  # the server stopped reading (its buffer is full), not the client
                self._body_timer = self.loop.call_later(limits.body_timeout, self._body_timed_out)
                return
            if self.cycle is not None and self.cycle.more_body and not self.cycle.response_complete:
                log_once("body", f"closing connections whose request body paused for more than "
                                 f"{limits.body_timeout:g} s (--timeout-body)")
                self._close()

        def _cancel_timers(self) -> None:
            for timer in (self._head_timer, self._body_timer):
                if timer is not None:
                    timer.cancel()
            self._head_timer = self._body_timer = None
            waiting_heads.pop(self, None)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing() or self.cycle is None or self.cycle.response_complete:
                return  # still waiting for a head: its timer keeps running
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
                waiting_heads.pop(self, None)
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            if self.cycle.more_body:
                self._body_timer = self.loop.call_later(limits.body_timeout, self._body_timed_out)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            if not self.transport.is_closing():
                self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timers()
            super().connection_lost(exc)

    return GuardedH11Protocol
