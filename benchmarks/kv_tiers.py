"""KV offload tiers on the default model, offline (issue 21).

1. restart: a 4,096-token prefix computed by one engine with the disk tier, which closes (flushing
   it to disk); a fresh engine on the same directory (a restart) then serves prefix + a 32-token
   suffix, TTFT measured: cold (each block file fsync'ed and dropped from the OS page cache with
   posix_fadvise(POSIX_FADV_DONTNEED) first) and warm; against an engine without tiers that
   computes it. One new prefix per round; medians over rounds.
2. distinct: all-distinct prompts through a pool small enough that published blocks are reclaimed
   (so the tiers do their copying and writing), tiers on vs off: output throughput, median ratio
   over interleaved pairs; each engine built once, each pair on new prompts.

    python benchmarks/kv_tiers.py restart [--rounds 3]
    python benchmarks/kv_tiers.py distinct [--pairs 5]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.model.loader import load_model
from kvserve.sampling_params import SamplingParams


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from add_request to the first token, the request alone in the engine."""
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def drop_page_cache(directory: Path) -> int:
    count = 0
    for path in directory.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def restart(args, loaded) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="kvserve-tier-bench-"))
    base = dict(kv_cache_memory=args.kv_cache_memory, max_model_len=8192)
    tiered = EngineArgs(**base, kv_offloading_disk_path=str(directory))
    plain = LLMEngine(EngineArgs(**base), loaded)
    rng = random.Random(0)
    rows = []
    vocab = plain.model_config.vocab_size
    for r in range(args.rounds):
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
        prompt = prefix + [rng.randrange(100, vocab) for _ in range(32)]
        writer = LLMEngine(tiered, loaded)
        ttft(writer, prefix + [rng.randrange(100, vocab) for _ in range(32)])
        writer.close()
        files = drop_page_cache(directory)
        cold_engine = LLMEngine(tiered, loaded)
        cold = ttft(cold_engine, prompt)
        hits = cold_engine.kv_manager.stats.tier_hits["disk"]
        cold_engine.close()
        warm_engine = LLMEngine(tiered, loaded)
        warm = ttft(warm_engine, prompt[:-1] + [prompt[-1] ^ 1])  # same prefix, not the same request
        warm_engine.close()
        computed = ttft(plain, prompt)
        plain.kv_manager.pool.reset_prefix_cache()
        rows.append({"computed_s": computed, "disk_cold_s": cold, "disk_warm_s": warm, "disk_hit_tokens": hits,
                     "files": files})
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(directory)
    med = {k: statistics.median(row[k] for row in rows) for k in ("computed_s", "disk_cold_s", "disk_warm_s")}
    return {"rounds": rows, "median": med, "cold_speedup": med["computed_s"] / med["disk_cold_s"],
            "warm_speedup": med["computed_s"] / med["disk_warm_s"]}


def throughput(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens / (time.perf_counter() - start)


def distinct(args, loaded) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="kvserve-tier-bench-"))
    base = dict(kv_cache_memory=args.distinct_pool, max_model_len=2048)
    engines = {"off": LLMEngine(EngineArgs(**base), loaded),
               "on": LLMEngine(EngineArgs(**base, kv_offloading_size=args.host_gib,
                                          kv_offloading_disk_path=str(directory)), loaded)}
    vocab = engines["off"].model_config.vocab_size
    rng = random.Random(1)
    pairs = []
    for i in range(args.pairs):
        prompts = [[rng.randrange(100, vocab) for _ in range(args.distinct_len)] for _ in range(args.num_prompts)]
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        result = {}
        for name in order:
            start = time.perf_counter()
            result[name] = throughput(engines[name], prompts, args.output_len)
            result[f"{name}_s"] = time.perf_counter() - start
        result["ratio"] = result["on"] / result["off"]
        pairs.append(result)
        print(json.dumps(result), flush=True)
    on = engines["on"]
    usage = on.tiers.usage()
    out = {"pairs": pairs, "median_ratio": statistics.median(p["ratio"] for p in pairs),
           "offloaded_blocks": on.tiers.num_offloaded, "offload_engine_thread_s": on.tiers.offload_s,
           "on_total_s": sum(p["on_s"] for p in pairs), "dropped_writes": usage.dropped_writes,
           "disk_used_bytes": usage.disk_used_bytes, "host_used_bytes": usage.host_used_bytes}
    on.close()
    shutil.rmtree(directory)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("restart", "distinct"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--distinct-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--distinct-pool", default="128MiB", help="pool of the distinct runs: small, so blocks are reclaimed")
    parser.add_argument("--host-gib", type=float, default=0.25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    loaded = load_model(None)
    result = restart(args, loaded) if args.which == "restart" else distinct(args, loaded)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rounds", "pairs")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
