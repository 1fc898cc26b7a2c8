"""The router's HTTP front: an OpenAI-compatible proxy over kvserve replicas.

    client ──> APIKeyMiddleware (if --api-key) ──> BodySizeLimitMiddleware ──> routes
    POST /v1/completions, /v1/chat/completions, /v1/messages, /v1/responses, /invocations: prompt
        tokens (worker thread) ──> Router.choose ──> the chosen backend, body as sent; its answer
        relayed (SSE streamed message by message). A Responses request continuing a stored
        response (previous_response_id) goes to the backend that stored it, found by asking each
        (GET /v1/responses/{id}); so do that GET and its cancel.
    POST /tokenize, /detokenize, /v1/embeddings, /v1/messages/count_tokens: any up backend
    GET /v1/models (an up backend's), /health (200 while one backend is up), /version,
        /metrics (the router's own and every backend's, labelled `replica`), /router/state

A backend that refuses the connection is taken out and the request tried on the next one (it
never reached an engine). A backend that fails or is taken out while answering (its event stream
or health checks went silent: a frozen process) ends the request at once, before or after its
answer began: a 502 with OpenAI's error body, or in a stream an error event and `[DONE]`. A
request not answered within --request-timeout is a 504. With no backend up the answer is a 503.
JSON too deeply nested to parse is the router's own 400; other bodies the router cannot read go to
a backend for its 400. Bodies over ROUTING_PARSE_MAX_BYTES are not parsed here (routed by load):
parsing holds the event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvserve.cache.kv_events import DISK, HOST
from kvserve.router import DEFAULT_LOAD_COST_TOKENS
from kvserve.router.backends import CONNECT_TIMEOUT_S, Backend, BackendWatcher, Ticket
from kvserve.router.index import PendingHints, PrefixIndex
from kvserve.router.metrics_merge import merge_metrics
from kvserve.router.policy import Router
from kvserve.router.prompt_hashes import PromptTokens
from kvserve.server.auth import APIKeyMiddleware
from kvserve.server.body_limit import BodySizeLimitMiddleware
from kvserve.server.connections import install_loop_error_throttle
from kvserve.server.cors import CorsOptions, add_cors
from kvserve.server.errors import TOO_DEEP, dispatched_path, error_body, install_error_handlers, speaks_anthropic
from kvserve.server.messages import error_event
from kvserve.server.request_id import RequestIdHeaderMiddleware
from kvserve.server.streaming import DONE, ClientDisconnected, EventStreamResponse, sse_error, unless_disconnected

logger = logging.getLogger("kvserve.router")

OWNER_LOOKUP_TIMEOUT_S = 5.0  # asking a backend whether it stored a response
# The router's own calls (a backend's /metrics, /v1/models, a prefix-cache reset): a hung backend
# would otherwise hold them, and the client, for as long as it hangs.
SIDE_CALL_TIMEOUT_S = 10.0
NO_BACKEND = "No backend is available to serve the request (every replica is down or unreachable)."
_PASSED_HEADERS = ("authorization", "x-api-key", "content-type", "accept", "x-request-id", "x-vllm-priority")
ROUTING_PARSE_MAX_BYTES = 4 * 1024 * 1024
# How long a request waits for the router's tokenizer before it is routed by load instead (the
# tokenizer thread is busy with other prompts).
TOKENIZE_WAIT_S = 0.5


class BackendGone(Exception):
    """The backend failed, was taken out, or passed the deadline while answering."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


