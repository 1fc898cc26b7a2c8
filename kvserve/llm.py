"""Offline batch inference, like vLLM's `LLM`: `LLM().generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.outputs import RequestOutput
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

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt, batched by the scheduler; results in prompt order."""
        if not isinstance(prompts, (list, tuple)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (a wrong type is refused when it is tokenized)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                ids.append(self.engine.add_request(prompt, params, final_only=True))
        except Exception:
            for request_id in ids:  # all or nothing: no orphans left queued for the next call
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate. `tools` (OpenAI
        tool definitions) and messages with `tool_calls` or role "tool" render as in the server:
        through the template where it handles them, else as hermes text (engine/tool_prompts.py).
        `continue_final_message` (with add_generation_prompt=False) continues the last message;
        `chat_template_kwargs` are extra template variables (vLLM's)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.engine.apply_chat_template(
            _checked(c), add_generation_prompt, tools, continue_final_message, chat_template_kwargs)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        return [results[i] for i in request_ids]


def _checked(conversation: list[Message]) -> list[Message]:
    """The conversation with `content: None` read as empty text (as the server does); a message
    that is not a dict with a string role is a ValueError, not a template error."""
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("a conversation is a non-empty list of messages")
    result = []
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must be a dict with a string 'role', got {message!r:.80}")
        result.append({**message, "content": message.get("content") or ""})
    return result
