"""A long StreamingLLM generation: per-token latency and KV memory over 50,000 generated tokens.

One sequence on the default model decodes `--num-tokens` tokens (greedy, end-of-sequence
ignored) with `--kv-eviction streaming --kv-budget 1024`. Every step's wall time and the KV
blocks the sequence holds are recorded. The summary compares the mean latency of the first and
the last 1,000 generated tokens (goal: ratio <= 1.1, i.e. the cost per token does not grow with
the length of the text); the plot shows blocks held and latency over the run.

    python benchmarks/eviction_streaming.py --num-tokens 50000 \\
        --json benchmarks/results/eviction-streaming.json --plot benchmarks/results/eviction-streaming.png
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from kvserve.cache.sizing import bytes_per_block
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.eval.runner import DEFAULT_TEXT
from kvserve.sampling_params import SamplingParams

WINDOW = 1000  # tokens compared at the start and the end


def run(num_tokens: int, budget: int, prompt_tokens: int) -> dict:
    engine = LLMEngine(EngineArgs(kv_eviction="streaming", kv_budget=budget, kv_cache_memory="256MiB"))
    prompt = engine.tokenizer.encode(DEFAULT_TEXT.read_text())[:prompt_tokens]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True), "long")
    request = engine.scheduler.waiting[0]
    seconds, blocks = [], []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - before)
        blocks.append(len(engine.kv_manager.req_blocks.get("long", ())) or blocks[-1])
    total = time.perf_counter() - start
    # Step 0 is the prefill (it samples the first token); every later step decodes one token.
    latency = np.array(seconds[1:]) * 1000
    first, last = latency[:WINDOW].mean(), latency[-WINDOW:].mean()
    per_block = bytes_per_block(engine.kv_spec, engine.kv_format)
    return {
        "model": str(engine.model_path), "dtype": str(engine.dtype).removeprefix("torch."),
        "budget": budget, "block_size": engine.args.block_size, "prompt_tokens": len(prompt),
        "generated_tokens": request.num_output_tokens, "evicted_tokens": request.num_evicted_tokens,
        "max_model_len": engine.max_model_len, "seconds": total,
        "first_1k_ms_per_token": float(first), "last_1k_ms_per_token": float(last), "ratio": float(last / first),
        "median_ms_per_token": float(np.median(latency)),
        # Medians too: on a shared 2-core machine another process's burst can inflate a mean.
        "first_1k_median_ms": float(np.median(latency[:WINDOW])),
        "last_1k_median_ms": float(np.median(latency[-WINDOW:])),
        # Tokens 1,001-2,000: the cache has just filled to the budget (the first 1K grow it from empty).
        "second_1k_ms_per_token": float(latency[WINDOW:2 * WINDOW].mean()),
        "max_blocks_held": max(blocks), "block_bound": math.ceil(budget / engine.args.block_size) + 2,
        "max_kv_mib_held": max(blocks) * per_block / 2**20,
        "blocks_held": blocks, "ms_per_token": [round(float(x), 3) for x in latency],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_blocks, ax_latency) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = np.arange(len(result["blocks_held"]))
    ax_blocks.plot(steps, result["blocks_held"], linewidth=0.8)
    ax_blocks.axhline(result["block_bound"], color="red", linestyle="--", linewidth=1,
                      label=f"bound ceil(budget/block)+2 = {result['block_bound']}")
    ax_blocks.set_ylabel("KV blocks held")
    ax_blocks.set_ylim(0, result["block_bound"] * 1.2)
    ax_blocks.legend(loc="lower right")
    latency = np.array(result["ms_per_token"])
    smooth = np.convolve(latency, np.ones(100) / 100, mode="valid")
    ax_latency.plot(np.arange(1, len(latency) + 1), latency, linewidth=0.3, alpha=0.4, label="per token")
    ax_latency.plot(np.arange(100, len(latency) + 1), smooth, linewidth=1.2, label="mean of 100")
    ax_latency.set_ylim(0, np.percentile(latency, 99.5) * 1.3)
    ax_latency.axvline(result["max_model_len"], color="gray", linestyle="--", linewidth=1)
    ax_latency.set_ylabel("ms per token")
    ax_latency.set_xlabel("tokens generated (gray: the model's trained context)")
    ax_latency.legend(loc="lower right")
    fig.suptitle(f"StreamingLLM, budget {result['budget']}: {result['generated_tokens']:,} tokens, "
                 f"last/first 1K latency {result['ratio']:.2f}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-tokens", type=int, default=50_000)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.num_tokens, args.budget, args.prompt_tokens)
    print(f"{result['generated_tokens']:,} tokens in {result['seconds']:.0f} s; first 1K "
          f"{result['first_1k_ms_per_token']:.2f} ms/token, last 1K {result['last_1k_ms_per_token']:.2f} ms/token "
          f"(ratio {result['ratio']:.3f}; medians {result['first_1k_median_ms']:.2f} / "
          f"{result['last_1k_median_ms']:.2f}); second 1K {result['second_1k_ms_per_token']:.2f} ms/token; "
          f"KV blocks held <= "
          f"{result['max_blocks_held']} (bound {result['block_bound']}, {result['max_kv_mib_held']:.1f} MiB)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
