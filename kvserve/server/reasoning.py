"""A reasoning model's thinking, told apart from its answer (vLLM's `--reasoning-parser`).

DeepSeek-R1's distills (Llama and Qwen2 architectures) and QwQ think first, between `<think>`
and `</think>` (their chat templates open the `<think>` in the prompt), then answer. The
`deepseek_r1` parser, as vLLM's: the text before the first `</think>` is the reasoning, the text
after it the answer (`content`, null when empty); without a `</think>` all of it is reasoning (a
max_tokens cut before the answer); a leading `<think>` is dropped. When the prompt itself closed the
thinking (a template switch that writes `<think></think>`, or a continued message past it), all
output is the answer; so is the continuation of a final message that did not leave a `<think>` open.
The prompt decides, as in vLLM, unless the output itself opens with `<think>`: then it is thinking
(a template that writes earlier turns' thinking but does not open `<think>` in its generation
prompt, Qwen3's in a tool loop, leaves `</think>` as the prompt's last tag). A grammar is set up
from the prompt alone: after one that closed the thinking it applies from the first token. The
`qwen3` parser (Qwen3's hybrid and thinking-only models) reads the same tags by the same rules;
vLLM's non-streamed qwen3 parser returns output without `</think>` as content, kvserve as
reasoning, the same streamed or not. The reasoning goes out as vLLM's `reasoning` field, on the message
and on stream deltas; tool calls are read from the answer only, and a request's structured output
applies from the token after `</think>` (`StructuredOutputsParams.starts_after_token_id`).
A request's `thinking_token_budget` (vLLM's field; Anthropic's `thinking.budget_tokens`) caps the
thinking: once that many thinking tokens are out, `ThinkingBudget` makes `</think>` the only token
the sampler may pick, and the model answers (vLLM's, SGLang's and llama.cpp's way).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ThinkTags:
    start: str
    end: str


# vLLM's names. Qwen3's hybrid models open <think> themselves (an earlier turn's thinking in the
# prompt then leaves </think> its last tag: the output's own <think> decides, see opened_by), or the
# template closes it empty (enable_thinking=False); its thinking-only models' templates open it.
REASONING_PARSERS = {"deepseek_r1": ThinkTags("<think>", "</think>"), "qwen3": ThinkTags("<think>", "</think>")}


@dataclass(frozen=True)
class ReasoningParser:
    """A parser bound to the model's tokenizer: its end tag is one token, so that a grammar can
    start after it and reasoning tokens can be counted."""

    tags: ThinkTags
    start_id: int | None
    end_id: int

    @classmethod
    def for_tokenizer(cls, name: str, tokenizer: Any) -> "ReasoningParser":
        """ValueError with one line for an unknown name or a model without the tags as tokens."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"invalid reasoning parser: {name} (choose from {', '.join(sorted(REASONING_PARSERS))})")
        tags = REASONING_PARSERS[name]
        ids = {tag: tokenizer.encode(tag, add_special_tokens=False) for tag in (tags.start, tags.end)}
        if len(ids[tags.end]) != 1:
            raise ValueError(f"--reasoning-parser {name} needs a model whose tokenizer has {tags.end} as one token "
                             f"(a reasoning model's); this one spells it in {len(ids[tags.end])} tokens")
        start = ids[tags.start]
        return cls(tags, start[0] if len(start) == 1 else None, ids[tags.end][0])

    def thinks_after(self, prompt_ids: list[int], continues_message: bool, final_message: str) -> bool:
        """Whether the output starts as thinking: after a generation prompt, unless the prompt
        closed the thinking; continuing a final message, only if that message left a <think> open."""
        if continues_message:
            return final_message.rfind(self.tags.start) > final_message.rfind(self.tags.end)
        return not self.ended_in(prompt_ids)

    def opened_by(self, output_ids: list[int]) -> bool:
        """Whether the output opens with the start tag: then it thinks, whatever the prompt said
        (as vLLM's parsers strip a leading <think>). A Qwen3 template writes the thinking of the
        turns since the last user message (a tool loop's) but not the new turn's <think>, so its
        prompt ends on </think> while the model is about to think again."""
        return self.start_id is not None and output_ids[:1] == [self.start_id]

    def ended_in(self, prompt_ids: list[int]) -> bool:
        """True if the prompt closed the thinking: its last tag token is the end tag."""
        for token in reversed(prompt_ids):
            if token == self.end_id:
                return True
            if token == self.start_id:
                return False
        return False

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        """(reasoning, content, ended) of the text so far. Before the output is `final`, text that
        may still become a tag (a trailing "</thi") is held back from both."""
        start, end = self.tags.start, self.tags.end
        if text.startswith(start):
            text = text[len(start):]
        elif not final and text and start.startswith(text):
            return "", "", False
        at = text.find(end)
        if at >= 0:
            return text[:at], text[at + len(end):], True
        if not final:
            held = next((k for k in range(len(end) - 1, 0, -1) if text.endswith(end[:k])), 0)
            text = text[:len(text) - held]
        return text, "", False

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """How many of the output's tokens are thinking: those before `</think>` (all without one),
        a leading `<think>` not counted."""
        first = 1 if token_ids and token_ids[0] == self.start_id else 0
        try:
            return token_ids.index(self.end_id) - first
        except ValueError:
            return len(token_ids) - first


@dataclass
class ThinkingBudget:
    """A logits processor (SamplingParams.logits_processors) that ends the thinking at `budget`
    thinking tokens, counted as `ReasoningParser.reasoning_tokens` counts them, plus `spent` (the
    thinking of a continued final message, already in the prompt): at that point every logit but
    `</think>`'s is -inf. `thinks`: the prompt left the thinking open; otherwise only an output
    that opens with `<think>` is thinking. Once the thinking has ended it is `done` (the sampler
    stops calling it); until then it keeps where it has read up to, so a long thinking costs one
    look at each new token (n > 1 gives each sample its own copy)."""

    parser: ReasoningParser
    budget: int
    thinks: bool
    spent: int = 0
    done: bool = False
    _read: int = field(default=0, repr=False)

    def __call__(self, output_ids: list[int], logits: Any) -> Any:
        if self.done:
            return logits
        opened = self.parser.opened_by(output_ids)
        if not self.thinks and not opened:
            self.done = bool(output_ids)  # the first token decides: an output that did not open <think> answers
            return logits
        if self.parser.end_id in output_ids[self._read:]:
            self.done = True  # the thinking has ended (by itself, or forced)
            return logits
        self._read = len(output_ids)
        if self.spent + len(output_ids) - int(opened) >= self.budget:
            logits.fill_(-math.inf)
            logits[self.parser.end_id] = 0.0
        return logits

    @staticmethod
    def thinking_in(prompt_ids: list[int], parser: ReasoningParser) -> int:
        """The thinking tokens a continued final message holds: those after the prompt's last
        `<think>` (0 when the start tag is not one token)."""
        if parser.start_id is None or parser.start_id not in prompt_ids:
            return 0
        return prompt_ids[::-1].index(parser.start_id)
