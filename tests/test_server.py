"""The OpenAI-compatible server end to end: a real `kvserve serve` process (tiny random llama,
float32) driven with the official `openai` client and raw HTTP, compared with the offline `LLM`."""
from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_process import FLAGGED_SERVER_ARGS, TINY_ENGINE_OPTIONS
from tiny_models import BOOK

import kvserve
from kvserve import LLM, SamplingParams

PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy", "The weather at Netherfield", "Elizabeth said"]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), **TINY_ENGINE_OPTIONS)


def offline_texts(offline: LLM, prompts: list, **params) -> list[str]:
    outputs = offline.generate(prompts, SamplingParams(**params), use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def sse_events(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    events = [block for block in response.text.split("\n\n") if block]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


def wait_for(condition, timeout_s: float = 20.0):
    """Poll until condition() is truthy (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def test_stream_interval_sends_every_nth_token_and_the_same_text(server_factory, tiny_llama, tiny_server):
    """`--stream-interval 4`: each event ends on the first token, every 4th after it or the last
    (an event may carry more when the reader falls behind, never cut elsewhere), and the text is
    what the server sends unstreamed."""
    from server_process import TINY_SERVER_ARGS

    server = server_factory(str(tiny_llama), *TINY_SERVER_ARGS, "--stream-interval", "4")
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 10, "ignore_eos": True, "logprobs": 0, **GREEDY}
    plain = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    streamed = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60)
    events = [json.loads(e) for e in sse_events(streamed)[:-1]]
    counts, texts = [], []
    for event in events:
        choice = event["choices"][0]
        counts.append((counts[-1] if counts else 0) + len(choice["logprobs"]["tokens"]))
        texts.append(choice["text"])
    assert counts[-1] == 10 and set(counts) <= {1, 5, 9, 10}, counts
    assert "".join(texts) == plain["text"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_models_health_version(tiny_server, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    body = httpx.get(f"{tiny_server.base_url}/v1/models").json()
    assert body["data"][0]["max_model_len"] == 1024
    assert httpx.get(f"{tiny_server.base_url}/health").status_code == 200
    assert httpx.head(f"{tiny_server.base_url}/health").status_code == 200
    assert httpx.get(f"{tiny_server.base_url}/version").json() == {"version": kvserve.__version__}
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nope")


def test_a_clients_request_id_names_the_response(tiny_server, server_factory, tiny_llama):
    """vLLM's: X-Request-Id, else the body's request_id, names a chat or completions response (the
    header wins); two requests with one id both run; --enable-request-id-headers echoes the header
    (or a new id) on every response."""
    url = tiny_server.base_url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "abc"}).json()["id"] \
        == "chatcmpl-abc"
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "request_id": "xyz"}).json()["id"] == "chatcmpl-xyz"
    assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                     "request_id": "xyz"}, headers={"X-Request-Id": "abc"}
                      ).json()["id"] == "cmpl-abc"
    stream = {**chat, "stream": True, "max_tokens": 8, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:  # one id twice at once: both answered in full
        replies = list(pool.map(lambda _: httpx.post(f"{url}/v1/chat/completions", json=stream, timeout=60,
                                                     headers={"X-Request-Id": "same"}), range(2)))
    for reply in replies:
        chunks = [json.loads(e) for e in sse_events(reply) if e != "[DONE]"]
        assert {c["id"] for c in chunks} == {"chatcmpl-same"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "x-request-id" not in httpx.get(f"{url}/health").headers
    flagged = server_factory(str(tiny_llama), *FLAGGED_SERVER_ARGS)
    assert httpx.get(f"{flagged.base_url}/health", headers={"X-Request-Id": "abc"}).headers["x-request-id"] == "abc"
    assert len(httpx.post(f"{flagged.base_url}/v1/chat/completions", json=chat).headers["x-request-id"]) == 32


def test_no_redirect_takes_its_host_from_the_request(tiny_server):
    response = httpx.get(f"{tiny_server.base_url}/health/", headers={"Host": "evil.example"})
    assert response.status_code == 404 and "location" not in response.headers
    assert "evil.example" not in response.text


@pytest.mark.torch_path
def test_completions_greedy_equal_offline_with_exact_usage(client, offline):
    response = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, extra_body={"ignore_eos": True},
                                         **GREEDY)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert [c.text for c in choices] == offline_texts(offline, PROMPTS, max_tokens=12, ignore_eos=True, **GREEDY)
    assert all(c.finish_reason == "length" for c in choices)
    tokenizer = offline.get_tokenizer()
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    assert response.usage.completion_tokens == 4 * 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 48
    assert response.model == "tiny" and response.object == "text_completion"


def test_completions_default_max_tokens_and_token_id_prompts(client, offline):
    ids = offline.get_tokenizer().encode(PROMPTS[1])
    by_text = client.completions.create(model="tiny-alias", prompt=PROMPTS[1], extra_body={"ignore_eos": True},
                                        **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=ids, extra_body={"ignore_eos": True}, **GREEDY)
    assert by_text.usage.completion_tokens == 16  # vLLM's default max_tokens for completions
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_streaming_completion_matches_non_streaming(tiny_server, client):
    request = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 20, "ignore_eos": True, **GREEDY}
    expected = client.completions.create(**{k: v for k, v in request.items() if k != "ignore_eos"},
                                         extra_body={"ignore_eos": True}).choices[0].text
    response = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=60,
                          json={**request, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == expected
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20

    streamed = client.completions.create(stream=True, **{k: v for k, v in request.items() if k != "ignore_eos"},
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_chat_greedy_equal_offline_streaming_and_not(client, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Describe Pemberley."}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, **GREEDY)
    expected = offline.chat(messages, SamplingParams(max_tokens=10, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(offline.engine.apply_chat_template(messages))
    assert response.usage.completion_tokens == len(expected.token_ids)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert chunks[-1].usage.prompt_tokens == response.usage.prompt_tokens


def test_chat_without_max_tokens_fills_the_context(tiny_server, client, offline):
    tokenizer = offline.get_tokenizer()
    words = tokenizer.decode(tokenizer.encode(BOOK.read_text()[:20000])[:990])
    messages = [{"role": "user", "content": words}]
    count = httpx.post(f"{tiny_server.base_url}/tokenize", json={"messages": messages}).json()["count"]
    assert count < 1024
    response = client.chat.completions.create(model="tiny", messages=messages, extra_body={"ignore_eos": True},
                                              **GREEDY)
    assert response.usage.prompt_tokens == count
    assert response.usage.completion_tokens == 1024 - count
    assert response.choices[0].finish_reason == "length"


def test_n_samples(client):
    response = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, max_tokens=8, temperature=1.0, seed=1,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == list(range(6))
    assert response.usage.completion_tokens == 6 * 8
    assert len({c.text for c in response.choices}) > 1

    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=2,
                                                 max_tokens=5, stream=True, seed=3))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2


def test_every_64_bit_seed_takes_n_samples(client):
    """Sample i is seeded seed + i, wrapping within int64 (vLLM takes any 64-bit seed)."""
    sample = dict(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    top = client.completions.create(n=2, seed=2 ** 63 - 1, **sample).choices
    wrapped = client.completions.create(seed=-2 ** 63, **sample).choices[0]
    assert top[1].text == wrapped.text != top[0].text


def test_stop_strings(tiny_server, client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, **GREEDY).choices[0].text
    match = re.search(r"[A-Za-z]{2}", full[4:])
    assert match, full
    stop = match.group(0)
    expected = full[:full.index(stop)]
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, stop=[stop, "@@@"], **GREEDY)
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    streamed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30, stop=stop, stream=True,
                                         **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_min_tokens_holds_back_stop_strings(tiny_server, client):
    """vLLM's rule: a stop string inside the text of the first min_tokens tokens does not end the
    sequence; the first one completed after them does."""
    def complete(max_tokens: int, **extra):
        return client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=max_tokens, **GREEDY,
                                         **extra).choices[0]

    full = complete(30).text
    stop = complete(1).text.strip()[:2] or complete(1).text
    early = complete(30, stop=[stop])
    assert early.text == full[: full.index(stop)] and early.finish_reason == "stop"
    min_tokens = 8
    before = complete(min_tokens).text  # the text of the first min_tokens tokens
    later = full.find(stop, len(before) - len(stop) + 1)  # the first occurrence not inside it
    held = complete(30, stop=[stop], extra_body={"min_tokens": min_tokens})
    if later == -1:
        assert (held.text, held.finish_reason) == (full, "length")
    else:
        assert (held.text, held.finish_reason) == (full[:later], "stop")
    assert full.index(stop) < len(before)  # the held-back occurrence was there to be skipped


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_server, client):
    """vLLM's truncate_prompt_tokens on completions and chat: the prompt's last k tokens are the
    prompt (usage counts them, echo repeats them), and a text longer than the context is then no 400."""
    ids = httpx.post(f"{tiny_server.base_url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    last = client.completions.create(model="tiny", prompt=ids[-6:], max_tokens=5, **GREEDY)
    cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, **GREEDY,
                                    extra_body={"truncate_prompt_tokens": 6})
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == last.choices[0].text
    # echo puts back the prompt the model saw: the kept tokens' text, not the whole prompt (vLLM)
    kept = httpx.post(f"{tiny_server.base_url}/detokenize", json={"tokens": ids[-6:]}).json()["prompt"]
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=5, echo=True, **GREEDY,
                                       extra_body={"truncate_prompt_tokens": 6})
    assert echoed.choices[0].text == kept + last.choices[0].text
    long = client.completions.create(model="tiny", prompt=PROMPTS[0] * 400, max_tokens=2, **GREEDY,
                                     extra_body={"truncate_prompt_tokens": 100})
    assert long.usage.prompt_tokens == 100
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0] * 400}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 50})
    assert chat.usage.prompt_tokens == 50
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"truncate_prompt_tokens": 0})


def test_logit_bias_forces_and_bans_a_token(tiny_server, client):
    """OpenAI's logit_bias through the openai client: +100 forces a token, -100 bans the greedy one;
    ids are checked against the vocabulary and biases clamped to [-100, 100] (vLLM)."""
    def completion(**extra):
        return client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, logprobs=1, **GREEDY,
                                         **extra).choices[0]

    greedy = completion()
    forced = completion(logit_bias={"7": 100})
    assert len(set(forced.logprobs.tokens)) == 1 and len(forced.logprobs.tokens) == 6
    assert completion(logit_bias={"7": 1e6}).text == forced.text  # clamped to 100, still forcing
    first = greedy.logprobs.tokens[0]
    [first_id] = httpx.post(f"{tiny_server.base_url}/tokenize",
                            json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    banned = completion(logit_bias={str(first_id): -100})
    assert banned.logprobs.tokens[0] != first
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          logit_bias={"7": 100}, logprobs=True, **GREEDY)
    assert len({t.token for t in chat.choices[0].logprobs.content}) == 1
    for bias, message in (({"99999999": 1}, "out of vocabulary"), ({"x": 1}, "logit_bias keys must be token ids")):
        with pytest.raises(openai.BadRequestError, match=message):
            completion(logit_bias=bias)


def test_allowed_token_ids_and_bad_words_reach_the_sampler(tiny_server, client):
    """vLLM's allowed_token_ids and bad_words on completions and chat (they were logged as ignored
    fields); bad values are 400s naming the field."""
    def completion(**extra):
        return client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, logprobs=0, seed=3,
                                         temperature=2.0, extra_body=extra).choices[0]

    def ids(choice):
        return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]

    allowed = [40, 41, 42]
    assert set(ids(completion(allowed_token_ids=allowed, return_tokens_as_token_ids=True))) <= set(allowed)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          logprobs=True, temperature=2.0, seed=1,
                                          extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True})
    assert {int(t.token.removeprefix("token_id:")) for t in chat.choices[0].logprobs.content} <= set(allowed)
    def one_token_forms(word):
        forms = [httpx.post(f"{tiny_server.base_url}/tokenize", json={"prompt": text, "add_special_tokens": False})
                 .json()["tokens"] for text in (word, " " + word)]
        return {form[0] for form in forms if len(form) == 1}

    greedy = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, logprobs=0, **GREEDY,
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0]
    word = next(w for t in ids(greedy) if (w := httpx.post(f"{tiny_server.base_url}/detokenize",
                                                         json={"tokens": [t]}).json()["prompt"].strip())
                and one_token_forms(w) & set(ids(greedy)))
    banned = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, logprobs=0, **GREEDY,
                                       extra_body={"bad_words": [word], "return_tokens_as_token_ids": True})
    assert not one_token_forms(word) & set(ids(banned.choices[0]))
    for extra, param in (({"allowed_token_ids": [10 ** 8]}, "allowed_token_ids"), ({"allowed_token_ids": []}, None),
                         ({"bad_words": [" "]}, None)):
        refused = httpx.post(f"{tiny_server.base_url}/v1/completions",
                             json={"prompt": "x", "max_tokens": 2, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_return_token_ids_gives_the_prompt_and_the_generated_ids(tiny_server, client):
    """vLLM's return_token_ids: the prompt's ids (/tokenize's) and the generated ids, whole in a
    response; streamed, the prompt's in the first chunk and each chunk's new ids with it."""
    url = tiny_server.base_url
    extra = {"return_token_ids": True}
    prompt_ids = httpx.post(f"{url}/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=7, **GREEDY, extra_body=extra)
    choice = whole.choices[0].model_extra
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == whole.usage.completion_tokens == 7
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=7, stream=True, **GREEDY,
                                            extra_body=extra))
    assert [c.choices[0].model_extra["prompt_token_ids"] for c in chunks] == [prompt_ids] + [None] * (len(chunks) - 1)
    assert sum((c.choices[0].model_extra["token_ids"] or [] for c in chunks), []) == choice["token_ids"]
    assert client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2).choices[0].model_extra[
        "token_ids"] is None
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, **GREEDY, extra_body=extra)
    assert reply.model_extra["prompt_token_ids"] == chat_ids
    assert len(reply.choices[0].model_extra["token_ids"]) == reply.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, stream=True, **GREEDY,
                                                 extra_body=extra))
    assert chunks[0].model_extra["prompt_token_ids"] == chat_ids
    assert all(c.model_extra["prompt_token_ids"] is None for c in chunks[1:])
    assert sum((c.choices[0].model_extra["token_ids"] or [] for c in chunks), []) == reply.choices[0].model_extra[
        "token_ids"]


def test_continue_final_message_continues_the_assistant_turn(tiny_server, client):
    """vLLM's continue_final_message (with add_generation_prompt false): the last assistant message
    is left open, and the reply is what a raw completion of that rendered prompt gives."""
    messages = [{"role": "user", "content": "Tell me of Netherfield."},
                {"role": "assistant", "content": "The weather at Netherfield"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{tiny_server.base_url}/tokenize", json={"messages": messages, **flags}).json()["tokens"]
    rendered = httpx.post(f"{tiny_server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert rendered.endswith("The weather at Netherfield")  # no end of turn after it
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, extra_body=flags, **GREEDY)
    raw = client.completions.create(model="tiny", prompt=ids, max_tokens=8, **GREEDY)
    assert reply.choices[0].message.content == raw.choices[0].text
    assert reply.usage.prompt_tokens == len(ids)
    echoed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            extra_body={**flags, "echo": True}, **GREEDY)
    assert echoed.choices[0].message.content == "The weather at Netherfield" + raw.choices[0].text
    streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, stream=True,
                                              extra_body={**flags, "echo": True}, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == echoed.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="Cannot set both `continue_final_message` and "
                                                     "`add_generation_prompt` to True"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_chat_template_kwargs_reach_the_template(tiny_server, client):
    """The tiny model's template renders a `persona` variable as a system turn when given one."""
    messages = [{"role": "user", "content": "Hello"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, **GREEDY)
    persona = {"chat_template_kwargs": {"persona": "You are terse."}}
    ids = httpx.post(f"{tiny_server.base_url}/tokenize", json={"messages": messages, **persona}).json()["tokens"]
    rendered = httpx.post(f"{tiny_server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>")
    with_persona = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=persona,
                                                  **GREEDY)
    assert with_persona.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set add_generation_prompt"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(client):
    """vLLM v0's best_of: best_of samples (each sample seeded seed + its index, as n samples are),
    the n with the highest sum of their tokens' logprobs returned, best first."""
    sample = {"temperature": 1.0, "seed": 21, "max_tokens": 8}
    candidates = client.completions.create(model="tiny", prompt=PROMPTS[1], n=4, logprobs=0, **sample).choices
    total = {c.text: sum(c.logprobs.token_logprobs) for c in candidates}
    ranked = sorted(candidates, key=lambda c: (-total[c.text], c.index))
    best = client.completions.create(model="tiny", prompt=PROMPTS[1], best_of=4, **sample)
    assert [c.text for c in best.choices] == [ranked[0].text] and best.choices[0].logprobs is None
    two = client.completions.create(model="tiny", prompt=PROMPTS[1], n=2, best_of=4, logprobs=0, **sample).choices
    assert [c.text for c in two] == [c.text for c in ranked[:2]] and [c.index for c in two] == [0, 1]
    for extra, message in (({"n": 3, "best_of": 2}, "best_of must be greater than or equal to n"),
                           ({"best_of": 2, "temperature": 0}, "best_of must be 1 when using greedy sampling"),
                           ({"best_of": 2, "stream": True}, "best_of > n is not supported with streaming")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=2,
                                      **{"temperature": 1.0, **extra})


@pytest.fixture(scope="module")
def fim_bos_server(server_factory, tiny_tokenizer, tmp_path_factory):
    """A tiny model whose tokenizer has FIM tokens and puts a BOS before every text (as Llama's
    do): (server, its client, the tokenizer)."""
    import copy

    from tiny_models import build_tiny_model
    from tokenizers import processors

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]})
    bos = (tokenizer.bos_token, tokenizer.bos_token_id)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos])
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-fim"), "llama", tokenizer)
    server = server_factory(str(path), "--dtype", "float32", "--kv-cache-memory", "8MiB", "--served-model-name", "fim")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    return server, client, tokenizer


