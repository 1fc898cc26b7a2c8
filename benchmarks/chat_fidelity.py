"""KV-cache dtype fidelity on chat-formatted text, which `kvserve eval` (a novel) does not cover.

Short questions go through the model's chat template; the full-precision cache's greedy answers
(`--max-tokens`, EOS ignored) become the targets, and every configuration scores prompt + answer
teacher-forced through the paged cache (prefix caching off, so each is computed afresh). Reported
per configuration: mean KL divergence from the full-precision next-token distributions and top-1
agreement over the answer positions. A configuration is a --kv-cache-dtype, or
`fp8_e4m3:hadamard-keys` for fp8_e4m3 with its keys in the plain Hadamard basis instead of the
fitted one (kvserve/engine/key_basis.py).

    python benchmarks/chat_fidelity.py [--configs fp8_e4m3,fp8_e4m3:hadamard-keys,int8] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import gc

import torch

from kvserve import SamplingParams
from kvserve.cache.formats.rotation import hadamard_rotation
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.eval.perplexity import FidelityMeter
from kvserve.model.loader import load_model

QUESTIONS = [
    "What is the capital of France?", "Name a colour.", "What is 2 + 2?", "Who wrote Hamlet?",
    "Translate 'cat' to French.", "Give me a synonym for happy.", "What is the largest planet?",
    "Write a haiku about rain.", "How do I boil an egg?", "Explain photosynthesis simply.",
    "What is the speed of light?", "Tell me a joke.", "Why is the sky blue?", "List three fruits.",
    "What is Python?", "How many days are in a leap year?", "Who painted the Mona Lisa?",
    "What does DNA stand for?", "Suggest a name for a dog.", "What is the boiling point of water?",
    "Summarise the story of Cinderella.", "How do airplanes fly?", "What is a prime number?",
    "Give me a tip for studying.", "What language is spoken in Brazil?", "Describe a cat.",
    "What is gravity?", "How do I make tea?", "What is the tallest mountain?", "Define democracy.",
    "What is the square root of 81?", "Recommend a book for children.",
]


def _engine(loaded, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineArgs(kv_cache_dtype=kv_cache_dtype, kv_cache_memory="512MiB", max_model_len=1024,
                                enable_prefix_caching=False), loaded_model=loaded)


def _answer_logprobs(engine: LLMEngine, sequences: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """float32 log-probabilities of each sequence's answer positions, teacher-forced."""
    out = []
    for sequence, prompt_len in zip(sequences, prompt_lens):
        logits = engine.score(sequence, chunk_size=24)
        out.append(torch.log_softmax(logits[prompt_len - 1: len(sequence) - 1].float(), dim=-1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="fp8_e4m3,fp8_e4m3:hadamard-keys,fp8_e5m2,int8")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    loaded = load_model(None)
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    reference = _engine(loaded, "auto")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        reference.add_request(list(prompt), params, str(i))
    answers: dict[int, list[int]] = {}
    while reference.has_unfinished_requests():
        for out in reference.step():
            if out.finished:
                answers[int(out.request_id)] = list(out.outputs[0].token_ids)
    sequences = [list(prompt) + answers[i] for i, prompt in enumerate(prompts)]
    prompt_lens = [len(prompt) for prompt in prompts]
    reference_logprobs = _answer_logprobs(reference, sequences, prompt_lens)
    del reference
    gc.collect()
    print(f"{len(QUESTIONS)} chat-formatted questions, {args.max_tokens} answer tokens each, "
          f"{sum(r.shape[0] for r in reference_logprobs)} scored positions\n"
          "| configuration | chat KL | chat top-1 |\n|---|---|---|")
    for config in args.configs.split(","):
        kv_cache_dtype, _, variant = config.partition(":")
        engine = _engine(loaded, kv_cache_dtype)
        if variant == "hadamard-keys":
            cfg = engine.model_config
            hadamard = hadamard_rotation(cfg.head_dim, torch.float32, engine.device)
            engine.model.set_key_bases([hadamard.expand(cfg.num_kv_heads, -1, -1)] * cfg.num_layers)
        elif variant:
            raise SystemExit(f"unknown variant {variant!r} in {config!r}")
        meter = FidelityMeter()
        for logprobs, ref, sequence, prompt_len in zip(_answer_logprobs(engine, sequences, prompt_lens),
                                                       reference_logprobs, sequences, prompt_lens):
            meter.add(logprobs, torch.tensor(sequence[prompt_len:]), ref)
        result = meter.result()
        print(f"| {config} | {result.mean_kl:.4f} | {100 * result.top1_agreement:.2f}% |", flush=True)
        del engine
        gc.collect()


if __name__ == "__main__":
    main()
