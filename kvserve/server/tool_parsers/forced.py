"""Readers for output that structured outputs already forced into tool-call shape (vLLM's named
and `required` tool choice): no model format to detect, just where the calls are."""
from __future__ import annotations

from kvserve.server.tool_parsers.base import CallSoFar, Parse, ToolParser, read_call
from kvserve.server.tool_parsers.json_scan import JSONSyntaxError, skip_whitespace


class NamedCallReader(ToolParser):
    """`tool_choice` names a function: the whole output is its arguments object."""

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parse:
        return Parse("", [CallSoFar(self.function_name, text, final)])


class RequiredCallsReader(ToolParser):
    """`tool_choice: "required"`: the output is a JSON array `[{"name": ..., "parameters": {...}}, ...]`.
    A call cut off by max_tokens keeps the arguments generated so far (as a named call does)."""

    def parse(self, text: str, final: bool) -> Parse:
        calls: list[CallSoFar] = []
        try:
            i = skip_whitespace(text, 0)
            if i >= len(text):
                return Parse("", calls)
            if text[i] != "[":
                raise JSONSyntaxError(i, "expected '['")
            i = skip_whitespace(text, i + 1)
            while i < len(text) and text[i] != "]":
                call, end = read_call(text, i, False, ("parameters", "arguments"))
                if call is not None:
                    calls.append(call)
                if end is None:
                    break
                i = skip_whitespace(text, end)
                if i < len(text) and text[i] == ",":
                    i = skip_whitespace(text, i + 1)
                elif i < len(text) and text[i] != "]":
                    raise JSONSyntaxError(i, "expected ',' or ']'")
        except JSONSyntaxError:
            return Parse("", calls, valid=False)
        return Parse("", calls)