def test_suffix_fills_in_the_middle_where_the_model_has_fim_tokens(fim_bos_server, client):
    """A model whose tokenizer has <fim_prefix>/<fim_suffix>/<fim_middle>: the prompt and suffix go
    around them in prefix-suffix-middle order, as a raw prompt of those ids would. Without FIM
    tokens (the tiny model) suffix is vLLM's 400."""
    _, fim, tokenizer = fim_bos_server
    prefix, middle, suffix = (tokenizer.convert_tokens_to_ids(t) for t in ("<fim_prefix>", "<fim_middle>",
                                                                            "<fim_suffix>"))
    ids = [prefix, *tokenizer.encode("Mr. Darcy", add_special_tokens=False), suffix,
           *tokenizer.encode(" said Elizabeth.", add_special_tokens=False), middle]
    filled = fim.completions.create(model="fim", prompt="Mr. Darcy", suffix=" said Elizabeth.", max_tokens=6,
                                    **GREEDY)
    raw = fim.completions.create(model="fim", prompt=ids, max_tokens=6, **GREEDY)
    assert filled.choices[0].text == raw.choices[0].text and filled.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="suffix is not currently supported for this model"):
        client.completions.create(model="tiny", prompt="Mr. Darcy", suffix=" said Elizabeth.", max_tokens=2)


