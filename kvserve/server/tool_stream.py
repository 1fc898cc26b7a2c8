"""One choice's output as an assistant message with tool calls: whole (a JSON response) or as the
deltas of a stream.

Both come from the same parse of the text (kvserve/server/tool_parsers), so a streamed reply
reassembles to the non-streamed one: the stream sends, after each step, what the parse of the
text so far adds to the previous parse. When the final text turns out not to be well-formed tool
calls, the reply falls back to plain content (the non-streamed message has the whole text as
content; a stream sends the part of it not yet sent, but cannot take back a call it already sent).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvserve.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from kvserve.server.tool_parsers import Parse, ToolParser


def tool_call_id() -> str:
    """vLLM's id format for a tool call."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolMessage:
    content: str | None
    tool_calls: list[ToolCall]


def final_message(parser: ToolParser, text: str, forced: bool, max_calls: int | None = None) -> ToolMessage:
    """The message for a finished choice. `forced` (named or required tool choice): content is ""
    as vLLM returns it; otherwise content is None when there are calls and nothing before them.
    `max_calls`: the calls after the first ones are dropped (`parallel_tool_calls: false`)."""
    parse = parser.parse(text, final=True)
    if not parse.valid:
        return ToolMessage(text, [])
    calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parse.calls[:max_calls]]
    if forced:
        return ToolMessage("", calls)
    return ToolMessage(parse.content or (None if calls else ""), calls)


@dataclass
class ToolDeltas:
    """What one streamed choice has sent so far, and the next deltas to send."""

    parser: ToolParser
    max_calls: int | None = None
    content_sent: int = 0
    call_ids: list[str] = field(default_factory=list)
    arguments_sent: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.call_ids)

    def step(self, text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """(content delta, tool-call deltas) for the text generated so far."""
        parse: Parse = self.parser.parse(text, final)
        if final and not parse.valid:
            content = text  # the fallback: everything not yet sent goes out as content
            parse = Parse(content)
        else:
            content = parse.content
        content_delta = content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(content))
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parse.calls[:self.max_calls]):
            if call.name is None or index > len(self.call_ids):
                break
            if index == len(self.call_ids):
                self.call_ids.append(tool_call_id())
                self.arguments_sent.append(len(call.arguments))
                deltas.append(DeltaToolCall(index=index, id=self.call_ids[index], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > self.arguments_sent[index]:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                    arguments=call.arguments[self.arguments_sent[index]:])))
                self.arguments_sent[index] = len(call.arguments)
        return content_delta, deltas
