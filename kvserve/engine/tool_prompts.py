"""Tool conversations in the prompt: tool definitions, assistant `tool_calls` and `tool` results.

A chat template that knows about tools gets them as transformers expects (`tools=` and messages
with `tool_calls`, arguments as objects). A template that does not (the default SmolLM2's just
concatenates `content`) would silently drop them, so kvserve writes them into the turns instead,
in the hermes text format that `--tool-call-parser hermes` reads back:

- the definitions go at the end of the system turn (one is added when the conversation has none):
  a short instruction, then one JSON definition per line between `<tools>` and `</tools>`;
- each call becomes `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after the
  assistant turn's text;
- consecutive `tool` messages become one user turn, each result as
  `<tool_response>\\n...\\n</tool_response>`.

Call arguments may come as JSON text (OpenAI's wire format) or as objects; templates get objects.
"""
from __future__ import annotations

import json
import re
from typing import Any

TOOLS_INSTRUCTION = (
    "# Tools\n\n"
    "You may call one or more of the functions below to help with the user's request. Their "
    "definitions, one JSON object per line, are inside <tools></tools>:\n"
    "<tools>\n{definitions}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call>, one block per call:\n"
    "<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n</tool_call>"
)


def template_handles(template: str | None) -> tuple[bool, bool]:
    """(renders `tools` definitions, renders assistant `tool_calls`) for a chat template's source."""
    text = template if isinstance(template, str) else json.dumps(template or "")
    return re.search(r"\btools\b", text) is not None, "tool_calls" in text


def _arguments_object(arguments: Any) -> Any:
    """Arguments as an object: JSON text is decoded (text that is not JSON stays as it is)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{**call, "function": {**call["function"], "arguments": _arguments_object(call["function"].get("arguments"))}}
             for call in message["tool_calls"]]
    return {**message, "tool_calls": calls}


def tool_call_text(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _calls_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = []
    results_turn: dict[str, Any] | None = None  # the user turn that collects consecutive tool results
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if results_turn is None:
                results_turn = {"role": "user", "content": block}
                result.append(results_turn)
            else:
                results_turn["content"] += "\n" + block
            continue
        results_turn = None
        turn = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        calls = [tool_call_text(c["function"]["name"], c["function"]["arguments"])
                 for c in message.get("tool_calls") or []]
        if calls:
            turn["content"] = "\n".join(([turn["content"]] if turn.get("content") else []) + calls)
        result.append(turn)
    return result


def _tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    definitions = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    block = TOOLS_INSTRUCTION.format(definitions=definitions)
    if messages and messages[0]["role"] in ("system", "developer"):
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{block}" if first.get("content") else block
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def render_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    template: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to hand to the chat template: as they are where the template renders them,
    else written into the turns in the hermes format."""
    renders_tools, renders_calls = template_handles(template)
    messages = [_with_argument_objects(m) for m in messages]
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if has_calls and not renders_calls:
        messages = _calls_as_text(messages)
    if tools and not renders_tools:
        return _tools_in_system(messages, tools), None
    return messages, tools or None
