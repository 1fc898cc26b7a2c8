"""Request and response bodies of the OpenAI-compatible API (pydantic), with vLLM's field names
and defaults. Range checks live in `SamplingParams`, so the API and the offline `LLM` refuse the
same values with the same messages.

Keys that no API defines are accepted and logged (as vLLM does). OpenAI fields that kvserve does
not implement are refused with a 400 unless their value means "off", so a client never gets an
answer that silently ignored what it asked for.
"""
from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer, model_validator

from kvserve.cache.eviction import POLICY_CHOICES
from kvserve.engine.output_processor import TEMPLATE_FIELDS
from kvserve.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams
from kvserve.server.json_schemas import closed_schema

# Prompts x n in one HTTP request: bounds the work one request can queue.
MAX_CHOICES_PER_REQUEST = 128


def is_off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


# field -> test that its value asks for nothing kvserve would have to ignore
_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "guided_whitespace_pattern": is_off,
    "guided_decoding_backend": is_off,
    "lora_request": is_off,
    # vLLM's fields for what kvserve does not build: beam search, logits processors named by the
    # request, custom extensions' arguments, disaggregated prefill, multimodal processors
    "use_beam_search": is_off,
    "length_penalty": lambda v: v is None or v == 1,
    "logits_processors": is_off,
    "vllm_xargs": is_off,
    "kv_transfer_params": is_off,
    "mm_processor_kwargs": is_off,
}
UNSUPPORTED_COMPLETION_FIELDS = {**_UNSUPPORTED_COMMON, "prompt_embeds": is_off}
UNSUPPORTED_CHAT_FIELDS = {
    **_UNSUPPORTED_COMMON,
    "functions": is_off,
    "function_call": lambda v: is_off(v) or v == "none",
    "audio": is_off,
    "modalities": lambda v: is_off(v) or v == ["text"],
    "prediction": is_off,
    "web_search_options": is_off,
    "store": is_off,
}


def _lone_surrogate(value: Any, where: str) -> str | None:
    """Where in `value` a string holds a lone UTF-16 surrogate (JSON's `"\\ud800"` escape allows
    one): such a string is not text, and tokenizing, hashing or echoing it would fail."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (str, list, dict)) and (found := _lone_surrogate(item, f"{where}[{i}]")):
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if found := _lone_surrogate(key, where) or _lone_surrogate(item, f"{where}.{key}"):
                return found
    return None


# OpenAI's reasoning_effort values (a chat template that reads the variable takes it)
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def template_fields(body: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
    """The request's fields that its chat template takes as variables (documents, reasoning_effort)."""
    return {name: value for name in TEMPLATE_FIELDS if (value := getattr(body, name)) is not None}


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @model_validator(mode="after")
    def _text_is_unicode(self) -> "OpenAIModel":
        # Nested OpenAIModels (messages, content parts) run this check themselves.
        values = {**{name: getattr(self, name) for name in type(self).model_fields}, **(self.model_extra or {})}
        for name, value in values.items():
            if where := _lone_surrogate(value, name):
                raise ValueError(f"{where} is not valid Unicode text (it holds a lone surrogate)")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KVEvictionField(BaseModel):
    """kvserve's `kv_eviction` request field: this request's KV eviction settings, each falling
    back to the server's (--kv-eviction, --kv-budget, --sink-tokens, --recent-tokens)."""

    model_config = ConfigDict(extra="forbid")

    policy: str | None = Field(default=None, description=f"one of {', '.join(POLICY_CHOICES)}")
    budget: int | None = Field(default=None, description="tokens the sequence may hold, sinks included")
    sink_tokens: int | None = Field(default=None, description="first tokens always kept")
    recent_tokens: int | None = Field(default=None, description="newest tokens always kept")


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: a named schema, always enforced by the grammar. Its
    objects that leave `additionalProperties` unset are closed (json_schemas.closed_schema, as
    xgrammar's strict mode and OpenAI's strict schemas are) unless `strict` is false, which keeps
    the schema exactly as given."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (no constraint), any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` request field (exactly one constraint)."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True


