"""Request ids a client chooses, as vLLM takes them: the `X-Request-Id` header, else the body's
`request_id`, names a chat or completions response (`chatcmpl-<id>`, `cmpl-<id>`), so that a
client's or a proxy's id can be found in the server's answer. The engine's own id stays unique
(the client's id plus a random suffix): two requests that send one id, a retry beside the
original, do not collide. `--enable-request-id-headers` echoes the header (or a fresh id) on
every response (vLLM's XRequestIdMiddleware)."""
from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"


def request_ids(prefix: str, request: Request, body_id: str | None) -> tuple[str, str]:
    """(the response's id, the engine's id) for a request."""
    chosen = request.headers.get("x-request-id") or body_id
    if not chosen:
        response_id = f"{prefix}{uuid.uuid4().hex}"
        return response_id, response_id
    response_id = f"{prefix}{chosen}"
    return response_id, f"{response_id}-{uuid.uuid4().hex[:12]}"


class RequestIdHeaderMiddleware:
    """Every HTTP response carries `X-Request-Id`: the request's, or a new one."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers", ()) if k.lower() == HEADER), None)
        value = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, value)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
