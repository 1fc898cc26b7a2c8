"""What a tool-call parser returns, and the step they share: reading one call object.

A parser is a pure function of the text generated so far: `parse(text, final)` says which part is
plain content and which calls it holds. Streaming calls it after every step and sends the growth
since the previous parse (kvserve/server/tool_stream.py), so the content and each call's
arguments text must only grow as the text grows; the final parse of the whole text is what a
non-streaming response returns, so the two always reassemble to the same message.
"""
from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field

from kvserve.server.tool_parsers.json_scan import JSONSyntaxError, ObjectScan, scan_object


@dataclass
class CallSoFar:
    """A tool call as far as the text goes: `name` once its string is complete, `arguments` the
    raw JSON text of the arguments value so far, `complete` once the call's object has closed."""

    name: str | None
    arguments: str
    complete: bool = False


@dataclass
class Parse:
    """`content`: plain text to show (held back where it might still turn into a call); `calls`:
    the calls found; `valid`: False when the text claimed to be tool calls but is not well formed
    (a final parse then returns the whole text as content, as vLLM's parsers do)."""

    content: str
    calls: list[CallSoFar] = field(default_factory=list)
    valid: bool = True


class ToolParser:
    """A tool-call format the model writes (`--tool-call-parser NAME`)."""

    name: str = ""
    argument_key: str = "arguments"  # the call object's key for the arguments, as the model writes it

    def __init__(self, tool_names: Collection[str] | None = None):
        """`tool_names`: given when a reply may also be response_format's JSON (strict tools), for
        a format whose calls that JSON could look like (llama3_json's bare objects)."""
        self.tool_names = None if tool_names is None else frozenset(tool_names)

    def parse(self, text: str, final: bool) -> Parse:
        raise NotImplementedError

    @classmethod
    def strict_grammar(cls, call: str, final: str | None, parallel: bool = True) -> str:
        """A Lark grammar (llguidance's dialect) of a reply in this format whose every call matches
        `call` (an inline `%json {...}` of the call object), for `tool_choice: "auto"` with strict
        tools; one call at most without `parallel`. With `final` (the `%json` of response_format's
        schema), a reply is calls or that JSON, not free text."""
        raise NotImplementedError


def read_call(text: str, start: int, final: bool, argument_keys: tuple[str, ...]) -> tuple[CallSoFar | None, int | None]:
    """The call object `{"name": ..., <argument key>: {...}}` whose `{` is at `text[start]`.

    Returns (call, end): call is None until its name is known; end is one past the object or None
    while it is open. Raises JSONSyntaxError for text that cannot become such an object; with
    `final`, also for an unfinished object or values that are not JSON."""
    scan: ObjectScan = scan_object(text, start)
    name_member = scan.get("name")
    name = None
    if name_member is not None and name_member.end is not None:
        name = json.loads(name_member.text(text))
        if not isinstance(name, str):
            raise JSONSyntaxError(name_member.start, "the call's name is not a string")
    arguments_member = scan.get(*argument_keys)
    arguments = arguments_member.text(text) if arguments_member is not None else ""
    if scan.end is not None and arguments_member is None:
        arguments = "{}"
    if final:
        if scan.end is None or name is None:
            raise JSONSyntaxError(len(text), "unfinished tool call")
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise JSONSyntaxError(arguments_member.start if arguments_member else start, str(exc)) from None
    if name is None:
        return None, scan.end
    return CallSoFar(name, arguments, scan.end is not None), scan.end


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (text to hold back
    because the next tokens may complete the marker)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
