"""How busy the GPU is during decode steps: `--batch` requests of `--prompt-len` tokens decode
greedily; the throughput of a first run is printed (prefill included), then a second batch, once
every prompt is computed, runs decode-only steps: timed without the profiler (decode tok/s at
this batch), then recorded by torch.profiler, whose GPU busy time (the sum of the device's own
events) is compared with their wall time, with the kernels and copies per step. Issue 42's
criteria: the busy share and the decode tok/s at 128 requests. Whether CUDA graphs were captured
is printed first.

    python benchmarks/gpu_decode_profile.py --model /tmp/m1b [--async-scheduling] [--enforce-eager]

On CPU (a dry run of the script) only the throughput and the profiler's op count are printed.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile


def timed_steps(engine, steps: int, cuda: bool) -> float:
    """Wall seconds of `steps` engine steps, the device idle at both ends."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()

    from kvserve import LLM, SamplingParams

    # Graphs up to --batch only: the steps measured replay the graph of that size either way, and
    # capturing the 67 sizes up to 512 would only lengthen the start.
    options = dict(device=args.device, max_model_len=args.prompt_len + args.max_tokens + 64,
                   async_scheduling=args.async_scheduling, enforce_eager=args.enforce_eager,
                   max_cudagraph_capture_size=args.batch)
    if args.device != "cpu":
        options["gpu_memory_utilization"] = 0.5
    llm = LLM(args.model, **options)
    prompts = [{"prompt_token_ids": list(range(100 + i, 100 + i + args.prompt_len))} for i in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    graphs = llm.engine.runner.graphs
    label = ("async " if args.async_scheduling else "") + ("graphs" if graphs is not None else "eager")
    print(f"[{label}] CUDA graphs: " + (f"captured for batches {graphs.sizes[0]}-{graphs.max_batch} "
                                         f"({len(graphs.graphs)} graphs)" if graphs is not None else "none"))
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print(f"[{label}] {args.batch} x {args.prompt_len}/{args.max_tokens}: {elapsed:.2f} s, "
          f"{args.batch * args.max_tokens / elapsed:.0f} out tok/s", flush=True)

    cuda = args.device.startswith("cuda")
    # Decode-only steps once every request has its prompt computed: `steps` timed without the
    # profiler (decode tok/s at this batch), then `steps` under it.
    engine, steps = llm.engine, args.max_tokens // 2
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2 * steps + 8, ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    engine.step()
    plain_wall = timed_steps(engine, steps, cuda)
    print(f"[{label}] decode only, {args.batch} sequences: {args.batch * steps / plain_wall:,.0f} tok/s "
          f"({1e3 * plain_wall / steps:.2f} ms per step, {steps} steps, no profiler)", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall = timed_steps(engine, steps, cuda)
    averages = prof.key_averages()
    if not cuda:
        print(f"[{label}] profiled {steps} steps in {wall:.2f} s; {sum(e.count for e in averages)} torch ops")
        return
    print(averages.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    # Only the device's own events: an operator's row also carries its kernels' time, which would count them twice.
    on_device = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in on_device) / 1e6
    copies = sum(e.count for e in on_device if e.key.startswith(("Memcpy", "Memset")))
    kernels = sum(e.count for e in on_device) - copies
    # The profiler's own host cost (a few µs per recorded op) lengthens an eager step: the busy
    # time is also given against the same number of steps timed without it.
    print(f"[{label}] {args.batch} decodes per step: GPU busy {busy:.3f} s of {wall:.3f} s = {100 * busy / wall:.0f}% "
          f"({100 * busy / plain_wall:.0f}% of the unprofiled steps' {plain_wall:.3f} s), "
          f"{1e3 * wall / steps:.2f} ms per step, {kernels / steps:.0f} kernels and {copies / steps:.0f} copies "
          f"per step ({steps} steps)", flush=True)
    # The requests finish after the figures are out: a crash while draining loses nothing.
    while engine.has_unfinished_requests():
        engine.step()


if __name__ == "__main__":
    main()
