"""The malformed and absurd request bodies of benchmarks/adversarial.py: what a fuzzer, an attacker
or a careless client sends. The hand-written cases of tests/test_reliability_fuzz.py, every
numeric field crossed with wrong types and extreme values, and a few bodies only a careless client
writes. Each is (name, route, raw body bytes, extra headers); the server must answer each with a
4xx and an OpenAI error body, or a 200 where the value happens to be valid, within the timeout."""
from __future__ import annotations

import json

from test_reliability_fuzz import CASES, CHAT_CASES, FLOAT_FIELDS  # tests/ is on sys.path

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
Case = tuple[str, str, bytes, dict[str, str]]

FLOAT_VALUES = ["NaN", "Infinity", "-Infinity", "-1e308", "1e999", "-0.5", "1e-40", "1e-308", '"0.5"', "null",
                "true", "[0.5]"]
INT_FIELDS = ("max_tokens", "n", "top_k", "logprobs", "seed", "min_tokens")
INT_VALUES = ["-1", "0", "1.5", "1e400", "1000000000000", '"3"', "null", "[]", "{}"]


def _completion(field: str, raw_value: str) -> bytes:
    """A small valid completion (two tokens) whose `field` holds the JSON text `raw_value`."""
    base = '"prompt": "Hello", "max_tokens": 2' if field != "max_tokens" else '"prompt": "Hello"'
    return f'{{{base}, "{field}": {raw_value}}}'.encode()


def _chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}).encode()


def _chat_of(message: dict) -> bytes:
    return json.dumps({"messages": [message], "max_tokens": 2}).encode()


def careless_cases(vocab_size: int) -> list[Case]:
    cases = [
        ("temperature 1e-40 (acts as greedy)", COMPLETIONS, _completion("temperature", "1e-40"), {}),
        ("repetition_penalty 1e-308", COMPLETIONS, _completion("repetition_penalty", "1e-308"), {}),
        ("min_tokens 10^12 with max_tokens", COMPLETIONS,
         b'{"prompt": "Hello", "max_tokens": 2, "min_tokens": 1000000000000}', {}),
        ("n x prompts: 64 prompts, n 64", COMPLETIONS,
         json.dumps({"prompt": ["Hello"] * 64, "n": 64, "max_tokens": 2}).encode(), {}),
        ("1000 prompts in one request", COMPLETIONS,
         json.dumps({"prompt": ["Hello"] * 1000, "max_tokens": 1}).encode(), {}),
        ("token id = vocab size", COMPLETIONS, json.dumps({"prompt": [1, vocab_size], "max_tokens": 2}).encode(), {}),
        ("token id 10^9", COMPLETIONS, b'{"prompt": [1, 1000000000], "max_tokens": 2}', {}),
        ("token id as a float", COMPLETIONS, b'{"prompt": [1, 2.5], "max_tokens": 2}', {}),
        ("unknown fields", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 2, "frobnicate": {"a": [1]}}', {}),
        ("prompt a number", COMPLETIONS, b'{"prompt": 42, "max_tokens": 2}', {}),
        ("prompt an object", COMPLETIONS, b'{"prompt": {"text": "Hello"}, "max_tokens": 2}', {}),
        ("prompt a list of lists of strings", COMPLETIONS, b'{"prompt": [["a", "b"]], "max_tokens": 2}', {}),
        ("no prompt", COMPLETIONS, b'{"max_tokens": 2}', {}),
        ("stop an integer", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 2, "stop": 7}', {}),
        ("stream 'yes'", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 2, "stream": "yes"}', {}),
        ("logit_bias key out of the vocabulary", COMPLETIONS,
         b'{"prompt": "Hello", "max_tokens": 2, "logit_bias": {"99999999": 5}}', {}),
        ("logit_bias value NaN", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 2, "logit_bias": {"1": NaN}}', {}),
        ("response_format garbage", COMPLETIONS,
         b'{"prompt": "Hello", "max_tokens": 2, "response_format": {"type": "frob"}}', {}),
        ("duplicate keys", COMPLETIONS, b'{"prompt": "Hello", "prompt": [1, 2], "max_tokens": 2}', {}),
        ("empty body", COMPLETIONS, b"", {}),
        ("body null", COMPLETIONS, b"null", {}),
        ("UTF-16 body", COMPLETIONS, '{"prompt": "Hello", "max_tokens": 2}'.encode("utf-16"), {}),
        ("Content-Type text/plain", COMPLETIONS, b'{"prompt": "Hello", "max_tokens": 2}',
         {"content-type": "text/plain"}),
        ("chat content null", CHAT, _chat_of({"role": "user", "content": None}), {}),
        ("chat content an integer", CHAT, _chat_of({"role": "user", "content": 5}), {}),
        ("chat message without a role", CHAT, _chat_of({"content": "Hi"}), {}),
        ("chat content part of unknown type", CHAT,
         _chat_of({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}), {}),
        ("chat tools garbage", CHAT, _chat(tools="everything"), {}),
        ("chat temperature 1e-40", CHAT, _chat(temperature=1e-40), {}),
        ("chat n 10^6", CHAT, _chat(n=1000000), {}),
        ("chat 10,000 messages", CHAT,
         json.dumps({"messages": [{"role": "user", "content": "Hi"}] * 10000, "max_tokens": 2}).encode(), {}),
        ("tokenize a lone surrogate", "/tokenize", b'{"prompt": "\\ud800"}', {}),
        ("detokenize ids out of the vocabulary", "/detokenize", b'{"tokens": [-1, 1000000000]}', {}),
        ("detokenize not a list", "/detokenize", b'{"tokens": "abc"}', {}),
    ]
    return cases


def all_cases(vocab_size: int) -> list[Case]:
    """Every body, named; the generated ones after the hand-written ones."""
    cases: list[Case] = [(f"completions: {name}", COMPLETIONS, body, {}) for name, (body, _) in CASES.items()]
    cases += [(f"chat: {name}", CHAT, body, {}) for name, (body, _) in CHAT_CASES.items()]
    cases += [(f"{field} = {value}", COMPLETIONS, _completion(field, value), {})
              for field in FLOAT_FIELDS for value in FLOAT_VALUES]
    cases += [(f"{field} = {value}", COMPLETIONS, _completion(field, value), {})
              for field in INT_FIELDS for value in INT_VALUES if (field, value) != ("max_tokens", "null")]
    # max_tokens null means "up to the context length", as in vLLM: valid, and minutes of work on a
    # CPU, so it is streamed and the client leaves after the first events (an abort).
    cases.append(("max_tokens = null (streamed, client leaves)", COMPLETIONS,
                  b'{"prompt": "Hello", "max_tokens": null, "stream": true}', {}))
    return cases + careless_cases(vocab_size)
