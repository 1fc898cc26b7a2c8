"""`/v1/messages` (Anthropic's Messages API) through the anthropic SDK against a real server: the
same greedy reply as chat for the same conversation, streamed and not; tool use with `tool_result`
turns; stop sequences; prefill; `max_tokens` past the context; count_tokens; the prefix cache in
`usage`; and Anthropic's error bodies."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is in the test extra")

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Greedy. The SDK's typed arguments (anthropic 2.x) have no temperature; older SDKs and Claude
# Code send it in the body, which is where extra_body puts it.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(tiny_server) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=tiny_server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_text(chat: openai.OpenAI, messages: list[dict], **fields) -> openai.types.chat.ChatCompletion:
    return chat.chat.completions.create(model="tiny", messages=messages, temperature=0, **fields)


def test_a_reply_is_chats_reply_in_anthropics_shape(client, chat):
    message = client.messages.create(model="tiny", max_tokens=12, system="Be brief.", messages=QUESTION, **GREEDY)
    reference = chat_text(chat, [{"role": "system", "content": "Be brief."}, *QUESTION], max_tokens=12)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "tiny"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == reference.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reference.choices[0].finish_reason]
    assert message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == reference.usage.completion_tokens
    # Anthropic's split: computed prompt tokens + prefix-cache hits = the whole prompt
    assert usage.input_tokens + usage.cache_read_input_tokens == reference.usage.prompt_tokens
    assert usage.cache_creation_input_tokens == 0


def test_a_repeated_prompt_reads_the_prefix_cache(client):
    system = "You answer questions about the weather in one short sentence, and nothing else at all. " * 3
    request = dict(model="tiny", max_tokens=2, system=system, messages=QUESTION, **GREEDY)
    client.messages.create(**request)
    again = client.messages.create(**request).usage
    assert again.cache_read_input_tokens >= 16  # a full block at least
    counted = client.messages.count_tokens(model="tiny", system=system, messages=QUESTION).input_tokens
    assert again.input_tokens + again.cache_read_input_tokens == counted


def test_the_stream_tells_the_same_message(client):
    request = dict(model="tiny", max_tokens=16, messages=QUESTION, **GREEDY)
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert streamed.content[0].text == message.content[0].text
    assert streamed.stop_reason == message.stop_reason
    assert streamed.usage.output_tokens == message.usage.output_tokens


def test_the_raw_stream_has_event_lines_and_no_done(tiny_server):
    body = {"model": "tiny", "max_tokens": 4, "messages": QUESTION, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/messages", json=body, timeout=60) as response:
        text = "".join(response.iter_text())
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [part for part in text.split("\n\n") if part.strip()]
    assert all(part.startswith("event: ") and "\ndata: " in part for part in events)
    for part in events:
        name, data = part.split("\n", 1)
        assert json.loads(data[len("data: "):])["type"] == name[len("event: "):]
    assert "[DONE]" not in text


def test_a_named_tool_then_its_result(client):
    first = client.messages.create(model="tiny", max_tokens=60, messages=QUESTION, tools=[WEATHER], **GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and call.name == "get_weather" and isinstance(call.input["city"], str)
    turns = [*QUESTION, {"role": "assistant", "content": first.content},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C."},
                 {"type": "text", "text": "Thanks. Anything else?"}]}]
    second = client.messages.create(model="tiny", max_tokens=6, messages=turns, tools=[WEATHER], **GREEDY,
                                    tool_choice={"type": "none"})
    assert [block.type for block in second.content] == ["text"] and second.stop_reason in ("end_turn", "max_tokens")
    # the call is the assistant turn's tool call, its result a tool turn right after it, then the user's text
    assert client.messages.count_tokens(model="tiny", messages=turns).input_tokens == len(chat_prompt(client, [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
        {"role": "user", "content": "Thanks. Anything else?"}]))


def chat_prompt(client, messages: list[dict]) -> list[int]:
    response = httpx.post(f"{client.base_url}/tokenize", json={"model": "tiny", "messages": messages}, timeout=60)
    return response.json()["tokens"]


def test_any_tool_streams_its_input_as_json_deltas(client):
    request = dict(model="tiny", max_tokens=80, messages=QUESTION, tools=[WEATHER], **GREEDY,
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    message = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert message.stop_reason == streamed.stop_reason == "tool_use"
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and [b.input for b in streamed.content if b.type == "tool_use"] == [calls[0].input]
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == calls[0].input


def test_a_stop_sequence_is_reported(client):
    request = dict(model="tiny", max_tokens=24, messages=[{"role": "user", "content": "Tell me a story."}], **GREEDY)
    text = client.messages.create(**request).content[0].text
    # three letters a few characters in, first seen there (the tiny model's greedy reply is random text)
    at = next(i for i in range(4, len(text) - 3) if text[i:i + 3].isalpha() and text.index(text[i:i + 3]) == i)
    stop = text[at:at + 3]
    message = client.messages.create(**request, stop_sequences=["\u2603", stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[:at]
    with client.messages.stream(**request, stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_a_final_assistant_message_is_continued(client, chat):
    turns = [*QUESTION, {"role": "assistant", "content": "The weather"}]
    message = client.messages.create(model="tiny", max_tokens=8, messages=turns, **GREEDY)
    reference = chat_text(chat, turns, max_tokens=8, extra_body={"continue_final_message": True,
                                                                 "add_generation_prompt": False})
    assert message.content[0].text == reference.choices[0].message.content


def test_max_tokens_past_the_context_stops_at_the_context(client, tiny_server):
    max_model_len = httpx.get(f"{tiny_server.base_url}/v1/models").json()["data"][0]["max_model_len"]
    message = client.messages.create(model="tiny", max_tokens=10 * max_model_len, messages=QUESTION, 
                                     extra_body={"temperature": 0, "ignore_eos": True})
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens + message.usage.output_tokens \
        == max_model_len


def test_under_kv_eviction_max_tokens_is_not_cut_to_the_context(client, tiny_server):
    """A sequence whose KV is evicted is not bounded by the context, on chat or here."""
    max_model_len = httpx.get(f"{tiny_server.base_url}/v1/models").json()["data"][0]["max_model_len"]
    message = client.messages.create(model="tiny", max_tokens=max_model_len, messages=QUESTION, extra_body={
        "temperature": 0, "ignore_eos": True, "kv_eviction": {"policy": "streaming", "budget": 256}})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == max_model_len


def test_claude_codes_billing_header_block_is_not_in_the_prompt(client):
    """Its text changes on every request, so it would make every prompt miss the prefix cache."""
    plain = client.messages.count_tokens(model="tiny", system=[{"type": "text", "text": "Be brief."}],
                                         messages=QUESTION).input_tokens
    with_header = client.messages.count_tokens(model="tiny", messages=QUESTION, system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=0a1b2;"},
        {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]).input_tokens
    assert with_header == plain


def test_system_blocks_and_system_messages_render_where_they_stand(client):
    """Blocks of `system` are joined by newlines; a system message in the list is a system turn in
    its place, so a later reminder leaves the earlier turns' prompt (and its cached blocks) as it was."""
    question = {"role": "user", "content": "What is the weather in Paris, London and Rome this week? " * 4}
    turns = [question, {"role": "assistant", "content": "Sunny."}, {"role": "system", "content": "Be brief."},
             {"role": "user", "content": "And tomorrow?"}]
    counted = client.messages.count_tokens(model="tiny", messages=turns, system=[
        {"type": "text", "text": "You know the weather."}, {"type": "text", "text": "Answer in English."}])
    assert counted.input_tokens == len(chat_prompt(client, [
        {"role": "system", "content": "You know the weather.\nAnswer in English."}, *turns]))
    before = client.messages.create(model="tiny", max_tokens=1, messages=[question], **GREEDY).usage
    after = client.messages.create(model="tiny", max_tokens=1, messages=turns, **GREEDY).usage
    first_prompt = before.input_tokens + before.cache_read_input_tokens
    assert first_prompt >= 48 and after.cache_read_input_tokens >= first_prompt // 16 * 16 - 16


