"""The tool-call parsers (hermes, llama3_json) and the readers of forced tool output, on fixed
text: whole replies, the same replies fed a few characters at a time (the deltas must reassemble
to the whole reply), and malformed text, which falls back to plain content."""
from __future__ import annotations

import json

import pytest

from kvserve.server.tool_parsers import TOOL_PARSERS
from kvserve.server.tool_parsers.forced import NamedCallReader, RequiredCallsReader
from kvserve.server.tool_parsers.json_scan import JSONSyntaxError, scan_object, value_end
from kvserve.server.tool_stream import ToolDeltas, final_message

WEATHER = '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" } brace"}'


def streamed(parser, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed `text` `step` characters at a time; reassemble content and calls the way a client does."""
    tracker = ToolDeltas(parser)
    content, calls = "", []
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta, deltas = tracker.step(text[:end], final=end == len(text))
        content += delta
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.type == "function" and d.function.name
                calls.append({"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""})
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    return content, calls


def whole(parser, text: str, forced: bool = False) -> tuple[str | None, list[dict]]:
    message = final_message(parser, text, forced)
    return message.content, [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]


def check_stream_equals_whole(parser, text: str) -> tuple[str | None, list[dict]]:
    content, calls = whole(parser, text)
    for step in (1, 2, 3, 7, len(text)):
        got_content, got_calls = streamed(parser, text, step)
        assert got_content == (content or "")
        assert [{k: c[k] for k in ("name", "arguments")} for c in got_calls] == calls
        assert len({c["id"] for c in got_calls}) == len(got_calls)
    return content, calls


def test_scanner_finds_value_ends_and_unfinished_values():
    assert value_end('"a\\"b" ,', 0) == 6
    assert value_end('{"a": [1, {"b": "}"}]} tail', 0) == 22
    assert value_end('{"a": [1, 2', 0) is None
    assert value_end("123", 0) is None  # more digits may follow
    assert value_end("123,", 0) == 3
    with pytest.raises(JSONSyntaxError):
        value_end('{"a": [1}', 0)
    scan = scan_object('{"name": "f", "arguments": {"x": 1', 0)
    assert [m.key for m in scan.members] == ["name", "arguments"] and scan.end is None
    assert scan.members[1].text('{"name": "f", "arguments": {"x": 1') == '{"x": 1'


def test_hermes_whole_reply_with_content_and_two_calls():
    parser = TOOL_PARSERS["hermes"]()
    text = (f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>\n'
            '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
    content, calls = check_stream_equals_whole(parser, text)
    assert content == "Let me look.\n"
    assert calls == [{"name": "weather", "arguments": WEATHER}, {"name": "time", "arguments": "{}"}]
    assert json.loads(calls[0]["arguments"])["note"] == 'a "quoted" } brace'


def test_hermes_call_only_has_null_content_and_an_unclosed_last_call_counts():
    parser = TOOL_PARSERS["hermes"]()
    content, calls = check_stream_equals_whole(parser, '<tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert content is None and calls == [{"name": "f", "arguments": '{"a": 1}'}]
    # arguments missing: an empty object, as the call has no parameters
    assert whole(parser, '<tool_call>{"name": "g"}</tool_call>')[1] == [{"name": "g", "arguments": "{}"}]


def test_hermes_holds_back_a_partial_tag_but_releases_plain_text():
    parser = TOOL_PARSERS["hermes"]()
    assert parser.parse("Hello <tool_", final=False).content == "Hello "
    assert parser.parse("Hello <tool_", final=True).content == "Hello <tool_"
    content, calls = check_stream_equals_whole(parser, "Use a <b>tag</b> or <tool> freely.")
    assert content == "Use a <b>tag</b> or <tool> freely." and calls == []


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut off
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    "<tool_call>",
])
def test_hermes_malformed_text_is_plain_content(text):
    parser = TOOL_PARSERS["hermes"]()
    assert whole(parser, text) == (text, [])
    content, calls = streamed(parser, text, 1)
    if not calls:  # nothing was announced as a call: the stream's content is the whole text too
        assert content == text


def test_hermes_stream_sends_the_name_first_then_argument_fragments():
    parser = TOOL_PARSERS["hermes"]()
    text = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tracker = ToolDeltas(parser)
    seen = []
    for end in range(1, len(text) + 1):
        _, deltas = tracker.step(text[:end], final=end == len(text))
        seen.extend(deltas)
    assert seen[0].id and seen[0].function.name == "weather"
    assert all(d.id is None and d.function.name is None for d in seen[1:])
    assert len(seen) > 3  # the arguments arrive in pieces, not at the end
    assert "".join(d.function.arguments for d in seen) == '{"city": "Paris"}'


def test_llama3_json_calls_separated_by_semicolons_and_python_tag():
    parser = TOOL_PARSERS["llama3_json"]()
    text = f'<|python_tag|>{{"name": "weather", "parameters": {WEATHER}}}; {{"name": "time", "parameters": {{}}}}'
    content, calls = check_stream_equals_whole(parser, text)
    assert content is None
    assert calls == [{"name": "weather", "arguments": WEATHER}, {"name": "time", "arguments": "{}"}]
    content, calls = check_stream_equals_whole(parser, ' {"name": "f", "arguments": {"x": [1]}}')
    assert calls == [{"name": "f", "arguments": '{"x": [1]}'}]


@pytest.mark.parametrize("text", ["The weather is fine.", "  <b>not a call</b>", "{not json}", '{"name": "f", "x"',
                                  '{"name": "f", "parameters": {}} and more', "<|python_tag|>"])
def test_llama3_json_plain_and_malformed_text_is_content(text):
    parser = TOOL_PARSERS["llama3_json"]()
    assert whole(parser, text) == (text, [])
    content, calls = streamed(parser, text, 1)
    if not calls:
        assert content == text


def test_forced_readers():
    named = NamedCallReader("weather")
    assert whole(named, '{"city":"Paris"}', forced=True) == ("", [{"name": "weather", "arguments": '{"city":"Paris"}'}])
    required = RequiredCallsReader()
    text = '[{"name":"weather","parameters":{"city":"Paris"}},{"name":"time","parameters":{}}]'
    assert whole(required, text, forced=True) == ("", [{"name": "weather", "arguments": '{"city":"Paris"}'},
                                                        {"name": "time", "arguments": "{}"}])
    for step in (1, 5):
        content, calls = streamed(required, text, step)
        assert content == "" and [c["arguments"] for c in calls] == ['{"city":"Paris"}', "{}"]
    # cut off by max_tokens: the call keeps the arguments generated so far, as a named call does
    assert whole(required, '[{"name":"weather","parameters":{"ci', forced=True)[1] == [
        {"name": "weather", "arguments": '{"ci'}]


def test_tool_schemas_are_closed_to_undeclared_keys_except_where_composed():
    from kvserve.server.json_schemas import closed_schema
    from kvserve.server.tools import required_schema

    schema = {"type": "object", "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {}, "additionalProperties": True},
        "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["where"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] is True
    assert all("additionalProperties" not in part for part in closed["properties"]["both"]["allOf"])
    assert closed["$defs"]["Point"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's schema is not modified

    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}},
             {"type": "function", "function": {"name": "g"}}]
    required = required_schema(tools)
    assert required["minItems"] == 1 and "maxItems" not in required
    [f, g] = required["items"]["anyOf"]
    assert f["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert f["properties"]["parameters"]["$defs"]["Point"]["additionalProperties"] is False  # no $ref: in place
    assert g["properties"]["parameters"] == {"type": "object", "properties": {}, "additionalProperties": False}
    # the wrapper of each call is closed too: a call holds its name and parameters, nothing else
    assert f["additionalProperties"] is False and g["additionalProperties"] is False
    assert required_schema(tools, parallel=False)["maxItems"] == 1
