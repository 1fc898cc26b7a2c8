"""Offline batch inference, like vLLM's `LLM`: `LLM().generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import numbers
import operator
from typing import Any, Callable, Sequence

from tqdm import tqdm

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict
Message = dict[str, Any]


class LLM:
    """`LLM(model=None)` loads the bundled default model; keyword arguments are `EngineArgs`."""

    def __init__(self, model: str | None = None, **engine_options: Any):
        self.engine = LLMEngine(EngineArgs(model=model, **engine_options))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Flush the KV tiers (with `kv_offloading_disk_path`, the cached prefixes go to disk for
        the next process) and stop their threads. Also what leaving a `with LLM(...)` block does."""
        self.engine.close()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """vLLM's: forget every cached prefix in the KV pool; False while requests hold blocks
        (between calls to generate none do). The offload tiers keep theirs."""
        return self.engine.reset_prefix_cache(reset_running_requests)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the SamplingParams a call without any uses, the model's generation config
        (--generation-config) over SamplingParams' defaults (engine/generation_defaults.py)."""
        defaults = self.engine.generation_defaults
        return SamplingParams(**defaults.sampling, **({"max_tokens": defaults.max_tokens}
                                                      if defaults.max_tokens is not None else {}))

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt, batched by the scheduler; results in prompt order.
        `use_tqdm` may be a tqdm-like class to show progress with (vLLM's). `priority` (one for
        all, or one per prompt; lower first) orders them under --scheduling-policy priority."""
        prompts = _prompt_list(prompts)
        priorities = _per_prompt(priority, len(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params]  # refused just below
        wrong = [type(p).__name__ for p in sampling_params if not isinstance(p, SamplingParams)]
        if wrong:  # vLLM's TypeError, not an AttributeError from inside the engine
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, one per prompt; "
                            f"got {wrong[0]}")
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids: list[str] = []
        try:
            for prompt, params, rank in zip(prompts, sampling_params, priorities):
                ids.append(self.engine.add_request(prompt, params, final_only=True, priority=rank, up_to_context=True))
        except Exception:
            for request_id in ids:  # all or nothing: no orphans left queued for the next call
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt],
              use_tqdm: bool | Callable[..., tqdm] = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, as `/v1/embeddings` computes it (the final-normed hidden states
        pooled by --pooling-type, L2-normalised), in vLLM's `LLM.embed` shape. Every prompt is
        checked before any runs; each gives its KV blocks back as soon as it is done."""
        token_ids = [self.engine.tokenize(prompt)[1] for prompt in _prompt_list(prompts)]
        for ids in token_ids:
            self.engine.validate(ids, SamplingParams(max_tokens=0))
        results = []
        with _progress(use_tqdm, len(token_ids), "Embedded prompts") as bar:
            for ids in token_ids:
                embedding = self.engine.embed(ids).tolist()
                results.append(EmbeddingRequestOutput(self.engine.new_request_id(), ids, EmbeddingOutput(embedding)))
                bar.update(1)
        return results

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None,
             priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Apply the chat template (`chat_template`, Jinja text, else the tokenizer's) to each
        conversation, then generate. `tools` (OpenAI tool definitions) and messages with
        `tool_calls` or role "tool" render as in the server: through the template where it handles
        them, else as hermes text (engine/tool_prompts.py). `continue_final_message` (with
        add_generation_prompt=False) continues the last message; `chat_template_kwargs` are extra
        template variables (vLLM's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            _checked(c), add_generation_prompt, tools, continue_final_message, chat_template_kwargs, chat_template)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, priority)

    def _run(self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        try:
            with _progress(use_tqdm, len(request_ids), "Processed prompts") as bar:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            results[output.request_id] = output
                            bar.update(1)
        except BaseException:  # Ctrl-C, or a progress bar's error: the call's requests go, not left to the next
            for request_id in request_ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        return [results[i] for i in request_ids]


def _per_prompt(priority: int | Sequence[int] | None, count: int) -> list[int]:
    """One priority per prompt: none (0), one for all, or a list as long as the prompts."""
    if priority is None:
        return [0] * count
    if isinstance(priority, (list, tuple)):
        if len(priority) != count:
            raise ValueError(f"give one priority, or one per prompt ({count}); got {len(priority)}")
        return list(priority)
    return [priority] * count


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts as a list, token ids as Python ints: a numpy array or numpy integers (a
    tokenizer's `return_tensors="np"`) are read as vLLM reads them; a wrong type is refused when
    it is tokenized."""
    def plain(prompt: Prompt) -> Prompt:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return {**prompt, "prompt_token_ids": plain(prompt["prompt_token_ids"])}
        if hasattr(prompt, "tolist"):  # a numpy array
            prompt = prompt.tolist()
        if isinstance(prompt, (list, tuple)):
            return [operator.index(t) if isinstance(t, numbers.Integral) else t for t in prompt]
        return prompt

    single = not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], numbers.Integral))
    return [plain(p) for p in ([prompts] if single else prompts)]


def _progress(use_tqdm: bool | Callable[..., tqdm], total: int, desc: str) -> tqdm:
    """A progress bar: tqdm's (hidden when use_tqdm is False), or the class given (vLLM's)."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc=desc)
    return tqdm(total=total, desc=desc, disable=not use_tqdm)


def _checked(conversation: list[Message]) -> list[Message]:
    """The conversation as the server reads one: `content: None` is empty text, and OpenAI's text
    content parts are their texts joined by newlines (as vLLM joins them). A message that is not a
    dict with a string role, or content that is not text, is a ValueError, not a template error."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("a conversation is a non-empty list of messages")
    result = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role', got {message!r:.80}")
        result.append({**message, "content": _text(message.get("content") or "", i)})
    return result


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message {index}'s content must be text or a list of text parts, got "
                         f"{type(content).__name__}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message {index}: only text content parts ({{'type': 'text', 'text': ...}}) are "
                             f"supported, got {kind!r}")
        texts.append(part["text"])
    return "\n".join(texts)
