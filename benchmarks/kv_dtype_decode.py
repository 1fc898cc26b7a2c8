"""Decode throughput of each KV-cache dtype (and attention backend) relative to the first, on the
default model.

One engine per dtype and attention backend, built from a single checkpoint load and all kept alive, so the dtypes can
be measured in interleaved rounds (a machine shared with other jobs drifts; interleaving spreads
the drift over all dtypes). Each round times pure decode steps of `--concurrency` sequences with
random prompts of `--prompt-len` tokens (`kvserve.bench.efficiency.kvserve_decode`, the decode
measurement of `kvserve bench throughput --efficiency`). Reported: every round, the best round,
and the median over rounds of each round's ratio to the first dtype (measured side by side, the
figure that drifts least on a shared machine).

    python benchmarks/kv_dtype_decode.py [--concurrency 32] [--prompt-len 256] [--steps 32] [--rounds 5]
    python benchmarks/kv_dtype_decode.py --kv-cache-dtypes auto --attention-backends torch,cpu_paged
"""
from __future__ import annotations

import argparse
import itertools
import statistics

from kvserve.bench.efficiency import kvserve_decode
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model


class _Engine:
    """The `llm.engine` shape that kvserve_decode expects."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8_e4m3,fp8_e5m2,int8,int4,int4_kivi")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--attention-backends", default="auto", help="comma-separated --attention-backend values")
    args = parser.parse_args()
    backends = args.attention_backends.split(",")
    variants = list(itertools.product(args.kv_cache_dtypes.split(","), backends))
    label = {v: v[0] if len(backends) == 1 else f"{v[0]}, {v[1]}" for v in variants}
    loaded = load_model(None)
    engines = {label[v]: _Engine(LLMEngine(EngineArgs(kv_cache_dtype=v[0], attention_backend=v[1],
                                                      kv_cache_memory=args.kv_cache_memory,
                                                      max_model_len=args.prompt_len + args.steps + 1),
                                           loaded_model=loaded)) for v in variants}
    names = list(engines)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            run = kvserve_decode(engines[name], args.concurrency, args.prompt_len, args.steps, seed=round_)
            rates[name].append(run.tokens_per_s)
    reference = rates[names[0]]
    print(f"decode, {args.concurrency} sequences, prompts of {args.prompt_len} tokens, {args.steps} steps, "
          f"{args.rounds} interleaved rounds")
    print(f"| kv cache dtype{'' if len(backends) == 1 else ', attention backend'} | decode tok/s (rounds) | best | best vs {names[0]} | median of round ratios |\n"
          "|---|---|---|---|---|")
    for name in names:
        rounds = ", ".join(f"{r:.1f}" for r in rates[name])
        ratio = statistics.median(r / ref for r, ref in zip(rates[name], reference))
        print(f"| {name} | {rounds} | {max(rates[name]):.1f} | {max(rates[name]) / max(reference):.2f}x | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
