"""Tool calling through the official openai client against real `kvserve serve` processes.

Named and `required` tool choice are enforced by structured outputs, so any model returns calls
whose arguments validate against the tool's schema: the default SmolLM2 (which never calls a tool
on its own) and the tiny random model. `auto` reads the model's own `<tool_call>` text with
`--tool-call-parser`; the tests force that text with a `structured_outputs` regex in the same
request, so what the parser sees is real generated output. Streams must reassemble to the
non-streamed message. Bad requests get vLLM's 400s.
"""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

jsonschema_rs = pytest.importorskip("jsonschema_rs")

from server_process import TINY_SERVER_ARGS  # noqa: E402

AUTO_HERMES = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time now in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 32}}, "required": ["zone"]}}}
# For the tiny random model: every value bounded, so the constrained output always ends.
TINY_WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TINY_TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
TINY_TOOLS = [TINY_WEATHER, TINY_TIME]
HERMES_CALL = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)", '
               r'"days": [1-7]\}\}\n</tool_call>')


def schema_of(tools: list[dict], name: str) -> dict:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def assert_valid_calls(message, tools: list[dict]) -> list[dict]:
    """Every call is well formed (id, type, a tool's name, JSON arguments valid for its schema)."""
    assert message.tool_calls, message
    arguments = []
    for call in message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert call.function.name in [t["function"]["name"] for t in tools]
        value = json.loads(call.function.arguments)
        assert jsonschema_rs.validator_for(schema_of(tools, call.function.name)).is_valid(value), value
        arguments.append(value)
    return arguments


def reassemble(stream, index: int = 0) -> tuple[str, list[dict], str | None]:
    """(content, calls, finish reason) of streamed choice `index`, merged the way OpenAI's clients do."""
    content, calls, finish_reason = "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.index != index:
                continue
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.id is not None:  # a new call: id, type and name come first
                    assert d.index == len(calls) and d.type == "function" and d.function.name
                    calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return content, calls, finish_reason


def summary(message) -> tuple[str, list[dict]]:
    return (message.content or "",
            [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []])


# ---------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tools_server(server_factory, tiny_llama):
    return server_factory(str(tiny_llama), *TINY_SERVER_ARGS, *AUTO_HERMES)


@pytest.fixture(scope="module")
def tiny_client(tools_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_server.base_url + "/v1", api_key="unused", max_retries=0)


def test_named_and_required_on_the_tiny_model(tiny_client):
    named = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TINY_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64, temperature=0)
    choice = named.choices[0]
    assert choice.finish_reason == "stop"  # vLLM (and OpenAI) keep "stop" for a named function
    assert choice.message.content == "" and [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert_valid_calls(choice.message, TINY_TOOLS)

    required = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=TINY_TOOLS, tool_choice="required",
        max_tokens=200, temperature=0, n=2, seed=3)
    for choice in required.choices:
        if choice.finish_reason == "tool_calls":
            assert_valid_calls(choice.message, TINY_TOOLS)
        else:  # cut by max_tokens: the calls before the last one are whole
            assert choice.finish_reason == "length"


@pytest.mark.parametrize("tool_choice", ["named", "required", "auto"])
def test_streamed_tool_calls_reassemble_to_the_non_streamed_message(tiny_client, tool_choice):
    request = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Oslo, please."}], tools=TINY_TOOLS,
                   max_tokens=120, temperature=0)
    if tool_choice == "named":
        request["tool_choice"] = {"type": "function", "function": {"name": "get_weather"}}
    elif tool_choice == "required":
        request["tool_choice"] = "required"
    else:
        request["extra_body"] = {"structured_outputs": {"regex": "Let me check.\n" + HERMES_CALL}}
    whole = tiny_client.chat.completions.create(**request).choices[0]
    content, calls, finish_reason = reassemble(tiny_client.chat.completions.create(**request, stream=True))
    assert (content, [{k: c[k] for k in ("name", "arguments")} for c in calls]) == summary(whole.message)
    assert finish_reason == whole.finish_reason
    assert len({c["id"] for c in calls}) == len(calls) >= 1
    assert_valid_calls(whole.message, TINY_TOOLS)


