"""POST /v1/chat/completions: the messages go through the tokenizer's chat template; one engine
request with `n` samples; JSON or SSE `chat.completion.chunk`s (a role delta first, then content
deltas, the finish reason on each choice's last chunk)."""
from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.outputs import Logprob
from kvserve.server.engine_loop import EngineError, PromptSpec, RequestStream
from kvserve.server.errors import APIError
from kvserve.server.prompt_logprobs import prompt_logprobs_field
from kvserve.server.prompts import Tokenization, conversation
from kvserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                     ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, DeltaMessage,
                                     TokenLogprob, TopLogprob)
from kvserve.server.serving import ServingContext, StreamState, usage
from kvserve.server.streaming import DONE, EventStreamResponse, sse, sse_error, unless_disconnected


def chat_logprobs(tokens: Tokenization, entries: list[Logprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = tokens.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = []
    for entry in entries:
        chosen = top(entry.token_id, entry.logprob)
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[top(t, lp) for t, lp in entry.top]))
    return ChatLogprobs(content=content)


def requested_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.logprobs:
        return body.top_logprobs or 0
    if body.top_logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
    return None


class ChatServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request) -> Response:
        ctx = self.ctx
        ctx.check_fields(body)
        messages = conversation(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # No max_tokens: up to the rest of the context (vLLM's default for chat).
        params = ctx.sampling_params(body, max_tokens, requested_logprobs(body), 1)
        # A client that leaves while its prompt waits for the tokenizer drops the job.
        prompt_ids = await unless_disconnected(ctx.tokens.chat_prompt(messages, body.add_generation_prompt), request)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await ctx.submit([PromptSpec(prompt_ids, params, body.cache_salt)], request_id)
        created = int(time.time())
        if body.stream:
            return EventStreamResponse(self._events(body, len(prompt_ids), stream, request_id, created), stream.close)
        try:
            [output] = await ctx.final_outputs(stream, request)
        finally:
            stream.close()
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              logprobs=chat_logprobs(ctx.tokens, c.logprobs) if c.logprobs is not None else None,
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in output.outputs]
        response = ChatCompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices,
            usage=usage([len(prompt_ids)], sum(len(c.token_ids) for c in output.outputs), output.num_cached_tokens),
            prompt_logprobs=prompt_logprobs_field(output.prompt_logprobs))
        return Response(response.model_dump_json(), media_type="application/json")

    async def _events(self, body: ChatCompletionRequest, prompt_len: int, stream: RequestStream,
                      request_id: str, created: int) -> AsyncIterator[str]:
        ctx = self.ctx
        state = StreamState(body.n)

        def chunk(choices: list[ChatChunkChoice], with_usage: bool) -> str:
            u = (usage([prompt_len], state.completion_tokens(), sum(state.cached_tokens.values()))
                 if with_usage else None)
            return sse(ChatCompletionChunk(id=request_id, created=created, model=ctx.model_name, choices=choices,
                                           usage=u))

        continuous = body.include_usage and body.continuous_usage
        for i in range(body.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))], continuous)
        try:
            async for batch in stream:
                for p, out in batch:
                    state.record(p, out)
                    for c in out.outputs:
                        index, choice = state.choice(p, c.index)
                        delta = c.text[choice.chars_sent:]
                        new_logprobs = c.logprobs[choice.tokens_sent:] if c.logprobs is not None else None
                        finishing = c.finish_reason is not None and not choice.finished
                        choice.chars_sent, choice.num_tokens = len(c.text), len(c.token_ids)
                        if not (delta or new_logprobs or finishing):
                            continue
                        if c.logprobs is not None:
                            choice.tokens_sent = len(c.logprobs)
                        choice.finished = c.finish_reason is not None
                        logprobs = chat_logprobs(ctx.tokens, new_logprobs) if new_logprobs is not None else None
                        yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(content=delta), logprobs=logprobs,
                                                     finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                                    continuous)
            if body.include_usage:
                yield chunk([], True)
        except EngineError as exc:
            yield sse_error(exc.status, str(exc))
        yield DONE
