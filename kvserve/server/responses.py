"""`POST /v1/responses`: OpenAI's Responses API (what the openai-agents SDK calls by default), on
the chat completions path.

A request's `instructions` and `input` (a string, or items: messages, `function_call`s and their
`function_call_output`s) become chat messages, after the conversation of `previous_response_id`
when given; `tools` (function tools), `tool_choice`, `text.format` (a JSON schema),
`max_output_tokens`, `temperature` and `top_p` map to their chat fields; the chat reply becomes
output items (a `message` with `output_text`, `function_call`s). Streaming sends the Responses
event types as the chat stream produces text and calls. `store` (on by default) keeps a response
and its conversation in memory, in an LRU of `MAX_STORED` entries, for `GET /v1/responses/{id}`
and `previous_response_id`. `background` (OpenAI's background mode, not streamed) answers at once
with the response `queued` and generates it in a task: poll `GET /v1/responses/{id}`, stop it with
`cancel`.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import Response

from kvserve.server.chat import ChatServing, chat_request
from kvserve.server.errors import APIError, error_type
from kvserve.server.protocol import OpenAIModel, is_off
from kvserve.server.serving import log_ignored_fields, logger
from kvserve.server.streaming import EventStreamResponse, sse_payloads
from kvserve.server.tools import plan_tools

MAX_STORED = 1024  # responses kept for previous_response_id and GET, least recently used dropped first
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the text's logprobs

# Responses fields that would change the answer and that kvserve does not implement: a 400 unless
# their value asks for nothing, with the reason (as chat's unsupported fields are refused).
_REFUSED = {
    "conversation": "the Conversations API is not built; continue with previous_response_id",
    "prompt": "stored prompt templates are not built; send instructions and input",
    "context_management": "server-side compaction is not built",
}


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None  # OUTPUT_LOGPROBS acts; the others name items kvserve never makes
    top_logprobs: int | None = None  # alternatives per token; asks for the text's logprobs as include does
    max_tool_calls: int | None = None  # bounds built-in tool calls, of which kvserve has none
    stream_options: dict[str, Any] | None = None  # include_obfuscation: kvserve's events carry no padding
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    reasoning: Any = None
    truncation: Literal["auto", "disabled"] | None = None

    def wants_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or []) or bool(self.top_logprobs)

    def refuse_unsupported(self) -> None:
        for name, reason in _REFUSED.items():
            value = getattr(self, name)
            if not (is_off(value) or (isinstance(value, dict) and all(is_off(v) for v in value.values()))):
                raise APIError(400, f"`{name}` is not supported by kvserve: {reason}.", param=name,
                               code="unsupported_parameter")


def _text_of(content: Any, where: str) -> str:
    """A message's content (or a tool's output) as text: a string, or input_text / output_text /
    text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}[{j}]: only text parts are supported, not {kind!r}.",
                               param="input")
            texts.append(str(part.get("text", "")))
        return "\n".join(texts)
    raise APIError(400, f"{where} must be a string or a list of text parts.", param="input")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages. Function calls join the assistant message before
    them (its text, then its calls: one turn, as the model wrote it); a call after a tool result or
    a user turn starts an assistant message of its own. A `reasoning` item (a reasoning model's
    earlier thinking) starts the assistant turn that follows it, as its `reasoning_content`."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        last = messages[-1] if messages else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer.", param="input")
            text = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant" and last is not None and last.get("thinking_only"):
                del last["thinking_only"]
                last["content"] = text
                continue
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise APIError(400, f"{where}.content must be a list of reasoning_text parts.", param="input")
            thinking = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            messages.append({"role": "assistant", "content": "", "reasoning_content": thinking, "thinking_only": True})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if last is not None and last["role"] == "assistant":
                last.pop("thinking_only", None)
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if output is not None and not isinstance(output, (str, list)):
                output = json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text_of("" if output is None else output, f"{where}.output")})
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported; use message, reasoning, function_call "
                                f"or function_call_output.", param="input")
    # thinking that no assistant text or call followed is dropped: no empty assistant turn
    return [m for m in messages if not m.pop("thinking_only", False)]