def test_streamed_samples_each_reassemble(tiny_client):
    request = dict(model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=TINY_TOOLS,
                   tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=7, n=3)
    whole = tiny_client.chat.completions.create(**request).choices
    chunks = list(tiny_client.chat.completions.create(**request, stream=True))
    for choice in whole:
        content, calls, finish_reason = reassemble(chunks, choice.index)
        assert (content, [{k: c[k] for k in ("name", "arguments")} for c in calls]) == summary(choice.message)
        assert finish_reason == choice.finish_reason == "tool_calls"


def test_auto_hermes_parses_the_generated_tool_call(tiny_client):
    response = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TINY_TOOLS, max_tokens=200,
        temperature=0, extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [arguments] = assert_valid_calls(choice.message, TINY_TOOLS)
    assert choice.message.tool_calls[0].function.name == "get_weather" and set(arguments) == {"city", "days"}

    # text before the call is the content; a reply without a call is plain content
    with_text = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TINY_TOOLS, max_tokens=200,
        temperature=0, tool_choice="auto", extra_body={"structured_outputs": {"regex": "One moment\\.\n" + HERMES_CALL}})
    assert with_text.choices[0].message.content == "One moment.\n"
    plain = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=TINY_TOOLS, max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"choice": ["It is sunny.", "It rains."]}})
    assert plain.choices[0].message.content in ("It is sunny.", "It rains.")
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].finish_reason == "stop"


def test_strict_tools_under_auto_hold_the_reply_to_one_call_or_the_response_format(tiny_client):
    """`strict: true` under tool_choice auto (the OpenAI Agents SDK sends it by default), with a
    response_format: whatever the random model writes is one valid call or the schema's JSON."""
    tools = [{"type": "function", "function": {**TINY_WEATHER["function"], "strict": True}}, TINY_TIME]
    answer = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"]}}}
    for seed in range(4):  # unconstrained, the random model writes neither
        choice = tiny_client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=tools, tool_choice="auto",
            response_format=answer, parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
            assert_valid_calls(choice.message, tools)
        else:
            assert choice.finish_reason == "stop" and json.loads(choice.message.content)["answer"] in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="a regex constraint cannot share"):
        tiny_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=tools,
                                            max_tokens=8, extra_body={"structured_outputs": {"regex": "a+"}})


def test_responses_tools_are_strict_unless_they_say_not(tiny_client):
    """OpenAI's Responses API makes a function tool that leaves `strict` out strict (chat's tools are
    not): under auto, each sampled reply of the random model is one valid call or text.format's
    JSON, and a regex cannot share the tools' grammar. `"strict": false` opts out."""
    tool = {"type": "function", **TINY_WEATHER["function"]}
    answer = {"format": {"type": "json_schema", "name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"]}}}
    for seed in range(3):
        response = tiny_client.responses.create(model="tiny", input="Weather?", tools=[tool], text=answer,
                                                parallel_tool_calls=False, max_output_tokens=200, temperature=1.0,
                                                extra_body={"seed": seed})
        calls = [item for item in response.output if item.type == "function_call"]
        if calls:
            assert len(calls) == 1 and calls[0].name == "get_weather"
            assert jsonschema_rs.validator_for(tool["parameters"]).is_valid(json.loads(calls[0].arguments))
        else:
            assert json.loads(response.output_text)["answer"] in ("yes", "no")
        assert response.tools[0].strict is True
    regex = {"structured_outputs": {"regex": "a+"}}
    with pytest.raises(openai.BadRequestError, match="a regex constraint cannot share"):
        tiny_client.responses.create(model="tiny", input="Hi", tools=[tool], max_output_tokens=4, extra_body=regex)
    loose = tiny_client.responses.create(model="tiny", input="Hi", tools=[{**tool, "strict": False}],
                                         max_output_tokens=4, temperature=0, extra_body=regex)
    assert set(loose.output_text) == {"a"} and loose.tools[0].strict is False


def test_parallel_tool_calls_false_gives_one_call(tiny_client):
    required = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=TINY_TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, temperature=0).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1  # the grammar's maxItems
    two_calls = HERMES_CALL + "\n" + HERMES_CALL
    request = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=TINY_TOOLS,
                   max_tokens=300, temperature=0, extra_body={"structured_outputs": {"regex": two_calls}})
    assert len(tiny_client.chat.completions.create(**request).choices[0].message.tool_calls) == 2
    auto = tiny_client.chat.completions.create(**request, parallel_tool_calls=False).choices[0]
    assert len(auto.message.tool_calls) == 1
    assert len(reassemble(tiny_client.chat.completions.create(**request, parallel_tool_calls=False, stream=True))[1]) == 1


