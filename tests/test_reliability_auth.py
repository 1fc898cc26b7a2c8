"""No way around `--api-key` (issue 9, #4): every route of the server's own schema (and the docs, and
paths that exist nowhere) refuses a missing or wrong key with 401 whatever the spelling of the
path (case, slashes, dot segments, single and double percent-encoding, absolute form), the Host
header or the method; the right key works on every route; keys are compared in constant time.
Requests go over a raw socket so that no client library normalises them first."""
from __future__ import annotations

import asyncio
import hmac
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest
from server_process import raw_request_status

from kvserve.server import auth
from kvserve.server.auth import APIKeyMiddleware

KEY = "sk-test-0123456789"
# The dashboard's page and static assets carry no data; its state (/dashboard/state) is protected.
# /ping is SageMaker's health check (as /health).
OPEN = {"/health", "/ping", "/metrics", "/version", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css",
        "/dashboard/uPlot.iife.min.js", "/dashboard/uPlot.min.css"}
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
WRONG_AUTHORIZATIONS = [None, "Bearer wrong", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", KEY, f"Basic {KEY}",
                        "Bearer ", f"Bearer {KEY.upper()}"]


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama):
    # The configuration of test_server_auth.py: one process serves both modules.
    return server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                          "--served-model-name", "tiny", env={"KVSERVE_API_KEY": KEY})


def raw_status(port: int, method: str, target: str, headers: list[tuple[str, str]]) -> int:
    lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers), "Content-Length: 2",
             "Connection: close"]
    return raw_request_status(port, ("\r\n".join(lines) + "\r\n\r\n{}").encode())


def spellings(path: str, port: int) -> list[str]:
    """Ways to write `path` that a router or proxy might take for the same route."""
    head, _, tail = path[1:].partition("/")
    variants = [path, path.upper(), path.title(), path + "/", "/" + path, path.replace("/", "//"),
                path + "?x=/health", path + ";/health", f"/./{path[1:]}", f"/health/../{path[1:]}",
                f"http://127.0.0.1:{port}{path}", "/" + "".join(f"%{ord(c):02X}" for c in path[1:]),
                quote(path, safe="").replace("%2F", "/", 1)]  # /v1%2Fcompletions
    if tail:
        variants += [f"/{head}%2F{tail}", f"/{head}%2f{tail}", f"/{head}%252F{tail}", f"/{head}/./{tail}",
                     f"/{head}\\{tail}"]
    return variants


def protected_paths(base_url: str, key: str) -> list[str]:
    """Every route of the server's schema but the open ones, the docs, and paths that exist nowhere."""
    schema = httpx.get(base_url + "/openapi.json", headers={"Authorization": f"Bearer {key}"}).json()
    return sorted(set(schema["paths"]) - OPEN) + ["/openapi.json", "/docs", "/redoc", "/debug/faults",
                                                  "/v1/no-such-route"]


def unauthorised_requests(port: int, protected: list[str], key: str) -> list[tuple[str, str, list]]:
    """(method, target, headers) for every spelling of every protected path, every method, with
    no key, wrong keys and spoofed Host headers; plus two Authorization headers (one of them
    right) and a websocket upgrade per path. The server must answer each with 401."""
    requests = []
    for path in protected:
        for target in spellings(path, port):
            for method in METHODS:
                for authorization in WRONG_AUTHORIZATIONS:
                    headers = [("Host", f"127.0.0.1:{port}")]
                    if authorization is not None:
                        headers.append(("Authorization", authorization))
                    requests.append((method, target, headers))
                for host in ("localhost", "evil.example", f"127.0.0.1:{port}\r\nX-Forwarded-For: x"):
                    requests.append((method, target, [("Host", host)]))
        # Two headers, one of them right: refused (which one a proxy honours is not ours to guess).
        requests.append(("GET", path, [("Host", "x"), ("Authorization", "Bearer wrong"),
                                       ("Authorization", f"Bearer {key}")]))
        requests.append(("GET", path, [("Host", "x"), ("Upgrade", "websocket"), ("Connection", "Upgrade")]))
    return requests


def test_every_protected_route_refuses_missing_and_wrong_keys_however_spelled(server):
    protected = protected_paths(server.base_url, KEY)
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
            "/dashboard/state"} <= set(protected)
    requests = unauthorised_requests(server.port, protected, KEY)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda r: raw_status(server.port, *r), requests))
    not_refused = [(r, s) for r, s in zip(requests, statuses) if s != 401]
    assert not_refused == [], f"{len(not_refused)} of {len(requests)}: {not_refused[:10]}"


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("GET", "/dashboard/state", None),
])
def test_the_right_key_works_on_every_route(server, method, path, body):
    right = httpx.request(method, server.base_url + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60)
    assert right.status_code == 200, right.text
    wrong = httpx.request(method, server.base_url + path, json=body, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def test_open_paths_stay_open_without_a_key(server):
    assert auth.OPEN_PATHS == {p.lower() for p in OPEN}  # a new open path is a decision this test must list
    for path in sorted(OPEN):
        assert raw_status(server.port, "GET", path, [("Host", "x")]) == 200


def test_keys_are_compared_in_constant_time(monkeypatch):
    """The check goes through hmac.compare_digest (its time does not depend on where the first
    differing byte is), once per request, with the presented header and the expected value."""
    calls = []
    compare = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    middleware = APIKeyMiddleware(app=None, api_key=KEY)
    scope = {"type": "http", "path": "/v1/models", "headers": [(b"authorization", f"Bearer {KEY}".encode())]}
    assert middleware._authorised(scope)
    assert not middleware._authorised({**scope, "headers": [(b"authorization", b"Bearer sk-test-0")]})
    assert calls == [(f"Bearer {KEY}".encode(), f"Bearer {KEY}".encode()),
                     (b"Bearer sk-test-0", f"Bearer {KEY}".encode())]


def test_a_websocket_without_the_key_is_closed_before_it_is_accepted():
    sent = []
    reached = []

    async def app(scope, receive, send):
        reached.append(scope)

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/completions", "headers": []}
    asyncio.run(APIKeyMiddleware(app, api_key=KEY)(scope, None, send))
    assert reached == [] and sent == [{"type": "websocket.close", "code": 1008}]
