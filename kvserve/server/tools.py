"""A chat request's `tools` and `tool_choice`, checked and turned into a plan (vLLM's semantics).

- `"none"`: the tools are shown to the model, the reply is plain text.
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained
  by structured outputs to that function's parameters schema (objects closed to undeclared keys,
  see `closed_schema`) and returned as its one call.
- `"required"`: the output is constrained to a JSON array of `{"name": <a tool>, "parameters":
  <that tool's schema>}` objects, at least one; each becomes a call.
- `"auto"` (the default when `tools` is given): the model writes calls in its own format, which
  the server's `--tool-call-parser` reads; needs `--enable-auto-tool-choice`. When a tool says
  `"strict": true`, a grammar in that format (the parser's `strict_grammar`) leaves text free and
  holds every call to a tool's name and its closed parameters schema (the others' to any object),
  as vLLM's structural tags do; with response_format's JSON schema, a reply is calls or that JSON,
  strict tools or not (OpenAI's meaning: the format is the answer's, calls stay possible).

Named and required work on any model because the grammar, not the model, guarantees the shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.engine.structured_output import SEPARATORS
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server.errors import APIError
from kvserve.server.json_schemas import closed_schema
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.tool_parsers import TOOL_PARSERS, ToolParser
from kvserve.server.tool_parsers.forced import NamedCallReader, RequiredCallsReader

_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    tools: list[dict[str, Any]]  # OpenAI tool definitions, as plain JSON, for the prompt
    choice: str  # "none" | "auto" | "required" | "named"
    function_name: str | None = None  # the named function
    parser_name: str | None = None  # auto: the server's --tool-call-parser
    parallel: bool = True  # parallel_tool_calls; False keeps one call (required: the grammar allows one)
    strict: bool = False  # auto: some tool is `strict`, so a grammar holds the calls to their schemas
    final_schema: dict | None = None  # auto: response_format's JSON schema, the reply when no call
    cut_stays_length: bool = False  # a token limit's cut is "length" even with calls (ChatCompletionRequest)

    def reader(self) -> ToolParser | None:
        """What reads this request's output into tool calls (None: plain text)."""
        if self.choice == "named":
            return NamedCallReader(self.function_name)
        if self.choice == "required":
            return RequiredCallsReader()
        if self.choice == "auto":
            names = [t["function"]["name"] for t in self.tools] if self.final_schema is not None else None
            return TOOL_PARSERS[self.parser_name](tool_names=names)
        return None

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.choice == "named":
            return StructuredOutputsParams(json=self._parameters(self.function_name))
        if self.choice == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        if self.choice == "auto" and (self.strict or self.final_schema is not None):
            parser = TOOL_PARSERS[self.parser_name]
            call = call_schema(self.tools, parser.argument_key, strict_only=True)
            final = None if self.final_schema is None else _inline_json(self.final_schema)
            return StructuredOutputsParams(grammar=parser.strict_grammar(_inline_json(call), final, self.parallel))
        return None

    def _parameters(self, name: str) -> dict:
        function = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return closed_schema(function.get("parameters") or EMPTY_PARAMETERS)

    def finish_reason(self, finish_reason: str | None, called: bool) -> str | None:
        """vLLM's (and OpenAI's) rule: "tool_calls" when auto produced calls or a required reply
        ended normally; a named call keeps "stop", as OpenAI's API answers a forced function. A
        reply a token limit cut is "tool_calls" too if auto produced calls (vLLM's), unless
        `cut_stays_length`."""
        if self.choice == "required" and finish_reason == "stop":
            return "tool_calls"
        ends = ("stop",) if self.cut_stays_length else ("stop", "length")
        if self.choice == "auto" and called and finish_reason in ends:
            return "tool_calls"
        return finish_reason


def call_schema(tools: list[dict[str, Any]], argument_key: str = "parameters", strict_only: bool = False) -> dict:
    """The schema of one call object, `{"name": <a tool>, argument_key: <that tool's schema>}`
    (parameters closed, see `closed_schema`). `strict_only`: tools not marked `strict` take any
    object. A tool whose parameters hold references moves to `$defs` under a name of its own, its
    local `$ref`s rewritten to point there: `#/$defs/...`, `#/definitions/...`, `#/properties/...`
    and `#` itself resolve as in the tool's own schema, and two tools may use one definition name."""
    definitions: dict[str, Any] = {}
    alternatives = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if strict_only and not function.get("strict"):
            parameters: dict[str, Any] = {"type": "object"}
        else:
            parameters = closed_schema(function.get("parameters") or EMPTY_PARAMETERS)
            if _has_local_ref(parameters):
                definitions[f"tool{i}"] = _relocated(parameters, f"#/$defs/tool{i}")
                parameters = {"$ref": f"#/$defs/tool{i}"}
        alternatives.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                            argument_key: parameters},
                             "required": ["name", argument_key], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "object", "anyOf": alternatives}
    if definitions:
        schema["$defs"] = definitions
    return schema


