"""POST /v1/chat/completions: the messages go through the tokenizer's chat template; one engine
request with `n` samples; JSON or SSE `chat.completion.chunk`s (a role delta first, then content
or tool-call deltas, the finish reason on each choice's last chunk). With `tools`, the request's
tool plan (tools.py) constrains the output and reads it back as `tool_calls` (tool_stream.py)."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, AsyncIterator

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from kvserve.outputs import CompletionOutput, SampleLogprobs, sampled_logprob, top_logprobs
from kvserve.sampling_params import SamplingParams
from kvserve.server.engine_loop import EngineError, PromptSpec, RequestStream
from kvserve.server.errors import APIError
from kvserve.server.prompt_logprobs import prompt_logprobs_field
from kvserve.server.prompts import Tokenization, conversation
from kvserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, DeltaMessage,
                                     TokenLogprob, TopLogprob, template_fields)
from kvserve.server.reasoning import ReasoningParser, ThinkingBudget
from kvserve.server.request_id import request_ids
from kvserve.server.serving import ServingContext, StreamState, usage
from kvserve.server.streaming import DONE, EventStreamResponse, sse, sse_error, unless_disconnected
from kvserve.server.tool_stream import ToolDeltas, final_message
from kvserve.server.tools import ToolPlan, plan_tools


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's fields map to (/v1/responses, /v1/messages); a field they
    fill wrongly (a tool without a name, say) is a 400 naming it, as it would be on the chat API."""
    try:
        body = ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}" if where else first["msg"],
                       param=str(first["loc"][0]) if first["loc"] else None) from None
    body._cut_stays_length = True
    return body


