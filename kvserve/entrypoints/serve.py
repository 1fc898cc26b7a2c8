"""`kvserve serve [MODEL]`: the OpenAI-compatible HTTP server, with vLLM's flag names.

The port is bound before the model loads, so a busy port fails in a second with one line instead
of after the load; the socket is then handed to uvicorn. How the server stops (signals, the
shutdown grace period, a dead engine) is in kvserve/server/lifecycle.py.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from pathlib import Path

from kvserve.cli import UserError
from kvserve.engine.args import EngineArgs
from kvserve.entrypoints.connection_options import (add_connection_options, add_cors_options, add_tls_options,
                                                    body_limits, connection_limits, cors_options, tls_options)
from kvserve.entrypoints.logging_options import (add_http_log_options, add_request_log_options, request_log,
                                                 root_path, uvicorn_log_options)

API_KEY_ENV = "KVSERVE_API_KEY"
logger = logging.getLogger("kvserve")


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve (same as --model; default: the bundled SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; "
                                                           "0.0.0.0 for every interface)")
    group.add_argument("--port", type=int, default=8000, help="default: %(default)s")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) the API answers to; the first is reported (default: MODEL as given)")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"require `Authorization: Bearer KEY` on every path but /health, /metrics and "
                            f"/version (default: ${API_KEY_ENV})")
    group.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, how long requests in flight may take to finish before "
                            "they are failed; a second signal exits at once (default: %(default)s)")
    group.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="a streamed response sends its first token at once, then an event each time N more "
                            "tokens have come (and one when it ends): fewer, larger SSE events, less server work "
                            "per token at high concurrency (SGLang's option; default: %(default)s, every token)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help='logprobs name each token "token_id:N" instead of its text, so that tokens that are no '
                            "text alone (part of a UTF-8 character) stay identifiable; a request's "
                            "`return_tokens_as_token_ids` overrides it (vLLM's flag)")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="every response carries an X-Request-Id header: the request's, or a new id (vLLM's flag)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream reports usage, on each chunk and in a final chunk, whatever its "
                            "stream_options (vLLM's flag)")
    add_connection_options(group)
    add_tls_options(group)
    add_cors_options(group)
    logs = parser.add_argument_group("logging and docs")
    add_http_log_options(logs)
    add_request_log_options(logs)
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                       help="run N engine replicas, each in its own process with its own KV pool, behind this "
                            "one endpoint (default: %(default)s)")
    group.add_argument("--routing-policy", default=None, choices=("kv_aware", "round_robin", "least_loaded"),
                       help="with --data-parallel-size > 1: how requests are spread over the replicas "
                            "(`kvserve router --help`; default: kv_aware)")
    templates = parser.add_argument_group("chat template")
    templates.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                           help="the Jinja chat template conversations render with, instead of the model's: a "
                                "file, or the template text itself (vLLM's flag)")
    templates.add_argument("--trust-request-chat-template", action="store_true",
                           help="render a request's own `chat_template` (or chat_template_kwargs.chat_template) "
                                "instead of refusing it with a 400 (vLLM's flag)")
    templates.add_argument("--reasoning-parser", default=None, metavar="NAME",
                           help="a reasoning model's thinking goes out as `reasoning`, apart from the answer, "
                                "which tool calls and structured outputs apply to: "
                                f"{', '.join(_reasoning_parser_names())} (vLLM's flag)")
    tools = parser.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='answer `tool_choice: "auto"` (and requests with `tools` but no `tool_choice`): the '
                            "model decides, --tool-call-parser reads its calls (named and \"required\" tool "
                            "choice need neither flag)")
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help=f"the format the model writes tool calls in: {', '.join(_tool_parser_names())}")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run_serve)


def _reasoning_parser_names() -> list[str]:
    from kvserve.server.reasoning import REASONING_PARSERS

    return sorted(REASONING_PARSERS)


def check_reasoning_parser(args: argparse.Namespace) -> None:
    """--reasoning-parser against the model's tokenizer (loaded alone, before the weights)."""
    from kvserve.model.loader import load_tokenizer
    from kvserve.server.reasoning import ReasoningParser

    if args.reasoning_parser is None:
        return
    try:
        tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
        ReasoningParser.for_tokenizer(args.reasoning_parser, tokenizer)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _tool_parser_names() -> list[str]:
    from kvserve.server.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for auto tool choice, or None when it is off; checks the two flags (vLLM's)."""
    names = _tool_parser_names()
    if args.tool_call_parser is not None and args.tool_call_parser not in names:
        raise UserError(f"invalid tool call parser: {args.tool_call_parser} (chose from {{ {','.join(names)} }})")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        raise UserError("--tool-call-parser is only used with --enable-auto-tool-choice; add that flag")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def server_chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template's text (chat_template_file.py), None without it; a bad one is a UserError."""
    from kvserve.engine.chat_template_file import load_chat_template

    if args.chat_template is None:
        return None
    try:
        text = load_chat_template(args.chat_template)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    logger.info("chat template from --chat-template (%d characters), in place of the model's", len(text))
    return text


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"cannot resolve --host {host!r}: {exc.strerror}") from exc
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    return sock


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.preflight import preflight
    from kvserve.process_heap import settle_heap
    from kvserve.server.api import ServerConfig, build_app
    from kvserve.server.connections import guarded_protocol
    from kvserve.server.engine_loop import ShuttingDownError
    from kvserve.server.faults import fault_injection_enabled
    from kvserve.server.lifecycle import EXIT_ENGINE_DEAD, ServingServer

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UserError(f"two models named: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key must not be empty")
    if args.data_parallel_size < 1:
        raise UserError(f"--data-parallel-size must be at least 1, got {args.data_parallel_size}")
    if args.routing_policy is not None and args.data_parallel_size == 1:
        raise UserError("--routing-policy needs --data-parallel-size > 1 (or use `kvserve router`)")
    if args.data_parallel_size > 1 and (args.nnodes > 1 or args.node_rank > 0 or args.master_port is not None):
        raise UserError("--data-parallel-size > 1 runs its replicas on this machine: it does not take --nnodes, "
                        "--node-rank or --master-port (each replica's tensor-parallel ranks meet on a free port)")
    max_body, in_flight = body_limits(args)
    parser_name = tool_call_parser(args)
    if args.stream_interval < 1:
        raise UserError(f"--stream-interval must be at least 1, got {args.stream_interval}")
    if not args.shutdown_timeout >= 0:  # also refuses nan
        raise UserError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    # The data-parallel front end is a router: a client connection also holds a replica connection.
    limits = connection_limits(args, fds_per_connection=2 if args.data_parallel_size > 1 else 1)
    engine_args = EngineArgs.from_cli_args(args)
    from kvserve.engine.parallel.group import torchrun_rank

    if engine_args.node_rank > 0 or (torchrun_rank() or 0) > 0:  # a tensor-parallel worker: no server
        from kvserve.engine.parallel.worker import run_node

        engine_args.validate()
        return run_node(engine_args)
    cors, tls, chat_template = cors_options(args), tls_options(args), server_chat_template(args)  # the front end's
    requests_log, uvicorn_logs, prefix = request_log(args), uvicorn_log_options(args), root_path(args)
    preflight(engine_args)
    check_reasoning_parser(args)  # bad engine options fail before the port is taken
    sock = _bind(args.host, args.port)
    if args.data_parallel_size > 1:
        from kvserve.entrypoints.data_parallel import run_data_parallel

        argv = getattr(args, "argv", None) or sys.argv[1:]
        serve_argv = argv[argv.index("serve") + 1:]
        uvicorn_kwargs = {**uvicorn_logs, "timeout_keep_alive": 5, **tls,
                          "http": guarded_protocol(limits)}
        return run_data_parallel(args, serve_argv, sock, uvicorn_kwargs,
                                 (max_body, in_flight), limits.max_connections, cors, chat_template)
    engine = LLMEngine(engine_args, serving=True)
    names = args.served_model_name or [args.model or Path(engine.model_path).name.removesuffix(".gguf")]
    app = build_app(engine, ServerConfig(names, args.api_key, max_body, max_body_bytes_in_flight=in_flight,
                                         fault_injection=fault_injection_enabled(), tool_call_parser=parser_name,
                                         stream_interval=args.stream_interval, cors=cors, chat_template=chat_template,
                                         trust_request_chat_template=args.trust_request_chat_template,
                                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                                         request_id_headers=args.enable_request_id_headers,
                                         reasoning_parser=args.reasoning_parser, request_log=requests_log,
                                         log_interval_s=None if args.disable_log_stats else 5.0,
                                         fastapi_docs=not args.disable_fastapi_docs,
                                         force_include_usage=args.enable_force_include_usage, root_path=prefix,
                                         shutdown_timeout=args.shutdown_timeout))
    async_engine = app.state.engine
    config = uvicorn.Config(app, **uvicorn_logs, timeout_keep_alive=5, **tls,
                            http=guarded_protocol(limits))
    ending = "the server is shutting down and its grace period (--shutdown-timeout) ended"

    def on_grace_expired() -> None:
        async_engine.fail_all(ShuttingDownError(ending))
        app.state.tokens.fail_pending(f"The server cannot take requests: {ending}.")

    server = ServingServer(config, args.shutdown_timeout, on_grace_expired=on_grace_expired)
    app.state.stopping = lambda: server.should_exit  # ends routers' event streams at shutdown
    async_engine.on_dead = lambda exc: server.stop(EXIT_ENGINE_DEAD)
    settle_heap()
    server.run(sockets=[sock])
    return server.exit_code
