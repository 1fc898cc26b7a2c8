"""Request body size limit (`--max-request-body-bytes`) as pure ASGI middleware: a body over the
limit gets a 413 with an OpenAI error body before any JSON parsing. The body is read here (at
most the limit) and replayed to the app, so the limit holds for chunked uploads too."""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import error_json


async def _send_error(send: Send, status: int, message: str) -> None:
    body = error_json(status, message)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"Request body too large: the limit is {self.max_bytes} bytes (--max-request-body-bytes)."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", ()) if k.lower() == b"content-length"), None)
        if declared is not None:
            if not declared.strip().isdigit():
                await _send_error(send, 400, "Invalid Content-Length header.")
                return
            if int(declared) > self.max_bytes:
                await _send_error(send, 413, self._too_large())
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await _send_error(send, 413, self._too_large())
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