def chat_logprobs(tokens: Tokenization, entries: SampleLogprobs, k: int, as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat logprobs: each sampled token (its entry's first) with the k most likely.
    `as_ids`: tokens named "token_id:N" (Tokenization.token_name); `bytes` stay the text's."""
    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=tokens.token_name(token_id, as_ids), logprob=logprob,
                          bytes=list(tokens.token_text(token_id).encode("utf-8")))

    content = []
    for entry in entries:
        token, sampled = sampled_logprob(entry)
        alternatives = [top(t, e.logprob) for t, e in top_logprobs(entry, k)]
        content.append(TokenLogprob(**top(token, sampled.logprob).model_dump(), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


def requested_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.logprobs:
        return body.top_logprobs or 0
    if body.top_logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
    return None


def assistant_message(plan: ToolPlan | None, output: CompletionOutput) -> tuple[AssistantMessage, str | None]:
    """A finished choice's message and finish reason (tool calls read from the text when the
    request's tool plan expects them)."""
    reader = plan.reader() if plan is not None else None
    if reader is None:
        return AssistantMessage(content=output.text), output.finish_reason
    message = final_message(reader, output.text, forced=plan.choice in ("named", "required"),
                            max_calls=None if plan.parallel else 1)
    return (AssistantMessage(content=message.content, tool_calls=message.tool_calls),
            plan.finish_reason(output.finish_reason, bool(message.tool_calls)))


def echoed_content(body: ChatCompletionRequest, messages: list[dict]) -> str:
    """What `echo` puts before the reply (vLLM's rule): the last message's text when that message
    is the assistant's, the role the reply continues; else nothing."""
    if not body.echo or messages[-1].get("role") != "assistant":
        return ""
    return messages[-1].get("content") or ""


class ChatServing:
    def __init__(self, ctx: ServingContext, tool_parser: str | None = None, reasoning: ReasoningParser | None = None):
        self.ctx = ctx
        self.tool_parser = tool_parser  # --tool-call-parser, set when --enable-auto-tool-choice is on
        self.reasoning = reasoning  # --reasoning-parser (reasoning.py)

    async def prompt(self, body: ChatCompletionRequest, plan: ToolPlan | None) -> list[int]:
        """The request's messages (and tools) through the chat template, tokenized."""
        return await self.ctx.tokens.chat_prompt(conversation(body.messages), body.add_generation_prompt,
                                                 plan.tools if plan is not None else None,
                                                 body.continue_final_message, body.chat_template_kwargs,
                                                 body.chat_template,
                                                 truncating=body.truncate_prompt_tokens is not None,
                                                 add_special_tokens=body.add_special_tokens,
                                                 fields=template_fields(body))

    async def create(self, body: ChatCompletionRequest, request: Request, fit_context: bool = False) -> Response:
        """`fit_context` (Anthropic's context rules): a max_tokens past the context is cut to the
        room the prompt leaves, as Anthropic's newer models answer (OpenAI's API and vLLM refuse
        it, the default), and a prompt that leaves no room is refused in Anthropic's words, which
        its clients (Claude Code's context compaction) look for."""
        ctx = self.ctx
        ctx.check_fields(body)
        self._check_thinking_budget(body)
        priority = ctx.priority(request, body.priority)
        plan = plan_tools(body, self.tool_parser)
        messages = conversation(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # No max_tokens: up to the rest of the context (vLLM's default for chat).
        params = ctx.sampling_params(body, max_tokens, requested_logprobs(body), 1)
        if plan is not None and (constraint := plan.structured_outputs()) is not None:
            params = dataclasses.replace(params, structured_outputs=constraint)
        # A client that leaves while its prompt waits for the tokenizer drops the job.
        prompt_ids = ctx.truncated(await unless_disconnected(self.prompt(body, plan), request),
                                   body.truncate_prompt_tokens)
        thinks = self.reasoning is not None and self.reasoning.thinks_after(prompt_ids, body.continue_final_message,
                                                                            messages[-1].get("content") or "")
        if thinks and params.structured_outputs is not None:  # the constraint is the answer's
            params = dataclasses.replace(params, structured_outputs=dataclasses.replace(
                params.structured_outputs, starts_after_token_id=self.reasoning.end_id))
        if body.thinking_token_budget is not None:
            continued = thinks and body.continue_final_message  # its open thinking counts too
            spent = ThinkingBudget.thinking_in(prompt_ids, self.reasoning) if continued else 0
            params = dataclasses.replace(params, logits_processors=[
                *params.logits_processors, ThinkingBudget(self.reasoning, body.thinking_token_budget, thinks, spent)])
        if fit_context:
            params = self._fit_context(params, len(prompt_ids))
        echoed = echoed_content(body, messages)
        request_id, engine_id = request_ids("chatcmpl-", request, body.request_id)
        stream = await ctx.submit([PromptSpec(prompt_ids, params, body.cache_salt, priority)], engine_id,
                                  streaming=body.stream)
        created = int(time.time())
        if body.stream:
            return EventStreamResponse(self._events(body, plan, prompt_ids, stream, request_id, created,
                                                    echoed, thinks), stream.close)
        try:
            [output] = await ctx.final_outputs(stream, request)
        finally:
            stream.close()
        choices = []
        for c in output.outputs:
            thinking, choice_thinks = None, self._thinks(thinks, c)
            if choice_thinks:  # the tool plan reads the answer only
                thinking, answer, _ = self.reasoning.split(c.text, final=True)
                c = dataclasses.replace(c, text=answer)
            message, finish_reason = assistant_message(plan, c)
            if choice_thinks:
                message.reasoning = thinking if body.include_reasoning else None
                if not message.tool_calls:  # nothing after the thinking: no answer (vLLM's null)
                    message.content = message.content or None
            if echoed:
                message.content = echoed + (message.content or "")
            choices.append(ChatChoice(index=c.index, message=message,
                                      logprobs=chat_logprobs(ctx.tokens, c.logprobs, body.top_logprobs or 0,
                                                             ctx.tokens_as_ids(body))
                                      if c.logprobs is not None else None,
                                      finish_reason=finish_reason, stop_reason=c.stop_reason,
                                      token_ids=list(c.token_ids) if body.return_token_ids else None))
        response = ChatCompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices,
            usage=usage([len(prompt_ids)], sum(len(c.token_ids) for c in output.outputs), output.num_cached_tokens,
                        self._reasoning_tokens(output.outputs, thinks)),
            prompt_logprobs=prompt_logprobs_field(output.prompt_logprobs),
            prompt_token_ids=prompt_ids if body.return_token_ids else None)
        return Response(response.model_dump_json(), media_type="application/json")

    def _fit_context(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """`create`'s fit_context: max_tokens cut to the room the prompt leaves; a prompt that
        leaves none refused in Anthropic's words. A sequence under KV eviction is not bounded by
        the context (the engine checks it), so it is left as it is."""
        try:
            evicting = self.ctx.engine.engine.resolve_eviction(params.kv_eviction) is not None
        except ValueError:
            return params  # a bad kv_eviction: the engine's check answers it
        if evicting:
            return params
        room = self.ctx.max_model_len - prompt_len
        if room < 1:
            raise APIError(400, f"prompt is too long: {prompt_len} tokens > {self.ctx.max_model_len - 1} maximum",
                           param="messages", code="context_length_exceeded")
        if params.min_tokens > room:
            raise APIError(400, f"min_tokens ({params.min_tokens}) is more than the context leaves after the "
                                f"prompt ({room} tokens).", param="min_tokens")
        if params.max_tokens is not None and room < params.max_tokens:
            return dataclasses.replace(params, max_tokens=room)
        return params

    def _check_thinking_budget(self, body: ChatCompletionRequest) -> None:
        """`thinking_token_budget` (a ThinkingBudget processor, after the request's own) needs a
        parser that tells thinking from answer."""
        if body.thinking_token_budget is not None and self.reasoning is None:
            raise APIError(400, "thinking_token_budget needs a reasoning model served with --reasoning-parser "
                                "(this server does not tell thinking from answer).", param="thinking_token_budget")

    def _thinks(self, thinks: bool, choice: CompletionOutput) -> bool:
        """Whether a choice's output starts as thinking: after a prompt that left it open (`thinks`)
        or when the output opens it itself (reasoning.py)."""
        return thinks or (self.reasoning is not None and self.reasoning.opened_by(choice.token_ids))

    def _reasoning_tokens(self, outputs: list[CompletionOutput], thinks: bool) -> int | None:
        """The thinking tokens of a reply's choices; None without --reasoning-parser."""
        if self.reasoning is None:
            return None
        return sum(self.reasoning.reasoning_tokens(c.token_ids) for c in outputs if self._thinks(thinks, c))

    async def _events(self, body: ChatCompletionRequest, plan: ToolPlan | None, prompt_ids: list[int],
                      stream: RequestStream, request_id: str, created: int, echoed: str,
                      thinks: bool = False) -> AsyncIterator[str]:
        ctx = self.ctx
        state = StreamState(body.n)
        tool_deltas: dict[int, ToolDeltas] = {}  # choice index -> its tool-call progress
        latest: dict[int, CompletionOutput] = {}  # choice index -> its output so far (reasoning tokens)

        def chunk(choices: list[ChatChunkChoice], with_usage: bool, first: bool = False) -> str:
            u = (usage([len(prompt_ids)], state.completion_tokens(), sum(state.cached_tokens.values()),
                       self._reasoning_tokens(list(latest.values()), thinks))
                 if with_usage else None)
            return sse(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices,
                                           usage=u, prompt_token_ids=prompt_ids if first else None))

        final_usage, continuous = ctx.stream_usage(body)
        opened = False
        try:
            async for batch in stream:
                if not opened:
                    # The role deltas go with the first token, as vLLM sends them: a client that times
                    # the first chunk then times the first token, and its usage counts the cached tokens.
                    for p, out in batch:
                        state.record(p, out)
                    for i in range(body.n):
                        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                                    continuous, first=bool(body.return_token_ids) and i == 0)
                        if echoed:
                            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=echoed))], continuous)
                    opened = True
                for p, out in batch:
                    state.record(p, out)
                    for c in out.outputs:
                        index, choice = state.choice(p, c.index)
                        latest[index] = c
                        finish_reason, calls = c.finish_reason, []
                        text, thinking, answering = c.text, "", True
                        if self._thinks(thinks, c):  # the thinking goes out as `reasoning`; the rest is the answer
                            final = c.finish_reason is not None
                            reasoning, text, ended = self.reasoning.split(c.text, final)
                            thinking = reasoning[choice.reasoning_sent:] if body.include_reasoning else ""
                            choice.reasoning_sent = len(reasoning)
                            answering = ended or final  # tool calls start after the thinking
                        reader = (plan.reader() if plan is not None and answering and index not in tool_deltas
                                  else None)
                        if reader is not None:
                            tool_deltas[index] = ToolDeltas(reader, None if plan.parallel else 1)
                        if index in tool_deltas:
                            tracker = tool_deltas[index]
                            delta, calls = tracker.step(text, final=c.finish_reason is not None)
                            finish_reason = plan.finish_reason(c.finish_reason, tracker.called)
                        else:
                            delta = text[choice.chars_sent:]
                        new_logprobs = c.logprobs[choice.tokens_sent:] if c.logprobs is not None else None
                        new_ids = list(c.token_ids[choice.ids_sent:]) if body.return_token_ids else None
                        finishing = c.finish_reason is not None and not choice.finished
                        choice.chars_sent, choice.num_tokens = len(text), len(c.token_ids)
                        if not (delta or calls or thinking or new_logprobs or new_ids or finishing):
                            continue
                        choice.ids_sent = len(c.token_ids)
                        if c.logprobs is not None:
                            choice.tokens_sent = len(c.logprobs)
                        choice.finished = c.finish_reason is not None
                        logprobs = (chat_logprobs(ctx.tokens, new_logprobs, body.top_logprobs or 0,
                                                  ctx.tokens_as_ids(body)) if new_logprobs is not None else None)
                        message = DeltaMessage(reasoning=thinking or None, tool_calls=calls or None,
                                               content=delta if delta or not (calls or thinking) else None)
                        yield chunk([ChatChunkChoice(index=index, delta=message, logprobs=logprobs,
                                                     finish_reason=finish_reason, stop_reason=c.stop_reason,
                                                     token_ids=new_ids)],
                                    continuous)
            if final_usage:
                yield chunk([], True)
        except EngineError as exc:
            yield sse_error(exc.status, str(exc))
        yield DONE
