"""Prompt logprobs over HTTP, through the official `openai` client against a real server: echo
with logprobs (what lm-evaluation-harness sends), max_tokens 0 with echo, vLLM's
`prompt_logprobs` field on completions and chat, and the --max-logprobs 400s. The values are
compared with the offline engine's (tests/test_prompt_logprobs.py compares those with HF)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_process import FLAGGED_SERVER_ARGS, TINY_ENGINE_OPTIONS, TINY_SERVER_ARGS
from test_server import sse_events

from kvserve import LLM, SamplingParams

PROMPT = "It is a truth universally acknowledged, that a single man"
CLOSE = 1e-4  # the same float32 engine, possibly batched differently


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), **TINY_ENGINE_OPTIONS)


def offline_prompt_logprobs(offline: LLM, prompt, k: int):
    [out] = offline.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=k), use_tqdm=False)
    return out.prompt_token_ids, out.prompt_logprobs


def error_of(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


def test_echo_with_logprobs_returns_the_prompt_tokens_first(client, offline):
    ids, expected = offline_prompt_logprobs(offline, PROMPT, 2)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=2,
                                         temperature=0, extra_body={"ignore_eos": True})
    choice = response.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    tokenizer = offline.get_tokenizer()
    for i in range(1, len(ids)):
        assert lp.tokens[i] == tokenizer.decode([ids[i]])
        assert lp.token_logprobs[i] == pytest.approx(expected[i][ids[i]].logprob, abs=CLOSE)
        top = lp.top_logprobs[i]
        # The prompt token and the 2 best, keyed by text (tokens with the same text share a key).
        assert top[lp.tokens[i]] == lp.token_logprobs[i] and 1 <= len(top) <= 3
        for text, value in top.items():
            assert any(tokenizer.decode([t]) == text and value == pytest.approx(e.logprob, abs=CLOSE)
                       for t, e in expected[i].items())
    # The text is the prompt then the completion, and the offsets walk through it.
    assert choice.text.startswith(PROMPT) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:len(ids)]) == PROMPT and lp.text_offset[len(ids)] == len(PROMPT)
    assert PROMPT + "".join(lp.tokens[len(ids):]) == choice.text
    assert all(v is not None for v in lp.token_logprobs[1:])
    # vLLM also fills the choice's prompt_logprobs when echo computed them.
    assert len(choice.prompt_logprobs) == len(ids) and choice.prompt_logprobs[0] is None


def test_lm_eval_harness_request_shape(tiny_server, offline):
    """lm-evaluation-harness's local-completions loglikelihood request: token ids, one token,
    echo, logprobs 1; it sums token_logprobs[context:-1] and checks each against its top."""
    ids, expected = offline_prompt_logprobs(offline, PROMPT, 1)
    body = {"model": "tiny", "prompt": [ids], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    lp = response.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    continuation = lp["token_logprobs"][5:-1]
    assert sum(continuation) == pytest.approx(sum(expected[i][ids[i]].logprob for i in range(5, len(ids))), abs=1e-3)
    for value, top in zip(continuation, lp["top_logprobs"][5:-1]):
        assert max(top.values()) >= value


def test_echo_with_logprobs_streamed_equals_non_streamed(tiny_server, client):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0, "n": 2}
    whole = client.completions.create(**body, extra_body={"ignore_eos": True}).choices
    body["ignore_eos"] = True
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60)
    chunks = [json.loads(e) for e in sse_events(response) if e != "[DONE]"]
    for index in (0, 1):  # each sample's first chunk carries the echoed prompt and its logprobs
        text, tokens, values, offsets = "", [], [], []
        for c in (c for chunk in chunks for c in chunk["choices"] if c["index"] == index):
            text += c["text"]
            if c["logprobs"]:
                tokens += c["logprobs"]["tokens"]
                values += c["logprobs"]["token_logprobs"]
                offsets += c["logprobs"]["text_offset"]
        expected = whole[index]
        assert text == expected.text and tokens == expected.logprobs.tokens
        assert offsets == expected.logprobs.text_offset
        assert values[0] is None and values[1:] == pytest.approx(expected.logprobs.token_logprobs[1:], abs=CLOSE)


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(tiny_server, client, offline):
    ids, expected = offline_prompt_logprobs(offline, PROMPT, 0)
    before = tiny_server.metrics()
    response = client.completions.create(model="tiny", prompt=[PROMPT, "Mr. Darcy"], max_tokens=0, echo=True)
    assert [c.text for c in response.choices] == [PROMPT, "Mr. Darcy"]
    assert {c.finish_reason for c in response.choices} == {"length"}
    assert response.usage.completion_tokens == 0 and response.choices[0].logprobs is None
    after = tiny_server.metrics()  # the prompts were computed: counted, though no token came
    assert after["kvserve:prompt_tokens_total"] - before["kvserve:prompt_tokens_total"] == response.usage.prompt_tokens
    scored = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0).choices[0]
    assert scored.text == PROMPT and len(scored.logprobs.tokens) == len(ids)
    assert scored.logprobs.token_logprobs[1:] == pytest.approx([expected[i][ids[i]].logprob
                                                                for i in range(1, len(ids))], abs=CLOSE)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == PROMPT and chunks[-1].choices[0].finish_reason == "length"
    assert "max_tokens must be at least 1, got 0" in error_of(
        lambda: client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0))["message"]


def check_vllm_structure(entries, ids: list[int], expected, k: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry = {int(token): value for token, value in entries[i].items()}
        assert list(entry)[0] == ids[i] and set(entry) == set(expected[i])
        assert len(entry) in (k, k + 1)
        for token, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert value["logprob"] == pytest.approx(expected[i][token].logprob, abs=CLOSE)
            assert value["rank"] == expected[i][token].rank
            assert value["decoded_token"] == expected[i][token].decoded_token


def test_prompt_logprobs_field_on_completions_and_chat(client, offline):
    ids, expected = offline_prompt_logprobs(offline, PROMPT, 3)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 3})
    choice = response.choices[0]
    assert choice.logprobs is None and not choice.text.startswith(PROMPT)
    check_vllm_structure(choice.model_dump()["prompt_logprobs"], ids, expected, 3)

    messages = [{"role": "user", "content": "Who is Mr. Darcy?"}]
    chat_ids = offline.engine.apply_chat_template(messages)
    _, chat_expected = offline_prompt_logprobs(offline, {"prompt_token_ids": chat_ids}, 1)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                          extra_body={"prompt_logprobs": 1})
    assert chat.usage.prompt_tokens == len(chat_ids)
    check_vllm_structure(chat.model_dump()["prompt_logprobs"], chat_ids, chat_expected, 1)
    # Not asked for: null, as in vLLM.
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert plain.model_dump().get("prompt_logprobs") is None


def test_logprob_limits_and_bad_values_are_400s(client, server_factory, tiny_llama):
    completions, chat = client.completions.create, client.chat.completions.create
    messages = [{"role": "user", "content": "Hi"}]
    cases = [
        (lambda: completions(model="tiny", prompt="x", extra_body={"prompt_logprobs": 21}),
         "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
        (lambda: completions(model="tiny", prompt="x", logprobs=21),
         "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        (lambda: completions(model="tiny", prompt="x", echo=True, logprobs=21),
         "logprobs of 21, which is greater than max allowed: 20"),
        (lambda: chat(model="tiny", messages=messages, logprobs=True, top_logprobs=21),
         "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        (lambda: chat(model="tiny", messages=messages, extra_body={"prompt_logprobs": 21}),
         "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
        (lambda: completions(model="tiny", prompt="x", stream=True, extra_body={"prompt_logprobs": 1}),
         "`prompt_logprobs` are not available when `stream=True`."),
        (lambda: completions(model="tiny", prompt="x", extra_body={"prompt_logprobs": -1}),
         "`prompt_logprobs` must be a non-negative value."),
        # -1 (the whole vocabulary) is the offline API's; the server refuses it, as vLLM's does
        (lambda: completions(model="tiny", prompt="x", logprobs=-1), "`logprobs` must be a positive value."),
        (lambda: chat(model="tiny", messages=messages, logprobs=True, top_logprobs=-1),
         "`top_logprobs` must be a positive value."),
    ]
    for call, message in cases:
        assert message in error_of(call)["message"]

    capped = server_factory(str(tiny_llama), *TINY_SERVER_ARGS, "--max-logprobs", "2")
    capped_client = openai.OpenAI(base_url=f"{capped.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert "Requested prompt logprobs of 3, which is greater than max allowed: 2" in error_of(
        lambda: capped_client.completions.create(model="tiny", prompt="x", extra_body={"prompt_logprobs": 3}))["message"]
    ok = capped_client.completions.create(model="tiny", prompt="x y", max_tokens=1, echo=True, logprobs=2)
    assert len(ok.choices[0].logprobs.top_logprobs[1]) in (2, 3)


def test_tokens_as_token_ids(tiny_server, client, server_factory, tiny_llama):
    """vLLM's return_tokens_as_token_ids: every token logprobs name (sampled, alternatives, echoed
    prompt) is "token_id:N" for the id the text names otherwise; offsets still count the text;
    --return-tokens-as-token-ids makes it the default, and a request's `false` overrides it."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "echo": True, "logprobs": 2, "temperature": 0}
    as_text = client.completions.create(**body).choices[0].logprobs
    as_ids = client.completions.create(**body, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    ids = httpx.post(f"{tiny_server.base_url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert as_ids.tokens[:len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(t.startswith("token_id:") for t in as_ids.tokens)
    assert all(all(k.startswith("token_id:") for k in top) for top in as_ids.top_logprobs if top)
    assert as_ids.text_offset == as_text.text_offset and as_ids.token_logprobs == as_text.token_logprobs
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=60, json={
        **body, "stream": True, "return_tokens_as_token_ids": True})
    chunks = [json.loads(e) for e in sse_events(response) if e != "[DONE]"]
    streamed = [lp for chunk in chunks for c in chunk["choices"] if (lp := c["logprobs"])]
    assert [t for lp in streamed for t in lp["tokens"]] == as_ids.tokens
    assert [o for lp in streamed for o in lp["text_offset"]] == as_text.text_offset
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    text_reply = client.chat.completions.create(**chat).choices[0]
    flagged = server_factory(str(tiny_llama), *FLAGGED_SERVER_ARGS)
    flagged_client = openai.OpenAI(base_url=f"{flagged.base_url}/v1", api_key="unused", max_retries=0)
    id_reply = flagged_client.chat.completions.create(**chat).choices[0]
    assert id_reply.message.content == text_reply.message.content
    for named, plain in zip(id_reply.logprobs.content, text_reply.logprobs.content):
        assert named.token.startswith("token_id:") and named.bytes == plain.bytes
        assert all(t.token.startswith("token_id:") for t in named.top_logprobs)
    overridden = flagged_client.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": False})
    assert [c.token for c in overridden.choices[0].logprobs.content] == [c.token for c in text_reply.logprobs.content]
