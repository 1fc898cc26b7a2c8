"""What the HTTP front ends log and publish, with vLLM's flags: uvicorn's log level and access log,
the OpenAPI docs routes, the root path behind a proxy (`kvserve serve` and `kvserve router`);
per-request log lines and the periodic stats line (`kvserve serve`, whose engine sees the
requests)."""
from __future__ import annotations

import argparse

from kvserve.cli import UserError
from kvserve.server.request_log import RequestLog

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_http_log_options(group: argparse._ActionGroup) -> None:
    group.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                       help="uvicorn's own log level (vLLM's flag; default: kvserve's --log-level)")
    group.add_argument("--disable-uvicorn-access-log", dest="uvicorn_access_log", action="store_false",
                       help="no access-log line per HTTP request (vLLM's flag)")
    group.add_argument("--enable-uvicorn-access-log", dest="uvicorn_access_log", action="store_true",
                       help="an access-log line per HTTP request (the default)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="serve no /docs, /redoc or /openapi.json (vLLM's flag)")
    group.add_argument("--root-path", default="", metavar="PREFIX",
                       help="the path prefix a path-based proxy serves this app under, e.g. /llm (vLLM's flag): "
                            "requests may come with it or without it, and the OpenAPI docs name it")


def uvicorn_log_options(args: argparse.Namespace) -> dict[str, object]:
    return {"log_level": args.uvicorn_log_level or args.log_level.lower(), "access_log": args.uvicorn_access_log}


def root_path(args: argparse.Namespace) -> str:
    """--root-path, checked. Set on the app as vLLM sets it (FastAPI's root_path, not uvicorn's,
    which would expect every request without the prefix), so routing takes a path with it or without."""
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise UserError(f"--root-path must start with / and not end with one, e.g. /llm; got {args.root_path!r}")
    return args.root_path


def add_request_log_options(group: argparse._ActionGroup) -> None:
    group.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                       help="log each request on arrival (vLLM's flag): its id and sampling parameters at INFO, its "
                            "prompt text and token ids at DEBUG (kvserve --log-level DEBUG). Prompts are users' "
                            "data: off by default")
    group.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                       help="no per-request log lines (the default; vLLM's older spelling)")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="with --enable-log-requests: log each finished choice's text and finish reason (INFO) "
                            "and token ids (DEBUG)")
    group.add_argument("--max-log-len", type=int, default=None, metavar="N",
                       help="cut logged prompts and outputs to N characters or token ids (default: whole)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no periodic throughput/queue/KV-usage log line (vLLM's flag); /metrics still counts")


def request_log(args: argparse.Namespace) -> RequestLog | None:
    """The per-request log the flags ask for (None: none); bad combinations are UserErrors."""
    if args.max_log_len is not None and args.max_log_len < 0:
        raise UserError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if args.enable_log_outputs and not args.enable_log_requests:
        raise UserError("--enable-log-outputs requires --enable-log-requests")  # vLLM's text
    if not args.enable_log_requests:
        return None
    return RequestLog(args.max_log_len, args.enable_log_outputs)
