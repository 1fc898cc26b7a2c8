"""JSON schemas closed the way xgrammar's strict mode (vLLM's default backend) closes them: objects
that list their `properties` and say nothing of `additionalProperties` take no other keys. A small
model left free to add keys may add them until max_tokens (issue 44: 2 of 10 samples did)."""
from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_schema(schema: Any, close: bool = True) -> Any:
    """A copy of `schema` where objects that list `properties` and say nothing about
    `additionalProperties` allow no other keys (xgrammar's strict mode, vLLM's default backend):
    a function's arguments are the parameters it declares, and a small model left free to add
    keys may add them until max_tokens. Objects whose keys are also declared elsewhere (`allOf`
    parts, `$ref`, `unevaluatedProperties`) are left open, so composed schemas still validate."""
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: closed_schema(sub) for name, sub in result[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(result.get(key), list):
            result[key] = [closed_schema(sub, close=key != "allOf") for sub in result[key]]
    for key in _SCHEMA_VALUES:
        if key in result:
            result[key] = closed_schema(result[key])
    composed = any(key in result for key in ("allOf", "$ref", "unevaluatedProperties", "additionalProperties"))
    if close and "properties" in result and not composed:
        result["additionalProperties"] = False
    return result
