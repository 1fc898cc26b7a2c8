"""The connection, body, TLS and CORS options `kvserve serve` and `kvserve router` share, and their checks.

A router holds two descriptors per proxied request (the client's connection and its backend
connection), so its default connection limit is half of what the descriptor limit leaves."""
from __future__ import annotations

import argparse
import json

from kvserve.cli import UserError
from kvserve.server.cors import CorsOptions
from kvserve.server.connections import RESERVED_FDS, ConnectionLimits, raise_fd_limit
from kvserve.units import parse_size


def add_connection_options(group: argparse._ActionGroup) -> None:
    group.add_argument("--max-request-body-bytes", default="32MiB",
                       help="larger request bodies get a 413 (bytes or with a unit; default: %(default)s)")
    group.add_argument("--max-body-bytes-in-flight", default=None,
                       help="request bodies the requests in flight may hold together; past it a new one gets a 503 "
                            "(bytes or with a unit; default: 4x --max-request-body-bytes)")
    group.add_argument("--timeout-header", type=float, default=10.0, metavar="SECONDS",
                       help="close a connection whose request head is not complete this long after it opened or "
                            "after its previous response (default: %(default)s)")
    group.add_argument("--timeout-body", type=float, default=30.0, metavar="SECONDS",
                       help="close a connection whose request body pauses longer than this (default: %(default)s)")
    group.add_argument("--max-connections", type=int, default=None, metavar="N",
                       help="open connections at most; at the limit a new one closes the oldest connection that "
                            "sent no request, so /health stays reachable (default: what the file-descriptor limit "
                            "allows after a reserve)")


def add_cors_options(group: argparse._ActionGroup) -> None:
    """vLLM's CORS flags (kvserve/server/cors.py), lists as JSON."""
    group.add_argument("--allowed-origins", default='["*"]', metavar="JSON",
                       help="origins a browser page may call the API from, a JSON list, e.g. "
                            "'[\"https://app.example.com\"]'; '[]' allows none (default: %(default)s)")
    group.add_argument("--allow-credentials", action="store_true",
                       help="let cross-origin pages send cookies and the Authorization header with credentials")
    group.add_argument("--allowed-methods", default='["*"]', metavar="JSON",
                       help="HTTP methods allowed cross-origin, a JSON list (default: %(default)s)")
    group.add_argument("--allowed-headers", default='["*"]', metavar="JSON",
                       help="request headers allowed cross-origin, a JSON list (default: %(default)s)")


def cors_options(args: argparse.Namespace) -> CorsOptions:
    """The checked CORS flags: each a JSON list of strings."""
    lists = {}
    for flag in ("--allowed-origins", "--allowed-methods", "--allowed-headers"):
        text = getattr(args, flag[2:].replace("-", "_"))
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{flag} must be a JSON list of strings such as '[\"*\"]', got {text!r}")
        lists[flag[2:].replace("-", "_")] = value
    return CorsOptions(allow_credentials=args.allow_credentials, **lists)


def add_tls_options(group: argparse._ActionGroup) -> None:
    """vLLM's TLS flags: serve HTTPS with a certificate and key (uvicorn's)."""
    group.add_argument("--ssl-certfile", default=None, metavar="PATH",
                       help="serve HTTPS with this PEM certificate (chain); needs --ssl-keyfile")
    group.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="the certificate's PEM private key")
    group.add_argument("--ssl-ca-certs", default=None, metavar="PATH",
                       help="CA certificates to verify client certificates against (with --ssl-cert-reqs)")
    group.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                       help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*; "
                            "default: %(default)s)")


def tls_options(args: argparse.Namespace) -> dict[str, object]:
    """uvicorn's TLS settings from the checked flags ({} without TLS): the certificate and key are
    loaded here, so a missing file or a key that does not match fails before the model loads."""
    import ssl

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise UserError("--ssl-certfile and --ssl-keyfile go together (HTTPS needs the certificate and its key)")
    if args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs:
            raise UserError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS: add --ssl-certfile and --ssl-keyfile")
        return {}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"cannot load the TLS certificate, key or CA certificates: {exc}") from None
    return {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile, "ssl_ca_certs": args.ssl_ca_certs,
            "ssl_cert_reqs": args.ssl_cert_reqs}


def body_limits(args: argparse.Namespace) -> tuple[int, int]:
    """(--max-request-body-bytes, --max-body-bytes-in-flight) in bytes."""
    max_body = parse_size(args.max_request_body_bytes)
    in_flight = parse_size(args.max_body_bytes_in_flight) if args.max_body_bytes_in_flight is not None else 4 * max_body
    if in_flight < max_body:
        raise UserError(f"--max-body-bytes-in-flight ({in_flight}) must be at least --max-request-body-bytes ({max_body})")
    return max_body, in_flight


def connection_limits(args: argparse.Namespace, fds_per_connection: int = 1) -> ConnectionLimits:
    """The checked --timeout-header, --timeout-body and --max-connections. `fds_per_connection`:
    descriptors one client connection may hold (2 in a router: its backend connection too)."""
    for flag, value in (("--timeout-header", args.timeout_header), ("--timeout-body", args.timeout_body)):
        if not 0 < value < float("inf"):  # also refuses nan
            raise UserError(f"{flag} must be a positive number of seconds, got {value}")
    available = max(16, (raise_fd_limit() - RESERVED_FDS) // fds_per_connection)
    given = args.max_connections
    if given is not None and not 1 <= given <= available:
        per = ", halved: a client connection also holds a backend connection" if fds_per_connection > 1 else ""
        raise UserError(f"--max-connections must be in 1..{available} (the file-descriptor limit minus "
                        f"{RESERVED_FDS} kept back{per}), got {given}")
    return ConnectionLimits(args.timeout_header, args.timeout_body, given or available)
