"""Prefix caching on vs off, offline on the default model (issue: automatic prefix caching).

1. Shared prefix: N requests share one P-token system prompt and differ in an S-token question;
   O output tokens each. Reports TTFT (mean, median) and total throughput with caching on and
   off, and the hit rate.
2. No sharing: N all-distinct prompts, so the cache can never hit; the cost of caching is the
   throughput ratio, median over interleaved on/off pairs (each run on a fresh, cold engine).

    python benchmarks/prefix_caching.py [--pairs 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve.bench.datasets import LengthRange, prefix_repetition_dataset, random_dataset
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model
from kvserve.sampling_params import SamplingParams


def run(engine: LLMEngine, prompts: list[str], output_len: int) -> dict:
    """All requests arrive at once; TTFT is measured from arrival to the first generated token."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first_token: dict[str, float] = {}
    prompt_tokens = output_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter() - start
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                output_tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    ttft = [first_token[i] for i in ids]
    stats = engine.kv_manager.stats
    return {"elapsed_s": elapsed, "mean_ttft_ms": 1000 * statistics.mean(ttft),
            "median_ttft_ms": 1000 * statistics.median(ttft),
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
            "hit_rate": stats.hits / stats.queries if stats.queries else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--distinct-len", type=int, default=256, help="prompt length of the no-sharing runs")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved on/off pairs of the no-sharing runs")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    loaded = load_model(None)

    def engine(caching: bool) -> LLMEngine:
        return LLMEngine(EngineArgs(kv_cache_memory=args.kv_cache_memory, max_model_len=4096,
                                    enable_prefix_caching=caching), loaded_model=loaded)

    tok = loaded.tokenizer
    shared = [s.prompt for s in prefix_repetition_dataset(tok, args.num_prompts, args.prefix_len, args.suffix_len,
                                                          1, args.output_len)]
    results: dict = {"shared_prefix": {}, "no_sharing": {"on": [], "off": []}}
    for caching in (False, True):
        label = "on" if caching else "off"
        results["shared_prefix"][label] = run(engine(caching), shared, args.output_len)
        print(f"shared prefix, caching {label}: {results['shared_prefix'][label]}", flush=True)
    on, off = results["shared_prefix"]["on"], results["shared_prefix"]["off"]
    results["shared_prefix"]["ttft_speedup"] = off["mean_ttft_ms"] / on["mean_ttft_ms"]
    results["shared_prefix"]["throughput_ratio"] = on["total_tokens_per_s"] / off["total_tokens_per_s"]

    for pair in range(args.pairs):
        distinct = [s.prompt for s in random_dataset(tok, args.num_prompts, LengthRange(args.distinct_len, args.distinct_len),
                                                     LengthRange(args.output_len, args.output_len), seed=pair)]
        order = (True, False) if pair % 2 == 0 else (False, True)
        for caching in order:
            label = "on" if caching else "off"
            results["no_sharing"][label].append(run(engine(caching), distinct, args.output_len))
            print(f"no sharing pair {pair}, caching {label}: {results['no_sharing'][label][-1]}", flush=True)
    ratios = [a["total_tokens_per_s"] / b["total_tokens_per_s"]
              for a, b in zip(results["no_sharing"]["on"], results["no_sharing"]["off"])]
    results["no_sharing"]["throughput_ratios"] = ratios
    results["no_sharing"]["median_throughput_cost"] = 1 - statistics.median(ratios)

    print(f"\nShared {args.prefix_len}-token prefix, {args.num_prompts} requests: mean TTFT "
          f"{off['mean_ttft_ms']:.0f} ms off -> {on['mean_ttft_ms']:.0f} ms on "
          f"({results['shared_prefix']['ttft_speedup']:.1f}x lower), total throughput "
          f"{off['total_tokens_per_s']:.0f} -> {on['total_tokens_per_s']:.0f} tok/s, hit rate {on['hit_rate']:.1%}")
    print(f"No sharing ({args.pairs} interleaved pairs): median throughput cost of caching "
          f"{results['no_sharing']['median_throughput_cost']:+.2%} (ratios {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