def test_auto_llama3_json_parser(server_factory, tiny_llama):
    server = server_factory(str(tiny_llama), *TINY_SERVER_ARGS, "--enable-auto-tool-choice",
                            "--tool-call-parser", "llama3_json")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    regex = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}; \{"name": "get_weather", "parameters": \{"city": "Rome", "days": 2\}\}'
    choice = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time and weather?"}], tools=TINY_TOOLS, max_tokens=200,
        temperature=0, extra_body={"structured_outputs": {"regex": regex}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time", "get_weather"]
    assert json.loads(choice.message.tool_calls[1].function.arguments) == {"city": "Rome", "days": 2}


def test_tool_choice_none_answers_in_text(tiny_client):
    choice = tiny_client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=TINY_TOOLS, tool_choice="none",
        max_tokens=8, temperature=0).choices[0]
    assert choice.message.tool_calls == [] and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_tool_conversation_renders_calls_and_results_in_hermes_text(tools_server, tiny_client):
    """The tiny model's template knows nothing of tools: definitions, calls and results are
    written into the turns; the conversation then answers."""
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    ids = httpx.post(tools_server.base_url + "/tokenize", json={"messages": messages, "tools": TINY_TOOLS}).json()["tokens"]
    prompt = httpx.post(tools_server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<tools>\n" + json.dumps(TINY_WEATHER) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>'
            in prompt)
    answer = tiny_client.chat.completions.create(model="tiny", messages=messages, tools=TINY_TOOLS, tool_choice="none",
                                                 max_tokens=8, temperature=0)
    assert answer.usage.prompt_tokens == len(ids) and answer.choices[0].message.content


def test_the_returned_message_object_can_go_back_into_the_conversation(tiny_client):
    """The usual client loop appends `response.choices[0].message` itself (with its null fields)."""
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    reply = tiny_client.chat.completions.create(model="tiny", messages=messages, tools=TINY_TOOLS, max_tokens=64,
                                                temperature=0, tool_choice="required").choices[0].message
    messages += [reply, *({"role": "tool", "tool_call_id": c.id, "content": "ok"} for c in reply.tool_calls)]
    answer = tiny_client.chat.completions.create(model="tiny", messages=messages, tools=TINY_TOOLS,
                                                 tool_choice="none", max_tokens=4, temperature=0)
    assert answer.choices[0].message.content


def test_a_reply_a_token_limit_cut_after_its_call_is_incomplete_on_responses(tiny_client):
    """Chat completions answer "tool_calls" for an auto reply holding a call whatever ended it
    (vLLM's rule); a Response reports the cut, `incomplete` for max_output_tokens, as OpenAI does
    (the APIs built on chat keep "length": /v1/messages says max_tokens the same way)."""
    tool = {"type": "function", **TINY_WEATHER["function"], "strict": False}  # no grammar: the regex leads
    regex = {"structured_outputs": {"regex": HERMES_CALL + " and then x{60}"}}
    whole = tiny_client.responses.create(model="tiny", input="Weather?", tools=[tool], max_output_tokens=200,
                                         temperature=0, extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    assert whole.status == "completed" and [i.type for i in whole.output] == ["function_call"]
    limit = whole.usage.output_tokens + 3  # the call, then the cut inside the words after it
    cut = tiny_client.responses.create(model="tiny", input="Weather?", tools=[tool], max_output_tokens=limit,
                                       temperature=0, extra_body=regex)
    assert [i.type for i in cut.output if i.type == "function_call"] == ["function_call"]
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    with tiny_client.responses.stream(model="tiny", input="Weather?", tools=[tool], max_output_tokens=limit,
                                      temperature=0, extra_body=regex) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    chat = tiny_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}],
                                               tools=[TINY_WEATHER], max_tokens=limit, temperature=0, extra_body=regex)
    assert chat.choices[0].finish_reason == "tool_calls" and chat.choices[0].message.tool_calls


