"""What the completions and chat endpoints share: request checks, submission to the engine with
errors mapped to HTTP statuses, waiting for the final outputs, usage and per-choice stream state."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from starlette.requests import Request

from kvserve.engine.generation_defaults import GenerationDefaults
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.engine_loop import AsyncEngine, EngineDeadError, EngineError, PromptSpec, RequestStream
from kvserve.server.errors import APIError
from kvserve.server.priority import request_priority
from kvserve.server.prompts import Tokenization
from kvserve.server.protocol import MAX_CHOICES_PER_REQUEST, SamplingFields, UsageInfo
from kvserve.server.streaming import unless_disconnected

logger = logging.getLogger("kvserve.server")

CONTEXT_LENGTH_PREFIX = "This model's maximum context length is"
# The unknown-keys warning names at most this many keys, each cut to this many characters.
MAX_LOGGED_KEYS, MAX_LOGGED_KEY_CHARS = 20, 64


def log_ignored_fields(names: list[str]) -> None:
    """vLLM's warning naming request fields kvserve ignores; bounded, so that a body of 200,000
    unknown keys does not write a megabyte per request."""
    if names:
        shown = ", ".join(repr(k[:MAX_LOGGED_KEY_CHARS]) for k in names[:MAX_LOGGED_KEYS])
        more = f" and {len(names) - MAX_LOGGED_KEYS} more" if len(names) > MAX_LOGGED_KEYS else ""
        logger.warning("The following fields were present in the request but ignored: [%s]%s", shown, more)


@dataclass
class ServingContext:
    engine: AsyncEngine
    tokens: Tokenization
    model_names: list[str]
    max_model_len: int
    stream_interval: int = 1  # --stream-interval: a streamed request gets its output every N tokens
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens "token_id:N"
    force_include_usage: bool = False  # --enable-force-include-usage: every stream reports usage on every chunk

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    @property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's sampling defaults and max_tokens cap (--generation-config)."""
        return self.engine.engine.generation_defaults

    def priority(self, request: Request, body_priority: int) -> int:
        """The request's scheduling priority (body or X-Vllm-Priority header), refused unless the
        engine orders by it or it is 0."""
        priority = request_priority(request, body_priority)
        try:
            self.engine.engine.check_priority(priority)
        except ValueError as exc:
            raise APIError(400, str(exc), param="priority") from exc
        return priority

    def truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: max-model-len); a 400
        for 0 or more than max-model-len (LLMEngine.truncated)."""
        try:
            return self.engine.engine.truncated(token_ids, keep)
        except ValueError as exc:
            raise APIError(400, str(exc), param="truncate_prompt_tokens") from exc

    def stream_usage(self, body: SamplingFields) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk) for a stream: the request's stream_options,
        or both under --enable-force-include-usage (vLLM's)."""
        if self.force_include_usage:
            return True, True
        return body.include_usage, body.include_usage and body.continuous_usage

    def tokens_as_ids(self, body: SamplingFields) -> bool:
        """Whether this request's logprobs name tokens "token_id:N": its own field, else the flag."""
        own = body.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if own is None else own

    def check_fields(self, body: SamplingFields) -> None:
        """Refuse OpenAI features kvserve lacks; log keys no API defines (vLLM's behaviour)."""
        self.check_model(body.model)
        extra = body.model_extra or {}
        for name, harmless in body.unsupported_fields.items():
            if name in extra and not harmless(extra[name]):
                raise APIError(400, f"`{name}` is not supported by kvserve.", param=name, code="unsupported_parameter")
        log_ignored_fields([k for k in body.unknown_fields() if k not in body.unsupported_fields])

    def sampling_params(self, body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        num_prompts: int, prompt_logprobs: int | None = None,
                        prompt_only: bool = False) -> SamplingParams:
        """`prompt_only`: max_tokens 0 is allowed (completions with echo: the prompt alone)."""
        if max_tokens is not None and max_tokens < 1 and not (prompt_only and max_tokens == 0):
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        defaults = self.generation_defaults
        if max_tokens is not None:  # the generation config's max_new_tokens caps every request (vLLM's)
            max_tokens = defaults.cap(max_tokens)
        if num_prompts * body.n > MAX_CHOICES_PER_REQUEST:
            raise APIError(400, f"At most {MAX_CHOICES_PER_REQUEST} completions per request (prompts x n), "
                                f"got {num_prompts} x {body.n}.", param="n")
        # The sampler indexes logits by these ids (min_tokens bans them): out-of-range ids would
        # fail the whole engine step, not just this request.
        self.tokens.check_token_ids(body.stop_token_ids or [], "stop_token_ids")
        try:
            params = body.sampling_params(max_tokens, logprobs, prompt_logprobs, defaults.sampling)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        self.tokens.check_token_ids(list(params.logit_bias or {}), "logit_bias")
        self.tokens.check_token_ids(params.allowed_token_ids or [], "allowed_token_ids")
        return params

    async def submit(self, specs: list[PromptSpec], request_id: str, streaming: bool) -> RequestStream:
        """The engine requests of one HTTP request. A streamed one is handed its outputs every
        --stream-interval tokens; one that is not, only its finished outputs (RequestStream)."""
        ids = [request_id] if len(specs) == 1 else [f"{request_id}-{i}" for i in range(len(specs))]
        try:
            # A new grammar compiles in a worker thread (a bad one is refused here), so the engine
            # thread finds it cached instead of pausing the running batch to compile it.
            for constraint in {id(s.params.structured_outputs): s.params.structured_outputs for s in specs
                               if s.params.structured_outputs is not None}.values():
                await asyncio.to_thread(self.engine.engine.grammars.compile, constraint)
            return await self.engine.submit(specs, ids, self.stream_interval if streaming else 0)
        except ValueError as exc:
            message = str(exc)
            code = "context_length_exceeded" if message.startswith(CONTEXT_LENGTH_PREFIX) else None
            raise APIError(400, message, code=code) from exc
        except EngineDeadError as exc:
            raise APIError(503, f"The server cannot take requests: {exc}.") from exc

    async def final_outputs(self, stream: RequestStream, request: Request) -> list[RequestOutput]:
        """Wait for every prompt to finish (abandoned if the client disconnects: the caller's
        `stream.close()` then aborts the requests)."""
        async def drain() -> list[RequestOutput]:
            latest: dict[int, RequestOutput] = {}
            async for batch in stream:
                latest.update(batch)
            return [latest[i] for i in range(len(stream.request_ids))]

        try:
            return await unless_disconnected(drain(), request)
        except EngineError as exc:
            raise APIError(exc.status, str(exc)) from exc