def strict_by_default(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool that leaves `strict` out (or null) is strict, as OpenAI's Responses
    API makes it (its Chat Completions tools are not); `"strict": false` opts out."""
    return {**tool, "strict": True if tool.get("strict") is None else tool["strict"]}


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type", "name", "parameters", ...}) in chat's nesting."""
    if not tools:
        return None
    result = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}.",
                           param="tools")
        result.append({"type": "function", "function": {k: v for k, v in strict_by_default(tool).items() if k in (
            "name", "description", "parameters", "strict") and v is not None}})
    return result


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format; other keys of `text` (`verbosity`) are logged as
    ignored, as unknown request fields are."""
    log_ignored_fields([f"text.{k}" for k in sorted(set(text or {}) - {"format"})])
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object.", param="text")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    raise APIError(400, f"text.format.type {fmt.get('type')!r} is not supported.", param="text")


def _message_item(text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _after_thinking(logprobs: list[dict[str, Any]], end_tag: str) -> list[dict[str, Any]] | None:
    """The answer's token logprobs: those after the thinking's end-tag token; None if it is not among them."""
    ends = [i for i, entry in enumerate(logprobs) if entry.get("token") == end_tag]
    return logprobs[ends[-1] + 1:] if ends else None


def _reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking (--reasoning-parser) as OpenAI's reasoning item, its text whole."""
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class _Detached:
    """What the chat path reads of a request, for one whose client has gone (background mode): its
    headers (priority, request id), and a receive that never reports a disconnect."""

    def __init__(self, headers: Any):
        self.headers = headers

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}


