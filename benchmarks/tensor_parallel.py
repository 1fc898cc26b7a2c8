"""Tensor parallelism on one machine: TP=1 against TP=N on the same batch, interleaved rounds.

Both engines stay up side by side; each round generates the same greedy batch on one, then on
the other, and the medians of output tokens per second are compared. Per rank: the weights and
KV pool it holds (measured on its tensors) and its resident memory. Rank 0's all-reduces are
timed around each call (their time includes waiting for the slowest rank), giving their share
of the decode time.

    python benchmarks/tensor_parallel.py --tp 3 --rounds 3 [--quantization auto|none]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.parallel.worker import sharded_layer_bytes
from kvserve.model.quant_linear import resident_weight_bytes

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a paged KV cache works.",
           "List five uses of copper.", "What is the capital of Australia, and why?"]


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """Resident memory now (VmRSS) or at its peak (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class ReduceTimer:
    """Wraps every layer's all-reduce hook on rank 0 to add up the seconds spent in it."""

    def __init__(self, llm: LLM):
        self.seconds = 0.0
        self.calls = 0
        for layer in llm.engine.model.layers:
            for module in (layer.self_attn, layer.mlp):
                module.reduce = self._timed(module.reduce)

    def _timed(self, reduce):
        def timed(x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = reduce(x)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out
        return timed


def _allreduce_rank(rank: int, world: int, port: int, rows: int, hidden: int, iters: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(rows, hidden, dtype=torch.bfloat16)
    for _ in range(10):
        dist.all_reduce(x)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times))
    dist.destroy_process_group()


def allreduce_latency(world: int, rows: int, hidden: int, iters: int = 200) -> float:
    """Median seconds of one gloo all-reduce of [rows, hidden] bfloat16 among `world` otherwise
    idle processes: the communication alone, without waiting for a busy rank."""
    import multiprocessing

    from kvserve.engine.parallel.group import free_port

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port("127.0.0.1")
    procs = [context.Process(target=_allreduce_rank, args=(r, world, port, rows, hidden, iters, out))
             for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join()
    return result


def run(llm: LLM, batch: int, max_tokens: int) -> tuple[float, int]:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", help="--quantization of both engines")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    options = {"dtype": args.dtype, "kv_cache_memory": "256MiB", "max_model_len": 512,
               "quantization": args.quantization}
    single = LLM(**options)
    tp1_weights, tp1_sharded = resident_weight_bytes(single.engine.model), sharded_layer_bytes(single.engine.model)
    parallel = LLM(**options, tensor_parallel_size=args.tp)
    timer = ReduceTimer(parallel)
    run(single, 2, 4), run(parallel, 2, 4)  # warm-up
    rates: dict[str, list[float]] = {"tp1": [], f"tp{args.tp}": []}
    reduce_share = []
    for _ in range(args.rounds):
        seconds, tokens = run(single, args.batch, args.max_tokens)
        rates["tp1"].append(tokens / seconds)
        timer.seconds, timer.calls = 0.0, 0
        seconds, tokens = run(parallel, args.batch, args.max_tokens)
        rates[f"tp{args.tp}"].append(tokens / seconds)
        reduce_share.append(timer.seconds / seconds)
    stats = parallel.engine.parallel.describe()
    pids = [os.getpid()] + [p.pid for p in parallel.engine.parallel.processes]
    rss = {"tp1 engine + rank 0 (one process)": rss_mib(pids[0]),
           **{f"rank{i + 1}": rss_mib(p) for i, p in enumerate(pids[1:])},
           **{f"rank{i + 1} peak": rss_mib(p, "VmHWM") for i, p in enumerate(pids[1:])}}
    hidden = parallel.engine.model_config.hidden_size
    layers = parallel.engine.model_config.num_layers
    parallel.engine.close()  # idle ranks for the all-reduce alone
    micro = {f"rows={rows}": allreduce_latency(args.tp, rows, hidden) for rows in (1, args.batch, 256)}
    result = {
        "machine": f"{os.cpu_count()}-vCPU {platform.processor() or platform.machine()}, torch {torch.__version__}",
        "dtype": str(parallel.engine.dtype), "batch": args.batch, "max_tokens": args.max_tokens,
        "output_tok_s_median": {k: statistics.median(v) for k, v in rates.items()},
        "output_tok_s_rounds": rates,
        "all_reduce_share_of_generate_median": statistics.median(reduce_share),
        "all_reduce_calls_per_round": timer.calls,
        "quantization": args.quantization,
        # Measured on the TP=1 engine's tensors (resident: dense copies for large batches included).
        "tp1": {"weights_mib": tp1_weights / 2**20, "sharded_layers_mib": tp1_sharded / 2**20,
                "kv_pool_mib": single.engine.kv_cache.nbytes / 2**20, "num_blocks": single.engine.num_blocks},
        "ranks": [{"rank": s.rank, "weights_mib": s.weight_bytes / 2**20,
                   "sharded_layers_mib": s.sharded_layer_bytes / 2**20, "kv_pool_mib": s.kv_pool_bytes / 2**20,
                   "q_heads": s.q_heads, "kv_heads": s.kv_heads, "linears": s.linears} for s in stats],
        "rss_mib": rss,
        "num_blocks_per_rank": parallel.engine.num_blocks,
        "allreduce_alone_s": micro,
        "allreduces_per_step": 2 * layers,
        "hidden_size": hidden,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