_LITERAL_KEYS = ("enum", "const", "default", "examples")  # values, not schemas: no references inside


def _has_local_ref(schema: Any) -> bool:
    pending = [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, list):
            pending += node
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                return True
            pending += [value for key, value in node.items() if key not in _LITERAL_KEYS]
    return False


def _relocated(schema: Any, base: str) -> Any:
    """`schema` with its local references (`#`, `#/...`) made relative to `base`, where it will sit."""
    if isinstance(schema, list):
        return [_relocated(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: value if key in _LITERAL_KEYS else _relocated(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        result["$ref"] = base + ref[1:]
    return result


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict:
    """vLLM's schema for `tool_choice: "required"`: an array of at least one call (exactly one
    without `parallel`), each naming a tool (an enum of one) with that tool's parameters."""
    call = call_schema(tools)
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": call["anyOf"]}}
    if not parallel:
        schema["maxItems"] = 1
    if "$defs" in call:
        schema["$defs"] = call["$defs"]
    return schema


def _inline_json(schema: dict) -> str:
    """A schema as Lark's `%json {...}`, its JSON written with the separators of every other
    constrained reply (kvserve/engine/structured_output.py)."""
    return "%json " + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False, **SEPARATORS}})


def _requested_constraint(body: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The output constraint the request itself asks for; None for none or a malformed one
    (sampling_params() reports that)."""
    try:
        return body.structured_outputs_params()
    except ValueError:
        return None


def _final_schema(body: ChatCompletionRequest) -> dict | None:
    """Under auto tools, the JSON schema a reply without calls follows (response_format), if
    any. Other constraints cannot share strict tools' grammar: a 400."""
    constraint = _requested_constraint(body)
    if constraint is None:
        return None
    if constraint.kind == "json_object":
        return {"type": "object"}
    if constraint.kind == "json":
        schema = constraint.json
        try:
            schema = json.loads(schema) if isinstance(schema, str) else schema
        except ValueError as exc:
            raise APIError(400, f"Invalid grammar specification: {exc}", param="response_format") from None
        if not isinstance(schema, dict):
            raise APIError(400, "a JSON schema must be an object", param="response_format")
        return schema
    raise APIError(400, "Strict tools (function.strict) under tool_choice \"auto\" constrain the reply with a "
                        f"grammar, which a {constraint.kind} constraint cannot share: use one or the other.",
                   param="tools")


def _check_tools(tools: list[dict[str, Any]]) -> None:
    """A 400 for tools no call could be made to as asked: arguments are a JSON object (OpenAI's
    rule for `parameters`), and a name picks one tool."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool["function"]
        kind = (function.get("parameters") or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema of an object (a call's "
                                f"arguments are a JSON object), not of type {kind!r}.", param="tools")
        if function["name"] in seen:
            raise APIError(400, f"tools[{i}]: two tools are named {function['name']!r}; tool names must be unique.",
                           param="tools")
        seen.add(function["name"])


def plan_tools(body: ChatCompletionRequest, auto_parser: str | None) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools. Raises APIError (400) with vLLM's
    messages. `auto_parser` is the server's --tool-call-parser when --enable-auto-tool-choice is on."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else []
    _check_tools(tools)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolPlan(tools, "none") if tools else None
    if not tools:
        raise APIError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict) or not function:
            raise APIError(400, f"Expected field `function` in `tool_choice`. {_USAGE}", param="tool_choice")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"Expected field `name` in `function` in `tool_choice`. {_USAGE}",
                           param="tool_choice")
        if choice.get("type", "function") != "function":
            raise APIError(400, f"`tool_choice.type` must be \"function\", got {choice.get('type')!r}. {_USAGE}",
                           param="tool_choice")
        if name not in names:
            raise APIError(400, "The tool specified in `tool_choice` does not match any of the specified `tools`",
                           param="tool_choice")
        plan = ToolPlan(tools, "named", function_name=name)
    elif choice in ("auto", "required"):
        plan = ToolPlan(tools, choice)
    else:
        raise APIError(400, f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                            f'"required" are supported.', param="tool_choice")
    plan.parallel = body.parallel_tool_calls is not False
    plan.cut_stays_length = body._cut_stays_length
    if plan.choice == "auto":
        if auto_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                'to be set', param="tool_choice")
        plan.parser_name = auto_parser
        plan.strict = any(t["function"].get("strict") for t in tools)
        constraint = _requested_constraint(body)
        if plan.strict or (constraint is not None and constraint.kind in ("json", "json_object")):
            plan.final_schema = _final_schema(body)
    elif _requested_constraint(body) is not None:
        raise APIError(400, "You can only either use guided decoding or tools, not both.", param="tool_choice")
    return plan