def test_add_special_tokens_as_vllm_on_completions_chat_embeddings_and_tokenize(fim_bos_server):
    """vLLM's add_special_tokens (it was logged as ignored): a completion's or an embedding's text
    gets the BOS unless false; chat gets the template's tokens only unless true (then a BOS on top);
    /tokenize says the same for messages."""
    server, fim, tokenizer = fim_bos_server
    bos, text = tokenizer.bos_token_id, "Mr. Darcy"
    bare = tokenizer.encode(text, add_special_tokens=False)

    def completion_prompt(**extra):
        return fim.completions.create(model="fim", prompt=text, max_tokens=1, extra_body={
            "return_token_ids": True, **extra}).choices[0].model_extra["prompt_token_ids"]

    assert completion_prompt() == [bos, *bare] and completion_prompt(add_special_tokens=False) == bare
    embeddings = [fim.embeddings.create(model="fim", input=text, extra_body=extra).usage.prompt_tokens
                  for extra in ({}, {"add_special_tokens": False})]
    assert embeddings == [len(bare) + 1, len(bare)]
    messages = [{"role": "user", "content": "Hi"}]
    template = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                add_special_tokens=False)

    def chat_prompt(**extra):
        return fim.chat.completions.create(model="fim", messages=messages, max_tokens=1, extra_body={
            "return_token_ids": True, **extra}).model_extra["prompt_token_ids"]

    assert chat_prompt() == template and chat_prompt(add_special_tokens=True) == [bos, *template]
    url = f"{server.base_url}/tokenize"
    assert [httpx.post(url, json={"messages": messages, **extra}).json()["tokens"]
            for extra in ({}, {"add_special_tokens": True})] == [template, [bos, *template]]


