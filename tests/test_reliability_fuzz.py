"""Fuzzing the API edge of a real `kvserve serve` (issue 9, #3): schemathesis generates valid and
invalid requests for every route of the server's own /openapi.json, and hand-written cases cover
what generators rarely hit (invalid UTF-8, lone surrogates, NaN, huge numbers, nesting, bodies
over the limit). Every answer must come within the timeout, never be a 5xx, and every error
must carry OpenAI's JSON body (Anthropic's on its Messages API paths). The server uses --max-model-len 64 so a generated request cannot
ask for long generations."""
from __future__ import annotations

import socket
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from scenarios import pool_state

TIMEOUT_S = 30
MAX_EXAMPLES = 30  # per route and mode; derandomized, so CI runs the same cases every time
SERVER_ARGS = ("--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-model-len", "64",
               "--max-request-body-bytes", "64KiB", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama):
    return server_factory(str(tiny_llama), *SERVER_ARGS)


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


# Every operation of the schema (test_the_schema_lists_exactly_these_routes keeps this in step).
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/version"),
              ("GET", "/metrics"), ("GET", "/dashboard/state"), ("GET", "/v1/kv_events/snapshot"),
              ("GET", "/v1/load"), ("POST", "/v1/embeddings"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"),
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("GET", "/v1/models/{model_id}"),
              ("HEAD", "/health"), ("POST", "/reset_prefix_cache"), ("GET", "/ping"), ("POST", "/ping"),
              ("POST", "/invocations")]
# The KV-events stream answers a valid request with a stream that lasts as long as the server:
# listed in the schema, not fuzzed (tests/test_router.py reads it).
STREAMS = [("GET", "/v1/kv_events")]


def assert_openai_error(status: int, content_type: str, body: bytes, path: str = "") -> None:
    """Below 400 anything goes; from 400 up: JSON `{"error": {message, type, param, code}}`, never 5xx
    (on /v1/messages..., Anthropic's `{"type": "error", "error": {type, message}}`)."""
    assert status < 500, f"HTTP {status}: {body[:500]!r}"
    if status < 400:
        return
    assert content_type.startswith("application/json"), (status, content_type, body[:200])
    parsed = httpx.Response(status, content=body).json()
    error = parsed["error"]
    if path.startswith("/v1/messages"):
        assert parsed["type"] == "error" and set(error) == {"type", "message"} and error["message"], parsed
    else:
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error


def test_the_schema_lists_exactly_these_routes(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS) | set(STREAMS)


# The GET routes take no body, the responses' {response_id} routes only a string in the path (any
# string is one), and /ping and /invocations declare no body (the latter reads any JSON and picks
# its route), so no request can break their schema: positive cases only.
SCHEMALESS = ("/ping", "/invocations")
FUZZ_CASES = [(method, path, mode) for method, path in OPERATIONS
              for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
              if (method == "POST" and "{" not in path and path not in SCHEMALESS) or mode == GenerationMode.POSITIVE]


@pytest.mark.parametrize("method, path, mode", FUZZ_CASES, ids=[f"{m} {p} {g.value}" for m, p, g in FUZZ_CASES])
def test_generated_requests_never_5xx_and_errors_are_openai_bodies(api_schema, method, path, mode):
    """schemathesis builds requests from the route's schema: valid ones (positive) and ones that
    break it (negative: wrong types, missing fields, out-of-range values)."""
    operation = api_schema[path][method]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(timeout=TIMEOUT_S)  # a hang fails here
        case.validate_response(response, checks=[not_a_server_error])
        content_type = (response.headers.get("content-type") or [""])[0]  # lower-case keys, list values
        assert_openai_error(response.status_code, content_type, response.content, path)

    check()


def post(server, path: str, content: bytes, **headers: str) -> httpx.Response:
    response = httpx.post(server.base_url + path, content=content, timeout=TIMEOUT_S,
                          headers={"content-type": "application/json", **headers})
    assert_openai_error(response.status_code, response.headers.get("content-type", ""), response.content)
    return response


FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "-1e308", "1e999", "-0.5"])
def test_non_finite_and_negative_floats_are_400(server, field, value):
    # Python's json accepts NaN/Infinity literals and 1e999 (= inf); all must be refused, not sampled with.
    body = f'{{"prompt": "x", "max_tokens": 2, "{field}": {value}}}'.encode()
    response = post(server, "/v1/completions", body)
    if field in ("presence_penalty", "frequency_penalty") and value == "-0.5":
        assert response.status_code == 200  # in [-2, 2]: valid
    else:
        assert response.status_code == 400 and field in response.json()["error"]["message"]


