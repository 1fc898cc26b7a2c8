"""Bad input gets a 4xx with OpenAI's error body and a useful message, never a 500 or a hang;
the `kvserve serve` command fails with one line for bad flags."""
from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from server_process import free_port

TIMEOUT = httpx.Timeout(30)


def post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=TIMEOUT, **kwargs)


def assert_error(response: httpx.Response, status: int, *fragments: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


def test_context_length_error_uses_vllms_text(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=5000)
    assert info.value.status_code == 400
    assert info.value.body["message"].startswith("This model's maximum context length is 1024 tokens.")
    long_message = [{"role": "user", "content": "word " * 1500}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=long_message)
    assert info.value.body["message"].startswith("This model's maximum context length is 1024 tokens.")
    assert info.value.body["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n must be at least 1"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 10 ** 6}, "At most"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": "x", "stream": [1]}, "stream"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "stop": ["a"] * 100}, "stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 10 ** 7]}, "out of vocabulary"),
    ({"prompt": "x", "max_tokens": 10 ** 9}, "maximum context length"),
    ({}, "prompt"),
])
def test_completions_bad_input_is_a_400(tiny_server, body, fragment):
    assert_error(post(tiny_server, "/v1/completions", json=body), 400, fragment)


@pytest.mark.parametrize("body, fragment", [
    ({"messages": []}, "at least one message"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "logprobs"),
])
def test_chat_bad_input_is_a_400(tiny_server, body, fragment):
    assert_error(post(tiny_server, "/v1/chat/completions", json=body), 400, fragment)


def test_invalid_json_and_bodies(tiny_server):
    assert_error(post(tiny_server, "/v1/completions", content=b"{not json",
                      headers={"content-type": "application/json"}), 400, "JSON")
    assert_error(post(tiny_server, "/v1/completions", content=b"\xff\xfe\x00",
                      headers={"content-type": "application/json"}), 400)
    assert_error(post(tiny_server, "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000,
                      headers={"content-type": "application/json"}), 400)
    too_big = {"prompt": "x" * (2 << 20)}  # the tiny server's limit is 1 MiB
    assert_error(post(tiny_server, "/v1/completions", json=too_big), 413, "too large")


def test_unknown_model_is_a_404(tiny_server):
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=1)
    assert info.value.body["message"] == "The model `gpt-17` does not exist."


def test_unsupported_openai_fields_are_refused_unknown_keys_accepted(tiny_server):
    for path, extra in [("/v1/chat/completions", {"functions": [{"name": "f"}]}),
                        ("/v1/chat/completions", {"guided_whitespace_pattern": " *"}),
                        ("/v1/completions", {"lora_request": {"name": "x"}}),
                        ("/v1/completions", {"use_beam_search": True}),
                        ("/v1/chat/completions", {"length_penalty": 0.8}),
                        ("/v1/chat/completions", {"logits_processors": ["my.Processor"]}),
                        ("/v1/completions", {"vllm_xargs": {"k": 1}}),
                        ("/v1/completions", {"prompt_embeds": "AAAA"})]:
        body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
        error = assert_error(post(tiny_server, path, json={**body, **extra}), 400, "not supported")
        assert error["param"] == next(iter(extra))
    # Values that ask for nothing kvserve lacks, and keys no API defines, are accepted.
    ok = post(tiny_server, "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "response_format": {"type": "text"},
        "tools": [], "my_own_key": {"a": 1}, "priority": 0, "use_beam_search": False, "length_penalty": 1.0})
    assert ok.status_code == 200, ok.text


def test_the_warning_for_many_unknown_keys_is_one_short_line(tiny_server):
    """15,000 unknown keys (the tiny server takes 1 MiB bodies): accepted (vLLM ignores them too), and
    logged in one line that names a few."""
    extra = {f"key_{i:06d}_" + "k" * 40: 0 for i in range(15_000)}
    ok = post(tiny_server, "/v1/completions", json={"prompt": "x", "max_tokens": 1, **extra})
    assert ok.status_code == 200, ok.text
    lines = [line for line in tiny_server.log_path.read_text(errors="replace").splitlines()
             if "key_000000_" in line]
    assert len(lines) == 1 and len(lines[0]) < 3000 and "and 14980 more" in lines[0], lines[0][:300]


def test_every_endpoint_logs_the_fields_it_ignores(tiny_server):
    """Embeddings, tokenize, detokenize and the Responses API's `text` warn of keys they do not read,
    as completions and chat do (vLLM's warning), and still answer."""
    for path, body, key in [("/v1/embeddings", {"input": "x", "my_own_key": True}, "my_own_key"),
                            ("/tokenize", {"prompt": "x", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
                            ("/detokenize", {"tokens": [5], "skip_special": True}, "skip_special"),
                            ("/v1/responses", {"input": "x", "max_output_tokens": 1, "text": {"verbosity": "low"}},
                             "text.verbosity")]:
        assert post(tiny_server, path, json=body).status_code == 200, path
        logged = [line for line in tiny_server.log_path.read_text(errors="replace").splitlines()
                  if "present in the request but ignored" in line and repr(key) in line]
        assert logged, (path, key)


def test_a_top_p_that_underflows_float32_keeps_the_most_likely_token(tiny_server):
    """top_p = 1e-46 is 0 in float32, which masked every token (a 200 of end-of-text tokens); it is
    raised to the smallest normal float32, which keeps the most likely token: greedy's text."""
    body = {"prompt": "It is a truth universally acknowledged", "max_tokens": 8, "ignore_eos": True}
    greedy = post(tiny_server, "/v1/completions", json={**body, "temperature": 0}).json()
    for top_p in (1e-46, 1e-300):
        tiny = post(tiny_server, "/v1/completions", json={**body, "temperature": 1.0, "top_p": top_p})
        assert tiny.status_code == 200, tiny.text
        assert tiny.json()["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_routing_errors_have_openai_bodies(tiny_server):
    assert_error(httpx.get(tiny_server.base_url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(tiny_server.base_url + "/v1/completions"), 405, "GET")
    assert_error(httpx.delete(tiny_server.base_url + "/v1/models"), 405)


def test_tokenize_detokenize(tiny_server):
    tokens = post(tiny_server, "/tokenize", json={"prompt": "Mr. Darcy", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
    assert tokens["max_model_len"] == 1024
    text = post(tiny_server, "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Mr. Darcy"
    assert_error(post(tiny_server, "/detokenize", json={"tokens": [10 ** 6]}), 400, "out of vocabulary")
    assert_error(post(tiny_server, "/tokenize", json={}), 400, "exactly one")


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_serve_command_errors_are_one_line(tiny_llama):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        result = run_serve(str(tiny_llama), "--port", port)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("kvserve serve: error: cannot listen on")
    assert "Traceback" not in result.stderr
    result = run_serve(str(tiny_llama), "--api-key", " ", "--port", str(free_port()))
    assert result.returncode == 2 and "--api-key must not be empty" in result.stderr
    result = run_serve(str(tiny_llama), "--max-request-body-bytes", "lots", "--port", str(free_port()))
    assert result.returncode == 2 and "cannot parse size" in result.stderr
