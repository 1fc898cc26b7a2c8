"""A stand-in OpenAI backend for router tests, run as its own process: `python fake_backend.py PORT`.
It is not kvserve (no event stream), so a router uses it by load and reads its health from /health.
What it does with a completion depends on the prompt:
  "hang"   never answers;
  "die"    exits at once, the connection dropped without an answer;
  "slow:S" answers after S seconds;
  anything else is answered at once, echoing the prompt's length (as SSE if "stream" is true)."""
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
        await asyncio.sleep(float(prompt[5:]))
    answer = {"object": "text_completion", "choices": [{"index": 0, "text": f"{len(prompt)}", "finish_reason": "stop"}]}
    if body.get("stream"):
        async def events():
            for i in range(3):
                yield f"data: {json.dumps({**answer, 'choices': [{'index': 0, 'text': str(i)}]})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse(answer)


app = Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])

if __name__ == "__main__":
    # A "hang" request would hold a graceful shutdown for its hour: stop within a second instead.
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_graceful_shutdown=1)
