"""`kvserve bench throughput`: offline, in-process throughput like vLLM's, on kvserve and on Hugging
Face transformers `generate` with the same requests, checkpoint, dtype and device.

The default workload is the engine's reference one: 64 requests, prompts of 32-512 tokens and
outputs of 32-256 tokens, every request generating exactly its length (end-of-sequence ignored).
kvserve gets all requests at once (continuous batching); HF serves them in arrival order in
static batches of --hf-batch-size, left-padded, each batch generating to its longest request.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from kvserve.bench.datasets import GivenAction, add_dataset_args, build_dataset, check_dataset_args
from kvserve.bench.report import save_json
from kvserve.engine.args import EMBEDDING_ARGS, EngineArgs
from kvserve.engine.generation_defaults import ENGINE_DEFAULTS, GENERATION_CONFIG_ARGS
from kvserve.sampling_params import SamplingParams

BACKENDS = ("kvserve", "hf")


@dataclass
class ThroughputResult:
    backend: str
    elapsed_time: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.elapsed_time

    @property
    def tokens_per_second(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_time

    @property
    def output_tokens_per_second(self) -> float:
        return self.output_tokens / self.elapsed_time

    def line(self) -> str:
        return (f"Throughput: {self.requests_per_second:.2f} requests/s, {self.tokens_per_second:.2f} total tokens/s, "
                f"{self.output_tokens_per_second:.2f} output tokens/s")

    def to_dict(self) -> dict[str, Any]:  # vLLM's keys, plus the output rate
        return {"elapsed_time": self.elapsed_time, "num_requests": self.num_requests,
                "total_num_tokens": self.prompt_tokens + self.output_tokens,
                "requests_per_second": self.requests_per_second, "tokens_per_second": self.tokens_per_second,
                "output_tokens_per_second": self.output_tokens_per_second,
                "total_prompt_tokens": self.prompt_tokens, "total_output_tokens": self.output_tokens}


def parse_backends(text: str) -> list[str]:
    names = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"--backend takes a comma list of {', '.join(BACKENDS)} (each once); got {text!r}")
    return names


def run_kvserve(llm: Any, prompts: list[list[int]], output_lens: list[int]) -> ThroughputResult:
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in output_lens]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return ThroughputResult("kvserve", elapsed, len(prompts), sum(map(len, prompts)), produced)


def run_hf(generator: Any, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> ThroughputResult:
    generator.generate_batch(prompts[:1], 4)  # warm-up
    elapsed = generator.run(prompts, output_lens, batch_size)
    # Only the tokens each request asked for count; a batch's padding to its longest is overhead.
    return ThroughputResult("hf", elapsed, len(prompts), sum(map(len, prompts)), sum(output_lens))


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("throughput", help="offline throughput of kvserve (and HF transformers) on one workload")
    p.add_argument("--backend", default="kvserve", help="comma list of kvserve, hf (default: kvserve)")
    p.add_argument("--hf-batch-size", type=int, default=32, action=GivenAction,
                   help="static batch size of the HF backend")
    p.add_argument("--efficiency", action="store_true",
                   help="also measure matmul peak and memory bandwidth, single-stream decode (and HF's), and "
                        "decode FLOP/s at 32 and 128 concurrent sequences as a share of the peak")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results as JSON")
    add_dataset_args(p, num_prompts=64, input_len="32:512", output_len="32:256")
    # --seed is the workload's (and the engine's) seed; the workload sets its sampling
    EngineArgs.add_cli_args(p, skip=("seed", *GENERATION_CONFIG_ARGS, *EMBEDDING_ARGS))
    p.set_defaults(func=run_throughput_cli, generation_config=ENGINE_DEFAULTS)


def run_throughput_cli(args: argparse.Namespace) -> int:
    from kvserve.bench.hf_backend import HFGenerator, load_hf_model, pad_token_id
    from kvserve.llm import LLM

    backends = parse_backends(args.backend)
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be at least 1, got {args.hf_batch_size}")
    if getattr(args, "hf_batch_size_given", False) and "hf" not in backends:
        raise ValueError("--hf-batch-size is the HF backend's batch size: it needs --backend hf")
    check_dataset_args(args)
    # kvserve is loaded even for `--backend hf` alone: it resolves the device, dtype and tokenizer.
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    samples = build_dataset(args, tokenizer)
    prompts = [tokenizer.encode(s.prompt, add_special_tokens=False) for s in samples]
    output_lens = [s.expected_output_len for s in samples]
    for prompt, n in zip(prompts, output_lens):
        engine.validate(prompt, SamplingParams(max_tokens=n))  # too long for the model: say so before any run
    print(f"Workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} each), {sum(output_lens)} output tokens "
          f"({min(output_lens)}-{max(output_lens)} each); {str(engine.dtype).removeprefix('torch.')} on {engine.device}")

    generator = None
    if "hf" in backends:
        generator = HFGenerator(load_hf_model(args.model, engine.dtype, engine.device), pad_token_id(tokenizer))
    results: dict[str, ThroughputResult] = {}
    for backend in backends:
        if backend == "kvserve":
            results[backend] = run_kvserve(llm, prompts, output_lens)
        else:
            results[backend] = run_hf(generator, prompts, output_lens, args.hf_batch_size)
        r = results[backend]
        print(f"[{backend}] {r.line()}")
        print(f"[{backend}] Total num prompt tokens:  {r.prompt_tokens}")
        print(f"[{backend}] Total num output tokens:  {r.output_tokens}")
    if "kvserve" in results and "hf" in results:
        ratio = results["kvserve"].output_tokens_per_second / results["hf"].output_tokens_per_second
        print(f"kvserve / hf: {ratio:.2f}x output tokens/s")
    data: dict[str, Any] = {backend: r.to_dict() for backend, r in results.items()}
    if args.efficiency:
        from kvserve.bench.efficiency import efficiency_report

        report = efficiency_report(llm, generator, seed=args.seed)
        print(report.format())
        data["efficiency"] = report.to_dict()
    if args.output_json:
        print(f"Result saved to {save_json(args.output_json, data)}")
    return 0