class SamplingFields(OpenAIModel):
    """The sampling fields shared by completions and chat (vLLM's extras included)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, le=INT64_MAX)
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, description="Prefix-cache namespace: only requests with "
                                   "the same salt share cached blocks.")
    kv_eviction: KVEvictionField | None = None
    prompt_logprobs: int | None = Field(default=None, description="Return the log-probability of every prompt "
                                        "token given the ones before it, with the k most likely tokens there.")
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* spellings; more than one constraint in all is a 400.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's: token id (a JSON key, so a string) -> bias, clamped to [-100, 100] as vLLM does.
    logit_bias: dict[str, float] | None = None
    # vLLM's: logprobs name tokens "token_id:N" (default: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the prompt's and each choice's token ids in the response (streamed: the prompt's in
    # the first chunk, each chunk's new ids with it)
    return_token_ids: bool | None = None
    request_id: str | None = None  # vLLM's: names the response unless an X-Request-Id header does (request_id.py)
    # vLLM's: lower is served first under --scheduling-policy priority (priority.py); else only 0
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    # vLLM's: keep the prompt's last k tokens (-1: max-model-len)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    bad_words: list[str] | None = None  # vLLM's: words never generated (engine/token_bans.py)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:  # vLLM's check and text
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    @model_validator(mode="after")
    def _cache_salt_not_empty(self) -> "SamplingFields":
        if self.cache_salt == "":  # vLLM's text
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "SamplingFields":
        # vLLM's texts; a streamed response has nowhere to put them (echo + logprobs has: the
        # first chunk of each completion choice).
        if self.prompt_logprobs is not None:
            if self.stream:
                raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
            if self.prompt_logprobs < 0:
                raise ValueError("`prompt_logprobs` must be a non-negative value.")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: values for the sampling fields the request leaves unset (the model's
        generation config). Raises ValueError (a 400) for values out of range."""
        given = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty") if getattr(self, name) is not None}
        given = {**(defaults or {}), **given}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            seed=self.seed, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            kv_eviction=self.kv_eviction.model_dump(exclude_none=True) if self.kv_eviction else None,
            structured_outputs=self.structured_outputs_params(), logit_bias=self.logit_bias_ids(),
            truncate_prompt_tokens=self.truncate_prompt_tokens, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words, **given)

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with integer token ids and biases clamped to [-100, 100]; ValueError (a 400)
        for a key that is not a token id or a bias that is not finite."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite numbers, got {bias!r} for token {key}.")
            biases[token] = min(100.0, max(-100.0, float(bias)))
        return biases

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for, from whichever field it used; None
        without one. Raises ValueError (a 400) for two constraints or a malformed one."""
        constraints: dict[str, Any] = {}
        whitespace = True
        if self.structured_outputs is not None:
            so = self.structured_outputs
            whitespace = so.disable_any_whitespace
            constraints.update({k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                  ("grammar", so.grammar), ("json_object", so.json_object))
                                if v is not None and v is not False})
            if not constraints:  # vLLM's text
                raise ValueError("You must use one kind of structured outputs constraint but none are specified.")
        for kind, value in (("json", self.guided_json), ("regex", self.guided_regex),
                            ("choice", self.guided_choice), ("grammar", self.guided_grammar)):
            if value is not None:
                _add_constraint(constraints, kind, value)
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            _add_constraint(constraints, "json_object", True)
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema (the JSON schema).")
            schema = fmt.json_schema.json_schema
            _add_constraint(constraints, "json", schema if fmt.json_schema.strict is False else closed_schema(schema))
        if not constraints:
            return None
        return StructuredOutputsParams(**constraints, disable_any_whitespace=whitespace)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _add_constraint(constraints: dict[str, Any], kind: str, value: Any) -> None:
    if constraints:  # vLLM's text
        raise ValueError(f"You can only use one kind of structured outputs constraint but multiple are "
                         f"specified: {', '.join([*constraints, kind])}.")
    constraints[kind] = value


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # Fill in the middle: the text after the insertion (models whose tokenizer has FIM tokens).
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (a BOS)
    # OpenAI's (vLLM v0's): sample best_of candidates per prompt, return the n with the highest
    # cumulative logprob.
    best_of: int | None = None

    @model_validator(mode="after")
    def _logprobs_not_negative(self) -> "CompletionRequest":
        if self.logprobs is not None and self.logprobs < 0:  # vLLM's text (-1 is the offline API's)
            raise ValueError("`logprobs` must be a positive value.")
        return self

    @model_validator(mode="after")
    def _best_of(self) -> "CompletionRequest":
        if self.best_of is None:
            return self
        if self.best_of < self.n:  # vLLM v0's texts
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        if self.best_of > self.n and self.stream:
            raise ValueError("best_of > n is not supported with streaming: every candidate would have to be "
                             "streamed before the best are known; use n.")
        if self.best_of > 1 and self.temperature == 0:
            raise ValueError(f"best_of must be 1 when using greedy sampling. Got {self.best_of}.")
        return self

    unsupported_fields: ClassVar[dict[str, Callable[[Any], bool]]] = UNSUPPORTED_COMPLETION_FIELDS


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class FunctionCallParam(OpenAIModel):
    name: str
    # JSON text, as OpenAI's API sends it; an object, empty or absent (no arguments) as vLLM takes it
    arguments: str | dict[str, Any] | None = None


class ToolCallParam(OpenAIModel):
    """A call in an assistant message of the conversation (what an earlier response returned)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none means no arguments
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    # Set for the APIs built on chat (chat.chat_request: /v1/responses, /v1/messages): a reply a
    # token limit cut keeps finish reason "length" though it holds tool calls, which those APIs
    # report as incomplete / max_tokens; chat completions say "tool_calls" there, as vLLM does.
    _cut_stays_length: bool = PrivateAttr(default=False)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: continue the last (assistant) message, no new turn
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    chat_template: str | None = None  # vLLM's: this request's Jinja template (--trust-request-chat-template)
    echo: bool = False  # vLLM's: the reply starts with the last message's content when it is the assistant's
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's
    # vLLM's fields a chat template reads as variables (output_processor.TEMPLATE_FIELDS)
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    tools: list[ChatTool] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}}; checked in
    # kvserve/server/tools.py with vLLM's messages.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call per reply
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the reply
    # vLLM's: at most this many thinking tokens, then </think> is forced (reasoning.ThinkingBudget)
    thinking_token_budget: int | None = Field(default=None, ge=0, strict=True)

    @model_validator(mode="after")
    def _top_logprobs_not_negative(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs < 0:  # vLLM's text
            raise ValueError("`top_logprobs` must be a positive value.")
        return self

    unsupported_fields: ClassVar[dict[str, Callable[[Any], bool]]] = UNSUPPORTED_CHAT_FIELDS


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # rendered with the messages, as chat renders them
    # prompt: default True. messages: as chat renders them, the template's special tokens only (vLLM's
    # default there); True is refused rather than ignored.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] | None = None  # reasoning_tokens, with --reasoning-parser


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry for one token at one prompt position."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: entry}.
PromptLogprobsField = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the generated ids (of this chunk, streamed)
    prompt_logprobs: PromptLogprobsField | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (streamed: in the choice's first chunk)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None  # a reasoning model's thinking (--reasoning-parser; vLLM's field)
    tool_calls: list[ToolCall] = Field(default_factory=list)  # always present, empty without calls (vLLM)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: the generated ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsField | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class _Sparse(BaseModel):
    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict:
        """OpenAI's deltas carry only what changed: no `"name": null`."""
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    """A piece of one tool call in a stream: the first carries `id`, `type` and the function's
    name; the following ones add fragments of `arguments`; `index` says which call."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: Any) -> dict:
        """OpenAI's deltas carry only what changed: no `"role": null`."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
