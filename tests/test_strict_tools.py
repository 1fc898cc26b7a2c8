"""`"strict": true` tools under `tool_choice: "auto"`: the grammar each tool-call format compiles to
(kvserve/server/tools.py, the parsers' `strict_grammar`), checked token by token through llguidance
with the tiny tokenizer, and a tiny model generating under it. Free text stays free; a call must name
a tool and match its closed parameters schema; with response_format, a reply is calls or that JSON."""
from __future__ import annotations

import json

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.structured_output import GrammarCompiler
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.tool_parsers import TOOL_PARSERS
from kvserve.server.tool_stream import ToolDeltas, final_message
from kvserve.server.tools import plan_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {  # not strict: its arguments may be any object
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
ANSWER = {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"]}}}}


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def llama3(name: str, arguments: str) -> str:
    return f'{{"name": "{name}", "parameters": {arguments}}}'


def constraint(parser: str, tools: list[dict] = (WEATHER, TIME), **fields):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "?"}],
                                                 "tools": list(tools), **fields})
    return plan_tools(body, parser).structured_outputs()


@pytest.fixture(scope="module")
def compiler(tiny_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer, len(tiny_tokenizer), (tiny_tokenizer.eos_token_id,))


def accepts(compiler, tokenizer, spec, text: str) -> bool:
    """Whether the grammar takes `text`, token by token, as a whole reply."""
    matcher = compiler.matcher(spec)
    return all(matcher.accept(t) is None for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.matcher.is_accepting()


@pytest.mark.parametrize("parser, call, separator", [("hermes", hermes, "\n"), ("llama3_json", llama3, "; ")])
def test_calls_must_match_their_schemas_and_text_stays_free(compiler, tiny_tokenizer, parser, call, separator):
    spec = constraint(parser)
    good = [call("get_weather", '{"city": "Rome", "days": 3}'), call("get_time", '{"any": [1, {"key": null}]}')]
    for text in ("It is sunny in Rome.", "", good[0], separator.join(good)):
        assert accepts(compiler, tiny_tokenizer, spec, text), text
    if parser == "hermes":  # text around the calls
        assert accepts(compiler, tiny_tokenizer, spec, f"Let me look. {good[0]} Done.")
    for text in (call("get_weather", '{"city": "Oslo", "days": 3}'),  # not in the enum
                 call("get_weather", '{"city": "Rome", "days": 3, "extra": 1}'),  # closed to other keys
                 call("get_weather", '{"city": "Rome"}'),  # a required key left out
                 call("get_weather", '{"city":"Rome","days":3}'),  # the separators every constrained reply uses
                 call("get_news", "{}"),  # no such tool
                 call("get_time", "5")):  # arguments are an object even for a tool that is not strict
        assert not accepts(compiler, tiny_tokenizer, spec, text), text
    # what the grammar lets through, the server's parser reads back as calls
    message = final_message(TOOL_PARSERS[parser](), separator.join(good), False)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Rome", "days": 3}), ("get_time", {"any": [1, {"key": None}]})]


@pytest.mark.parametrize("parser, call", [("hermes", hermes), ("llama3_json", llama3)])
def test_with_response_format_a_reply_is_calls_or_that_json(compiler, tiny_tokenizer, parser, call):
    spec = constraint(parser, **ANSWER)
    assert accepts(compiler, tiny_tokenizer, spec, '{"answer": "yes"}')
    assert accepts(compiler, tiny_tokenizer, spec, call("get_weather", '{"city": "Paris", "days": 1}'))
    for text in ("Yes.", '{"answer": "maybe"}', call("get_weather", '{"city": "Oslo", "days": 1}')):
        assert not accepts(compiler, tiny_tokenizer, spec, text), text
    two = {"hermes": "\n", "llama3_json": "; "}[parser].join([call("get_weather", '{"city": "Paris", "days": 1}')] * 2)
    assert accepts(compiler, tiny_tokenizer, spec, two)
    assert not accepts(compiler, tiny_tokenizer, constraint(parser, parallel_tool_calls=False, **ANSWER), two)


def plan(parser: str, tools: list[dict] = (WEATHER, TIME), **fields):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "?"}],
                                                 "tools": list(tools), **fields})
    return plan_tools(body, parser)


