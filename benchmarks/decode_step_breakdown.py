"""Where a decode step of the default model goes: wall time of the step's parts, and the number of
torch ops the profiler counts per step.

`--batch` requests (128-token prompts, distinct so that none shares a cached prefix; one by
default) decode greedily; after a warm-up, `--rounds` rounds of `--steps` steps each are timed
with the parts wrapped (input preparation, decoder layers + final norm, LM head, sampling; the
rest is the scheduler and output processing), and the medians printed. Run it against two
checkouts to compare them (PYTHONPATH picks the kvserve):

    PYTHONPATH=/path/to/before python benchmarks/decode_step_breakdown.py --label before
    PYTHONPATH=. python benchmarks/decode_step_breakdown.py --label after
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--label", default="kvserve")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=1, help="concurrent requests decoding together")
    parser.add_argument("--async-scheduling", action="store_true", help="the engine option of that name")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import kvserve.engine.model_runner as model_runner
    import kvserve.model.llama as llama
    from kvserve import LLM, SamplingParams

    if args.batch < 1:
        parser.error("--batch must be at least 1")
    max_tokens = 20 + args.rounds * args.steps + 40
    llm = LLM(quantization=args.quantization, kv_cache_memory=f"{256 * -(-args.batch // 4)}MiB",
              max_model_len=128 + max_tokens, **({"async_scheduling": True} if args.async_scheduling else {}))
    engine = llm.engine
    for i in range(args.batch):
        engine.add_request([100 + i] + list(range(1000, 1127)),
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    for _ in range(20):
        engine.step()
    spent: dict[str, float] = {}

    def timed(cls, name: str, part: str) -> None:
        original = getattr(cls, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                spent[part] = spent.get(part, 0.0) + time.perf_counter() - start

        setattr(cls, name, wrapper)

    timed(model_runner.ModelRunner, "prepare", "input preparation")
    timed(llama.LlamaForCausalLM, "final_hidden", "decoder layers + final norm")
    timed(llama.LlamaForCausalLM, "compute_logits", "LM head")
    # (the device-side part since the runner launches and waits separately; before that, all of it)
    sample = "sample_on_device" if hasattr(model_runner.Sampler, "sample_on_device") else "__call__"
    timed(model_runner.Sampler, sample, "sampling")
    rounds = []
    for _ in range(args.rounds):
        spent.clear()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step = (time.perf_counter() - start) / args.steps * 1e3
        parts = {k: v / args.steps * 1e3 for k, v in spent.items()}
        parts["rest (scheduler, outputs)"] = step - sum(parts.values())
        parts["step"] = step
        rounds.append(parts)
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            engine.step()
    ops = sum(event.count for event in prof.key_averages()) / 20
    print(f"{args.label}: ms per step of {args.batch} decode(s), median of {args.rounds} rounds "
          f"({args.threads} thread(s)); "
          f"torch ops per step {ops:.0f}")
    for part, ms in medians.items():
        print(f"  {part:32s} {ms:7.2f}")


if __name__ == "__main__":
    main()