@dataclass
class RouterConfig:
    backends: list[str]
    policy: str = "kv_aware"
    api_key: str | None = None  # required from clients; also sent on the router's own calls
    backend_api_key: str | None = None  # replaces the client's Authorization header (serve --data-parallel-size)
    tokenizer: str | None = None  # a model or tokenizer path; default: the backends' model, if on this machine
    trust_remote_code: bool = False  # the tokenizer's own code may run (--trust-remote-code)
    max_index_entries: int = 1_000_000
    load_cost_tokens: float = DEFAULT_LOAD_COST_TOKENS
    max_request_body_bytes: int = 32 * 1024 * 1024
    max_body_bytes_in_flight: int | None = None  # None: 4 x max_request_body_bytes
    request_timeout_s: float = 1800.0  # a request's whole answer, sent or not, within this
    max_backend_connections: int | None = None  # None: no limit
    names: list[str] = field(default_factory=list)  # labels per backend (default "0", "1", ...)
    startup_wait_s: float = 0.0  # serve only once every backend is up, or this long has passed
    cors: CorsOptions | None = None  # browsers' cross-origin access (kvserve/server/cors.py); None: none
    chat_template: str | None = None  # the replicas' --chat-template text, for rendering chat prompts alike
    request_id_headers: bool = False  # --enable-request-id-headers: X-Request-Id on every response
    fastapi_docs: bool = True  # /docs, /redoc, /openapi.json (off: --disable-fastapi-docs)
    root_path: str = ""  # --root-path: the prefix a path-based proxy serves the app under


class OwnerUnknown(Exception):
    """No reachable backend holds a stored response, but one could not be asked."""


class OwnerLookupRefused(Exception):
    """A backend refused the lookup itself (401, 403, 400, ...): its answer is the client's."""

    def __init__(self, response: httpx.Response):
        super().__init__(response.status_code)
        self.response = response


def relayed(response: httpx.Response) -> Response:
    """A backend's whole answer, as the router's."""
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type"))


def _response_path(response_id: str) -> str:
    """A stored response's route on a backend, its id quoted whole (a `?` or `/` in it stays the id's)."""
    return f"/v1/responses/{quote(response_id, safe='')}"


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