def usage(prompt_lengths: list[int], completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int | None = None) -> UsageInfo:
    """`reasoning_tokens`: the thinking among the completion tokens (only with --reasoning-parser)."""
    prompt_tokens = sum(prompt_lengths)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details={"cached_tokens": cached_tokens},
                     completion_tokens_details=None if reasoning_tokens is None
                     else {"reasoning_tokens": reasoning_tokens})


@dataclass
class ChoiceState:
    """How much of one choice a stream has already sent."""

    started: bool = False
    chars_sent: int = 0
    reasoning_sent: int = 0  # characters of its reasoning (--reasoning-parser)
    tokens_sent: int = 0
    ids_sent: int = 0  # token ids sent (return_token_ids)
    prompt_ids_sent: bool = False  # its prompt's ids sent (return_token_ids, completions)
    num_tokens: int = 0
    finished: bool = False


@dataclass
class StreamState:
    """Per-choice progress of a streamed response; choice index = prompt index * n + sample index."""

    n: int
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)

    def choice(self, prompt_index: int, sample_index: int) -> tuple[int, ChoiceState]:
        index = prompt_index * self.n + sample_index
        return index, self.choices.setdefault(index, ChoiceState())

    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices.values())

    def record(self, prompt_index: int, output: RequestOutput) -> None:
        self.cached_tokens[prompt_index] = output.num_cached_tokens
