"""API-key check (`--api-key`), as pure ASGI middleware in front of routing.

Deny by default: every path needs `Authorization: Bearer <key>` (or `x-api-key: <key>`, what
Anthropic's clients send, taken when no Authorization header is sent) except a few open ones
(/health, /ping, /metrics, /version, and the dashboard's page and static assets, which carry no data;
its state, /dashboard/state, needs the key). The decision uses the path the router will dispatch on
(`scope["path"]`, already percent-decoded by the server), normalised for case, repeated and
trailing slashes and any remaining percent-encoding, so that `/V1/completions`,
`//v1/completions/`, `/v1%2Fcompletions` and `/%68ealth`-style tricks cannot reach a protected
route without the key. The Host header and the rebuilt URL play no part. Keys are compared with
`hmac.compare_digest` (constant time).
"""
from __future__ import annotations

import hmac
import re
from urllib.parse import unquote

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.dashboard import OPEN_DASHBOARD_PATHS
from kvserve.server.errors import dispatched_path, error_json

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", *OPEN_DASHBOARD_PATHS})
_MAX_DECODE_ROUNDS = 4


def normalise_path(path: str) -> str:
    """Lower-case, percent-decoded until stable, `//` collapsed, no trailing slash."""
    for _ in range(_MAX_DECODE_ROUNDS):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = re.sub(r"/+", "/", path.lower())
    return path.rstrip("/") or "/"


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("the API key must not be empty")
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    def _authorised(self, scope: Scope) -> bool:
        headers = scope.get("headers", ())
        values = [v for k, v in headers if k.lower() == b"authorization"]
        if not values:
            keys = [v for k, v in headers if k.lower() == b"x-api-key"]
            return len(keys) == 1 and hmac.compare_digest(keys[0].strip(), self._key)
        # Exactly one header: with several, proxies and frameworks disagree on which one counts.
        return len(values) == 1 and hmac.compare_digest(values[0].strip(), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or normalise_path(dispatched_path(scope)) in OPEN_PATHS \
                or self._authorised(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # deny by default here too: close before accepting
            await send({"type": "websocket.close", "code": 1008})
            return
        body = error_json(401, "Incorrect or missing API key: send `Authorization: Bearer <key>` or "
                               "`x-api-key: <key>`.", code="invalid_api_key", path=dispatched_path(scope))
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