class ResponsesServing:
    def __init__(self, chat: ChatServing):
        self.chat = chat
        self.stored: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self.background: dict[str, asyncio.Future] = {}  # background responses still running, by id

    # ------------------------------------------------------------------ the store
    def get(self, response_id: str) -> dict[str, Any]:
        if response_id not in self.stored:
            raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
        self.stored.move_to_end(response_id)
        return self.stored[response_id][0]

    def cancel(self, response_id: str) -> dict[str, Any]:
        """Stop a background response still running (OpenAI's; its status becomes `cancelled`);
        idempotent."""
        task = self.background.pop(response_id, None)
        response = self.get(response_id)
        if task is not None:
            task.cancel()  # the chat path's stream closes: the engine aborts the request
            self._update(response_id, status="cancelled")
            return self.stored[response_id][0]
        if response["status"] == "cancelled":  # cancelling twice gives the cancelled response (OpenAI's)
            return response
        if not response.get("background"):
            raise APIError(400, "Only responses created with background=true can be cancelled; this one was "
                                "answered synchronously and has already completed.", param="response_id")
        raise APIError(400, f"The response has already finished (status {response['status']}); only a queued "
                            f"or in-progress background response can be cancelled.", param="response_id")

    def _store(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        """Keep it, forgetting the least recently used beyond MAX_STORED (never a background
        response still running: it must stay visible to GET and cancel)."""
        self.stored[response["id"]] = (response, messages)
        while len(self.stored) > MAX_STORED:
            oldest = next((key for key in self.stored if key not in self.background), None)
            if oldest is None:
                break
            del self.stored[oldest]

    # ------------------------------------------------------------------ create
    @staticmethod
    def _reasoning_effort(reasoning: Any) -> str | None:
        """OpenAI's `reasoning`: its effort goes to chat's reasoning_effort (a chat template that
        reads the variable takes it; others refuse it); a summary is refused: kvserve returns the
        thinking itself as the reasoning item's content (--reasoning-parser), and writes no summary."""
        if is_off(reasoning):
            return None
        if not isinstance(reasoning, dict):
            raise APIError(400, "`reasoning` must be an object (effort, summary).", param="reasoning")
        for name in ("summary", "generate_summary"):
            if not is_off(reasoning.get(name)):
                raise APIError(400, f"`reasoning.{name}` is not supported by kvserve: it writes no summaries; with "
                                    f"--reasoning-parser the thinking itself is the reasoning item's content.",
                               param=f"reasoning.{name}", code="unsupported_parameter")
        return reasoning.get("effort")

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        if body.background and body.stream:
            raise APIError(400, "`background` with `stream` is not supported by kvserve: create the response "
                                "in the background, then poll GET /v1/responses/{id}.", param="background")
        if body.background and not body.store:  # OpenAI's rule: a background response is fetched from the store
            raise APIError(400, "`background` requires `store` (the response is fetched from the store).",
                           param="background")
        body.refuse_unsupported()
        effort = self._reasoning_effort(body.reasoning)
        if (body.model_extra or {}).get("n") not in (None, 1):  # a chat field passed through: one output here
            raise APIError(400, "`n` must be 1 on /v1/responses: a response has one output; use "
                                "/v1/chat/completions for several choices.", param="n")
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            if body.previous_response_id not in self.stored:
                raise APIError(400, f"Previous response with id '{body.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            self.stored.move_to_end(body.previous_response_id)
            previous, history = self.stored[body.previous_response_id]
            if previous["status"] in ("queued", "in_progress"):
                raise APIError(400, f"Previous response with id '{body.previous_response_id}' is still "
                                    f"{previous['status'].replace('_', ' ')}: poll it until it has finished.",
                               param="previous_response_id")
            if previous["status"] in ("failed", "cancelled"):  # its conversation has no reply to go on from
                raise APIError(400, f"Previous response with id '{body.previous_response_id}' "
                                    f"{previous['status']}: it has no output to continue from.",
                               param="previous_response_id")
        conversation = history + input_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        fields = {
            "model": body.model, "tools": chat_tools(body.tools),
            "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body.text), "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "user": body.user, "stream": body.stream,
            **({"stream_options": {"include_usage": True}} if body.stream else {}),
            **({"logprobs": True, "top_logprobs": body.top_logprobs} if body.wants_logprobs() else {}),
            **({"reasoning_effort": effort} if effort is not None else {}),
            **(body.model_extra or {})}  # vLLM's extra sampling fields (top_k, seed, ...) pass through
        kept = await self._fit_context(fields, system, conversation) if body.truncation == "auto" else conversation
        chat_body = chat_request({**fields, "messages": system + kept})
        response_id = f"resp_{uuid.uuid4().hex}"
        base = self._response(body, response_id)
        if body.stream:
            reply = await self.chat.create(chat_body, request)
            return EventStreamResponse(self._events(reply, base, conversation, body.store), reply.on_close)
        if body.background:
            return self._start_background(body, base, chat_body, conversation, request)
        response = await self._complete(body, base, chat_body, conversation, request)
        return Response(json.dumps(response), media_type="application/json")

    def _start_background(self, body: ResponsesRequest, base: dict[str, Any], chat_body: Any,
                          conversation: list[dict[str, Any]], request: Request) -> Response:
        """OpenAI's background mode: answer at once with the response `queued`, generate it in a
        task (whose client is gone: it never disconnects), keep its state in the store for GET;
        `cancel` aborts it (the engine frees its blocks). A failure is the stored response's
        `error`, its status `failed`."""
        queued = dict(base, status="queued")
        self._store(queued, conversation)
        detached = _Detached(request.headers)

        async def run() -> None:
            self._update(queued["id"], status="in_progress")
            try:
                await self._complete(body, base, chat_body, conversation, detached)
            except asyncio.CancelledError:
                self._update(queued["id"], status="cancelled")
                raise
            except APIError as exc:
                self._update(queued["id"], status="failed",
                             error={"code": exc.code or error_type(exc.status), "message": str(exc)})
            except Exception as exc:  # the engine's or ours: reported on the response, logged here
                logger.exception("background response %s failed", queued["id"])
                self._update(queued["id"], status="failed",
                             error={"code": "server_error", "message": f"{type(exc).__name__}: {exc}"})
            finally:
                self.background.pop(queued["id"], None)

        self.background[queued["id"]] = asyncio.ensure_future(run())
        return Response(json.dumps(queued), media_type="application/json")

    async def finish_background(self, timeout: float) -> None:
        """At shutdown: let background responses still running finish for up to `timeout` seconds
        (--shutdown-timeout), then cancel the rest."""
        running = list(self.background.values())
        if running:
            logger.info("waiting up to %.0f s for %d background responses", timeout, len(running))
            _, late = await asyncio.wait(running, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)

    def _update(self, response_id: str, **fields: Any) -> None:
        if response_id in self.stored:
            response, messages = self.stored[response_id]
            self.stored[response_id] = (dict(response, **fields), messages)

    async def _complete(self, body: ResponsesRequest, base: dict[str, Any], chat_body: Any,
                        conversation: list[dict[str, Any]], request: Any) -> dict[str, Any]:
        """The response to a request that is not streamed, stored when asked."""
        reply = json.loads((await self.chat.create(chat_body, request)).body)
        choice = reply["choices"][0]
        message = choice["message"]
        output = [_reasoning_item(message["reasoning"])] if message.get("reasoning") else []
        if message.get("content") or not (message.get("tool_calls") or output):
            # the tokens' logprobs are the text's when no call was cut out of it
            logprobs = (choice.get("logprobs") or {}).get("content") if not message.get("tool_calls") else None
            if message.get("reasoning") and logprobs:
                logprobs = _after_thinking(logprobs, self.chat.reasoning.tags.end) or []
            output.append(_message_item(message.get("content") or "", logprobs=logprobs))
        output += [_call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
                   for c in message.get("tool_calls") or []]
        self._settle(output, choice["finish_reason"])
        response = self._finish(base, output, choice["finish_reason"], reply["usage"])
        if body.store:
            self._store(response, conversation + self._output_messages(output))
        return response

    async def _fit_context(self, fields: dict[str, Any], system: list[dict[str, Any]],
                           conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`truncation: "auto"` (OpenAI's): the conversation less as few of its first messages as make
        the prompt and the reply's max tokens fit the context, found by bisection over the places
        it may be cut (at a message, never between a call and its result); the instructions stay.
        Unchanged when it fits, or when no cut does (the chat path's 400 then says why)."""
        async def fits(start: int) -> bool:
            probe = chat_request({**fields, "messages": system + conversation[start:]})
            try:
                prompt = await self.chat.prompt(probe, plan_tools(probe, self.chat.tool_parser))
            except APIError as exc:
                if exc.code == "context_length_exceeded":
                    return False
                raise
            reply = probe.max_completion_tokens if probe.max_completion_tokens is not None else probe.max_tokens
            if reply is not None:  # a generation config's max_new_tokens caps it (serving.py)
                reply = self.chat.ctx.generation_defaults.cap(reply)
            return len(prompt) + (reply or 1) <= self.chat.ctx.tokens.max_model_len

        cuts = [i for i in range(1, len(conversation)) if conversation[i]["role"] != "tool"]
        if await fits(0) or not cuts or not await fits(cuts[-1]):
            return conversation
        low, high = 0, len(cuts) - 1  # the first cut that fits
        while low < high:
            middle = (low + high) // 2
            if await fits(cuts[middle]):
                high = middle
            else:
                low = middle + 1
        logger.info("truncation auto: the first %d of %d conversation messages dropped to fit the context",
                    cuts[low], len(conversation))
        return conversation[cuts[low]:]

    def _response(self, body: ResponsesRequest, response_id: str) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "model": self.chat.ctx.model_name, "output": [], "error": None, "incomplete_details": None,
                "instructions": body.instructions, "tools": [strict_by_default(t) for t in body.tools or []],
                "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
                "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "previous_response_id": body.previous_response_id, "store": body.store,
                "truncation": body.truncation or "disabled",
                "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
                "usage": None, "user": body.user, "background": body.background}

    @staticmethod
    def _settle(output: list[dict[str, Any]], finish_reason: str | None) -> None:
        """Every output item's final status: the last one is `incomplete` when max_output_tokens
        cut the reply (as OpenAI marks the item it stopped in), the others `completed`."""
        for item in output:
            item["status"] = "completed"
        if output and finish_reason == "length":
            output[-1]["status"] = "incomplete"

    @staticmethod
    def _finish(base: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None,
                usage: dict[str, Any] | None) -> dict[str, Any]:
        response = dict(base, output=output, status="completed")
        if finish_reason == "length":
            response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        if usage is not None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            response["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                                 "total_tokens": usage["total_tokens"],
                                 "input_tokens_details": {"cached_tokens": cached},
                                 "output_tokens_details": {"reasoning_tokens": (
                                     usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}}
        return response

    @staticmethod
    def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A response's output items as the chat messages a follow-up continues from."""
        return input_messages([{k: v for k, v in item.items() if k not in ("id", "status")} for item in output])

    async def _events(self, reply: Response, base: dict[str, Any], conversation: list[dict[str, Any]],
                      store: bool) -> AsyncIterator[str]:
        """The chat stream re-told as Responses events (each with its sequence number)."""
        sequence = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence
            data = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        text_item: dict[str, Any] | None = None
        thinking_item: dict[str, Any] | None = None  # a reasoning model's (--reasoning-parser)
        text, thinking, answered = "", "", False
        text_logprobs: list[dict[str, Any]] = []
        pending_logprobs: list[dict[str, Any]] = []  # tokens whose text is not out yet (a split character)
        calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its output item
        output: list[dict[str, Any]] = []
        finish_reason, usage = None, None
        thinking_open = False

        def close_thinking(status: str) -> list[str]:
            """The reasoning item's closing events: when the next item opens (as OpenAI finishes
            each item before the next; the openai-agents SDK reports the reasoning item then), or
            at the end."""
            nonlocal thinking_open
            thinking_open = False
            index = output.index(thinking_item)
            thinking_item.update(status=status, content=[{"type": "reasoning_text", "text": thinking}])
            return [event("response.reasoning_text.done", item_id=thinking_item["id"], output_index=index,
                          content_index=0, text=thinking),
                    event("response.output_item.done", output_index=index, item=thinking_item)]

        def open_message() -> list[str]:
            """The text's message item opening."""
            nonlocal text_item
            text_item = _message_item("", status="in_progress")
            text_item["content"] = []
            output.append(text_item)
            return [event("response.output_item.added", output_index=len(output) - 1, item=text_item),
                    event("response.content_part.added", item_id=text_item["id"], output_index=len(output) - 1,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

        async for chunk in sse_payloads(reply):
            if "error" in chunk and "choices" not in chunk:  # the engine failed: OpenAI's response.failed
                for item in output:
                    item["status"] = "incomplete"
                if thinking_item is not None:
                    thinking_item["content"] = [{"type": "reasoning_text", "text": thinking}]
                if text_item is not None:
                    text_item["content"] = [{"type": "output_text", "text": text, "annotations": [],
                                             "logprobs": text_logprobs}]
                error = chunk["error"]
                failed = dict(base, output=output, status="failed",
                              error={"code": error.get("code") or error.get("type") or "server_error",
                                     "message": error.get("message") or "the response failed"})
                if store:  # kept for GET; previous_response_id on it is refused (no reply to go on from)
                    self._store(failed, conversation)
                yield event("response.failed", response=failed)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                finish_reason = choice.get("finish_reason") or finish_reason
                entries = (choice.get("logprobs") or {}).get("content") or []
                if (thinking_item is not None or delta.get("reasoning")) and not answered:  # thinking: not the text's
                    after = _after_thinking(entries, self.chat.reasoning.tags.end)
                    entries, answered = (after, True) if after is not None else ([], False)
                elif self.chat.reasoning is not None and not answered:  # an output's own opening <think>
                    entries = [e for e in entries if e.get("token") != self.chat.reasoning.tags.start]
                pending_logprobs += entries
                if delta.get("reasoning"):
                    if thinking_item is None:
                        thinking_item, thinking_open = _reasoning_item("", status="in_progress"), True
                        output.append(thinking_item)
                        yield event("response.output_item.added", output_index=len(output) - 1, item=thinking_item)
                    thinking += delta["reasoning"]
                    yield event("response.reasoning_text.delta", item_id=thinking_item["id"],
                                output_index=output.index(thinking_item), content_index=0, delta=delta["reasoning"])
                if delta.get("content"):
                    if text_item is None:
                        for line in (close_thinking("completed") if thinking_open else []) + open_message():
                            yield line
                    text += delta["content"]
                    logprobs, pending_logprobs = pending_logprobs, []
                    text_logprobs += logprobs
                    yield event("response.output_text.delta", item_id=text_item["id"],
                                output_index=output.index(text_item), content_index=0, delta=delta["content"],
                                logprobs=logprobs)
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    if call["index"] not in calls:
                        for line in close_thinking("completed") if thinking_open else ():
                            yield line
                        item = _call_item(call.get("id"), function.get("name"), "", status="in_progress")
                        calls[call["index"]] = item
                        output.append(item)
                        yield event("response.output_item.added", output_index=len(output) - 1, item=item)
                    item = calls[call["index"]]
                    if function.get("arguments"):
                        item["arguments"] += function["arguments"]
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=output.index(item), delta=function["arguments"])
        for line in open_message() if not output else ():  # an empty reply: an empty message, as not streamed
            yield line
        self._settle(output, finish_reason)
        for index, item in enumerate(output):
            if item is thinking_item:
                for line in close_thinking(item["status"]) if thinking_open else ():
                    yield line
                continue
            if item is text_item:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": text_logprobs}
                item["content"] = [part]
                yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=text_logprobs)
                yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part)
            else:
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        response = self._finish(base, output, finish_reason, usage)
        if store:
            self._store(response, conversation + self._output_messages(output))
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                    response=response)