def test_a_call_cut_off_by_max_tokens_can_go_back_into_the_conversation(tools_server, tiny_client):
    """OpenAI returns the call max_tokens stopped in with its partial arguments and takes it back
    as it is, so the usual loop (append the message, then the results) goes on."""
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    choice = tiny_client.chat.completions.create(
        model="tiny", messages=messages, tools=TINY_TOOLS, max_tokens=4, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    cut = choice.message.tool_calls[-1].function.arguments
    assert choice.finish_reason == "length" and cut.startswith("{")
    with pytest.raises(ValueError):
        json.loads(cut)
    messages += [choice.message, *({"role": "tool", "tool_call_id": c.id, "content": "ok"}
                                   for c in choice.message.tool_calls)]
    answer = tiny_client.chat.completions.create(model="tiny", messages=messages, tools=TINY_TOOLS,
                                                 tool_choice="none", max_tokens=4, temperature=0)
    assert answer.choices[0].message.content
    # the template gets the partial text as it is
    sent = [messages[0], choice.message.model_dump(exclude_none=True)]
    ids = httpx.post(tools_server.base_url + "/tokenize", json={"messages": sent}).json()["tokens"]
    prompt = httpx.post(tools_server.base_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f'"arguments": {json.dumps(cut)}' in prompt


def test_call_arguments_empty_absent_or_an_object_are_taken_as_vllm_takes_them(tools_server):
    """Clients send a no-argument call's arguments as "" or not at all, some as an object (vLLM:
    `{}`, and the object as it is)."""
    def rendered(function: dict) -> str:
        messages = [{"role": "user", "content": "Time?"},
                    {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", **function}}]},
                    {"role": "tool", "tool_call_id": "c", "content": "noon"}]
        reply = httpx.post(tools_server.base_url + "/tokenize", json={"messages": messages})
        assert reply.status_code == 200, reply.text
        return httpx.post(tools_server.base_url + "/detokenize", json={"tokens": reply.json()["tokens"]}).json()["prompt"]
    empty = '{"name": "get_time", "arguments": {}}'
    assert empty in rendered({"arguments": ""}) and empty in rendered({}) and empty in rendered({"arguments": None})
    assert '{"name": "get_time", "arguments": {"zone": "UTC"}}' in rendered({"arguments": {"zone": "UTC"}})
    assert rendered({"arguments": {"zone": "UTC"}}) == rendered({"arguments": '{"zone": "UTC"}'})


# ---------------------------------------------------------------- errors
def bad_request(client: openai.OpenAI, **request) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", max_tokens=4, **request)
    assert caught.value.status_code == 400
    return caught.value.body["message"] if isinstance(caught.value.body, dict) else str(caught.value)


@pytest.fixture(scope="module")
def plain_client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0)


USER = [{"role": "user", "content": "Hi"}]


def test_vllm_errors_for_bad_tool_requests(plain_client, tiny_client):
    assert bad_request(plain_client, messages=USER, tools=TINY_TOOLS) == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    assert "--enable-auto-tool-choice" in bad_request(plain_client, messages=USER, tools=TINY_TOOLS, tool_choice="auto")
    assert bad_request(plain_client, messages=USER, tool_choice="required") == (
        "When using `tool_choice`, `tools` must be set.")
    assert bad_request(plain_client, messages=USER, tools=TINY_TOOLS,
                       tool_choice={"type": "function", "function": {"name": "send_email"}}) == (
        "The tool specified in `tool_choice` does not match any of the specified `tools`")
    assert bad_request(plain_client, messages=USER, tools=TINY_TOOLS, tool_choice={"type": "function"}).startswith(
        "Expected field `function` in `tool_choice`.")
    assert bad_request(plain_client, messages=USER, tools=TINY_TOOLS, tool_choice="sometimes").startswith(
        "Invalid value for `tool_choice`: sometimes!")
    assert bad_request(plain_client, messages=USER, tools=TINY_TOOLS, tool_choice="required",
                       response_format={"type": "json_object"}) == (
        "You can only either use guided decoding or tools, not both.")


@pytest.mark.parametrize("tools, where", [
    ([{"type": "function"}], "function"),
    ([{"type": "function", "function": {"description": "no name"}}], "name"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "type"),
    ([{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}], "parameters"),
    ("get_weather", "tools"),
])
def test_malformed_tools_are_400(plain_client, tools, where):
    assert where in bad_request(plain_client, messages=USER, tools=tools, tool_choice="required")


def test_a_parameters_schema_the_grammar_cannot_compile_is_400(plain_client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(unclosed"}}}}}
    bad_request(plain_client, messages=USER, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})


@pytest.mark.parametrize("message, where", [
    ({"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, "tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]}, "function"),
])
def test_malformed_tool_messages_are_400(plain_client, message, where):
    assert where in bad_request(plain_client, messages=[*USER, message])


@pytest.mark.parametrize("flags, expected", [
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "invalid tool call parser: nope"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--tool-call-parser", "hermes"], "--enable-auto-tool-choice"),
])
def test_bad_tool_flags_stop_the_server_at_startup(flags, expected):
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", *flags, "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and expected in done.stderr


# ---------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def default_server(server_factory):
    return server_factory(*AUTO_HERMES, "--kv-cache-memory", "512MiB")  # holds max-model-len (8,192) in float32


@pytest.fixture(scope="module")
def client(default_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="unused", max_retries=0)


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.slow
@pytest.mark.parametrize("question", ["What's the weather in Paris?", "Is it cold in Oslo today?",
                                      "Do I need an umbrella in London?"])
def test_named_tool_choice_on_the_default_model(client, question):
    choice = client.chat.completions.create(
        model=model_id(client), messages=[{"role": "user", "content": question}], tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=100, temperature=0).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == ""
    [arguments] = assert_valid_calls(choice.message, [WEATHER, TIME])
    assert choice.message.tool_calls[0].function.name == "get_weather" and arguments["city"]


@pytest.mark.slow
def test_required_tool_choice_on_the_default_model(client):
    choice = client.chat.completions.create(
        model=model_id(client), messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=[WEATHER, TIME], tool_choice="required", max_tokens=150, temperature=0).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    assert_valid_calls(choice.message, [WEATHER, TIME])


@pytest.mark.slow
def test_required_finishes_with_tool_calls_within_100_tokens_on_ten_prompts(client):
    """The required wrapper's calls are closed objects (name and parameters only), so the default
    model can no longer add keys until max_tokens (issue 44 saw it run to `length` at 100, 400 and
    1000 tokens). With one call per reply, all ten prompts finish with `tool_calls` within 100 tokens;
    with parallel calls every call it makes is well formed (greedy, it repeats one identical call
    after "Forecast for Berlin?" until max_tokens: a loop of the model, not an extra key)."""
    questions = ["What time is it in Tokyo?", "Weather in Paris?", "Is it raining in London?", "Time in Oslo now?",
                 "How warm is Rome today?", "What's the hour in Lima?", "Is Cairo sunny?", "Current time in Sydney?",
                 "Forecast for Berlin?", "Clock time in Toronto?"]
    for question in questions:
        for parallel in (False, True):
            choice = client.chat.completions.create(
                model=model_id(client), messages=[{"role": "user", "content": question}], tools=[WEATHER, TIME],
                tool_choice="required", parallel_tool_calls=parallel, max_tokens=100, temperature=0).choices[0]
            if not parallel:
                assert choice.finish_reason == "tool_calls", (question, choice.message)
            if choice.finish_reason == "tool_calls":
                assert_valid_calls(choice.message, [WEATHER, TIME])


@pytest.mark.slow
def test_two_turn_tool_conversation_on_the_default_model(client):
    """Turn 1 calls the tool; turn 2 sends the call back (content null) with the tool's result,
    and the model answers in text."""
    model = model_id(client)
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    [call] = first.tool_calls
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                            "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'},
    ]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=40, temperature=0).choices[0]
    assert second.message.tool_calls == [] and second.message.content.strip()
    assert second.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_langchain_bind_tools_and_function_calling_structured_output(default_server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """Weather report for a city."""

        city: str = Field(description="the city", max_length=40)
        celsius: int = Field(ge=-60, le=60)

    base_url = default_server.base_url + "/v1"
    llm = langchain_openai.ChatOpenAI(base_url=base_url, api_key="unused", temperature=0, max_tokens=100, max_retries=0,
                                      model=model_id(openai.OpenAI(base_url=base_url, api_key="unused")))
    reply = llm.bind_tools([Weather], tool_choice="Weather").invoke("It is 21 degrees in Rome.")
    [call] = reply.tool_calls
    assert call["name"] == "Weather" and Weather(**call["args"])
    report = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Madrid: 30 C.")
    assert isinstance(report, Weather)
