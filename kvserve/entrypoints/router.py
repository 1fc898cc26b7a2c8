"""`kvserve router --backend URL ...`: one OpenAI-compatible endpoint over several `kvserve serve`
replicas, routing each request to the replica that holds most of its prefix (kvserve/router)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvserve.cli import UserError
from kvserve.router import DEFAULT_LOAD_COST_TOKENS, POLICIES
from kvserve.entrypoints.connection_options import (add_connection_options, add_cors_options, add_tls_options,
                                                    body_limits, connection_limits, cors_options, tls_options)
from kvserve.entrypoints.logging_options import add_http_log_options, root_path, uvicorn_log_options

API_KEY_ENV = "KVSERVE_API_KEY"


def register(subparsers) -> None:
    parser = subparsers.add_parser("router", help="route OpenAI requests over kvserve replicas by their prefix caches")
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a `kvserve serve` replica, e.g. http://10.0.0.2:8000 (repeat for each)")
    parser.add_argument("--routing-policy", default="kv_aware", choices=POLICIES,
                        help="kv_aware: the replica holding the longest run of the prompt's cached blocks, weighed "
                             "against load; round_robin; least_loaded (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="model or tokenizer to tokenize prompts with for kv_aware (default: the backends' "
                             "model, when its path exists on this machine; give the backends' --tokenizer if "
                             "they serve with one)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let transformers run the tokenizer's own code (as the backends' flag)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="kv_aware: the --chat-template the backends serve with, so that chat prompts are "
                             "rendered as they render them (default: the tokenizer's)")
    parser.add_argument("--load-cost-tokens", type=float, default=DEFAULT_LOAD_COST_TOKENS, metavar="TOKENS",
                        help="kv_aware: cached prompt tokens one more request in a replica's queue is worth "
                             "(default: %(default)s)")
    parser.add_argument("--max-index-entries", type=int, default=1_000_000, metavar="N",
                        help="(replica, block) pairs the prefix index keeps; the oldest go first (default: %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"require `Authorization: Bearer KEY` from clients (passed on to the backends as "
                             f"sent) and send it on the router's own calls to them (default: ${API_KEY_ENV})")
    parser.add_argument("--enable-request-id-headers", action="store_true",
                        help="every response carries an X-Request-Id header: the request's, or a new id")
    parser.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    parser.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    parser.add_argument("--request-timeout", type=float, default=1800.0, metavar="SECONDS",
                        help="a request whose backend has not finished answering this long after it came is "
                             "ended: a 504, or an error event in a stream (default: %(default)s)")
    connection = parser.add_argument_group("connection, TLS and CORS options (as `kvserve serve`)")
    add_connection_options(connection)
    add_tls_options(connection)
    add_cors_options(connection)
    add_http_log_options(parser.add_argument_group("logging and docs (as `kvserve serve`)"))
    parser.set_defaults(func=run_router)


def check_backend_url(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--backend {url!r} is not an http(s) URL such as http://127.0.0.1:8000")
    try:
        parts.port
    except ValueError:
        raise UserError(f"--backend {url!r} has an invalid port") from None
    return url.rstrip("/")


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.entrypoints.serve import _bind, server_chat_template
    from kvserve.router.app import RouterConfig, build_router_app
    from kvserve.server.connections import guarded_protocol

    backends = [check_backend_url(url) for url in args.backend]
    if len(set(backends)) != len(backends):
        raise UserError("a --backend is given twice")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key must not be empty")
    if args.max_index_entries < 1:
        raise UserError(f"--max-index-entries must be at least 1, got {args.max_index_entries}")
    if not args.load_cost_tokens >= 0:
        raise UserError(f"--load-cost-tokens must be >= 0, got {args.load_cost_tokens}")
    if not 0 < args.request_timeout < float("inf"):
        raise UserError(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    given = [flag for flag, value in (("--tokenizer", args.tokenizer), ("--chat-template", args.chat_template))
             if value is not None]
    if given and args.routing_policy != "kv_aware":  # (only kv_aware tokenizes prompts)
        raise UserError(f"{' and '.join(given)} only serve(s) --routing-policy kv_aware, which tokenizes prompts; "
                        f"{args.routing_policy} does not")
    if args.tokenizer is not None and not Path(args.tokenizer).expanduser().exists():
        raise UserError(f"--tokenizer {args.tokenizer!r}: no such file or directory")
    max_body, in_flight = body_limits(args)
    cors = cors_options(args)
    tls = tls_options(args)
    chat_template = server_chat_template(args)
    limits = connection_limits(args, fds_per_connection=2)  # a client connection and its backend connection
    config = RouterConfig(backends, args.routing_policy, api_key=args.api_key, tokenizer=args.tokenizer,
                          trust_remote_code=args.trust_remote_code, max_index_entries=args.max_index_entries,
                          load_cost_tokens=args.load_cost_tokens,
                          max_request_body_bytes=max_body, max_body_bytes_in_flight=in_flight,
                          request_timeout_s=args.request_timeout, max_backend_connections=limits.max_connections,
                          cors=cors, chat_template=chat_template, request_id_headers=args.enable_request_id_headers,
                          fastapi_docs=not args.disable_fastapi_docs, root_path=root_path(args))
    sock = _bind(args.host, args.port)
    app = build_router_app(config)
    uvicorn.Server(uvicorn.Config(app, **uvicorn_log_options(args), timeout_keep_alive=5, **tls,
                                  http=guarded_protocol(limits))).run(sockets=[sock])
    return 0