def test_a_json_reply_with_a_name_key_is_content_not_a_call():
    """llama3_json's calls are bare objects, so response_format's JSON can look like one: an object
    named after no tool is the JSON reply, streamed and not."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    reply_format = {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
    tool_plan = plan("llama3_json", **reply_format)
    person = '{"name": "Alice", "age": 3}'
    message = final_message(tool_plan.reader(), person, False)
    assert message.content == person and not message.tool_calls
    streamed = ToolDeltas(tool_plan.reader())
    deltas = [streamed.step(person[:n], n == len(person)) for n in range(1, len(person) + 1)]
    assert "".join(content for content, _ in deltas) == person and not any(calls for _, calls in deltas)
    call = llama3("get_weather", '{"city": "Paris", "days": 1}')
    assert [c.function.name for c in final_message(tool_plan.reader(), call, False).tool_calls] == ["get_weather"]


def test_a_json_reply_streams_as_it_comes_once_it_cannot_be_a_call():
    """Under llama3_json with response_format, an object whose first key is not "name" is the
    reply's JSON: streamed from that key on, not held back to the end; a "name" key later in it
    does not make it a call."""
    tool_plan = plan("llama3_json", tools=[TIME], **ANSWER)
    for text in ('{"answer": "yes", "name": "get_time"}', "{}"):
        streamed = ToolDeltas(tool_plan.reader())
        deltas = [streamed.step(text[:n], n == len(text)) for n in range(1, len(text) + 1)]
        assert "".join(content for content, _ in deltas) == text and not any(calls for _, calls in deltas)
        if len(text) > 2:
            assert "".join(content for content, _ in deltas[:-3]) == text[:-3]  # before the object ends
        assert final_message(tool_plan.reader(), text, False).content == text


def test_without_parallel_calls_a_hermes_reply_ends_with_its_call(compiler, tiny_tokenizer):
    spec = constraint("hermes", parallel_tool_calls=False)
    good = hermes("get_weather", '{"city": "Rome", "days": 3}')
    assert accepts(compiler, tiny_tokenizer, spec, "Let me look. " + good)
    assert accepts(compiler, tiny_tokenizer, spec, "No call.")
    for text in (good + "\n<tool_call>\n{\"oops", good + " More text.", good + "\n" + good):
        assert not accepts(compiler, tiny_tokenizer, spec, text), text


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_references_resolve_inside_each_tools_own_schema(compiler, tiny_tokenizer, choice):
    """`#`, `#/definitions/...`, `#/properties/...` and one `$defs` name in two tools mean what they
    mean in the tool's own schema, though the tools sit inside one call schema."""
    def tool(name, parameters):
        return {"type": "function", "function": {"name": name, "strict": True, "parameters": parameters}}

    tree = tool("tree", {"type": "object", "properties": {"label": {"type": "string", "enum": ["a", "b"]},
                                                           "child": {"$ref": "#"}}, "required": ["label"]})
    old_style = tool("old", {"type": "object", "properties": {"unit": {"$ref": "#/definitions/Unit"},
                                                               "same": {"$ref": "#/properties/unit"}},
                             "definitions": {"Unit": {"type": "string", "enum": ["C", "F"]}}})
    number = tool("number", {"type": "object", "properties": {"v": {"$ref": "#/$defs/V"}},
                             "$defs": {"V": {"type": "integer"}}})
    word = tool("word", {"type": "object", "properties": {"v": {"$ref": "#/$defs/V"}},
                         "$defs": {"V": {"type": "boolean"}}})
    spec = constraint("hermes", [tree, old_style, number, word], tool_choice=choice)

    def call(name, arguments):
        return hermes(name, arguments) if choice == "auto" else f'[{{"name": "{name}", "parameters": {arguments}}}]'
    for name, arguments in [("tree", '{"label": "a", "child": {"label": "b", "child": {"label": "a"}}}'),
                            ("old", '{"unit": "C", "same": "F"}'), ("number", '{"v": 3}'), ("word", '{"v": true}')]:
        assert accepts(compiler, tiny_tokenizer, spec, call(name, arguments)), (name, arguments)
    for name, arguments in [("tree", '{"label": "a", "child": {"label": "c"}}'),
                            ("tree", '{"label": "a", "child": {"name": "tree", "arguments": {"label": "a"}}}'),
                            ("old", '{"unit": "K"}'), ("old", '{"same": "K"}'), ("number", '{"v": true}'),
                            ("word", '{"v": 3}')]:
        assert not accepts(compiler, tiny_tokenizer, spec, call(name, arguments)), (name, arguments)


