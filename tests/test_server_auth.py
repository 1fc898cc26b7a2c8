"""`--api-key` (here from KVSERVE_API_KEY): every /v1 route needs the key whatever the spelling
of the path, the Host header or the method; /health, /metrics, /version and the dashboard's page
and static assets stay open, while the dashboard's state needs the key. Paths are sent over a
raw socket so that no client library normalises them first."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_process import raw_request_status

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama):
    return server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                          "--served-model-name", "tiny", env={"KVSERVE_API_KEY": KEY})


def raw_status(server, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> int:
    headers = {"Host": f"127.0.0.1:{server.port}", "Connection": "close", "Content-Length": str(len(body)),
               **(headers or {})}
    request = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return raw_request_status(server.port, request.encode() + body)


@pytest.mark.parametrize("path", ["/v1/models", "/V1/models", "/v1/models/", "//v1/models", "/v1//models",
                                  "/v1%2Fmodels", "/%761/models", "/v1/%6dodels", "/v1/./models", "/tokenize",
                                  "/docs", "/openapi.json", "/dashboard/state", "/DASHBOARD/state",
                                  "/dashboard//state", "/dashboard%2Fstate", "/dashboard/state/"])
@pytest.mark.parametrize("method", ["GET", "POST", "OPTIONS"])
def test_protected_paths_refuse_a_missing_key(server, path, method):
    assert raw_status(server, method, path) == 401


@pytest.mark.parametrize("headers", [
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {KEY}x"},
    {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"},
    {"Host": "localhost"},
    {"Host": "localhost", "X-Forwarded-For": "127.0.0.1", "X-Original-URL": "/health"},
    {"x-api-key": "wrong"},
    {"x-api-key": f"Bearer {KEY}"},
    {"Authorization": "Bearer wrong", "x-api-key": KEY},  # a wrong Authorization is not overruled
])
def test_wrong_keys_and_spoofed_headers_are_refused(server, headers):
    assert raw_status(server, "GET", "/v1/models", headers) == 401


def test_right_key_works_and_open_paths_stay_open(server):
    assert raw_status(server, "GET", "/v1/models", {"Authorization": f"Bearer {KEY}"}) == 200
    assert raw_status(server, "GET", "/dashboard/state", {"Authorization": f"Bearer {KEY}"}) == 200
    for path in ("/health", "/metrics", "/version", "/dashboard", "/dashboard/dashboard.js",
                 "/dashboard/uPlot.iife.min.js"):
        assert raw_status(server, "GET", path) == 200
    response = httpx.get(f"{server.base_url}/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"] == "Bearer"

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
    response = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=0)
    assert response.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_anthropic_clients_send_the_key_as_x_api_key(server):
    """Older anthropic SDKs (0.x) and Claude Code with ANTHROPIC_API_KEY send `x-api-key`; the
    2.x SDK sends `Authorization: Bearer`. Both work, and a refusal has Anthropic's error body."""
    anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is in the test extra")
    assert raw_status(server, "GET", "/v1/models", {"x-api-key": KEY}) == 200
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
            "extra_body": {"ignore_eos": True}}
    raw = {k: v for k, v in body.items() if k != "extra_body"}
    assert httpx.post(f"{server.base_url}/v1/messages", json=raw, headers={"x-api-key": KEY}).status_code == 200
    refused = httpx.post(f"{server.base_url}/v1/messages", json=raw, headers={"x-api-key": "nope"})
    assert refused.status_code == 401
    assert refused.json() == {"type": "error", "error": {"type": "authentication_error", "message": refused.json()[
        "error"]["message"]}} and "x-api-key" in refused.json()["error"]["message"]
    message = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0).messages.create(**body)
    assert message.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0).messages.create(**body)


def test_a_refused_request_never_reaches_the_engine(server):
    before = server.metrics()["kvserve:prompt_tokens_total"]
    body = b'{"prompt": "Hello", "max_tokens": 3}'
    assert raw_status(server, "POST", "/v1/completions", {"Content-Type": "application/json"}, body) == 401
    assert server.metrics()["kvserve:prompt_tokens_total"] == before


# ---------------------------------------------------------------------------- CORS (kvserve/server/cors.py)
PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_a_browser_preflight_needs_no_key_and_errors_stay_readable_cross_origin(server):
    """vLLM's defaults: every origin; the preflight carries no key (browsers never send one), and a
    401 carries the CORS headers, so the page can read why it was refused."""
    preflight = httpx.options(f"{server.base_url}/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "POST" in preflight.headers["access-control-allow-methods"]
    origin = {"Origin": "https://app.example"}
    refused = httpx.get(f"{server.base_url}/v1/models", headers=origin)
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    allowed = httpx.get(f"{server.base_url}/v1/models", headers={**origin, "Authorization": f"Bearer {KEY}"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-origin" not in httpx.get(f"{server.base_url}/health").headers  # same-origin


def test_allowed_origins_limit_which_pages_may_call(server_factory, tiny_llama):
    server = server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                            "--allowed-origins", '["https://app.example"]', "--allow-credentials")
    url = f"{server.base_url}/v1/completions"
    allowed = httpx.options(url, headers=PREFLIGHT)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    other = httpx.options(url, headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    reply = httpx.post(url, headers={"Origin": "https://evil.example"},
                       json={"prompt": "hi", "max_tokens": 1})
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
    closed = server_factory(str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                            "--allowed-origins", "[]")
    assert "access-control-allow-origin" not in httpx.options(url.replace(str(server.port), str(closed.port)),
                                                              headers=PREFLIGHT).headers
