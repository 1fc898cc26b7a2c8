"""Server-sent events, and noticing a client that went away.

A client that disconnects aborts its request, streaming or not, so its KV blocks return to the
pool at once instead of after the last token nobody will read.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.server.errors import error_body

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(event: BaseModel) -> str:
    return f"data: {event.model_dump_json()}\n\n"


def sse_error(status: int, message: str) -> str:
    """An error after the stream started: OpenAI's error object as an event (then send DONE)."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"


async def sse_payloads(response: StreamingResponse) -> AsyncIterator[dict]:
    """The JSON payloads of a `data:` event stream (ours, read back by an endpoint that re-tells
    the chat stream in another API's events), up to `[DONE]`."""
    async for raw in response.body_iterator:
        # "\n" only: splitlines() would also split the JSON at U+2028, U+2029 or U+0085 in a token
        for line in (raw if isinstance(raw, str) else raw.decode()).split("\n"):
            if line.startswith("data: ") and line != DONE.strip():
                yield json.loads(line[len("data: "):])


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` that calls `on_close` however the response ends: finished, client gone
    (Starlette cancels the body iterator when it sees the disconnect) or failed."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await `work`, but give up (cancel it, raise ClientDisconnected) if the client leaves first.
    The request body must already have been read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        left = not task.done()
        if left:
            task.cancel()
    if left or task.cancelled():
        # A cancelled task is only done once it has run again: wait for that (its outcome has
        # no one to go to), then report.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    return task.result()