def test_logprobs(client):
    response = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=5, logprobs=3, **GREEDY)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token

    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())


def test_echo(client, offline):
    response = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=3, echo=True, **GREEDY)
    generated = offline_texts(offline, [PROMPTS[3]], max_tokens=3, **GREEDY)[0]
    assert response.choices[0].text == PROMPTS[3] + generated


@pytest.mark.torch_path
def test_concurrent_requests_all_answered_correctly(tiny_server, offline):
    prompts = [f"{PROMPTS[i % 4]} number {i}" for i in range(24)]
    lengths = [6 + i % 7 for i in range(24)]
    expected = [offline_texts(offline, [p], max_tokens=n, ignore_eos=True, **GREEDY)[0]
                for p, n in zip(prompts, lengths)]

    async def run() -> list[str]:
        base_url = f"{tiny_server.base_url}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as aclient:
            async def one(i: int) -> str:
                if i % 2:  # half of them stream
                    stream = await aclient.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i],
                                                              stream=True, extra_body={"ignore_eos": True}, **GREEDY)
                    return "".join([c.choices[0].text async for c in stream])
                response = await aclient.completions.create(model="tiny", prompt=prompts[i], max_tokens=lengths[i],
                                                            extra_body={"ignore_eos": True}, **GREEDY)
                return response.choices[0].text
            return await asyncio.gather(*(one(i) for i in range(24)))

    assert asyncio.run(run()) == expected


