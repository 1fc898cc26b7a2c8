"""A structural scanner for JSON that may still be arriving token by token.

Tool-call parsers read the model's output after every step and need to know, on a prefix of the
final text, where a call's `name` and `arguments` values start and whether they have ended. The
scanner walks strings (with escapes), nested objects and arrays and bare scalars without
materialising anything; it reports `None` where the text ends before a value does and raises
`JSONSyntaxError` where the prefix can no longer become JSON. Complete values are checked again
with `json.loads` by the parsers, so the scanner only has to be exact about where values end.
A stream re-reads its text after every step, so the scanner jumps over string bodies and the text
between brackets with regular expressions (C loops) instead of stepping through it in Python.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"
_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_CLOSING = {"{": "}", "[": "]"}
_STRING_BODY = re.compile(r'(?:[^"\\]+|\\.)*', re.DOTALL)  # up to the closing quote (or the end)
_STRUCTURAL = re.compile(r'[{}\[\]"]')


class JSONSyntaxError(ValueError):
    """The text cannot be the start of a JSON value (at `position`)."""

    def __init__(self, position: int, what: str):
        super().__init__(f"{what} at character {position}")
        self.position = position


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """`text[i]` is an opening quote: one past the closing quote, or None if the text ends first."""
    j = _STRING_BODY.match(text, i + 1).end()
    return j + 1 if j < len(text) and text[j] == '"' else None


def value_end(text: str, i: int) -> int | None:
    """One past the JSON value that starts at `text[i]` (no leading whitespace), or None when the
    text ends inside it. A bare scalar (number, true, false, null) that reaches the end of the text
    is unfinished: more digits may follow."""
    if i >= len(text):
        return None
    char = text[i]
    if char == '"':
        return _string_end(text, i)
    if char in _CLOSING:
        stack = [_CLOSING[char]]
        j = i + 1
        while (found := _STRUCTURAL.search(text, j)) is not None:
            j, char = found.start(), found.group()
            if char == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if char in _CLOSING:
                stack.append(_CLOSING[char])
            elif char in "}]":
                if char != stack.pop():
                    raise JSONSyntaxError(j, f"unexpected {char!r}")
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] in _SCALAR_CHARS:
        j += 1
    if j == i:
        raise JSONSyntaxError(i, f"unexpected {char!r}")
    return None if j == len(text) else j


@dataclass
class Member:
    """One `"key": value` of an object; `end` is None while the value is unfinished."""

    key: str
    start: int
    end: int | None

    def text(self, source: str) -> str:
        """The value's text so far (it only grows as the source grows)."""
        return source[self.start:self.end if self.end is not None else len(source)]


@dataclass
class ObjectScan:
    members: list[Member] = field(default_factory=list)
    end: int | None = None  # one past the closing brace; None while the object is open

    def get(self, *keys: str) -> Member | None:
        return next((m for m in self.members if m.key in keys), None)


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the object whose `{` is at `text[i]`, as far as the text goes."""
    if text[i] != "{":
        raise JSONSyntaxError(i, "expected '{'")
    scan = ObjectScan()
    i = skip_whitespace(text, i + 1)
    if i < len(text) and text[i] == "}":
        scan.end = i + 1
        return scan
    while True:
        if i >= len(text):
            return scan
        if text[i] != '"':
            raise JSONSyntaxError(i, "expected a key")
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        key = json.loads(text[i:key_end])
        i = skip_whitespace(text, key_end)
        if i >= len(text):
            return scan
        if text[i] != ":":
            raise JSONSyntaxError(i, "expected ':'")
        i = skip_whitespace(text, i + 1)
        if i >= len(text):
            return scan
        end = value_end(text, i)
        scan.members.append(Member(key, i, end))
        if end is None:
            return scan
        i = skip_whitespace(text, end)
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != ",":
            raise JSONSyntaxError(i, "expected ',' or '}'")
        i = skip_whitespace(text, i + 1)
