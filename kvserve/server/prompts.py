"""Turning request bodies into token ids (and token ids into text) on the HTTP side.

Tokenizing runs in worker threads so a long prompt never stalls the event loop, and the engine
thread only ever receives token ids. `LLMEngine.tokenize` and `apply_chat_template` are used so
prompts tokenize exactly as in the offline `LLM`; both only read the tokenizer, which is why
calling them off the engine thread is safe.

The work is bounded and fair. Text longer than max-model-len times the vocabulary's longest
token cannot fit in the context, so it is refused before tokenizing, which bounds every job.
Small jobs and large ones run in separate threads (the tokenizer releases the GIL), so a small
request never queues behind large ones; a queued job whose client left is dropped unstarted
(its handler is cancelled), and at shutdown the jobs still pending answer 503.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.output_processor import TemplateFieldError
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatMessage, ToolCallParam

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED_MESSAGE_FIELDS = ("function_call", "audio", "refusal")


@dataclass
class Prompt:
    text: str | None  # None when the client sent token ids
    token_ids: list[int]


# Fill-in-the-middle special tokens: (prefix, suffix, middle), in the spellings models use.
_FIM_SPELLINGS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                  ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fim_token_ids(tokenizer: Any) -> tuple[int, int, int] | None:
    """The tokenizer's fill-in-the-middle token ids, or None when it has none."""
    vocab = tokenizer.get_vocab()
    for spelling in _FIM_SPELLINGS:
        if all(token in vocab for token in spelling):
            return tuple(vocab[token] for token in spelling)
    return None


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the template expects them; text content parts are joined by newlines.
    An assistant message's `tool_calls` keep their arguments as objects (what chat templates
    render), a tool message its `tool_call_id`. Other keys (a reasoning model's earlier
    `reasoning_content`, say) reach the template as they are, as vLLM passes them; an earlier
    turn's `reasoning` (vLLM's reply field) is also its `reasoning_content`, what templates read."""
    if not messages:
        raise APIError(400, "messages must contain at least one message.", param="messages")
    result = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in CHAT_ROLES:
            raise APIError(400, f"{where}.role {message.role!r} is not supported; use one of "
                                f"{', '.join(CHAT_ROLES)}.", param=f"{where}.role")
        for name in _UNSUPPORTED_MESSAGE_FIELDS:
            if (message.model_extra or {}).get(name) not in (None, [], ""):
                raise APIError(400, f"{where}.{name} is not supported by kvserve.", param=f"{where}.{name}")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"{where}.content[{j}]: only text content parts are supported, "
                                        f"got type {part.type!r}.", param=f"{where}.content")
                texts.append(part.text)
            content = "\n".join(texts)
        extra = {k: v for k, v in (message.model_extra or {}).items() if k not in _UNSUPPORTED_MESSAGE_FIELDS}
        entry = {**extra, "role": message.role, "content": content or ""}
        if entry.get("reasoning") is not None and entry.get("reasoning_content") is None:
            entry["reasoning_content"] = entry["reasoning"]
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(400, f"{where}.tool_calls: only assistant messages carry tool calls.",
                               param=f"{where}.tool_calls")
            entry["tool_calls"] = [_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        result.append(entry)
    return result


def _call(call: ToolCallParam) -> dict[str, Any]:
    """A call of the conversation with its arguments as an object, what chat templates render.
    Empty or absent arguments are `{}` (vLLM's reading). Text that is not JSON (a call cut off by
    max_tokens, as an earlier response may return it) stays text: OpenAI takes it back as it is."""
    arguments = call.function.arguments
    if not arguments:
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    entry: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        entry["id"] = call.id
    return entry


# Jobs over this many characters run in the large-job thread.
SMALL_JOB_CHARS = 16_384
# The characters all the prompts of one body may have together, in prompts of the longest length
# max-model-len can hold.
BODY_PROMPTS_BUDGET = 4


UNTRUSTED_CHAT_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                           "Refused request with untrusted chat template.")  # vLLM's text


class Tokenization:
    def __init__(self, engine: LLMEngine, chat_template: str | None = None, trust_request_chat_template: bool = False):
        """`chat_template` (--chat-template): the template conversations render with instead of
        the tokenizer's. `trust_request_chat_template` (--trust-request-chat-template): a request's
        own (`chat_template`, or `chat_template_kwargs.chat_template`) is rendered rather than
        refused, in jinja2's sandbox and under the rendering budget (template_budget.py)."""
        self._engine = engine
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.max_model_len
        self.longest_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.max_model_len * self.longest_token_chars
        # All the prompts of one body together: a batch of several full-length prompts, not hundreds
        self.max_body_chars = BODY_PROMPTS_BUDGET * self.max_prompt_chars
        self._small = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tokenizer-large")
        self._pending: set[asyncio.Future] = set()
        self._token_texts: dict[int, str] = {}

    async def _run(self, chars: int, fn: Callable, *args: Any) -> Any:
        """fn(*args) in the thread for its size. Cancelling the caller drops a job not yet started;
        `fail_pending` makes the caller raise instead of waiting for it."""
        executor = self._small if chars <= SMALL_JOB_CHARS else self._large
        job = asyncio.wrap_future(executor.submit(fn, *args))
        failed = asyncio.get_running_loop().create_future()
        self._pending.add(failed)
        try:
            await asyncio.wait({job, failed}, return_when=asyncio.FIRST_COMPLETED)
            return job.result() if job.done() else failed.result()
        finally:
            self._pending.discard(failed)
            job.cancel()  # no-op when done; drops the job if it has not started

    def check_length(self, chars: int, param: str) -> None:
        """Text of `chars` characters that cannot fit in max-model-len tokens is a 400 now,
        before any tokenizing (vLLM's context-length message)."""
        if chars > self.max_prompt_chars:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"your prompt has {chars} characters, more than {self.max_model_len} tokens can hold "
                                f"(this vocabulary's longest token has {self.longest_token_chars} characters). "
                                f"Please reduce the length of the input.", param=param,
                           code="context_length_exceeded")

    def fail_pending(self, message: str) -> None:
        """At shutdown: every request still waiting for its tokens gets a 503 with `message`."""
        for failed in list(self._pending):
            if not failed.done():
                failed.set_exception(APIError(503, message))

    def shutdown(self) -> None:
        for executor in (self._small, self._large):
            executor.shutdown(wait=False, cancel_futures=True)

    async def completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                                 truncating: bool = False, param: str = "prompt",
                                 add_special_tokens: bool = True) -> list[Prompt]:
        """`prompt` as OpenAI allows it: a string, strings, token ids, or lists of token ids (texts
        get the tokenizer's special tokens, a BOS, unless `add_special_tokens` is false: vLLM's field).
        `truncating` (truncate_prompt_tokens given): a text longer than max-model-len can hold is
        tokenized anyway (the request's texts stay within the body's budget)."""
        if isinstance(prompt, str):
            items: list = [prompt]
        elif not prompt:
            raise APIError(400, f"{param} must not be empty.", param=param)
        elif isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        chars = 0
        for i, item in enumerate(items):
            if isinstance(item, str):
                if not truncating:
                    self.check_length(len(item), param if len(items) == 1 else f"{param}[{i}]")
                chars += len(item)
        if chars > self.max_body_chars:
            raise APIError(400, f"The prompts of this request have {chars} characters in all, more than one request "
                                f"may send ({self.max_body_chars}: {BODY_PROMPTS_BUDGET} prompts of the longest "
                                f"max-model-len can hold). Send them in several requests.", param=param)
        # One tokenizer job per prompt, queued one after the other: another request's job waits
        # behind one of these prompts at most, not behind the whole body.
        prompts = []
        for item in items:
            if isinstance(item, str):
                prompts.append(Prompt(item, await self._run(len(item), self._tokenize_one, item, add_special_tokens)))
            else:  # the engine checks the ids against the vocabulary
                prompts.append(Prompt(None, list(item)))
        return prompts

    def _tokenize_one(self, text: str, add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            return self._engine.tokenize(text)[1]
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
                          template_kwargs: dict[str, Any] | None = None,
                          chat_template: str | None = None, truncating: bool = False,
                          add_special_tokens: bool = False, fields: dict[str, Any] | None = None) -> list[int]:
        """The conversation rendered by the chat template (the request's own, `chat_template`, only
        when trusted) and tokenized; tool definitions, calls and results go where the template puts
        them, or in hermes text (engine/tool_prompts.py)."""
        own = chat_template if chat_template is not None else (template_kwargs or {}).get("chat_template")
        if own is not None and not self.trust_request_chat_template:
            raise APIError(400, UNTRUSTED_CHAT_TEMPLATE, param="chat_template")
        chars = sum(len(str(m.get("content") or "")) + len(json.dumps({k: v for k, v in m.items() if k != "content"}))
                    for m in messages)
        chars += len(json.dumps(tools or [])) + len(json.dumps(template_kwargs or {})) + len(chat_template or "")
        chars += len(json.dumps(fields or {}))
        chat_template = own or self.chat_template  # (an empty one: the server's)
        if not truncating:  # (truncate_prompt_tokens: kept to the body's budget only)
            self.check_length(chars, "messages")

        def render() -> list[int]:
            try:
                return self._engine.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message,
                                                        template_kwargs, chat_template, add_special_tokens,
                                                        fields)
            except TemplateFieldError as exc:
                raise APIError(400, str(exc), param=exc.field, code="unsupported_parameter") from exc
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from exc
            except Exception as exc:  # a Jinja error raised by the template itself
                raise APIError(400, f"the chat template rejected the messages: {exc}", param="messages") from exc
        return await self._run(chars, render)

    async def fill_in_the_middle(self, prompts: list[Prompt], suffix: str) -> None:
        """Each text prompt becomes <prefix> prompt <suffix> suffix <middle> (the prefix-suffix-middle
        order of StarCoder's and Qwen2.5-Coder's FIM tokens), in place. APIError (400) for a model
        without FIM tokens, or a prompt given as token ids."""
        fim = fim_token_ids(self.tokenizer)
        if fim is None:  # vLLM's text, and why
            raise APIError(400, "suffix is not currently supported for this model: its tokenizer has no "
                                "fill-in-the-middle tokens.", param="suffix")
        if any(p.text is None for p in prompts):
            raise APIError(400, "suffix needs the prompt as text, not token ids.", param="suffix")
        self.check_length(len(suffix) + sum(len(p.text) for p in prompts), "suffix")
        prefix_id, suffix_id, middle_id = fim
        tail = [suffix_id, *await self.encode(suffix, add_special_tokens=False), middle_id]
        for prompt in prompts:
            prompt.token_ids = [prefix_id, *await self.encode(prompt.text, add_special_tokens=False), *tail]

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self.check_length(len(text), "prompt")
        return await self._run(len(text), lambda: self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    async def decode(self, token_ids: list[int]) -> str:
        self.check_token_ids(token_ids, "tokens")
        return await self._run(len(token_ids), lambda: self.tokenizer.decode(token_ids))

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"Token id {bad} is out of vocabulary (the model has {self.vocab_size} tokens).",
                           param=param)

    def token_text(self, token_id: int) -> str:
        """One token as text (for logprobs); cached, since the same ids recur."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_name(self, token_id: int, as_id: bool) -> str:
        """How logprobs name a token: its text, or with `as_id` (vLLM's
        return_tokens_as_token_ids) "token_id:N", which survives tokens that are no text alone."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)
