"""Between the user's request and the scheduler's sequences: prompts in, RequestOutputs out.

In: a prompt is tokenized (or rendered with the chat template first), and a request with n > 1
fans out into n sequences (`Request`s) that share the prompt, one detokenizer each. Out: after
each step the sampled tokens are detokenized (stop strings found), logprobs and prompt logprobs
collected, and every request that advanced is reported as one `RequestOutput` gathering its
sequences. vLLM v1 keeps
the same split (its OutputProcessor), so that the engine itself only schedules and runs.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.model_runner import PromptLogprobsChunk
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampleResult
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.engine.template_budget import guard_chat_template
from kvserve.engine.tool_prompts import render_messages
from kvserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs


@dataclass
class _Child:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)
    # Entries so far (the first sequence computes them for all); None when not asked for.
    prompt_logprobs: PromptLogprobs | None = None
    final_only: bool = False  # reported once, when finished

    @property
    def finished(self) -> bool:
        return all(c.request.status.finished for c in self.children)

    @property
    def complete_prompt_logprobs(self) -> PromptLogprobs | None:
        entries = self.prompt_logprobs
        return entries if entries is not None and len(entries) == len(self.prompt_token_ids) else None


# vLLM's TextPrompt / TokensPrompt keys kvserve reads; "prompt" beside "prompt_token_ids" is its text,
# which the ids win over (as in vLLM). Multimodal keys are refused: kvserve serves text-only models.
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def tokenize(tokenizer: Any, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt given as text, token ids or vLLM's
    {"prompt_token_ids": [...]} / {"prompt": text} (with an optional "cache_salt")."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt and "prompt" not in prompt:
            raise ValueError(f"a prompt dict needs a 'prompt' or 'prompt_token_ids' key, got keys {sorted(prompt)}")
        unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
        if unknown:
            raise ValueError(f"prompt keys {unknown} are not supported (kvserve reads {', '.join(PROMPT_KEYS)}; "
                             f"its models take text only)")
        prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the prompt is not valid Unicode text (a lone surrogate at index {exc.start})") from None
        return prompt, tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is text, a list of token ids or a dict, got {type(prompt).__name__}")
    return None, list(prompt)


# vLLM's request fields that a chat template takes as variables of the same name, and why a
# template that never reads one is no place for it.
TEMPLATE_FIELDS = {
    "documents": "retrieval-augmented templates read them, e.g. Command-R's; put them in the messages instead",
    "reasoning_effort": "the reasoning models kvserve serves, R1's distills and QwQ, think without an effort "
                        "setting; a template's own switch goes through chat_template_kwargs",
}


class TemplateFieldError(ValueError):
    """A request field (TEMPLATE_FIELDS) that the chat template never reads."""

    def __init__(self, field: str):
        super().__init__(f"`{field}` is not supported for this model: its chat template does not read it "
                         f"({TEMPLATE_FIELDS[field]}).")
        self.field = field


# Arguments of the template call that chat_template_kwargs may not replace.
_RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "tokenize", "add_generation_prompt",
                             "continue_final_message", "return_dict", "return_tensors")


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, continue_final_message: bool = False,
                        template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                        add_special_tokens: bool = False, fields: dict[str, Any] | None = None) -> list[int]:
    """Render a conversation with the chat template (render_chat_template), then tokenize it (the
    template already holds the special tokens, so none are added unless `add_special_tokens`, vLLM's
    request field: a BOS on top of the template's)."""
    text = render_chat_template(tokenizer, messages, add_generation_prompt, tools, continue_final_message,
                                template_kwargs, chat_template, fields)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def render_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, continue_final_message: bool = False,
                         template_kwargs: dict[str, Any] | None = None, chat_template: str | None = None,
                         fields: dict[str, Any] | None = None) -> str:
    """A conversation as the text a chat template makes of it: `chat_template` (Jinja text;
    `template_kwargs["chat_template"]` as vLLM takes it), else the tokenizer's. Tool definitions,
    assistant `tool_calls` and `tool` results go to the template where it renders them, else into
    the turns as hermes text (tool_prompts.py). `continue_final_message` leaves the last message
    open (no end-of-turn after it) for the model to continue; `template_kwargs` are extra variables
    for the template (vLLM's chat_template_kwargs, e.g. a reasoning switch). `fields`: vLLM's
    request fields a template takes as variables of the same name (TEMPLATE_FIELDS); a
    TemplateFieldError where the template never reads one (vLLM would render without it)."""
    template_kwargs = dict(template_kwargs or {})
    from_kwargs = template_kwargs.pop("chat_template", None)
    chat_template = chat_template or from_kwargs
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError("chat_template must be a string holding a Jinja template")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use the completions API "
                         "(or give one: `kvserve serve --chat-template`)")
    if continue_final_message and add_generation_prompt:  # vLLM's text
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    reserved = sorted(set(template_kwargs) & set(_RESERVED_TEMPLATE_KWARGS))
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: use the request's own fields")
    messages, tools = render_messages(messages, tools, chat_template or tokenizer.chat_template)
    guard_chat_template(tokenizer, tools, chat_template)
    for name, value in (fields or {}).items():
        if not re.search(rf"\b{name}\b", tokenizer.get_chat_template(chat_template, tools)):
            raise TemplateFieldError(name)
        template_kwargs[name] = value
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **template_kwargs)


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
        self._token_texts: dict[int, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            sequences: list[Request], final_only: bool = False) -> None:
        """Track a request and its sequences (one per sample, ids as the engine named them);
        `final_only`: `process` reports it only once it has finished."""
        parent = _Parent(request_id, prompt, prompt_token_ids, final_only=final_only)
        if sequences and sequences[0].params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for request in sequences:
            params = request.params
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                           params.include_stop_str_in_output, params.skip_special_tokens,
                                           params.min_tokens)
            child = _Child(request, detok, [] if params.logprobs is not None else None)
            parent.children.append(child)
            self._children[request.request_id] = (parent, child)
        self._parents[request_id] = parent

    def sequences(self, request_id: str) -> list[Request]:
        """The request's sequences; empty for an unknown (or finished and reported) id."""
        parent = self._parents.get(request_id)
        return [] if parent is None else [c.request for c in parent.children]

    def process(self, sampled: list[ScheduledRequest], result: SampleResult,
                prompt_logprobs: list[PromptLogprobsChunk] = (), finished: list[Request] = ()) -> list[RequestOutput]:
        """After a step: each sequence's sampled token (`result`, in `sampled`'s order) detokenized,
        a stop string ending its sequence; prompt logprobs collected; `finished`: sequences the
        scheduler ended without sampling (prefill only). Returns one output per request that
        advanced (a final-only request: only once finished), in the order first seen."""
        for chunk in prompt_logprobs:
            self._add_prompt_logprobs(chunk)
        touched: dict[str, _Parent] = {}
        for request in finished:
            if request.request_id in self._children:
                parent = self._children[request.request_id][0]
                touched[parent.request_id] = parent
        for index, (item, token, logprob) in enumerate(zip(sampled, result.token_ids, result.logprobs)):
            parent, child = self._children[item.request.request_id]
            request = child.request
            touched[parent.request_id] = parent
            if request.status == RequestStatus.FINISHED_ERROR:  # its token was discarded (a logits processor failed)
                continue
            if result.drafts is not None and result.drafts[index] and \
                    self._stopped_in_drafts(child, result.drafts[index], result.draft_logprobs[index]):
                continue
            if not self._hidden_stop_token(request, token):
                child.detokenizer.add_token(token)
            if child.logprobs is not None and logprob is not None:
                child.logprobs.append(self._ranked(token, *logprob))
            if child.detokenizer.stop_string is not None:
                if not request.status.finished:
                    request.stop_reason = child.detokenizer.stop_string
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                elif request.status == RequestStatus.FINISHED_LENGTH:  # the last token allowed completed it
                    request.stop_reason = child.detokenizer.stop_string  # (vLLM: the stop string's "stop")
                    request.status = RequestStatus.FINISHED_STOPPED
        return [self._output(parent) for parent in touched.values() if not parent.final_only or parent.finished]

    def _stopped_in_drafts(self, child: _Child, drafts: list[int], logprobs: list) -> bool:
        """Speculative decoding: the confirmed drafts before a sequence's sampled token, detokenized
        one by one. A stop string among them ends the sequence there: the tokens after it, appended
        already, are dropped, as if it had stopped one step at a time. True if it did."""
        request = child.request
        for position, (token, logprob) in enumerate(zip(drafts, logprobs)):
            child.detokenizer.add_token(token)
            if child.logprobs is not None and logprob is not None:
                child.logprobs.append(self._ranked(token, *logprob))
            if child.detokenizer.stop_string is not None:
                request.discard_last_tokens(len(drafts) - position)  # the later drafts and the sampled token
                request.stop_reason = child.detokenizer.stop_string
                if request.status.finished:  # (ended by its sampled token, after the stop string)
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                return True
        return False

    def _hidden_stop_token(self, request: Request, token: int) -> bool:
        """The token that ended the sequence (EOS, one of stop_token_ids, special or not) is not in
        the text, with skip_special_tokens=False too, unless include_stop_str_in_output; it stays
        in token_ids (what vLLM's detokenizer does, whatever SamplingParams' docstring says)."""
        return (request.status == RequestStatus.FINISHED_STOPPED
                and (token == request.stop_reason or token in request.eos_token_ids)
                and not request.params.include_stop_str_in_output)

    def _add_prompt_logprobs(self, chunk: PromptLogprobsChunk) -> None:
        entry = self._children.get(chunk.request.request_id)
        parent = entry[0] if entry else None
        if parent is None or parent.prompt_logprobs is None or len(parent.prompt_logprobs) != chunk.first_token:
            return  # not tracked, or entries this request already has (never expected: the runner skips them)
        found, k = chunk.logprobs, chunk.request.params.prompt_logprobs
        for j, target in enumerate(chunk.targets):
            top = zip(found.top_ids[j][:k], found.top_logprobs[j][:k])
            parent.prompt_logprobs.append(self._ranked(target, found.logprobs[j], found.ranks[j], top))

    def _ranked(self, token: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        """vLLM's logprobs entry: `token` first, then the top alternatives by rank, each once."""
        ranked = {token: Logprob(logprob, rank, self._token_text(token))}
        for rank, (other, value) in enumerate(top, 1):
            if other not in ranked:
                ranked[other] = Logprob(value, rank, self._token_text(other))
        return ranked

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def output(self, request_id: str) -> RequestOutput | None:
        """The request's state now (None for an unknown id); a finished request is then forgotten."""
        parent = self._parents.get(request_id)
        return None if parent is None else self._output(parent)

    def _output(self, parent: _Parent) -> RequestOutput:
        # Built for every request that advanced, every step: one pass over its sequences.
        outputs, finished, error = [], True, None
        for index, child in enumerate(parent.children):
            request = child.request
            done = request.status.finished
            if done:
                self._forget(request.request_id)
            else:
                finished = False
            error = error or request.error
            outputs.append(CompletionOutput(index, child.detokenizer.visible_text(done), list(request.output_token_ids),
                                            request.status.value if done else None, request.stop_reason,
                                            None if child.logprobs is None else list(child.logprobs)))
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._children.pop(child.request.request_id, None)
        scheduled = None
        if finished:
            times = [c.request.first_scheduled_time for c in parent.children
                     if c.request.first_scheduled_time is not None]
            scheduled = min(times) if times else None
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             parent.children[0].request.num_cached_tokens, error, parent.complete_prompt_logprobs,
                             scheduled)
