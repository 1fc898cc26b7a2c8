"""How `kvserve serve` stops: uvicorn's server with kvserve's signal and exit rules.

    SIGTERM / Ctrl-C ──> stop accepting (the listening socket closes), idle connections close
        │                requests in flight keep streaming
        ├── all finished ─────────────────────────────────────────────> exit 0
        ├── --shutdown-timeout s passed ──> the rest fail (503; SSE error event, [DONE]) ──> exit 0
        └── a second SIGTERM / Ctrl-C ──> exit at once, status 128 + signal number
    engine thread died ──> in-flight requests already failed ──> same shutdown ──> exit 1

uvicorn's own handler re-raises the signal after a graceful shutdown (so the process dies by the
signal, not with status 0) and only lets a second Ctrl-C, not a second SIGTERM, cut the wait
short; hence this subclass.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from types import FrameType
from typing import Callable, Iterator

import uvicorn

logger = logging.getLogger("kvserve.server")

EXIT_ENGINE_DEAD = 1
# After the grace period has failed the remaining requests, how long their connections get to
# deliver that error before uvicorn cancels them.
_BACKSTOP_S = 5.0


class ServingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float, on_grace_expired: Callable[[], None]):
        if shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {shutdown_timeout}")
        config.timeout_graceful_shutdown = shutdown_timeout + _BACKSTOP_S
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.on_grace_expired = on_grace_expired
        self.exit_code = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            logger.warning("%s again: exiting now, cutting %d open connection(s)", name,
                           len(self.server_state.connections))
            os._exit(128 + sig)
        logger.info("%s: shutting down; requests in flight get up to %.0f s to finish (send %s again to "
                    "exit now)", name, self.shutdown_timeout, name)
        self.should_exit = True

    def stop(self, exit_code: int) -> None:
        """Shut down as after a signal, then exit with `exit_code` (called on the event loop)."""
        self.exit_code = exit_code
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._grace_expired)
        try:
            await super().shutdown(sockets)
        finally:
            grace.cancel()

    def _grace_expired(self) -> None:
        if self.server_state.connections:
            logger.warning("--shutdown-timeout (%.0f s) passed: failing the requests still in flight",
                           self.shutdown_timeout)
            self.on_grace_expired()
