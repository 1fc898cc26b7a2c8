"""Between the user's request and the scheduler's sequences: prompts in, RequestOutputs out.

In: a prompt is tokenized (or rendered with the chat template first), and a request with n > 1
fans out into n sequences (`Request`s) that share the prompt, one detokenizer each. Out: after
each step the sampled tokens are detokenized (stop strings found), logprobs collected, and every
request that advanced is reported as one `RequestOutput` gathering its sequences. vLLM v1 keeps
the same split (its OutputProcessor), so that the engine itself only schedules and runs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampleResult
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.engine.tool_prompts import render_messages
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class _Child:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[Logprob] | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.status.finished for c in self.children)


def tokenize(tokenizer: Any, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, token ids or {"prompt_token_ids": [...]}
    / {"prompt": text}."""
    if isinstance(prompt, dict):
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    return None, list(prompt)


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None) -> list[int]:
    """Render a conversation with the tokenizer's chat template, then tokenize it (the template
    already holds the special tokens, so none are added). Tool definitions, assistant `tool_calls`
    and `tool` results go to the template where it renders them, else into the turns as hermes
    text (tool_prompts.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use the completions API")
    messages, tools = render_messages(messages, tools, tokenizer.chat_template)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


class OutputProcessor:
    """The requests in flight, by the user's request id and by each sequence's id.

    `finish(request, status)` ends a sequence (the scheduler's, which frees its blocks) when a stop
    string appears; `forget(sequence id)` drops per-sequence state elsewhere (the sampler's
    seeded generator) once a sequence finished."""

    def __init__(self, tokenizer: Any, finish: Callable[[Request, RequestStatus], None],
                 forget: Callable[[str], None]):
        self.tokenizer = tokenizer
        self._finish = finish
        self._forget = forget
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Child]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            sequences: list[Request]) -> None:
        """Track a request and its sequences (one per sample, ids as the engine named them)."""
        parent = _Parent(request_id, prompt, prompt_token_ids)
        for request in sequences:
            params = request.params
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                           params.include_stop_str_in_output, params.skip_special_tokens)
            child = _Child(request, detok, [] if params.logprobs is not None else None)
            parent.children.append(child)
            self._children[request.request_id] = (parent, child)
        self._parents[request_id] = parent

    def sequences(self, request_id: str) -> list[Request]:
        """The request's sequences; empty for an unknown (or finished and reported) id."""
        parent = self._parents.get(request_id)
        return [] if parent is None else [c.request for c in parent.children]

    def process(self, sampled: list[ScheduledRequest], result: SampleResult) -> list[RequestOutput]:
        """After a step: each sequence's sampled token (`result`, in `sampled`'s order) detokenized,
        a stop string ending its sequence; returns one output per request that advanced, in the
        order first seen."""
        touched: dict[str, _Parent] = {}
        for item, token, logprob in zip(sampled, result.token_ids, result.logprobs):
            parent, child = self._children[item.request.request_id]
            request = child.request
            touched[parent.request_id] = parent
            if request.status == RequestStatus.FINISHED_ERROR:  # its token was discarded (a logits processor failed)
                continue
            child.detokenizer.add_token(token)
            if child.logprobs is not None and logprob is not None:
                child.logprobs.append(Logprob(token, logprob[0], logprob[1]))
            if child.detokenizer.stop_string is not None and not request.status.finished:
                request.stop_reason = child.detokenizer.stop_string
                self._finish(request, RequestStatus.FINISHED_STOPPED)
        return [self._output(parent) for parent in touched.values()]

    def output(self, request_id: str) -> RequestOutput | None:
        """The request's state now (None for an unknown id); a finished request is then forgotten."""
        parent = self._parents.get(request_id)
        return None if parent is None else self._output(parent)

    def _output(self, parent: _Parent) -> RequestOutput:
        outputs = []
        for index, child in enumerate(parent.children):
            request = child.request
            done = request.status.finished
            if done:
                self._forget(request.request_id)
            outputs.append(CompletionOutput(
                index=index,
                text=child.detokenizer.visible_text(done),
                token_ids=list(request.output_token_ids),
                finish_reason=request.status.value if done else None,
                stop_reason=request.stop_reason,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
            ))
        finished = parent.finished
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._children.pop(child.request.request_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             num_cached_tokens=parent.children[0].request.num_cached_tokens,
                             error=next((c.request.error for c in parent.children if c.request.error), None))
