"""POST /v1/completions: one engine request per prompt, `n` samples each; JSON or SSE chunks in
OpenAI's `text_completion` format with its legacy logprobs (parallel lists per token).

`echo` puts the prompt before the generated text; with `logprobs` the prompt's tokens' logprobs
come first too (computed as prompt logprobs, as vLLM does), and `max_tokens: 0` with `echo`
returns the prompt alone (the engine computes the prompt and samples nothing)."""
from __future__ import annotations

import dataclasses
import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from kvserve.outputs import RequestOutput, SampleLogprobs, sampled_logprob, top_logprobs
from kvserve.server.errors import APIError
from kvserve.server.engine_loop import EngineError, PromptSpec, RequestStream
from kvserve.server.prompt_logprobs import echoed_prompt_logprobs, prompt_logprobs_field
from kvserve.server.prompts import Prompt, Tokenization
from kvserve.server.protocol import (MAX_CHOICES_PER_REQUEST, CompletionChoice, CompletionLogprobs, CompletionRequest,
                                     CompletionResponse)
from kvserve.server.request_id import request_ids
from kvserve.server.serving import ServingContext, StreamState, usage
from kvserve.server.streaming import DONE, EventStreamResponse, sse, sse_error, unless_disconnected


def completion_logprobs(tokens: Tokenization, entries: SampleLogprobs, k: int, text_offset: int,
                        as_ids: bool = False) -> CompletionLogprobs:
    """Legacy logprobs for `entries` (k alternatives each), the first token starting at `text_offset`
    in the choice's text. Each position's top_logprobs also holds the chosen token, as in vLLM;
    where two tokens decode to the same text (the format keys by text), the chosen token's value is kept.
    `as_ids`: tokens named "token_id:N" (Tokenization.token_name); offsets still count the text."""
    result = CompletionLogprobs()
    for entry in entries:
        token, sampled = sampled_logprob(entry)
        name = tokens.token_name(token, as_ids)
        result.tokens.append(name)
        result.token_logprobs.append(sampled.logprob)
        result.text_offset.append(text_offset)
        top = {tokens.token_name(t, as_ids): e.logprob for t, e in top_logprobs(entry, k)}
        top[name] = sampled.logprob
        result.top_logprobs.append(top)
        text_offset += len(tokens.token_text(token))
    return result


def joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=first.text_offset + second.text_offset,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              tokens=first.tokens + second.tokens, top_logprobs=first.top_logprobs + second.top_logprobs)


def best_candidates(output: RequestOutput, n: int, keep_logprobs: bool) -> RequestOutput:
    """The n of a request's candidates with the highest cumulative logprob (of the raw model, as
    every kvserve logprob), best first, numbered 0..n-1; their logprobs dropped unless asked for."""
    ranked = sorted(output.outputs, key=lambda c: (-(c.cumulative_logprob or 0.0), c.index))[:n]
    best = [dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
            for i, c in enumerate(ranked)]
    return dataclasses.replace(output, outputs=best)


class CompletionServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        ctx = self.ctx
        ctx.check_fields(body)
        priority = ctx.priority(request, body.priority)
        # A client that leaves while its prompt waits for the tokenizer drops the job.
        prompts = await unless_disconnected(ctx.tokens.completion_prompts(
            body.prompt, truncating=body.truncate_prompt_tokens is not None,
            add_special_tokens=body.add_special_tokens), request)
        if body.suffix:
            await ctx.tokens.fill_in_the_middle(prompts, body.suffix)
        for prompt in prompts:
            kept = ctx.truncated(prompt.token_ids, body.truncate_prompt_tokens)
            if len(kept) < len(prompt.token_ids):
                prompt.text = None  # echo repeats the tokens the model saw, decoded below
            prompt.token_ids = kept
        # As in vLLM: echo with logprobs computes the prompt's logprobs (k = logprobs).
        echo_logprobs = body.echo and body.logprobs is not None
        as_ids = ctx.tokens_as_ids(body)
        params = ctx.sampling_params(body, body.max_tokens, body.logprobs, len(prompts),
                                     prompt_logprobs=body.logprobs if echo_logprobs else None, prompt_only=body.echo)
        best_of = body.best_of if body.best_of is not None and body.best_of > body.n else None
        if best_of is not None:  # every candidate reports its tokens' logprobs, to rank them by their sum
            if len(prompts) * best_of > MAX_CHOICES_PER_REQUEST:
                raise APIError(400, f"At most {MAX_CHOICES_PER_REQUEST} completions per request (prompts x best_of), "
                                    f"got {len(prompts)} x {best_of}.", param="best_of")
            params = dataclasses.replace(params, n=best_of, logprobs=params.logprobs or 0)
        if body.echo:
            for prompt in prompts:
                if prompt.text is None:
                    prompt.text = await ctx.tokens.decode(prompt.token_ids)
        request_id, engine_id = request_ids("cmpl-", request, body.request_id)
        stream = await ctx.submit([PromptSpec(p.token_ids, params, body.cache_salt, priority) for p in prompts],
                                  engine_id, streaming=body.stream)
        created = int(time.time())
        if body.stream:
            return EventStreamResponse(self._events(body, prompts, stream, request_id, created), stream.close)
        try:
            outputs = await ctx.final_outputs(stream, request)
        finally:
            stream.close()
        if best_of is not None:
            outputs = [best_candidates(out, body.n, keep_logprobs=body.logprobs is not None) for out in outputs]
        choices = []
        for p, (prompt, out) in enumerate(zip(prompts, outputs)):
            prefix = prompt.text if body.echo else ""
            for c in out.outputs:
                logprobs = (completion_logprobs(ctx.tokens, c.logprobs, body.logprobs or 0, len(prefix), as_ids)
                            if c.logprobs is not None else None)
                if echo_logprobs:
                    echoed = echoed_prompt_logprobs(ctx.tokens, prompt.token_ids, out.prompt_logprobs, body.logprobs,
                                                    as_ids)
                    logprobs = joined(echoed, logprobs or CompletionLogprobs())
                choices.append(CompletionChoice(index=p * body.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_logprobs_field(out.prompt_logprobs),
                                                token_ids=list(c.token_ids) if body.return_token_ids else None,
                                                prompt_token_ids=prompt.token_ids if body.return_token_ids else None))
        response = CompletionResponse(
            id=request_id, created=created, model=ctx.model_name, choices=choices,
            usage=usage([len(p.token_ids) for p in prompts], sum(len(c.token_ids) for o in outputs for c in o.outputs),
                        sum(o.num_cached_tokens for o in outputs)))
        return Response(response.model_dump_json(), media_type="application/json")

    async def _events(self, body: CompletionRequest, prompts: list[Prompt], stream: RequestStream,
                      request_id: str, created: int) -> AsyncIterator[str]:
        ctx = self.ctx
        state = StreamState(body.n)
        prompt_lengths = [len(p.token_ids) for p in prompts]
        offsets: dict[int, int] = {}  # choice index -> text offset of its next logprob token
        echo_logprobs = body.echo and body.logprobs is not None
        final_usage, continuous = ctx.stream_usage(body)
        as_ids = ctx.tokens_as_ids(body)

        def chunk(choices: list[CompletionChoice], with_usage: bool) -> str:
            u = (usage(prompt_lengths, state.completion_tokens(), sum(state.cached_tokens.values()))
                 if with_usage else None)
            return sse(CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices,
                                          usage=u))

        try:
            async for batch in stream:
                for p, out in batch:
                    state.record(p, out)
                    for c in out.outputs:
                        index, choice = state.choice(p, c.index)
                        echo = body.echo and not choice.started
                        if echo and echo_logprobs and out.prompt_logprobs is None and c.finish_reason is None:
                            continue  # the first chunk waits for the prompt's logprobs (another sample computes them)
                        delta = (prompts[p].text if echo else "") + c.text[choice.chars_sent:]
                        choice.started = True
                        new_logprobs = c.logprobs[choice.tokens_sent:] if c.logprobs is not None else None
                        new_ids = list(c.token_ids[choice.ids_sent:]) if body.return_token_ids else None
                        send_prompt = body.return_token_ids and not choice.prompt_ids_sent  # (in its first chunk)
                        prompt_ids = prompts[p].token_ids if send_prompt else None
                        finishing = c.finish_reason is not None and not choice.finished
                        choice.chars_sent, choice.num_tokens = len(c.text), len(c.token_ids)
                        if not (delta or new_logprobs or new_ids or prompt_ids or finishing):
                            continue
                        choice.ids_sent, choice.prompt_ids_sent = len(c.token_ids), True
                        logprobs = None
                        if echo and echo_logprobs:
                            logprobs = echoed_prompt_logprobs(ctx.tokens, prompts[p].token_ids, out.prompt_logprobs,
                                                              body.logprobs, as_ids)
                            offsets[index] = len(prompts[p].text)
                        if new_logprobs is not None:
                            generated = completion_logprobs(ctx.tokens, new_logprobs, body.logprobs or 0,
                                                            offsets.get(index, 0), as_ids)
                            offsets[index] = offsets.get(index, 0) + sum(
                                len(ctx.tokens.token_text(sampled_logprob(e)[0])) for e in new_logprobs)
                            logprobs = joined(logprobs, generated) if logprobs is not None else generated
                            choice.tokens_sent = len(c.logprobs)
                        choice.finished = c.finish_reason is not None
                        yield chunk([CompletionChoice(index=index, text=delta, logprobs=logprobs,
                                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                      token_ids=new_ids, prompt_token_ids=prompt_ids)],
                                    continuous)
            if final_usage:
                yield chunk([], True)
        except EngineError as exc:
            yield sse_error(exc.status, str(exc))
        yield DONE
