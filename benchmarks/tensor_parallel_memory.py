"""Resident memory of each tensor-parallel process right after start-up, and its peak.

Starts `LLM(tensor_parallel_size=N)` on the default model and reads VmRSS (now) and VmHWM (peak)
of rank 0 (this process) and of every worker from /proc. Start-up memory, not speed: the machine
may be busy.

    python benchmarks/tensor_parallel_memory.py --tp 3 [--quantization auto]
"""
from __future__ import annotations

import argparse
import json
import os

from kvserve import LLM


def memory_mib(pid: int) -> dict[str, float]:
    """{"rss": VmRSS, "peak": VmHWM} of `pid`, MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) / 1024
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    args = parser.parse_args()
    llm = LLM(kv_cache_memory=args.kv_cache_memory, max_model_len=256, tensor_parallel_size=args.tp,
              quantization=args.quantization)
    pids = [os.getpid()] + [p.pid for p in llm.engine.parallel.processes]
    print(json.dumps({f"rank{i}": memory_mib(pid) for i, pid in enumerate(pids)}))
    llm.engine.close()


if __name__ == "__main__":
    main()
