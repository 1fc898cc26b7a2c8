"""Passkey retrieval (Mohtashami & Jaggi 2023, "Landmark Attention", arXiv:2305.16300): a 5-digit
key is hidden at a given depth of repetitive filler text and the model is asked to repeat it.
Greedy decoding; a trial passes when the first 5-digit number generated is the key.

The prompt is a raw completion (no chat template) ending in "The pass key is", which even a
135M model completes by copying. The default lengths are ones at which SmolLM2-135M with a
full-precision cache finds the key reliably (BENCHMARKS.md, "KV-cache dtypes"), so a quantized
cache that loses the key shows up as a lower score.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"
_KEY = re.compile(r"\d{5}")


@dataclass(frozen=True)
class PasskeyConfig:
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # prompt lengths in tokens (within one filler unit)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)  # where the needle sits, as a fraction of the filler
    trials: int = 3  # keys per (length, depth)
    seed: int = 0
    max_tokens: int = 8  # greedy tokens generated per trial

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 64:
            raise ValueError("passkey lengths must be at least 64 tokens")
        if not self.depths or not all(0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError("passkey depths must lie in [0, 1]")
        if self.trials < 1:
            raise ValueError("passkey trials must be positive")


@dataclass(frozen=True)
class PasskeyResult:
    correct: int
    total: int
    by_length: dict[int, tuple[int, int]]  # length -> (correct, total)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


def build_prompt(tokenizer, key: str, length: int, depth: float) -> list[int]:
    """Token ids of a passkey prompt of about `length` tokens with the needle at `depth`."""
    fixed = len(tokenizer.encode(INTRO + NEEDLE.format(key=key) + QUESTION))
    unit = len(tokenizer.encode(FILLER * 8)) / 8
    units = max(1, round((length - fixed) / unit))
    before = round(depth * units)
    text = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before) + QUESTION
    return tokenizer.encode(text)


@dataclass(frozen=True)
class PasskeyPrompt:
    length: int  # the requested length (the prompt is within one filler sentence of it)
    depth: float
    key: str
    token_ids: list[int]


def make_prompts(tokenizer, config: PasskeyConfig) -> list[PasskeyPrompt]:
    """`trials` random keys for every (length, depth), reproducible from `config.seed`."""
    rng = random.Random(config.seed)
    prompts = []
    for length in config.lengths:
        for depth in config.depths:
            for _ in range(config.trials):
                key = str(rng.randint(10000, 99999))
                prompts.append(PasskeyPrompt(length, depth, key, build_prompt(tokenizer, key, length, depth)))
    return prompts


def run_passkey(engine: LLMEngine, prompts: list[PasskeyPrompt], max_tokens: int = 8) -> PasskeyResult:
    """All trials in one batch through the engine's scheduler; greedy decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    pending = {engine.add_request(p.token_ids, params): p for p in prompts}
    answers: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                answers[output.request_id] = output.outputs[0].text
    by_length: dict[int, list[int]] = {}
    for request_id, prompt in pending.items():
        found = _KEY.search(answers[request_id])
        tally = by_length.setdefault(prompt.length, [0, 0])
        tally[0] += int(found is not None and found.group() == prompt.key)
        tally[1] += 1
    correct = sum(c for c, _ in by_length.values())
    return PasskeyResult(correct, len(prompts), {k: (c, t) for k, (c, t) in by_length.items()})
