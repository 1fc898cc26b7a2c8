"""What one sampling step costs on the host, for a decode batch of the default model's vocabulary:
this tree's Sampler against another revision's (loaded from git), side by side in one process,
medians of interleaved rounds.

    python benchmarks/sampler_cost.py --against 1d7c5fc [--batch 32] [--vocab 49152] [--rounds 7]

Workloads: greedy rows; rows with repetition + frequency penalties over a 300-token history; half
the rows with top_p 0.9 beside seeded rows without; and (this tree only) rows with
allowed_token_ids or bad_words.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler
from kvserve.hardware import cpu_flags
from kvserve.sampling_params import SamplingParams


def sampler_at(rev: str) -> type:
    """The Sampler class of kvserve/engine/sampler.py at git revision `rev`."""
    source = subprocess.run(["git", "show", f"{rev}:kvserve/engine/sampler.py"], check=True, capture_output=True,
                            text=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sampler_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.Sampler


def workloads(batch: int, vocab: int) -> dict[str, list[Request]]:
    history = list(range(5, 305))

    def rows(make) -> list[Request]:
        return [Request(f"r{i}", history, make(i), (0,)) for i in range(batch)]

    return {
        "greedy": rows(lambda i: SamplingParams(temperature=0)),
        "penalties": rows(lambda i: SamplingParams(temperature=0, repetition_penalty=1.1, frequency_penalty=0.1)),
        "top_p mix": rows(lambda i: SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, seed=i)),
        "allowed_token_ids": rows(lambda i: SamplingParams(temperature=0, allowed_token_ids=list(range(100, 600)))),
        "bad_words": rows(lambda i: SamplingParams(temperature=0, bad_words=["x"])),
    }


def step_ms(sampler, logits: torch.Tensor, requests: list[Request], repeats: int) -> float:
    sampler.sample_on_device(logits, requests)
    start = time.perf_counter()
    for _ in range(repeats):
        sampler.sample_on_device(logits, requests)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision to compare with")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2's
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 4
    ours, theirs = Sampler(args.vocab, torch.device("cpu")), sampler_at(args.against)(args.vocab, torch.device("cpu"))
    print(f"CPU: {'AVX512' if 'avx512f' in cpu_flags() else 'AVX2'}, {torch.get_num_threads()} threads; "
          f"batch {args.batch}, vocab {args.vocab}; medians of {args.rounds} interleaved rounds")
    for name, requests in workloads(args.batch, args.vocab).items():
        for r in requests:  # bad_words as the engine tokenizes them (one token each here)
            if r.params.bad_words:
                r.bad_word_ids = ((7,), (8,))
        new_only = name in ("allowed_token_ids", "bad_words")
        mine, other = [], []
        for _ in range(args.rounds):
            mine.append(step_ms(ours, logits, requests, args.repeats))
            if not new_only:
                other.append(step_ms(theirs, logits, requests, args.repeats))
        line = f"{name:18s} this tree {statistics.median(mine):7.2f} ms"
        if other:
            line += (f"   {args.against} {statistics.median(other):7.2f} ms   "
                     f"ratio {statistics.median(mine) / statistics.median(other):.3f}")
        print(line)


if __name__ == "__main__":
    main()
