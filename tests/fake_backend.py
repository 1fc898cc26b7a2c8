"""A stand-in OpenAI backend for router tests, run as its own process: `python fake_backend.py PORT`.
It is not kvserve (no event stream), so a router uses it by load and reads its health from /health.
What it does with a completion depends on the prompt:
  "hang"   never answers;
  "die"    exits at once, the connection dropped without an answer;
  "slow:S" answers after S seconds, unless its client leaves first (GET /left lists those prompts);
  anything else is answered at once, echoing the prompt's length (as SSE if "stream" is true).
GET /v1/responses/ID answers 401 without the key "right-key", else 404 (it stores none).
With `--kv-events` it is a replica as a router sees one: GET /v1/kv_events says Hello, then a
keepalive every second; after POST /drain (a replica shutting down, which still answers what it
holds) the stream says Draining and ends, and new streams are refused (503)."""
from __future__ import annotations

import asyncio
import json
import os
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def completions(request: Request) -> Response:
    body = json.loads(await request.body())
    prompt = body.get("prompt", "")
    if prompt == "hang":
        await asyncio.sleep(3600)
    if prompt == "die":
        os._exit(1)
    if isinstance(prompt, str) and prompt.startswith("slow:"):
        end = asyncio.get_running_loop().time() + float(prompt[5:])
        while asyncio.get_running_loop().time() < end:
            if await request.is_disconnected():
                LEFT.append(prompt)
                return Response(status_code=499)
            await asyncio.sleep(0.1)
    answer = {"object": "text_completion", "choices": [{"index": 0, "text": f"{len(prompt)}", "finish_reason": "stop"}]}
    if body.get("stream"):
        async def events():
            for i in range(3):
                yield f"data: {json.dumps({**answer, 'choices': [{'index': 0, 'text': str(i)}]})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse(answer)


LEFT: list[str] = []  # prompts whose client left before their answer


async def left(request: Request) -> Response:
    return JSONResponse(LEFT)


async def stored_response(request: Request) -> Response:
    if request.headers.get("authorization") != "Bearer right-key":
        return JSONResponse({"error": {"message": "Invalid API key", "type": "authentication_error"}},
                            status_code=401)
    return JSONResponse({"error": {"message": "no such response", "type": "invalid_request_error"}}, status_code=404)


DRAINING = asyncio.Event()


async def drain(request: Request) -> Response:
    DRAINING.set()
    return Response(status_code=200)


async def kv_events(request: Request) -> Response:
    hello = {"type": "Hello", "replica": {"instance_id": f"fake-{os.getpid()}", "namespace": "fake",
                                          "block_size": 16, "prefix_caching": True}}
    if DRAINING.is_set():
        return Response(status_code=503)

    async def events():
        yield f"data: {json.dumps(hello)}\n\n"
        while not DRAINING.is_set():
            await asyncio.sleep(0.2)
            yield ": keepalive\n\n"
        yield f"data: {json.dumps({'type': 'Draining'})}\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


routes = [Route("/health", health), Route("/v1/completions", completions, methods=["POST"]), Route("/left", left),
          Route("/v1/responses/{response_id}", stored_response)]
if "--kv-events" in sys.argv:
    routes += [Route("/v1/kv_events", kv_events), Route("/drain", drain, methods=["POST"])]
app = Starlette(routes=routes)

if __name__ == "__main__":
    # A "hang" request would hold a graceful shutdown for its hour: stop within a second instead.
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_graceful_shutdown=1)
