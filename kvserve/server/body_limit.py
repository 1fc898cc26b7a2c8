"""Request body size limits as pure ASGI middleware: a body over `--max-request-body-bytes` gets a
413 with an error body (errors.py) before any JSON parsing, and while the bodies of the requests in
flight already hold `--max-body-bytes-in-flight` bytes, another large one gets a 503 instead of
growing the process (memory per queued request is bounded, and so is their sum). The body is
read here (at most the limit) and replayed to the app, so the limits hold for chunked uploads too."""
from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import dispatched_path, error_json

# Before a 413, read and drop up to this much of what the client is still sending. Closing a
# connection with unread data makes the kernel reset it, and a client still writing its body can
# lose the 413 before it reads it (nginx's "lingering close" exists for the same reason).
_DRAIN_BYTES = 1 << 20
_DRAIN_SECONDS = 1.0  # a client that stalls instead still gets its 413 this soon


async def _send_error(scope: Scope, send: Send, status: int, message: str) -> None:
    body = error_json(status, message, path=dispatched_path(scope))
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive) -> None:
    async def read() -> None:
        drained = 0
        while drained <= _DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    try:
        await asyncio.wait_for(read(), _DRAIN_SECONDS)
    except asyncio.TimeoutError:
        pass


def _header(scope: Scope, name: bytes) -> bytes | None:
    """The value of request header `name` (lower-case), or None."""
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, max_bytes_in_flight: int | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.max_bytes_in_flight = max_bytes_in_flight or 4 * max_bytes
        self.bytes_in_flight = 0  # the bodies of the requests being read or handled

    def _too_large(self) -> str:
        return f"Request body too large: the limit is {self.max_bytes} bytes (--max-request-body-bytes)."

    def _too_many(self) -> str:
        return (f"The server is busy: the requests in flight already hold {self.bytes_in_flight} bytes of request "
                f"bodies (--max-body-bytes-in-flight {self.max_bytes_in_flight}); retry later.")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held = 0

        def hold(size: int) -> bool:
            """Count `size` more bytes of this body; False when the in-flight budget cannot take them."""
            nonlocal held
            if size > 0 and self.bytes_in_flight + size > self.max_bytes_in_flight:
                return False
            self.bytes_in_flight += size
            held += size
            return True

        try:
            await self._read_and_handle(scope, receive, send, hold)
        finally:
            self.bytes_in_flight -= held

    async def _read_and_handle(self, scope: Scope, receive: Receive, send: Send, hold) -> None:
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                await _send_error(scope, send, 400, "Invalid Content-Length header.")
                return
            if int(declared) > self.max_bytes:
                if _header(scope, b"expect") is None:  # a client waiting for "100 Continue" sends nothing
                    await _drain(receive)
                await _send_error(scope, send, 413, self._too_large())
                return
            if not hold(int(declared)):
                await _drain(receive)
                await _send_error(scope, send, 503, self._too_many())
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                await _send_error(scope, send, 413, self._too_large())
                return
            if declared is None and not hold(len(chunk)):
                if message.get("more_body", False):
                    await _drain(receive)
                await _send_error(scope, send, 503, self._too_many())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect notice

        await self.app(scope, replay, send)
