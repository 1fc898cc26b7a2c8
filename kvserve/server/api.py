"""The FastAPI application: routes, middleware and the engine thread's lifetime.

    client ──> CORSMiddleware ──> APIKeyMiddleware (if --api-key) ──> BodySizeLimitMiddleware ──> routes
                                                                                   │
               /v1/completions, /v1/chat/completions ──> AsyncEngine (engine thread)
               /v1/responses, /v1/messages (Anthropic's) ──> the chat path
               /dashboard (page), /dashboard/state ──> AsyncEngine.fresh_state (a snapshot between steps)
               /v1/kv_events, /v1/kv_events/snapshot, /v1/load ──> the pool's event log (routers)
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.auth import APIKeyMiddleware
from kvserve.server.body_limit import BodySizeLimitMiddleware
from kvserve.server.chat import ChatServing
from kvserve.server.dashboard import add_dashboard
from kvserve.server.completions import CompletionServing
from kvserve.server.cors import CorsOptions, add_cors
from kvserve.server.connections import install_loop_error_throttle
from kvserve.server.embeddings import EmbeddingRequest, EmbeddingResponse, EmbeddingServing
from kvserve.server.engine_loop import AsyncEngine
from kvserve.server.responses import ResponsesRequest, ResponsesServing
from kvserve.server.errors import TOO_DEEP, APIError, error_body, install_error_handlers
from kvserve.server.faults import add_fault_injection
from kvserve.server.kv_events_api import add_kv_event_routes, attach_kv_events
from kvserve.server.messages import MessagesRequest, MessagesServing
from kvserve.server.metrics import ServerMetrics
from kvserve.server.prompts import Tokenization, conversation
from kvserve.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                     CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                     ModelCard, ModelList, TokenizeRequest, TokenizeResponse, template_fields)
from kvserve.server.reasoning import ReasoningParser
from kvserve.server.request_id import RequestIdHeaderMiddleware
from kvserve.server.request_log import RequestLog
from kvserve.server.serving import ServingContext, log_ignored_fields
from kvserve.server.streaming import ClientDisconnected

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Documented in the OpenAPI schema: every error has OpenAI's body.
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503)}


def _answers(model: type) -> dict:
    return {200: {"model": model, "description": "JSON, or with `stream: true` an SSE stream of chunks"}, **_ERRORS}


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_body_bytes_in_flight: int | None = None  # None: 4 x max_request_body_bytes
    log_interval_s: float | None = 5.0  # the periodic stats line; None: none (--disable-log-stats)
    fault_injection: bool = False  # POST /debug/faults (kvserve/server/faults.py); tests only
    tool_call_parser: str | None = None  # reads `tool_choice: "auto"` replies (--enable-auto-tool-choice)
    kv_events_capacity: int = 65536  # prefix-cache events kept for routers (kv_events_api.py)
    stream_interval: int = 1  # --stream-interval (serving.ServingContext)
    cors: CorsOptions | None = None  # browsers' cross-origin access (cors.py); None: none
    chat_template: str | None = None  # --chat-template's text: replaces the tokenizer's (prompts.Tokenization)
    trust_request_chat_template: bool = False  # a request may bring its own chat template (prompts.Tokenization)
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids (serving.ServingContext)
    request_id_headers: bool = False  # --enable-request-id-headers: X-Request-Id on every response
    reasoning_parser: str | None = None  # --reasoning-parser: a reasoning model's thinking as `reasoning`
    request_log: RequestLog | None = None  # --enable-log-requests: per-request log lines (request_log.py)
    fastapi_docs: bool = True  # /docs, /redoc, /openapi.json (off: --disable-fastapi-docs)
    force_include_usage: bool = False  # --enable-force-include-usage (serving.ServingContext)
    root_path: str = ""  # --root-path: the prefix a path-based proxy serves the app under
    shutdown_timeout: float = 30.0  # --shutdown-timeout: also how long background responses may finish


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The app around a loaded engine; the engine thread starts and stops with the app's lifespan."""
    from kvserve import __version__

    metrics = ServerMetrics(config.served_model_names[0], config.log_interval_s, max_model_len=engine.max_model_len,
                            max_num_batched_tokens=engine.args.max_num_batched_tokens or 8192)
    async_engine = AsyncEngine(engine, metrics, config.request_log)
    tokens = Tokenization(engine, config.chat_template, config.trust_request_chat_template)
    ctx = ServingContext(async_engine, tokens, list(config.served_model_names), engine.max_model_len,
                         config.stream_interval, config.return_tokens_as_token_ids, config.force_include_usage)
    reasoning = (ReasoningParser.for_tokenizer(config.reasoning_parser, engine.tokenizer)
                 if config.reasoning_parser else None)
    completions, chat = CompletionServing(ctx), ChatServing(ctx, config.tool_call_parser, reasoning)
    embeddings = EmbeddingServing(ctx, tokens, engine.model_config.hidden_size)
    responses = ResponsesServing(chat)
    messages = MessagesServing(chat)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        install_loop_error_throttle(asyncio.get_running_loop())
        async_engine.start()
        try:
            yield
        finally:
            await responses.finish_background(config.shutdown_timeout)  # they hold no connection to wait on
            async_engine.shutdown()
            tokens.shutdown()

    # No trailing-slash redirects: Starlette builds their Location from the request's Host header,
    # an open redirect (/health/ with Host: evil.example -> http://evil.example/health).
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, redirect_slashes=False,
                  root_path=config.root_path,
                  **({} if config.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.engine = async_engine
    app.state.tokens = tokens
    app.state.stopping = lambda: False  # kvserve serve replaces it: True once shutdown began
    kv_log, replica = attach_kv_events(async_engine, config.kv_events_capacity)
    app.state.replica = replica
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": only the access log sees it

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and clients' probes
    async def health() -> Response:
        if async_engine.healthy:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "The engine has stopped."), status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, root=str(engine.model_path), max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card(name) for name in config.served_model_names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)  # OpenAI's and Anthropic's clients' models.retrieve
        return card(model_id)

    @app.post("/v1/completions", responses=_answers(CompletionResponse))
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await completions.create(body, request)

    @app.post("/v1/chat/completions", responses=_answers(ChatCompletionResponse))
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat.create(body, request)

    @app.post("/v1/responses", responses=_ERRORS)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        ctx.check_model(body.model)
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}", responses=_ERRORS)
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.get(response_id))

    @app.post("/v1/responses/{response_id}/cancel", responses=_ERRORS)
    async def cancel_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.cancel(response_id))

    @app.post("/v1/messages", responses=_ERRORS)
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return await messages.create(body, request)

    @app.post("/v1/messages/count_tokens", responses=_ERRORS)
    async def count_message_tokens(body: MessagesRequest) -> dict:
        return await messages.count_tokens(body)

    @app.post("/reset_prefix_cache", responses=_ERRORS)
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> Response:
        """vLLM's (a dev-mode route there; here always, behind --api-key when set) and SGLang's
        /flush_cache: forget the pool's cached prefixes, between two steps."""
        if reset_external and engine.tiers is not None:
            raise APIError(400, "reset_external is not supported: the KV offload tiers keep their blocks.",
                           param="reset_external")
        if not await async_engine.call(lambda e: e.reset_prefix_cache(reset_running_requests)):
            raise APIError(409, "The prefix cache was not reset: requests hold KV blocks. Retry when they have "
                                "finished, or pass reset_running_requests=true to preempt them (they recompute).")
        return Response(status_code=200)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def create_embedding(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        return await embeddings.create(body, request)

    # Amazon SageMaker's hosting contract, as vLLM serves it: /ping for health, /invocations for every
    # request, dispatched here by its body's defining key (messages, prompt, input) so that a bad
    # field gets that endpoint's own 400 rather than "no handler".
    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    @app.post("/invocations", responses=_ERRORS)
    async def invocations(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except RecursionError:
            raise APIError(400, TOO_DEEP) from None
        except ValueError as exc:
            raise APIError(400, f"JSON decode error: {exc}") from None
        kinds = (("messages", ChatCompletionRequest, create_chat_completion),
                 ("prompt", CompletionRequest, create_completion), ("input", EmbeddingRequest, create_embedding))
        for key, model, endpoint in kinds:
            if isinstance(body, dict) and key in body:
                try:
                    parsed = model.model_validate(body)
                except ValidationError as exc:
                    raise RequestValidationError(exc.errors()) from None
                return await endpoint(parsed, request)
        raise APIError(400, "Cannot find a suitable handler for the request: /invocations takes a chat completion "
                            "(messages), a completion (prompt) or an embeddings request (input).")

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        log_ignored_fields(body.unknown_fields())
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of `prompt` and `messages`.")
        if body.messages is not None:  # add_special_tokens: false unless asked, as chat renders them
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            ids = await tokens.chat_prompt(conversation(body.messages), body.add_generation_prompt, tools,
                                           body.continue_final_message, body.chat_template_kwargs, body.chat_template,
                                           add_special_tokens=body.add_special_tokens is True,
                                           fields=template_fields(body))
        else:
            ids = await tokens.encode(body.prompt, body.add_special_tokens is not False)
        strs = [tokens.token_text(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        log_ignored_fields(body.unknown_fields())
        return DetokenizeResponse(prompt=await tokens.decode(body.tokens))

    add_dashboard(app, async_engine, config.served_model_names[0])
    add_kv_event_routes(app, async_engine, kv_log, replica, lambda: app.state.stopping())
    if config.fault_injection:
        add_fault_injection(app, engine)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes,
                       max_bytes_in_flight=config.max_body_bytes_in_flight)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)  # before the body is read
    if config.request_id_headers:  # outside the key check: a 401 carries the id too
        app.add_middleware(RequestIdHeaderMiddleware)
    add_cors(app, config.cors)  # outermost: preflights are answered before the key check
    return app
