"""One concurrent batch, timed and then profiled: where a commit's c8/c32 figure goes.

Builds the engine once (the default model, `--quantization auto`), warms it up, times `--rounds`
batches of `--concurrency` requests of `--prompt-tokens` random ids in and `--decode-tokens` out
(greedy, end to end as vs_llama_cpp.py's cN), prints their output tok/s, then runs one more batch
under cProfile and prints its top functions by own time. Run it for two checkouts alternately
(PYTHONPATH=<checkout>) to tell a per-step cost from this VM's drift.

    python benchmarks/concurrent_profile.py --concurrency 8
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.bench.efficiency import random_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--top", type=int, default=25, help="functions to print from the profile (0: none)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(None, quantization="auto", kv_cache_memory="2GiB", max_model_len=1024, max_num_seqs=256)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)

    def batch(seed: int) -> float:
        prompts = random_prompts(vocab, args.concurrency, args.prompt_tokens, seed)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return args.concurrency * args.decode_tokens / (time.perf_counter() - start)

    batch(1)
    rates = [batch(2 + r) for r in range(args.rounds)]
    print(f"c{args.concurrency} output tok/s: {', '.join(f'{r:.1f}' for r in rates)} "
          f"(median {statistics.median(rates):.1f})", flush=True)
    if args.top:
        profile = cProfile.Profile()
        profile.enable()
        batch(1000)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