def test_metrics_names_and_values_move(tiny_server, client, offline):
    before = tiny_server.metrics()
    for name in ("kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc",
                 "kvserve:prefix_cache_queries_total", "kvserve:prefix_cache_hits_total",
                 "kvserve:num_preemptions_total", "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
                 "kvserve:time_to_first_token_seconds_count", "kvserve:inter_token_latency_seconds_count",
                 "kvserve:e2e_request_latency_seconds_count", "kvserve:e2e_request_latency_seconds_bucket{le=\"1.0\"}"):
        assert name in before, name
    prompt = "Lady Catherine de Bourgh arrived"
    client.completions.create(model="tiny", prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}, **GREEDY)
    after = tiny_server.metrics()

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("kvserve:prompt_tokens_total") == len(offline.get_tokenizer().encode(prompt))
    assert moved("kvserve:generation_tokens_total") == 7
    assert moved('kvserve:request_success_total{finished_reason="length"}') == 1
    assert moved("kvserve:time_to_first_token_seconds_count") == 1
    assert moved("kvserve:inter_token_latency_seconds_count") == 6
    assert moved("kvserve:e2e_request_latency_seconds_count") == 1
    assert moved("kvserve:prefix_cache_queries_total") == len(offline.get_tokenizer().encode(prompt))
    for phase in ("queue", "prefill", "decode", "inference"):  # vLLM's per-request phases
        assert moved(f"kvserve:request_{phase}_time_seconds_count") == 1
    assert moved("kvserve:request_time_per_output_token_seconds_count") == 1
    assert moved("kvserve:request_generation_tokens_sum") == 7 and moved("kvserve:request_params_max_tokens_sum") == 7
    assert moved("kvserve:request_prompt_tokens_sum") == len(offline.get_tokenizer().encode(prompt))
    assert moved("kvserve:request_params_n_count") == 1