def test_a_prompt_longer_than_the_context_is_refused_in_anthropics_words(client):
    """Claude Code compacts its context when the error says "prompt is too long"."""
    turns = [{"role": "user", "content": "The weather in Paris is sunny. " * 300}]
    counted = client.messages.count_tokens(model="tiny", messages=turns).input_tokens
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="tiny", max_tokens=32000, messages=turns)
    assert raised.value.body["error"]["message"] == f"prompt is too long: {counted} tokens > 1023 maximum"


@pytest.mark.parametrize("fields, status, words", [
    ({"messages": QUESTION}, 400, "max_tokens"),
    ({"max_tokens": 4}, 400, "messages"),
    ({"max_tokens": 4, "messages": QUESTION, "model": "claude-nope"}, 404, "claude-nope"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, 400, "image"),
    ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, 400, "robot"),
    ({"max_tokens": 4, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "server tools"),
    ({"max_tokens": 4, "messages": QUESTION, "tool_choice": {"type": "tool"}}, 400, "tool_choice.name"),
    ({"max_tokens": 0, "messages": QUESTION}, 400, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": []}]}, 400, "empty"),
    ({"max_tokens": 4, "messages": QUESTION, "min_tokens": 1020}, 400, "min_tokens"),
    ({"max_tokens": 4, "messages": QUESTION, "temperature": 1.5}, 400, "temperature"),  # Anthropic's is 0..1
])
def test_bad_requests_get_anthropics_error_body(tiny_server, fields, status, words):
    response = httpx.post(f"{tiny_server.base_url}/v1/messages", json={"model": "tiny", **fields}, timeout=60)
    body = response.json()
    assert response.status_code == status, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert words in body["error"]["message"]


def test_a_body_over_the_limit_gets_anthropics_413(tiny_server):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    response = httpx.post(f"{tiny_server.base_url}/v1/messages", json=body, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["type"] == "request_too_large"


def test_the_sdk_raises_its_error_classes(client):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="claude-nope", max_tokens=4, messages=QUESTION)
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])


@pytest.mark.slow
def test_an_agent_turn_on_the_default_model_reads_the_first_turn_from_the_prefix_cache(server_factory):
    """A Claude-Code-shaped loop, streamed: a tool call, its result sent back, the answer. The second
    prompt begins with the first, so most of it is read from the prefix cache."""
    server = server_factory("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--kv-cache-memory",
                            "512MiB")  # the same server as test_server_tools.py's default_server
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    time_tool = {**WEATHER, "name": "get_time", "description": "The local time in a city."}
    request = dict(model=model, system="You are a helpful assistant.", tools=[WEATHER, time_tool], **GREEDY)
    with client.messages.stream(max_tokens=100, messages=QUESTION, tool_choice={"type": "any"}, **request) as stream:
        first = stream.get_final_message()
    [call] = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    turns = [*QUESTION, {"role": "assistant", "content": first.content}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C."}]}]
    with client.messages.stream(max_tokens=40, messages=turns, **request) as stream:
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens") and second.content[0].type == "text"
    usage = second.usage
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert usage.cache_read_input_tokens >= first_prompt - 16  # all the first prompt's full blocks
    counted = client.messages.count_tokens(messages=turns, **{k: v for k, v in request.items() if k != "extra_body"})
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