CASES = {
    "invalid UTF-8 bytes": (b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', "parsing the body"),
    "truncated UTF-8 sequence": (b'{"prompt": "caf\xc3", "max_tokens": 2}', "parsing the body"),
    "lone surrogate in the prompt": (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "lone surrogate"),
    "lone surrogate in a stop string": (b'{"prompt": "a", "stop": ["\\udfff"], "max_tokens": 2}', "surrogate"),
    "lone surrogate in the cache salt": (b'{"prompt": "a", "cache_salt": "\\ud800", "max_tokens": 2}', "surrogate"),
    "empty cache salt": (b'{"prompt": "a", "cache_salt": "", "max_tokens": 2}', "non-empty string"),
    "lone surrogate in an unknown key": (b'{"prompt": "a", "\\ud800": 1, "max_tokens": 2}', "nicode"),
    "not JSON": (b"prompt=hello", "JSON"),
    "JSON but not an object": (b'["prompt", "x"]', ""),
    "deeply nested JSON": (b'{"prompt": "x", "user": ' + b"[" * 20000 + b"]" * 20000 + b"}", ""),
    "empty prompt": (b'{"prompt": ""}', "empty"),
    "empty prompt in a list": (b'{"prompt": [""]}', "empty"),
    "empty token list": (b'{"prompt": [[]]}', "empty"),
    "token id below the vocabulary": (b'{"prompt": [1, -1]}', "out of vocabulary"),
    "token id above the vocabulary": (b'{"prompt": [1, 512]}', "out of vocabulary"),
    "token id beyond int64": (b'{"prompt": [1, 100000000000000000000000]}', "out of vocabulary"),
    "stop token id beyond the vocabulary": (b'{"prompt": "x", "stop_token_ids": [99999], "min_tokens": 1}',
                                            "out of vocabulary"),
    "max_tokens 10^9": (b'{"prompt": "x", "max_tokens": 1000000000}', "maximum context length"),
    "max_tokens 10^400": (b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}", "maximum context length"),
    "n 10^6": (b'{"prompt": "x", "n": 1000000}', "At most"),
    "seed beyond int64": (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    "top_k beyond int64": (b'{"prompt": "x", "top_k": 100000000000000000000}', "top_k"),
    "too many stop strings": (b'{"prompt": "x", "stop": [' + b",".join([b'"s"'] * 65) + b"]}", "stop"),
    "empty stop string": (b'{"prompt": "x", "stop": [""]}', "stop"),
    "logprobs 10^9": (b'{"prompt": "x", "logprobs": 1000000000}', "logprobs"),
    "stream_options without stream": (b'{"prompt": "x", "stream_options": {"include_usage": true}}',
                                      "Stream options can only be defined when `stream=True`."),
}

CHAT_CASES = {
    "empty messages": (b'{"messages": []}', "at least one message"),
    "unknown role": (b'{"messages": [{"role": "root", "content": "x"}]}', "role"),
    "legacy function role": (b'{"messages": [{"role": "function", "name": "f", "content": "x"}]}', "role"),
    "tool call arguments neither text nor an object": (
        b'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", '
        b'"function": {"name": "f", "arguments": [1]}}]}]}', "arguments"),
    "lone surrogate in content": (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "surrogate"),
    "lone surrogate in a content part": (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "surrogate"),
    "max_completion_tokens 10^9": (b'{"messages": [{"role": "user", "content": "x"}], '
                                   b'"max_completion_tokens": 1000000000}', "maximum context length"),
    "stream_options without stream": (b'{"messages": [{"role": "user", "content": "x"}], "stream": false, '
                                      b'"stream_options": {"include_usage": true}}', "only be defined when `stream=True`"),
    "top_logprobs 10^6": (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, '
                          b'"top_logprobs": 1000000}', "logprobs"),
    "messages not a list": (b'{"messages": {"role": "user"}}', "messages"),
}


@pytest.mark.parametrize("name", CASES)
def test_hand_written_bad_completions_are_400(server, name):
    body, fragment = CASES[name]
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


@pytest.mark.parametrize("name", CHAT_CASES)
def test_hand_written_bad_chats_are_400(server, name):
    body, fragment = CHAT_CASES[name]
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


def test_bodies_over_the_limit_are_413_declared_or_chunked(server):
    huge = b'{"prompt": "' + b"x" * (128 << 10) + b'"}'  # the limit is 64 KiB
    assert post(server, "/v1/completions", huge).status_code == 413

    def chunks():
        yield b'{"prompt": "'
        for _ in range(128):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(server.base_url + "/v1/completions", content=chunks(), timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"})  # no Content-Length: chunked
    assert response.status_code == 413
    assert_openai_error(413, response.headers["content-type"], response.content)
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n"
                     b"Connection: close\r\n\r\n{}")
        reply = sock.recv(4096)
    assert reply.split(b" ", 2)[1] == b"400"  # refused by the HTTP parser or by the limit check


def test_an_over_limit_body_gets_its_413_even_from_a_stalled_client_or_one_expecting_continue(server):
    # The server drains what an over-limit client is still sending before it answers, but no
    # longer than about a second, and never invites the body with "100 Continue".
    for expect in (b"", b"Expect: 100-continue\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000000\r\n" + expect + b"\r\n" + b'{"prompt": "')  # then stalls
            started = time.monotonic()
            reply = sock.recv(4096)
            assert reply.startswith(b"HTTP/1.1 413 "), reply[:80]
            assert time.monotonic() - started < 10


def test_the_server_is_still_healthy_and_drained_after_the_fuzzing(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Mr. Darcy", "max_tokens": 3},
                    timeout=TIMEOUT_S)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    state = pool_state(server.base_url)
    assert state.num_free_blocks == state.num_blocks and state.running == state.waiting == 0
