"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API (what the
anthropic SDK, Claude Code and agent frameworks built on them send), on the chat completions path,
as vLLM and llama.cpp's servers serve it.

The request's `system` and `messages` (text, `tool_use` and `tool_result` blocks) become chat
messages; `tools` (`input_schema`), `tool_choice` (auto, any, tool, none), `stop_sequences`,
`max_tokens`, `temperature`, `top_p`, `top_k` and `output_config.format` map to their chat fields.
The chat reply becomes content blocks (`text`, then `tool_use`), its finish reason a `stop_reason`;
streaming re-tells the chat stream as Anthropic's events (message_start, one content block at a
time, message_delta, message_stop). Errors on these paths have Anthropic's body (errors.py).

Choices where the API leaves room (README, "Anthropic Messages API"): `max_tokens` past the context
is cut to the room left and such a stop says `model_context_window_exceeded`, as Anthropic's newer
models answer; `usage.input_tokens` excludes the prefix-cache hits, which are
`cache_read_input_tokens`; `cache_control` marks need nothing (every full block is cached);
`thinking` and `output_config.effort` ask nothing of a model that does not think; a reasoning model
served with --reasoning-parser answers with a `thinking` block first (its `signature` empty: there
is nothing to verify) of at most `thinking.budget_tokens` tokens (chat's `thinking_token_budget`),
unless `thinking.type` is "disabled" (then a template that can switch
thinking off, Qwen3's `enable_thinking`, is told to), and an earlier turn's thinking block
is that turn's `reasoning_content` for the template; a Claude Code billing-header system block,
new text every request, is dropped so it does not defeat the prefix cache (vLLM drops it too).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from kvserve.server.chat import ChatServing, chat_request
from kvserve.server.errors import APIError, anthropic_error_type
from kvserve.server.protocol import ChatCompletionRequest, OpenAIModel, is_off
from kvserve.server.serving import log_ignored_fields

from kvserve.server.streaming import EventStreamResponse, sse_payloads
from kvserve.server.tools import plan_tools

# Anthropic fields that would change the answer and that kvserve cannot honour: a 400 unless off.
_REFUSED = {
    "mcp_servers": "kvserve does not call MCP servers; pass their tools as client tools",
    "container": "kvserve runs no code-execution containers",
}
# vLLM's extra request fields, taken from a body as /v1/chat/completions takes them; other unknown
# keys are logged as ignored (chat-only ones, `echo` or `logprobs`, have no place in a message).
_CHAT_EXTRAS = ("seed", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                "min_tokens", "stop_token_ids", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
                "cache_salt", "kv_eviction", "chat_template_kwargs", "chat_template", "priority",
                "allowed_token_ids", "bad_words")
# Roles Claude Code sends beside user and assistant (vLLM reads them as user turns).
_USER_ROLES = ("user", "ctx", "msg")
# The first system block Claude Code sends, different on every request (a per-request hash).
_BILLING_HEADER = "x-anthropic-billing-header:"


class MessagesRequest(OpenAIModel):
    model: str | None = None
    max_tokens: int | None = None  # required on /v1/messages (checked there), absent on count_tokens
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's spelling of output_config.format
    # Accepted, and they ask for nothing kvserve does not do (see the module docstring).
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    context_management: dict[str, Any] | None = None  # a hint to clear old tool results; the prompt is kept whole
    mcp_servers: Any = None
    container: Any = None

    def refuse_unsupported(self) -> None:
        for name, reason in _REFUSED.items():
            if not is_off(getattr(self, name)):
                raise APIError(400, f"`{name}` is not supported by kvserve: {reason}.", param=name)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise APIError(400, f"{where} must be a string or a list of content blocks.", param="messages")
    return content


def _block_text(block: dict[str, Any], where: str) -> str:
    if block.get("type") != "text":
        raise APIError(400, f"{where}: a {block.get('type')!r} block is not supported here; kvserve reads text "
                            f"blocks, and tool_use, tool_result and thinking blocks where Anthropic's API puts "
                            f"them (images, documents and server tools' blocks are not served).", param="messages")
    if not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}.text must be a string.", param="messages")
    return block["text"]


def _text(content: Any, where: str) -> str:
    """Text blocks (or a string) as one text, joined by newlines as the chat path joins parts."""
    return "\n".join(_block_text(block, f"{where}[{j}]") for j, block in enumerate(_blocks(content, where)))


def _string(block: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(block.get(key), str):
        raise APIError(400, f"{where}.{key} must be a string.", param="messages")
    return block[key]


def system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    texts = [_block_text(block, f"system[{j}]") for j, block in enumerate(_blocks(system, "system"))]
    return "\n".join(text for text in texts if not text.startswith(_BILLING_HEADER))


def _tool_message(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", where), "content": text}


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The system prompt, then each message as chat turns: a user message's tool results first, as
    tool messages right after the assistant turn that made the calls, then its text; an assistant
    message's text, then its `tool_use` blocks as tool calls; a system message a system turn where
    it stands (vLLM moves it into the system prompt, which changes the prompt's start and so
    misses the prefix cache for the whole conversation). Thinking blocks are dropped (no template
    here renders them)."""
    system = system_text(body.system)
    turns: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    if not body.messages:
        raise APIError(400, "messages: at least one message is required.", param="messages")
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        role, content = message.get("role"), message.get("content")
        if role == "system":
            turns.append({"role": "system", "content": _text(content, where)})
        elif role in _USER_ROLES:
            texts = []
            for j, block in enumerate(_blocks(content, where)):
                if block.get("type") == "tool_result":
                    turns.append(_tool_message(block, f"{where}[{j}]"))
                else:
                    texts.append(_block_text(block, f"{where}[{j}]"))
            if texts:
                turns.append({"role": "user", "content": "\n".join(texts)})
        elif role == "assistant":
            texts, calls, thoughts = [], [], []
            for j, block in enumerate(_blocks(content, where)):
                kind = block.get("type")
                if kind == "thinking" and isinstance(block.get("thinking"), str):
                    thoughts.append(block["thinking"])
                elif kind == "tool_use":
                    arguments = block.get("input", {})
                    if not isinstance(arguments, dict):
                        raise APIError(400, f"{where}[{j}].input must be an object.", param="messages")
                    calls.append({"id": _string(block, "id", f"{where}[{j}]"), "type": "function", "function": {
                        "name": _string(block, "name", f"{where}[{j}]"), "arguments": arguments}})
                elif kind not in ("thinking", "redacted_thinking"):
                    texts.append(_block_text(block, f"{where}[{j}]"))
            turns.append({"role": "assistant", "content": "\n".join(texts), **({"tool_calls": calls} if calls else {}),
                          **({"reasoning_content": "\n".join(thoughts)} if thoughts else {})})
        else:
            raise APIError(400, f"messages[{i}].role must be user, assistant or system, not {role!r}.",
                           param="messages")
    if not turns:
        raise APIError(400, "messages: the conversation is empty (no text, tool use or tool result in it).",
                       param="messages")
    return turns


def is_prefill(messages: list[dict[str, Any]]) -> bool:
    """A final assistant message (without tool calls) is a prefill: the reply continues it."""
    return messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    result = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: server tools ({tool.get('type')!r}) are not supported; kvserve "
                                f"serves client tools (name, description, input_schema).", param="tools")
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}].name must be a string.", param="tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise APIError(400, f"tools[{i}].input_schema: a JSON schema object is required.", param="tools")
        function = {"name": tool.get("name"), "parameters": {"type": "object", **schema}}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        result.append({"type": "function", "function": function})
    return result


def thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """`thinking: {"type": "enabled", "budget_tokens": N}`: N, the thinking's cap (Anthropic's
    API wants N >= 1024; any N >= 0 is taken, for small local models)."""
    if not thinking or thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
        return None
    budget = thinking["budget_tokens"]
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise APIError(400, f"thinking.budget_tokens must be an integer >= 0, got {budget!r}.", param="thinking")
    return budget


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """Anthropic's tool_choice as chat's, and parallel_tool_calls (False with disable_parallel_tool_use)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        if not choice.get("name"):
            raise APIError(400, "tool_choice.name is required with type \"tool\".", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none, not {kind!r}.", param="tool_choice")


def response_format(body: MessagesRequest) -> dict[str, Any] | None:
    if body.output_format is not None and (body.output_config or {}).get("format") is not None:
        raise APIError(400, "Give output_config.format or output_format, not both.", param="output_config")
    fmt = body.output_format or (body.output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}.',
                       param="output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def stop_reason(finish_reason: str | None, matched: Any, called: bool, output_tokens: int,
                max_tokens: int) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from chat's finish reason, the stop string it matched and
    whether the reply made tool calls (a forced call, which chat ends with "stop", too)."""
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if finish_reason == "length":  # short of max_tokens: the context filled first
        return ("max_tokens" if output_tokens >= max_tokens else "model_context_window_exceeded"), None
    return ("tool_use" if called else "end_turn"), None


def anthropic_usage(chat_usage: dict[str, Any] | None) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, the prefix-cache hits are
    `cache_read_input_tokens` (the three add up to the prompt)."""
    chat_usage = chat_usage or {}
    prompt = chat_usage.get("prompt_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt - cached, "output_tokens": chat_usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def sse_event(kind: str, **fields: Any) -> str:
    """One Anthropic stream event: its type on the `event:` line and in the data."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


def error_event(status: int, message: str) -> str:
    """An error after the stream started (then the stream ends; Anthropic sends no [DONE])."""
    return sse_event("error", error={"type": anthropic_error_type(status), "message": message})


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use `input`, an object; arguments max_tokens cut off are `{}`."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat

    def _chat_body(self, body: MessagesRequest, max_tokens: int | None) -> ChatCompletionRequest:
        body.refuse_unsupported()
        self.chat.ctx.check_model(body.model)
        extra = body.model_extra or {}
        if extra.get("n") not in (None, 1):  # a chat field: a message is one reply
            raise APIError(400, "`n` must be 1 on /v1/messages: a message is one reply; use /v1/chat/completions "
                                "for several choices.", param="n")
        user = (body.metadata or {}).get("user_id")
        if user is not None and not isinstance(user, str):
            raise APIError(400, "metadata.user_id must be a string.", param="metadata")
        messages = chat_messages(body)
        prefill = is_prefill(messages)
        choice, parallel = chat_tool_choice(body.tool_choice)
        log_ignored_fields(sorted(set(extra) - set(_CHAT_EXTRAS)))
        thinking_off = (body.thinking or {}).get("type") == "disabled"
        budget = thinking_budget(body.thinking) if self.chat.reasoning is not None else None
        fields = {
            **{name: extra[name] for name in _CHAT_EXTRAS if name in extra},
            "model": body.model, "messages": messages, "tools": chat_tools(body.tools), "tool_choice": choice,
            "parallel_tool_calls": parallel, "response_format": response_format(body), "max_tokens": max_tokens,
            "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
            "user": user, "stream": body.stream,
            "add_generation_prompt": not prefill, "continue_final_message": prefill,
            "include_reasoning": not thinking_off,
            **({"thinking_token_budget": budget} if budget is not None else {}),
            # disabled: templates that can switch thinking off (Qwen3's enable_thinking) do, unless
            # the request's own chat_template_kwargs say otherwise
            **({"chat_template_kwargs": {"enable_thinking": False, **(extra.get("chat_template_kwargs") or {})}}
               if thinking_off else {}),
            **({"stream_options": {"include_usage": True, "continuous_usage_stats": True}} if body.stream else {})}
        return chat_request(fields)

    async def count_tokens(self, body: MessagesRequest) -> dict[str, int]:
        """The prompt's tokens as /v1/messages renders it: system, tools and messages."""
        chat_body = self._chat_body(body.model_copy(update={"stream": False}), None)
        if chat_body.tools and chat_body.tool_choice != "none":
            chat_body.tool_choice = "none"  # the tools are rendered the same; no parser is needed to count
        prompt = await self.chat.prompt(chat_body, plan_tools(chat_body, self.chat.tool_parser))
        return {"input_tokens": len(prompt)}

    async def create(self, body: MessagesRequest, request: Request) -> Response:
        if body.max_tokens is None:
            raise APIError(400, "max_tokens: Field required.", param="max_tokens")
        chat_body = self._chat_body(body, body.max_tokens)
        message_id = f"msg_{uuid.uuid4().hex}"
        reply = await self.chat.create(chat_body, request, fit_context=True)
        # what the reply may reach: a generation config's max_new_tokens caps it (serving.py)
        max_tokens = self.chat.ctx.generation_defaults.cap(body.max_tokens)
        if body.stream:
            return EventStreamResponse(self._events(reply, message_id, max_tokens), reply.on_close)
        chat = json.loads(reply.body)
        choice = chat["choices"][0]
        text, calls = choice["message"].get("content") or "", choice["message"].get("tool_calls") or []
        thinking = choice["message"].get("reasoning")
        content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
        content += [{"type": "text", "text": text}] if text or not (calls or content) else []
        content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                     "input": _input(c["function"]["arguments"])} for c in calls]
        usage = anthropic_usage(chat["usage"])
        reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(calls),
                                       usage["output_tokens"], max_tokens)
        return Response(json.dumps({"id": message_id, "type": "message", "role": "assistant",
                                    "model": self.chat.ctx.model_name, "content": content, "stop_reason": reason,
                                    "stop_sequence": sequence, "usage": usage}), media_type="application/json")

    async def _events(self, reply: Response, message_id: str, max_tokens: int) -> AsyncIterator[str]:
        """The chat stream re-told as Anthropic's events: each content block opened, filled and
        closed before the next one opens, with contiguous indices."""
        blocks = 0  # content blocks opened so far
        open_block: Any = None  # "text", a chat tool-call index, or None
        finish_reason, matched, usage = None, None, None
        started = called = False

        def close() -> str:
            nonlocal open_block
            # a thinking block ends with its signature, as Anthropic's do (empty: nothing to verify)
            signed = (sse_event("content_block_delta", index=blocks - 1,
                                delta={"type": "signature_delta", "signature": ""}) if open_block == "thinking" else "")
            open_block = None
            return signed + sse_event("content_block_stop", index=blocks - 1)

        async for chunk in sse_payloads(reply):
            if "error" in chunk and "choices" not in chunk:
                error = chunk["error"]
                yield error_event(500 if error.get("type") == "server_error" else 400, error.get("message"))
                return
            usage = chunk.get("usage") or usage
            if not started:
                yield sse_event("message_start", message={
                    "id": message_id, "type": "message", "role": "assistant", "model": self.chat.ctx.model_name,
                    "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {**anthropic_usage(usage), "output_tokens": 0}})
                started = True
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                finish_reason = choice.get("finish_reason") or finish_reason
                matched = choice.get("stop_reason") if choice.get("finish_reason") else matched
                if delta.get("reasoning"):
                    if open_block != "thinking":
                        if open_block is not None:
                            yield close()
                        yield sse_event("content_block_start", index=blocks,
                                        content_block={"type": "thinking", "thinking": "", "signature": ""})
                        blocks, open_block = blocks + 1, "thinking"
                    yield sse_event("content_block_delta", index=blocks - 1,
                                    delta={"type": "thinking_delta", "thinking": delta["reasoning"]})
                # Text after a call is chat's stream retelling, as text, an auto call max_tokens cut
                # off (README): its tool_use block already went out, so it is not sent twice.
                if delta.get("content") and not called:
                    if open_block != "text":
                        if open_block is not None:
                            yield close()
                        yield sse_event("content_block_start", index=blocks, content_block={"type": "text", "text": ""})
                        blocks, open_block = blocks + 1, "text"
                    yield sse_event("content_block_delta", index=blocks - 1,
                                    delta={"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    if call.get("index") != open_block:
                        if open_block is not None:
                            yield close()
                        yield sse_event("content_block_start", index=blocks, content_block={
                            "type": "tool_use", "id": call.get("id"), "name": function.get("name"), "input": {}})
                        blocks, open_block, called = blocks + 1, call.get("index"), True
                    if function.get("arguments"):
                        yield sse_event("content_block_delta", index=blocks - 1,
                                        delta={"type": "input_json_delta", "partial_json": function["arguments"]})
        if open_block is not None:
            yield close()
        if blocks == 0:  # an empty reply has one empty text block, as the JSON answer has
            yield sse_event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield sse_event("content_block_stop", index=0)
        final = anthropic_usage(usage)
        reason, sequence = stop_reason(finish_reason, matched, called, final["output_tokens"], max_tokens)
        yield sse_event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=final)
        yield sse_event("message_stop")