def test_prefix_cache_hits_respect_cache_salt(tiny_server, client):
    prompt = "In vain have I struggled. It will not do. My feelings will not be repressed. " * 3

    def cached_tokens(salt: str) -> int:
        response = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt},
                                             **GREEDY)
        return response.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens("tenant-a") == 0
    hits_before = tiny_server.metrics()["kvserve:prefix_cache_hits_total"]
    assert cached_tokens("tenant-a") > 0
    assert tiny_server.metrics()["kvserve:prefix_cache_hits_total"] > hits_before
    assert cached_tokens("tenant-b") == 0


def test_disconnect_mid_stream_returns_every_block(tiny_server):
    before = tiny_server.metrics()
    request = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", json=request, timeout=60) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 3
        during = tiny_server.metrics()
        assert during["kvserve:num_requests_running"] == 1 and during["kvserve:kv_cache_usage_perc"] > 0
    # Leaving the block closed the connection: the server aborts the request and frees its blocks.
    after = wait_for(lambda: (m := tiny_server.metrics())["kvserve:num_requests_running"] == 0 and m)
    assert after, "the aborted request is still running"
    assert after["kvserve:kv_cache_usage_perc"] == 0.0
    abort = 'kvserve:request_success_total{finished_reason="abort"}'
    assert after[abort] - before.get(abort, 0.0) == 1
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] < 1000