def test_tools_no_call_could_be_made_to_are_refused():
    for parameters in ({"type": "string"}, {"type": "array", "items": {}}):
        bad = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        with pytest.raises(APIError, match="must be a JSON schema of an object") as caught:
            plan("hermes", [bad], tool_choice="required")
        assert caught.value.status == 400
    with pytest.raises(APIError, match="two tools are named 'get_weather'"):
        plan("hermes", [WEATHER, {"type": "function", "function": {"name": "get_weather"}}])


@pytest.mark.parametrize("parser, call", [("hermes", hermes), ("llama3_json", llama3)])
def test_without_strict_tools_a_response_format_still_leaves_calls_possible(compiler, tiny_tokenizer, parser, call):
    """OpenAI's meaning (Anthropic's output_config.format too): the format is the answer's; a tool
    call stays possible, its arguments any object."""
    for fields in (ANSWER, {"response_format": {"type": "json_object"}}):
        spec = constraint(parser, tools=[TIME], **fields)
        assert accepts(compiler, tiny_tokenizer, spec, '{"answer": "yes"}')
        assert accepts(compiler, tiny_tokenizer, spec, call("get_time", '{"zone": "UTC", "any": [1]}'))
        assert not accepts(compiler, tiny_tokenizer, spec, "Yes.")
    assert not accepts(compiler, tiny_tokenizer, constraint(parser, tools=[TIME], **ANSWER), '{"answer": "maybe"}')


def test_no_strict_tool_means_no_grammar_and_other_constraints_are_refused():
    assert constraint("hermes", tools=[TIME]) is None  # auto without strict: the model's own text
    with pytest.raises(APIError, match="a regex constraint cannot share"):
        constraint("hermes", structured_outputs={"regex": "a+"})


class ForcePrefix:
    """Forces the first tokens of a reply, then leaves the logits alone."""

    def __init__(self, prefix: list[int]):
        self.prefix = prefix

    def __call__(self, output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) < len(self.prefix):
            logits = torch.full_like(logits, float("-inf"))
            logits[self.prefix[len(output_token_ids)]] = 0.0
        return logits


def test_a_model_that_opens_a_call_finishes_it_to_the_schema(tiny_llama, tiny_tokenizer):
    """The tiny random model is made to write "<tool_call>\\n"; the strict grammar then holds the rest
    to a valid call, where the same model unconstrained writes no valid call at all."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    opening = tiny_tokenizer.encode("<tool_call>\n", add_special_tokens=False)
    replies = {}
    for name, grammar in (("strict", constraint("hermes")), ("free", None)):
        params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=grammar,
                                logits_processors=[ForcePrefix(opening)])
        replies[name] = llm.generate(["Weather in Rome?"], params, use_tqdm=False)[0].outputs[0].text
    [call] = final_message(TOOL_PARSERS["hermes"](), replies["strict"], False).tool_calls[:1]
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome") \
        and 1 <= arguments["days"] <= 7 and set(arguments) == {"city", "days"}, replies["strict"]
    assert not final_message(TOOL_PARSERS["hermes"](), replies["free"], False).tool_calls, replies["free"]
