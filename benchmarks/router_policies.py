"""Routing policies over two replicas: kv_aware vs round_robin vs least_loaded (issue 24).

Two `kvserve serve` replicas of the default model, each pool sized for about half of the shared
prefixes plus the running requests' own blocks, and one `kvserve router` per policy in front of
them. Each run is `kvserve bench serve` through one router; runs are interleaved (a round runs
every policy once, in rotated order) and every run has its own seed, so its prefixes are new to
both replicas whatever ran before. Reported per policy: the prefix-cache hit rate (the replicas'
counters over the run), mean TTFT and output tokens/s, medians over the rounds. Then all-distinct
prompts (nothing to share): kv_aware vs round_robin output throughput, median ratio.

    python benchmarks/router_policies.py [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

POLICIES = ("kv_aware", "round_robin", "least_loaded")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{url}: exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} not healthy in {timeout} s")


def bench(url: str, args: argparse.Namespace, seed: int, distinct: bool, out: Path) -> dict:
    workload = (["--dataset-name", "random", "--random-input-len", str(args.distinct_len),
                 "--random-output-len", str(args.output_len)] if distinct else
                ["--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                 "--prefix-repetition-suffix-len", str(args.suffix_len),
                 "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                 "--prefix-repetition-output-len", str(args.output_len)])
    command = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url, "--num-prompts",
               str(args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed",
               str(seed), "--disable-tqdm", "--metrics-interval", "0.5", "--save-result", str(out), *workload]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    return {"hit_rate": result["server_metrics"]["prefix_cache_hit_rate"], "mean_ttft_ms": result["mean_ttft_ms"],
            "output_tok_s": result["output_throughput"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--distinct-len", type=int, default=256)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="54MiB",
                        help="per replica: about half the prefixes plus the running requests' blocks")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    processes = []
    try:
        replicas = []
        for _ in range(2):
            port = free_port()
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "kvserve.cli", "--log-level", "WARNING", "serve", "--port", str(port),
                 "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len)], env=env))
            replicas.append(f"http://127.0.0.1:{port}")
        for url, process in zip(replicas, processes):
            wait_health(url, process)
        routers = {}
        for policy in POLICIES:
            port = free_port()
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "kvserve.cli", "--log-level", "WARNING", "router", "--port", str(port),
                 "--routing-policy", policy, *[x for r in replicas for x in ("--backend", r)]], env=env))
            routers[policy] = f"http://127.0.0.1:{port}"
        for policy, url in routers.items():
            while True:
                state = httpx.get(f"{url}/router/state", timeout=5).json() if _up(url) else None
                if state and all(b["up"] for b in state["backends"]) and (
                        policy != "kv_aware" or state["tokenizer_loaded"]):
                    break
                time.sleep(0.5)
        results: dict[str, list[dict]] = {p: [] for p in POLICIES}
        distinct: dict[str, list[dict]] = {"kv_aware": [], "round_robin": []}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            bench(routers["round_robin"], argparse.Namespace(**{**vars(args), "num_prompts": 8}), 999, True, out)
            seed = 1000
            for r in range(args.rounds):
                for i in range(len(POLICIES)):
                    policy = POLICIES[(r + i) % len(POLICIES)]
                    seed += 1
                    results[policy].append(bench(routers[policy], args, seed, False, out))
                    print(f"round {r} {policy}: {results[policy][-1]}", flush=True)
                for policy in (("kv_aware", "round_robin") if r % 2 == 0 else ("round_robin", "kv_aware")):
                    seed += 1
                    distinct[policy].append(bench(routers[policy], args, seed, True, out))
                    print(f"round {r} distinct {policy}: {distinct[policy][-1]}", flush=True)
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait()

    summary = {p: {k: statistics.median(run[k] for run in runs) for k in runs[0]} for p, runs in results.items()}
    ratio = statistics.median(k["output_tok_s"] / rr["output_tok_s"]
                              for k, rr in zip(distinct["kv_aware"], distinct["round_robin"]))
    print("\n| policy | prefix hit rate | mean TTFT (ms) | output tok/s |\n|---|---|---|---|")
    for policy, s in summary.items():
        print(f"| {policy} | {100 * s['hit_rate']:.1f}% | {s['mean_ttft_ms']:.0f} | {s['output_tok_s']:.1f} |")
    kv, rr = summary["kv_aware"], summary["round_robin"]
    print(f"\nkv_aware / round_robin: hit rate x{kv['hit_rate'] / rr['hit_rate']:.2f}, mean TTFT "
          f"x{rr['mean_ttft_ms'] / kv['mean_ttft_ms']:.2f} lower; all-distinct output throughput ratio "
          f"{ratio:.3f} (median of {len(distinct['kv_aware'])} interleaved pairs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results, "distinct": distinct,
                                               "summary": summary, "distinct_ratio": ratio}, indent=1))


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/router/state", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