class RouterService:
    def __init__(self, config: RouterConfig, tokenizer: Any = None):
        self.config = config
        names = config.names or [str(i) for i in range(len(config.backends))]
        self.backends = [Backend(name, url.rstrip("/")) for name, url in zip(names, config.backends)]
        self.index = PrefixIndex(config.max_index_entries)
        self.hints = PendingHints()
        self.router = Router(config.policy, self.index, self.hints, config.load_cost_tokens)
        self.prompts: PromptTokens | None = (PromptTokens(tokenizer, config.chat_template) if tokenizer is not None
                                             else None)
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-router-tokenizer")
        own_key = config.backend_api_key or config.api_key
        self.own_headers = {"Authorization": f"Bearer {own_key}"} if own_key else {}
        self.client: httpx.AsyncClient | None = None
        self.watchers: dict[str, BackendWatcher] = {}
        registry = self.registry = CollectorRegistry()
        self.m_routed = Counter("kvserve_router:requests_routed", "Requests sent to each backend.",
                                ["backend"], registry=registry)
        self.m_cached = Counter("kvserve_router:expected_cached_tokens", "Prompt tokens the router expected the "
                                "chosen backend to find in its prefix cache.", registry=registry)
        self.m_prompt = Counter("kvserve_router:prompt_tokens", "Prompt tokens of routed requests (as the "
                                "router tokenized them).", registry=registry)
        self.m_up = Gauge("kvserve_router:backend_up", "1 while the backend is in service.", ["backend"],
                          registry=registry)
        self.m_failed = Counter("kvserve_router:backend_failures", "Requests ended because their backend failed.",
                                ["backend"], registry=registry)
        self.m_index = Gauge("kvserve_router:index_entries", "(backend, block hash) pairs in the prefix index.",
                             registry=registry)

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        install_loop_error_throttle(asyncio.get_running_loop())
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=None, pool=None),
                                        limits=httpx.Limits(max_connections=self.config.max_backend_connections,
                                                            max_keepalive_connections=64))
        for backend in self.backends:
            watcher = self.watchers[backend.name] = BackendWatcher(backend, self.client, self.index, self.hints,
                                                                   self.own_headers)
            watcher.start()
        deadline = asyncio.get_running_loop().time() + self.config.startup_wait_s
        while len(self.up_backends()) < len(self.backends) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        if self.config.policy == "kv_aware" and self.prompts is None:
            self._tokenizer_task = asyncio.create_task(self._load_tokenizer())

    async def stop(self) -> None:
        for watcher in self.watchers.values():
            await watcher.stop()
        if self.client is not None:
            await self.client.aclose()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def _load_tokenizer(self) -> None:
        """--tokenizer, or the model of the first backend whose model path exists here."""
        from kvserve.model.loader import load_tokenizer

        source = self.config.tokenizer
        while source is None:
            for backend in self.up_backends():
                try:
                    models = (await self.client.get(f"{backend.url}/v1/models", headers=self.own_headers,
                                                    timeout=SIDE_CALL_TIMEOUT_S)).json()
                    root = models["data"][0].get("root")
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    continue
                if root and Path(root).exists():
                    source = root
                    break
                logger.warning("the backends' model %s is not on this machine: routing by load until "
                               "--tokenizer names its tokenizer", root)
                return
            else:
                await asyncio.sleep(0.5)
        loop = asyncio.get_running_loop()
        try:
            tokenizer = await loop.run_in_executor(self._tokenizer_pool, load_tokenizer, source,
                                                   self.config.trust_remote_code)
        except Exception as exc:
            logger.error("cannot load the tokenizer from %s (%s): routing by load only", source, exc)
            return
        self.prompts = PromptTokens(tokenizer, self.config.chat_template)
        logger.info("kv_aware routing with the tokenizer of %s", source)

    def up_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.up]

    # ------------------------------------------------------------------ proxying
    async def proxy(self, request: Request, route: str) -> Response:
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        raw = await request.body()
        path = dispatched_path(request.scope)  # (without --root-path's prefix: what the backend serves)
        body: Any = None
        if len(raw) <= ROUTING_PARSE_MAX_BYTES:
            try:
                body = json.loads(raw)
            except RecursionError:
                return JSONResponse(error_body(400, TOO_DEEP, path=path), status_code=400)
            except ValueError:
                pass
        owner = None  # Responses: the backend that stored the previous response holds its conversation
        if route == "responses":
            if body is None and len(raw) > ROUTING_PARSE_MAX_BYTES:  # too big to parse on the event loop
                body = await asyncio.get_running_loop().run_in_executor(None, _json_or_none, raw)
            previous = body.get("previous_response_id") if isinstance(body, dict) else None
            if isinstance(previous, str):
                try:
                    owner = await self._response_owner(previous, request)
                except OwnerUnknown as exc:
                    return JSONResponse(error_body(503, str(exc), path=path), status_code=503)
                except OwnerLookupRefused as exc:
                    return relayed(exc.response)
        if route == "invocations":  # SageMaker's one route: read as the body's kind (the replica does the same)
            route = ("chat" if "messages" in body else "completions" if "prompt" in body else "other") \
                if isinstance(body, dict) else "other"
        token_ids = None
        if self.prompts is not None and self.config.policy == "kv_aware" and route != "other" and isinstance(body, dict):
            token_ids = await self._prompt_tokens(route, body)
        salt = body.get("cache_salt") if isinstance(body, dict) and isinstance(body.get("cache_salt"), str) else None
        headers = self._headers(request)
        tried: set[str] = set()
        while True:
            choice = self.router.choose([b for b in self.up_backends() if b.name not in tried
                                         and (owner is None or b is owner)], token_ids, salt)
            if choice is None:
                return JSONResponse(error_body(503, NO_BACKEND, path=path), status_code=503)
            backend = choice.backend
            ticket = backend.open()
            try:
                # A client that leaves while the head is awaited (all of a non-streamed answer's
                # time) ends the request: the connection closed, the replica aborts it.
                upstream = await unless_disconnected(self._send(backend, self.client.build_request(
                    "POST", f"{backend.url}{path}", content=raw, headers=headers), deadline), request)
            except ClientDisconnected:
                ticket.close()
                return Response(status_code=499)  # nginx's "client closed request": only the access log sees it
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                ticket.close()
                tried.add(backend.name)
                self.watchers[backend.name].take_out(f"connection failed: {type(exc).__name__}")
                continue
            except BackendGone as exc:
                ticket.close()
                return JSONResponse(error_body(exc.status, str(exc), path=path), status_code=exc.status)
            except BaseException:
                ticket.close()
                raise
            break
        self.router.routed(choice)
        backend.routed += 1
        self.m_routed.labels(backend.name).inc()
        if token_ids:
            self.m_prompt.inc(len(token_ids))
            self.m_cached.inc(choice.cached_tokens)
        media_type = upstream.headers.get("content-type", "application/json")
        if upstream.status_code == 200 and media_type.startswith("text/event-stream"):
            def closed() -> None:  # however the response ends, even before its first chunk
                ticket.close()
                asyncio.ensure_future(upstream.aclose())
            return EventStreamResponse(self._relay_stream(upstream, ticket, deadline, speaks_anthropic(path)), closed)
        try:
            content = await unless_disconnected(self._read_body(upstream, ticket, deadline), request)
        except BackendGone as exc:
            return JSONResponse(error_body(exc.status, str(exc), path=path), status_code=exc.status)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            await upstream.aclose()
            ticket.close()
        return Response(content, status_code=upstream.status_code, media_type=media_type)

    async def _read_body(self, upstream: httpx.Response, ticket: Ticket, deadline: float) -> bytes:
        return b"".join([chunk async for chunk in self._relay(upstream, ticket, deadline)])

    async def _prompt_tokens(self, route: str, body: dict) -> list[int] | None:
        """The prompt's first tokens, or None (route by load) if the tokenizer is busy too long."""
        job = asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self.prompts.token_ids, route, body)
        try:
            return await asyncio.wait_for(asyncio.shield(job), TOKENIZE_WAIT_S)
        except asyncio.TimeoutError:
            return None

    async def _send(self, backend: Backend, upstream_request: httpx.Request, deadline: float) -> httpx.Response:
        """The backend's response head; BackendGone (502) if it fails or is taken out before
        answering, or (504) past the deadline. Connection errors are raised as they are (retried)."""
        send = asyncio.ensure_future(self.client.send(upstream_request, stream=True))
        down = asyncio.ensure_future(backend.down.wait())
        try:
            return await self._backend_part(backend, send, down, deadline, "before answering")
        finally:
            down.cancel()
            if not send.done():  # taken out, past the deadline, or our own task cancelled (the client left)
                send.cancel()

    async def _backend_part(self, backend: Backend, part: asyncio.Future, down: asyncio.Future, deadline: float,
                            when: str) -> Any:
        """`part`'s result, unless the backend fails (502), is taken out (502) or the deadline
        passes (504) first: BackendGone. Connection errors and the end of a body pass through."""
        await asyncio.wait({part, down}, timeout=max(0.0, deadline - asyncio.get_running_loop().time()),
                           return_when=asyncio.FIRST_COMPLETED)
        if not part.done():
            if not down.done():
                raise BackendGone(f"The backend {backend.name} did not answer within "
                                  f"{self.config.request_timeout_s:g} s (--request-timeout).", 504)
            self.m_failed.labels(backend.name).inc()
            raise BackendGone(f"The backend {backend.name} was taken out of service {when}.")
        try:
            return part.result()
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise
        except httpx.HTTPError as exc:
            self.m_failed.labels(backend.name).inc()
            raise BackendGone(f"The backend {backend.name} failed {when} ({type(exc).__name__}).") from None

    async def _relay(self, upstream: httpx.Response, ticket: Ticket, deadline: float) -> AsyncIterator[bytes]:
        """The backend's body as it arrives; BackendGone if it fails or is taken out meanwhile, or
        the deadline passes."""
        backend = ticket.backend
        down = asyncio.ensure_future(backend.down.wait())
        chunks = upstream.aiter_raw().__aiter__()
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(chunks.__anext__())
                try:
                    chunk = await self._backend_part(backend, step, down, deadline, "while answering")
                except StopAsyncIteration:
                    step = None
                    return
                step = None
                ticket.answer()
                yield chunk
        finally:
            down.cancel()
            if step is not None:  # abandoned mid-read (taken out, or our client left)
                if step.done():
                    if not step.cancelled():
                        step.exception()  # retrieved: the response is closed anyway
                else:
                    step.cancel()

    async def _relay_stream(self, upstream: httpx.Response, ticket: Ticket, deadline: float,
                            anthropic: bool) -> AsyncIterator[bytes]:
        """An SSE body passed on whole message by message, so that an error event, if the backend
        fails, never lands inside one (OpenAI's, or `anthropic`'s on its Messages API)."""
        pending = b""
        try:
            async for chunk in self._relay(upstream, ticket, deadline):
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
            if pending:
                yield pending
        except BackendGone as exc:
            yield (error_event(exc.status, str(exc)) if anthropic else sse_error(exc.status, str(exc)) + DONE).encode()
        finally:
            await upstream.aclose()

    async def fan_out(self, request: Request) -> Response:
        """A POST every up backend must take (POST /reset_prefix_cache): 200 once all answered 200,
        else the first failure's status, naming every backend that failed (a backend that is down
        now takes no part)."""
        headers = self._headers(request)
        backends = self.up_backends()
        if not backends:
            return JSONResponse(error_body(503, NO_BACKEND), status_code=503)

        async def post(backend: Backend) -> httpx.Response | None:
            try:
                return await self.client.post(f"{backend.url}{dispatched_path(request.scope)}",
                                              params=request.query_params, headers=headers,
                                              timeout=SIDE_CALL_TIMEOUT_S)
            except httpx.HTTPError:
                return None
        failed = []
        for backend, response in zip(backends, await asyncio.gather(*(post(b) for b in backends))):
            if response is None or response.status_code != 200:
                try:
                    detail = response.json()["error"]["message"] if response is not None else "no answer"
                except (ValueError, KeyError, TypeError):
                    detail = f"HTTP {response.status_code}"
                failed.append((502 if response is None else response.status_code, f"{backend.name}: {detail}"))
        if failed:
            message = (f"Failed on {len(failed)} of {len(backends)} backends (the others took it): "
                       + "; ".join(text for _, text in failed))
            return JSONResponse(error_body(failed[0][0], message), status_code=failed[0][0])
        return Response(status_code=200)

    def _headers(self, request: Request) -> dict[str, str]:
        """The client's headers a backend gets, with the router's own key when it has one."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}
        if self.config.backend_api_key:
            headers["authorization"] = f"Bearer {self.config.backend_api_key}"
        return headers

    async def _response_owner(self, response_id: str, request: Request) -> Backend | None:
        """The backend that stored a Responses API response (its store is per replica), asking every
        backend that is up at once; None when every one answered that it has none (any of them then
        answers the 404). OwnerUnknown when none has it but one could not say (an error, a timeout,
        a backend down): a 404 then might be wrong. OwnerLookupRefused when one refused the
        request itself (401, ...)."""
        headers = self._headers(request)
        path = _response_path(response_id)

        async def holds(backend: Backend) -> bool | None:
            try:
                response = await self.client.get(f"{backend.url}{path}", headers=headers,
                                                 timeout=OWNER_LOOKUP_TIMEOUT_S)
            except httpx.HTTPError:
                return None
            if 400 <= response.status_code < 500 and response.status_code != 404:
                raise OwnerLookupRefused(response)  # a wrong key, say: the answer, not "unreachable"
            return True if response.status_code == 200 else False if response.status_code == 404 else None

        backends = self.up_backends()
        found = await asyncio.gather(*(holds(b) for b in backends))
        owner = next((b for b, held in zip(backends, found) if held), None)
        unasked = [b.name for b, held in zip(backends, found) if held is None] + \
            [b.name for b in self.backends if b not in backends]
        if owner is None and unasked:
            raise OwnerUnknown(f"Response '{response_id}' is not on the replicas that answered; replica(s) "
                               f"{', '.join(unasked)} cannot be asked now and may hold it: retry later.")
        return owner

    async def forward_to_response_owner(self, request: Request, response_id: str, action: str = "") -> Response:
        """GET /v1/responses/{id} or its cancel (`action` "/cancel"), sent to the backend holding
        it (else to one that answers the 404)."""
        try:
            owner = await self._response_owner(response_id, request)
        except OwnerUnknown as exc:
            return JSONResponse(error_body(503, str(exc)), status_code=503)
        except OwnerLookupRefused as exc:
            return relayed(exc.response)
        backends = [owner] if owner is not None else self.up_backends()[:1]
        if not backends:
            return JSONResponse(error_body(503, NO_BACKEND), status_code=503)
        try:
            url = f"{backends[0].url}{_response_path(response_id)}{action}"
            response = await self.client.request(request.method, url, params=request.query_params,
                                                 headers=self._headers(request), content=await request.body(),
                                                 timeout=httpx.Timeout(CONNECT_TIMEOUT_S,
                                                                       read=self.config.request_timeout_s))
        except httpx.HTTPError as exc:
            return JSONResponse(error_body(502, f"The backend failed: {type(exc).__name__}."), status_code=502)
        return relayed(response)

    async def forward_get(self, path: str, request: Request) -> Response:
        headers = self._headers(request)
        for backend in self.up_backends():
            try:
                response = await self.client.get(f"{backend.url}{path}", headers=headers, timeout=SIDE_CALL_TIMEOUT_S)
            except httpx.HTTPError:
                continue
            return relayed(response)
        return JSONResponse(error_body(503, NO_BACKEND), status_code=503)

    async def metrics(self) -> bytes:
        for backend in self.backends:
            self.m_up.labels(backend.name).set(1 if backend.up else 0)
        self.m_index.set(len(self.index))

        async def page(backend: Backend) -> tuple[str, str | None]:
            try:
                return backend.name, (await self.client.get(f"{backend.url}/metrics", timeout=SIDE_CALL_TIMEOUT_S)).text
            except httpx.HTTPError:
                return backend.name, None
        pages = await asyncio.gather(*(page(b) for b in self.up_backends()))
        merged = merge_metrics({name: text for name, text in pages if text is not None})
        return generate_latest(self.registry) + merged.encode()

    def state(self, with_hashes: bool) -> dict:
        return {"policy": self.config.policy, "tokenizer_loaded": self.prompts is not None,
                "index_entries": len(self.index),
                "backends": [{"name": b.name, "url": b.url, "up": b.up, "draining": b.draining,
                              "instance_id": b.instance_id,
                              "namespace": b.namespace, "block_size": b.block_size, "seq": b.seq,
                              "in_flight": b.in_flight, "prefilling": b.prefilling, "running": b.running, "waiting": b.waiting,
                              "kv_cache_usage": b.kv_usage, "routed": b.routed,
                              **({"block_hashes": sorted(h.hex() for h in self.index.hashes(b.name)),
                                  "tier_block_hashes": {m: sorted(h.hex() for h in self.index.hashes(b.name, m))
                                                        for m in (HOST, DISK)}}
                                 if with_hashes else {})} for b in self.backends]}


def build_router_app(config: RouterConfig, tokenizer: Any = None) -> FastAPI:
    """`tokenizer`: already loaded (serve --data-parallel-size); else loaded in the background."""
    from kvserve import __version__

    service = RouterService(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = FastAPI(title="kvserve router", version=__version__, lifespan=lifespan, redirect_slashes=False,
                  root_path=config.root_path,
                  **({} if config.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.router = service
    install_error_handlers(app)

    def proxied(route: str):
        async def proxy(request: Request) -> Response:
            return await service.proxy(request, route)
        return proxy

    # path -> how its prompt is read for routing ("other": not read, placed in turn)
    for path, route in (("/v1/completions", "completions"), ("/v1/chat/completions", "chat"),
                        ("/v1/messages", "messages"), ("/v1/messages/count_tokens", "other"),
                        ("/tokenize", "other"), ("/detokenize", "other"), ("/v1/embeddings", "other"),
                        ("/invocations", "invocations"), ("/v1/responses", "responses")):
        app.add_api_route(path, proxied(route), methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> Response:
        return await service.forward_to_response_owner(request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        return await service.forward_to_response_owner(request, response_id, "/cancel")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        return await service.fan_out(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await service.forward_get("/v1/models", request)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        return await service.forward_get(dispatched_path(request.scope), request)

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's health check
    async def health() -> Response:
        if service.up_backends():
            return Response(status_code=200)
        return JSONResponse(error_body(503, NO_BACKEND), status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await service.metrics(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/state")
    async def router_state(hashes: bool = False) -> dict:
        return service.state(hashes)

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_body_bytes,
                       max_bytes_in_flight=config.max_body_bytes_in_flight or 4 * config.max_request_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    if config.request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    add_cors(app, config.cors)  # outermost: preflights are answered before the key check
    return app
