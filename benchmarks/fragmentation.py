"""KV memory waste of paged allocation (blocks of 8/16/32) vs contiguous preallocation of
max-model-len per sequence, on a ShareGPT-like workload, through kvserve's scheduler and block
allocator. Prints a Markdown table (the one in BENCHMARKS.md).

    python benchmarks/fragmentation.py --requests 1000 --budget-tokens 65536
"""
from __future__ import annotations

import argparse
import platform
import time

from kvserve.plan.fragmentation import measure_waste, sharegpt_like


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--budget-tokens", type=int, default=65536, help="KV slots shared by all sequences")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-sizes", default="8,16,32")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of both length distributions")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    workload = sharegpt_like(args.requests, args.max_model_len, args.sigma, args.seed)
    print(f"{args.requests} requests, mean prompt {workload.mean_prompt:.1f}, mean output {workload.mean_output:.1f} "
          f"tokens; budget {args.budget_tokens:,} token slots; max-model-len {args.max_model_len}; "
          f"{platform.machine()} {platform.python_version()}, {time.strftime('%Y-%m-%d')}\n")
    runs = [("paged", int(b)) for b in args.block_sizes.split(",")] + [("contiguous", args.max_model_len)]
    results = []
    for kind, block in runs:
        start = time.perf_counter()
        result = measure_waste(workload, block, args.budget_tokens, args.max_model_len)
        results.append((kind, result, time.perf_counter() - start))
    contiguous = results[-1][1]
    print("| allocation | block size | blocks | waste (time-averaged) | mean running seqs (pool-bound) | "
          "vs contiguous | max running | preemptions | steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, r, _ in results:
        print(f"| {kind} | {r.block_size} | {r.num_blocks:,} | {r.waste_fraction:.2%} | {r.mean_running:.1f} | "
              f"{r.mean_running / contiguous.mean_running:.2f}x | {r.max_running} | {r.preemptions:,} | {r.steps:,} |")
    print(f"\nsimulated in {sum(t for *_, t in results):.1f} s")


if __name__ == "__main__":
    main()
