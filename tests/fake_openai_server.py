"""A small fake OpenAI-compatible server for the `kvserve bench` tests: streams `max_tokens`
one-word chunks with a fixed delay, reports usage, and exports kvserve's Prometheus names.
A prompt containing FAIL gets an HTTP 400 with an OpenAI-style error body.

Run in-process (`FakeServer`) or as a process: `python tests/fake_openai_server.py --port P
[--delay S] [--kv-per-request F]` (what `kvserve bench compare` starts in the tests)."""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from server_process import free_port

MODEL = "fake-model"


def make_app(delay: float = 0.002, kv_per_request: float = 0.1) -> FastAPI:
    app = FastAPI()
    state = {"running": 0, "requests": 0, "prefix_queries": 0, "prefix_hits": 0}

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        lines = [
            "# TYPE kvserve:kv_cache_usage_perc gauge",
            f'kvserve:kv_cache_usage_perc{{model_name="{MODEL}"}} {min(1.0, state["running"] * kv_per_request)}',
            "# TYPE kvserve:num_requests_running gauge",
            f'kvserve:num_requests_running{{model_name="{MODEL}"}} {state["running"]}',
            "# TYPE kvserve:num_requests_waiting gauge",
            f'kvserve:num_requests_waiting{{model_name="{MODEL}"}} 0',
            "# TYPE kvserve:num_preemptions counter",
            f'kvserve:num_preemptions_total{{model_name="{MODEL}"}} {state["requests"] // 4}',
            "# TYPE kvserve:prefix_cache_queries counter",
            f'kvserve:prefix_cache_queries_total{{model_name="{MODEL}"}} {state["prefix_queries"]}',
            "# TYPE kvserve:prefix_cache_hits counter",
            f'kvserve:prefix_cache_hits_total{{model_name="{MODEL}"}} {state["prefix_hits"]}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def handle(request: Request, chat: bool):
        body = await request.json()
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return JSONResponse(status_code=400, content={"error": {
                "message": "fake failure requested", "type": "BadRequestError", "code": 400}})
        n = int(body.get("max_tokens") or 16)
        prompt_tokens = len(prompt.split())
        state["prefix_queries"] += prompt_tokens
        state["prefix_hits"] += prompt_tokens // 2

        async def stream():
            state["running"] += 1
            state["requests"] += 1
            try:
                for i in range(n):
                    await asyncio.sleep(delay)
                    piece = f"w{i} "
                    choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["running"] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


class FakeServer:
    """`with FakeServer(delay=...) as url:` serves the fake app on a free port in a thread."""

    def __init__(self, **app_options):
        self.port = free_port()
        config = uvicorn.Config(make_app(**app_options), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.002)
    parser.add_argument("--kv-per-request", type=float, default=0.1)
    args = parser.parse_args()
    uvicorn.run(make_app(args.delay, args.kv_per_request), host=args.host, port=args.port, log_level="warning")
