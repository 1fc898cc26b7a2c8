"""`kvserve bench latency`: offline latency of one batch, like vLLM's: `--batch-size` prompts of
`--input-len` random tokens, each generating exactly `--output-len` tokens, timed end to end
over `--num-iters` runs after `--num-iters-warmup`. Every iteration draws fresh prompts, so the
prefix cache cannot serve one iteration from the last."""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np

from kvserve.bench.report import save_json
from kvserve.bench.throughput import parse_backends
from kvserve.engine.args import EMBEDDING_ARGS, EngineArgs
from kvserve.engine.generation_defaults import ENGINE_DEFAULTS, GENERATION_CONFIG_ARGS
from kvserve.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def time_iterations(run_once: Callable[[int], None], warmup: int, iters: int) -> list[float]:
    """Seconds of each timed call of `run_once(iteration)` (warm-up calls are not kept)."""
    for i in range(warmup):
        run_once(i)
    latencies = []
    for i in range(warmup, warmup + iters):
        start = time.perf_counter()
        run_once(i)
        latencies.append(time.perf_counter() - start)
    return latencies


def summarize(latencies: list[float]) -> dict[str, Any]:
    arr = np.asarray(latencies)
    return {"avg_latency": float(arr.mean()), "latencies": latencies,
            "percentiles": {str(p): float(np.percentile(arr, p)) for p in PERCENTILES}}


def format_latency(backend: str, summary: dict[str, Any]) -> str:
    lines = [f"[{backend}] Avg latency: {summary['avg_latency']:.4f} seconds"]
    lines += [f"[{backend}] {p}% percentile latency: {v:.4f} seconds" for p, v in summary["percentiles"].items()]
    return "\n".join(lines)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("latency", help="offline latency of one batch on kvserve (and HF transformers)")
    p.add_argument("--backend", default="kvserve", help="comma list of kvserve, hf (default: kvserve)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-iters-warmup", type=int, default=2)
    p.add_argument("--num-iters", type=int, default=5)
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON")
    EngineArgs.add_cli_args(p, skip=(*GENERATION_CONFIG_ARGS, *EMBEDDING_ARGS))  # the workload sets its sampling
    p.set_defaults(func=run_latency_cli, generation_config=ENGINE_DEFAULTS)


def run_latency_cli(args: argparse.Namespace) -> int:
    from kvserve.bench.efficiency import random_prompts
    from kvserve.bench.hf_backend import HFGenerator, load_hf_model, pad_token_id
    from kvserve.llm import LLM

    backends = parse_backends(args.backend)
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    engine = llm.engine
    engine.validate([0] * args.input_len, SamplingParams(max_tokens=args.output_len))
    vocab = engine.model_config.vocab_size

    def prompts(i: int) -> list[list[int]]:
        return random_prompts(vocab, args.batch_size, args.input_len, seed=args.seed * 1_000_003 + i)

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    print(f"Batch of {args.batch_size} x {args.input_len} prompt tokens -> {args.output_len} output tokens each; "
          f"{str(engine.dtype).removeprefix('torch.')} on {engine.device}")
    data: dict[str, Any] = {}
    for backend in backends:
        if backend == "kvserve":
            def once(i: int) -> None:
                llm.generate(prompts(i), params, use_tqdm=False)
        else:
            generator = HFGenerator(load_hf_model(args.model, engine.dtype, engine.device),
                                    pad_token_id(llm.get_tokenizer()))

            def once(i: int) -> None:
                generator.generate_batch(prompts(i), args.output_len)
        data[backend] = summarize(time_iterations(once, args.num_iters_warmup, args.num_iters))
        print(format_latency(backend, data[backend]))
    if "kvserve" in data and "hf" in data:
        print(f"hf / kvserve: {data['hf']['avg_latency'] / data['kvserve']['avg_latency']:.2f}x average latency")
    if args.output_json:
        print(f"Result saved to {save_json(args.output_json, data)}")
    return 0
