"""Host time of `DeviceBlockTables.rows` per decode step: the device block tables' bookkeeping
for the CUDA decode graphs (engine/device_block_tables.py), on CPU tensors. Every request decodes
one token a step, its table gaining an entry every `--block-size` steps as the KV cache
manager's would: the same list object, grown in place.

    python benchmarks/device_block_tables.py [--requests 128] [--context 4096] [--block-size 16]
    PYTHONPATH=/path/to/other/checkout python benchmarks/device_block_tables.py   # another revision
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.engine.device_block_tables import DeviceBlockTables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--context", type=int, default=4096, help="tokens each request holds at the start")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    width = (args.context + args.steps) // args.block_size + 1
    per_step = []
    for _ in range(args.rounds):
        tables = DeviceBlockTables(args.requests, width, torch.device("cpu"))
        ids = [f"r{i}" for i in range(args.requests)]
        lists = [list(range(i * width, i * width + args.context // args.block_size)) for i in range(args.requests)]
        tables.rows(ids, lists)
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            if (args.context + step) % args.block_size == 0:
                for i, table in enumerate(lists):
                    table.append(i * width + len(table))
            tables.rows(ids, lists)
        per_step.append((time.perf_counter() - start) / args.steps * 1e6)
    print("us per step:", ", ".join(f"{t:.1f}" for t in per_step))
    print(f"median {statistics.median(per_step):.1f} us per step ({args.requests} requests, "
          f"{args.context}-token contexts, blocks of {args.block_size})")


if __name__ == "__main__":
    main()
