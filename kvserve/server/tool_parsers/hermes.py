"""The `hermes` format (Hermes 2 Pro, Qwen2.5, SmolLM and kvserve's own fallback rendering):
each call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
`</tool_call>`; text before the first call is the message's content (text after it is dropped,
as vLLM's parser does)."""
from __future__ import annotations

import json

from kvserve.server.tool_parsers.base import Parse, ToolParser, partial_suffix, read_call
from kvserve.server.tool_parsers.json_scan import JSONSyntaxError, skip_whitespace

START, END = "<tool_call>", "</tool_call>"
# A call on a line of its own, as the format writes it (Lark string literals, for strict_grammar).
_OPEN_LINE, _CLOSE_LINE = json.dumps(START + "\n"), json.dumps("\n" + END)


class HermesParser(ToolParser):
    name = "hermes"

    @classmethod
    def strict_grammar(cls, call: str, final: str | None, parallel: bool = True) -> str:
        """Free text up to each `<tool_call>` (a lazy lexeme: it ends at the tag, llguidance's
        tool-calling pattern), then a call as the model writes it, on a line of its own. With
        `final`, calls and no text, or the final JSON: at a reply's first byte llguidance commits to
        one lexeme class, free text's or the JSON's."""
        if final is None:  # without `parallel`, the reply ends with its one call
            return "\n".join(["%llguidance {}", "start: call* TEXT" if parallel else "start: call | TEXT",
                              "TEXT: /(.|\\n)*/",
                              f"call_open[lazy]: TEXT {json.dumps(START)}",
                              f'call: call_open "\\n" {call} {_CLOSE_LINE}'])
        calls = 'call ("\\n" call)*' if parallel else "call"
        return "\n".join(["%llguidance {}", f"start: final | {calls}", f"final: {final}",
                          f"call: {_OPEN_LINE} {call} {_CLOSE_LINE}"])

    def parse(self, text: str, final: bool) -> Parse:
        first = text.find(START)
        if first < 0:
            held = 0 if final else partial_suffix(text, START)
            return Parse(text[:len(text) - held])
        content, calls, position = text[:first], [], first
        try:
            while position >= 0:
                i = skip_whitespace(text, position + len(START))
                if i >= len(text):
                    if final:
                        raise JSONSyntaxError(i, "empty tool call")
                    break
                call, end = read_call(text, i, final, ("arguments", "parameters"))
                if call is not None:
                    calls.append(call)
                if end is None:
                    break
                j = skip_whitespace(text, end)
                if text.startswith(END, j):
                    position = text.find(START, j + len(END))
                elif END.startswith(text[j:]):  # the closing tag is still arriving, or was left out
                    break
                else:
                    raise JSONSyntaxError(j, f"expected {END}")
        except JSONSyntaxError:
            return Parse(content, calls, valid=False)
        return Parse(content, calls)
