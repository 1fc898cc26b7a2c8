"""The `llama3_json` format (Llama 3.1/3.2 JSON tool calling): the whole reply is one or more JSON
objects `{"name": ..., "parameters": {...}}` separated by `;`, optionally after the
`<|python_tag|>` token; a reply that starts with anything else is plain content, and so is an
object named after none of the tools where the reply may be response_format's JSON."""
from __future__ import annotations

from kvserve.server.tool_parsers.base import Parse, ToolParser, read_call
from kvserve.server.tool_parsers.json_scan import JSONSyntaxError, scan_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    argument_key = "parameters"

    @classmethod
    def strict_grammar(cls, call: str, final: str | None, parallel: bool = True) -> str:
        """Text that does not open with `{`, or calls separated by `; ` (without the python tag,
        which not every tokenizer has)."""
        if final is None:  # TEXT: a reply that opens with anything but `{`, or nothing
            start = ["start: TEXT | calls", "TEXT: /\\s*([^{\\s](.|\\n)*)?/"]
        else:
            start = ["start: calls | final", f"final: {final}"]
        calls = 'calls: call ("; " call)*' if parallel else "calls: call"
        return "\n".join(["%llguidance {}", *start, calls, f"call: {call}"])

    def parse(self, text: str, final: bool) -> Parse:
        i = skip_whitespace(text, 0)
        tagged = text.startswith(PYTHON_TAG, i)
        if tagged:
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):  # nothing yet, or a tag still arriving
            return Parse("")
        if not tagged and (i >= len(text) or text[i] != "{"):
            return Parse(text)
        if not tagged and self.tool_names is not None and not self._may_be_a_call(text, i):
            return Parse(text)  # response_format's JSON, streamed as it comes
        calls = []
        try:
            while True:
                if i >= len(text):
                    if final and not calls:
                        raise JSONSyntaxError(i, "no tool call after the python tag")
                    break
                if text[i] != "{":
                    raise JSONSyntaxError(i, "expected a JSON object")
                call, end = read_call(text, i, final, ("parameters", "arguments"))
                if call is not None and not calls and self.tool_names is not None and call.name not in self.tool_names:
                    return Parse(text)  # no tool's name: the grammar's other branch, response_format's JSON
                if call is not None:
                    calls.append(call)
                if end is None:
                    break
                j = skip_whitespace(text, end)
                if j >= len(text):
                    break
                if text[j] != ";":
                    raise JSONSyntaxError(j, "expected ';' between tool calls")
                i = skip_whitespace(text, j + 1)
        except JSONSyntaxError:
            return Parse("", calls, valid=False)
        return Parse("", calls)

    @staticmethod
    def _may_be_a_call(text: str, i: int) -> bool:
        """Whether the object at `text[i]` may still be a call: a call's first key is "name" (the
        grammar writes it first), so an object whose first key is another, or an empty object, is
        the reply's JSON from then on."""
        try:
            scan = scan_object(text, i)
        except JSONSyntaxError:
            return True  # the call reader reports it
        if scan.members:
            return scan.members[0].key == "name"
        return scan.end is None