def test_disconnect_while_waiting_for_a_non_streaming_answer_aborts(tiny_server):
    log_start = len(tiny_server.log_path.read_bytes())
    before = tiny_server.metrics()
    request = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny_server.base_url}/v1/completions", json=request, timeout=httpx.Timeout(60, read=0.5))
    abort = 'kvserve:request_success_total{finished_reason="abort"}'
    after = wait_for(lambda: (m := tiny_server.metrics())[abort] > before.get(abort, 0.0) and m)
    assert after, "the request was not aborted"
    assert after["kvserve:num_requests_running"] == 0 and after["kvserve:kv_cache_usage_perc"] == 0.0
    time.sleep(0.5)  # the handler's last lines, after the abort
    new_log = tiny_server.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert "Traceback" not in new_log and "InvalidStateError" not in new_log, new_log[-3000:]


def test_reset_prefix_cache_route(tiny_server):
    """POST /reset_prefix_cache (vLLM's route): the next repeat of a prompt computes it again; while
    a stream holds blocks it is a 409 unless reset_running_requests preempts the stream, which then
    ends with the text it would have had."""
    url = tiny_server.base_url
    body = {"model": "tiny", "prompt": BOOK.read_text()[3000:3400], "max_tokens": 40, "ignore_eos": True, **GREEDY}

    def cached() -> int:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        return response["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 200
    assert cached() == 0
    reference = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 400, "stream": True},
                      timeout=60) as stream:
        lines = stream.iter_lines()
        first = [next(lines) for _ in range(4)]  # the stream is running
        refused = httpx.post(f"{url}/reset_prefix_cache", timeout=30)
        assert refused.status_code == 409 and "reset_running_requests" in refused.json()["error"]["message"]
        assert httpx.post(f"{url}/reset_prefix_cache?reset_running_requests=true", timeout=30).status_code == 200
        events = [json.loads(line[6:]) for line in [*first, *lines] if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text[:len(reference)] == reference and events[-1]["choices"][0]["finish_reason"] == "length"


def test_sagemaker_ping_and_invocations_dispatch_by_body(tiny_server):
    """/ping is /health; /invocations answers a chat, a completion or an embeddings body as its own
    endpoint does (vLLM's SageMaker routes)."""
    url = tiny_server.base_url
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Mr. Darcy"}], "max_tokens": 6, **GREEDY}
    completion = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, **GREEDY}
    embedding = {"model": "tiny", "input": PROMPTS[1]}
    for path, body, pick in (("/v1/chat/completions", chat, lambda r: r["choices"][0]["message"]["content"]),
                             ("/v1/completions", completion, lambda r: r["choices"][0]["text"]),
                             ("/v1/embeddings", embedding, lambda r: r["data"][0]["embedding"])):
        direct = httpx.post(f"{url}{path}", json=body, timeout=60).json()
        via = httpx.post(f"{url}/invocations", json=body, timeout=60)
        assert via.status_code == 200, via.text
        assert pick(via.json()) == pick(direct)
    streamed = httpx.post(f"{url}/invocations", json={**chat, "stream": True}, timeout=60)
    assert sse_events(streamed)[-1] == "[DONE]"
    bad = httpx.post(f"{url}/invocations", json={**chat, "temperature": "hot"}, timeout=60)
    assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
    for content in (b"{not json", b'{"neither": 1}', b"[1, 2]"):
        answer = httpx.post(f"{url}/invocations", content=content, headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and answer.json()["error"]["message"]
