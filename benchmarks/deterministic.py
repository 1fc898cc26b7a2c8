"""What --deterministic costs and what it buys, on the default model.

    python benchmarks/deterministic.py throughput [--rounds 3] [engine flags...]
    python benchmarks/deterministic.py latency [--rounds 3] [engine flags...]
    python benchmarks/deterministic.py outputs [--max-tokens 32] [engine flags...]

`throughput` alternates `kvserve bench throughput` with and without --deterministic on two
workloads (32 x 128/128, and the default one), `--rounds` times, and prints output tok/s per round,
the medians and their ratio; `latency` does the same with `kvserve bench latency` at batch 1 and 8. `outputs` runs 32 prompts (four groups of eight sharing a 256-token
prefix of the bundled book; even ones greedy, odd ones sampled with their own seed) alone with prefix
caching off as the reference, then under each condition the issue names: a batch of 64 mixed
requests, prefix-cache hits, 64-token chunked prefill, forced preemptions, blocks restored from the
disk tier after a restart, one thread; and prints, with and without --deterministic, how many of
the 32 differ from the reference in their tokens and in their logprobs.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOADS = {
    "32 x 128/128": ["--dataset-name", "random", "--num-prompts", "32", "--random-input-len", "128",
                     "--random-output-len", "128"],
    "default workload": [],
}


def throughput(rounds: int, engine_flags: list[str]) -> None:
    results: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, workload in WORKLOADS.items():
                for deterministic in (False, True):
                    out = Path(tmp) / "result.json"
                    command = [sys.executable, "-m", "kvserve.cli", "bench", "throughput", *workload, *engine_flags, "--output-json", str(out)]
                    if deterministic:
                        command.append("--deterministic")
                    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    value = json.loads(out.read_text())["kvserve"]["output_tokens_per_second"]
                    results.setdefault((name, deterministic), []).append(value)
                    print(f"round {r + 1} {name} deterministic={deterministic}: {value:.1f} output tok/s",
                          file=sys.stderr)
    print("| output tok/s | " + " | ".join(f"round {r + 1}" for r in range(rounds)) + " | median |")
    print("|---|" + "---|" * (rounds + 1))
    for (name, deterministic), values in results.items():
        label = f"{name}, {'--deterministic' if deterministic else 'default'}"
        print(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {statistics.median(values):.1f} |")
    for name in WORKLOADS:
        ratio = statistics.median(results[(name, True)]) / statistics.median(results[(name, False)])
        print(f"{name}: --deterministic / default, ratio of medians = {ratio:.3f}")


def latency(rounds: int, engine_flags: list[str]) -> None:
    """`kvserve bench latency` (128 prompt tokens -> 128 output tokens) at batch 1 and 8, alternating
    the modes: a lone stream is where a mode that multiplies more bytes per token would show it."""
    results: dict[tuple[int, bool], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for batch in (1, 8):
                for deterministic in (False, True):
                    out = Path(tmp) / "result.json"
                    command = [sys.executable, "-m", "kvserve.cli", "bench", "latency", "--batch-size", str(batch),
                               "--input-len", "128", "--output-len", "128", "--num-iters", "3", *engine_flags,
                               "--output-json", str(out)] + (["--deterministic"] if deterministic else [])
                    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    value = json.loads(out.read_text())["kvserve"]["avg_latency"]
                    results.setdefault((batch, deterministic), []).append(value)
                    print(f"round {r + 1} batch {batch} deterministic={deterministic}: {value:.3f} s", file=sys.stderr)
    print("| seconds per batch (128 -> 128) | " + " | ".join(f"round {r + 1}" for r in range(rounds)) + " | median |")
    print("|---|" + "---|" * (rounds + 1))
    for (batch, deterministic), values in results.items():
        label = f"batch {batch}, {'--deterministic' if deterministic else 'default'}"
        print(f"| {label} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {statistics.median(values):.3f} |")
    for batch in (1, 8):
        ratio = statistics.median(results[(batch, True)]) / statistics.median(results[(batch, False)])
        print(f"batch {batch}: --deterministic / default latency, ratio of medians = {ratio:.3f}")


# ------------------------------------------------------------------------------------------ outputs
def _prompts(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    from kvserve.bench.datasets import BOOK_PATH

    ids = tokenizer.encode(BOOK_PATH.read_text()[:200_000])
    rng = random.Random(0)
    prompts = []
    for group in range(4):
        prefix = ids[group * 5000: group * 5000 + 256]
        for _ in range(8):
            start = rng.randrange(30_000, len(ids) - 100)
            prompts.append(prefix + ids[start: start + rng.randrange(20, 60)])
    fillers = []
    for _ in range(32):
        start = rng.randrange(30_000, len(ids) - 400)
        fillers.append(ids[start: start + rng.randrange(16, 300)])
    return prompts, fillers


def _params(i: int, max_tokens: int):
    from kvserve import SamplingParams

    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    return SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


def _result(output) -> tuple:
    completion = output.outputs[0]
    return tuple(completion.token_ids), tuple(e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids))


def _run_conditions(deterministic: bool, max_tokens: int, engine_options: dict) -> dict[str, list[tuple]]:
    from kvserve import LLM, SamplingParams
    from kvserve.torch_threads import one_thread

    common = dict(deterministic=deterministic, max_model_len=1024, kv_cache_memory="512MiB", **engine_options)

    def alone(llm, prompts):
        return [_result(llm.generate([{"prompt_token_ids": p}], _params(i, max_tokens), use_tqdm=False)[0])
                for i, p in enumerate(prompts)]

    runs: dict[str, list[tuple]] = {}
    with LLM(enable_prefix_caching=False, **common) as llm:
        prompts, fillers = _prompts(llm.get_tokenizer())
        # The pool of the preemption run: 28 MiB (1,274 tokens of the default model in bfloat16),
        # or 1,100 tokens of a model with more KV bytes per token (one 1,024-token sequence fits).
        cache = llm.engine.kv_cache
        small_pool = max(28 << 20, 1100 * cache.block_nbytes // cache.spec.block_size)
        runs["reference (alone, no prefix caching)"] = alone(llm, prompts)
        order = [("p", i) for i in range(32)] + [("f", i) for i in range(32)]
        random.Random(1).shuffle(order)
        outputs = llm.generate(
            [{"prompt_token_ids": (prompts if k == "p" else fillers)[i]} for k, i in order],
            [_params(i, max_tokens) if k == "p" else
             SamplingParams(temperature=0.7, max_tokens=8 + i % 40, ignore_eos=True) for k, i in order],
            use_tqdm=False)
        mine = {i: o for (k, i), o in zip(order, outputs) if k == "p"}
        runs["batch of 64 mixed requests"] = [_result(mine[i]) for i in range(32)]
        with one_thread():
            runs["one thread"] = alone(llm, prompts)
    with LLM(enable_prefix_caching=True, **common) as llm:
        results = alone(llm, prompts)
        runs[f"prefix-cache hits (alone; {llm.engine.kv_manager.stats.hits} prompt tokens hit)"] = results
    with LLM(enable_prefix_caching=False, max_num_batched_tokens=64, **common) as llm:
        runs["--max-num-batched-tokens 64 (alone)"] = alone(llm, prompts)
    small = {**common, "kv_cache_memory": small_pool}
    with LLM(enable_prefix_caching=False, **small) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               [_params(i, max_tokens) for i in range(32)], use_tqdm=False)
        preemptions = llm.engine.scheduler.num_preemptions
        runs[f"forced preemption (32 at once, {preemptions} preemptions)"] = [_result(o) for o in outputs]
    with tempfile.TemporaryDirectory() as disk:
        tiered = {**common, "kv_offloading_disk_path": disk}
        with LLM(**tiered) as llm:
            alone(llm, prompts)
        with LLM(**tiered) as llm:
            restored = alone(llm, prompts)
            hits = llm.engine.kv_manager.stats.tier_hits["disk"]
        runs[f"disk tier after a restart ({hits} tokens from disk)"] = restored
    return runs


def outputs(max_tokens: int, engine_flags: list[str]) -> None:
    from kvserve.engine.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    parsed = vars(parser.parse_args(engine_flags))
    defaults = vars(parser.parse_args([]))
    engine_options = {k: v for k, v in parsed.items() if v != defaults[k]}
    table = {}
    for deterministic in (False, True):
        runs = _run_conditions(deterministic, max_tokens, engine_options)
        reference = runs.pop("reference (alone, no prefix caching)")
        for condition, results in runs.items():
            tokens = sum(r[0] != ref[0] for r, ref in zip(results, reference))
            bits = sum(r != ref for r, ref in zip(results, reference))
            table.setdefault(condition.split(" (")[0], {})[deterministic] = (condition, tokens, bits)
            print(f"deterministic={deterministic} {condition}: {tokens} differ in tokens, {bits} in logprobs",
                  file=sys.stderr)
    print("| condition (32 prompts, vs each alone) | default: tokens differ | default: logprobs differ | "
          "--deterministic: tokens differ | --deterministic: logprobs differ |")
    print("|---|---|---|---|---|")
    for _, modes in table.items():
        (label, t0, b0), (_, t1, b1) = modes[False], modes[True]
        print(f"| {label} | {t0} | {b0} | {t1} | {b1} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--rounds", type=int, default=3)
    lat = sub.add_parser("latency")
    lat.add_argument("--rounds", type=int, default=3)
    o = sub.add_parser("outputs")
    o.add_argument("--max-tokens", type=int, default=32)
    args, engine_flags = parser.parse_known_args()
    if args.command == "throughput":
        throughput(args.rounds, engine_flags)
    elif args.command == "latency":
        latency(args.rounds, engine_flags)
    else:
        outputs(args.max_tokens, engine_flags)


if __name__ == "__main__":
    main()
