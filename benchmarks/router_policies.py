"""Routing policies over two replicas: kv_aware vs round_robin vs least_loaded (issue 24).

Two `kvserve serve` replicas of the default model, each pool sized for about half of the shared
prefixes plus the running requests' own blocks, and one `kvserve router` per policy in front of
them. Each run is `kvserve bench serve` through one router; runs are interleaved (a round runs
every policy once, in rotated order) and every run has its own seed, so its prefixes are new to
both replicas whatever ran before. Reported per policy: the prefix-cache hit rate (the replicas'
counters over the run), mean TTFT and output tokens/s, medians over the rounds. Then all-distinct
prompts (nothing to share): kv_aware vs round_robin output throughput, median ratio.

    python benchmarks/router_policies.py [--rounds 3] [--json out.json]

Rounds can be split over several invocations (`--first-round K` numbers them, and so seeds them,
from K) and reported together: `--combine a.json b.json`.
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


def routed(url: str) -> dict[str, int]:
    return {b["name"]: b["routed"] for b in httpx.get(f"{url}/router/state", timeout=5).json()["backends"]}


def bench(url: str, args: argparse.Namespace, seed: int, distinct: bool, out: Path,
          num_prompts: int | None = None) -> dict:
    workload = (["--dataset-name", "random", "--random-input-len", str(args.distinct_len),
                 "--random-output-len", str(args.output_len)] if distinct else
                ["--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                 "--prefix-repetition-suffix-len", str(args.suffix_len),
                 "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                 "--prefix-repetition-output-len", str(args.output_len)])
    command = [sys.executable, "-m", "kvserve.cli", "bench", "serve", "--base-url", url, "--num-prompts",
               str(num_prompts or args.num_prompts), "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed",
               str(seed), "--disable-tqdm", "--metrics-interval", "0.5", "--save-result", str(out), *workload]
    before = routed(url)
    started, load_before = time.strftime("%H:%M:%S", time.gmtime()), os.getloadavg()[0]
    start = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    after = routed(url)
    result = json.loads(out.read_text())
    return {"hit_rate": result["server_metrics"]["prefix_cache_hit_rate"], "mean_ttft_ms": result["mean_ttft_ms"],
            "output_tok_s": result["output_throughput"], "seed": seed, "wall_s": round(time.monotonic() - start, 1),
            "started_utc": started, "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "routed": {name: after[name] - before[name] for name in after},
            "ttfts_ms": [round(1000 * t, 1) for t in result["ttfts"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=256, help="prefix-repetition requests per run (0: none)")
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--distinct-len", type=int, default=256)
    parser.add_argument("--distinct-prompts", type=int, default=48, help="all-distinct prompts per run (0: none)")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="99MiB",
                        help="per replica: about half the prefixes plus the running requests' blocks (99MiB "
                             "with bfloat16 KV; 198MiB where dtype auto is float32, on CPUs without bf16)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--first-round", type=int, default=0, help="number (and seed) rounds from here")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                        help="the routers to run (default: all three; kv_aware and round_robin are compared)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--combine", nargs="+", default=None, metavar="JSON",
                        help="only report the runs saved by earlier invocations together")
    args = parser.parse_args()
    if args.combine:
        saved = [json.loads(Path(path).read_text()) for path in args.combine]
        report({p: [run for s in saved for run in s["runs"][p]] for p in POLICIES},
               {p: [run for s in saved for run in s["distinct"].get(p, [])] for p in POLICIES})
        return

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
        for policy in args.policies:
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
        distinct: dict[str, list[dict]] = {p: [] for p in POLICIES}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            bench(routers[args.policies[0]], argparse.Namespace(**{**vars(args), "num_prompts": 8}), 999, True, out)
            seed = 1000 + 10 * args.first_round
            for r in range(args.first_round, args.first_round + args.rounds):
                order = args.policies
                for i in range(len(order) if args.num_prompts > 0 else 0):
                    policy = order[(r + i) % len(order)]
                    seed += 1
                    results[policy].append(bench(routers[policy], args, seed, False, out))
                    print(f"round {r} {policy}: {results[policy][-1]}", flush=True)
                    save(args, results, distinct)
                for i in range(len(order) if args.distinct_prompts > 0 else 0):
                    policy = order[(r + i + 1) % len(order)]
                    seed += 1
                    distinct[policy].append(bench(routers[policy], args, seed, True,
                                                  out, num_prompts=args.distinct_prompts))
                    print(f"round {r} distinct {policy}: {distinct[policy][-1]}", flush=True)
                    save(args, results, distinct)
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait()

    save(args, results, distinct)
    report(results, distinct)


def save(args: argparse.Namespace, results: dict, distinct: dict) -> None:
    """After every run, so a benchmark stopped early keeps what it measured."""
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results, "distinct": distinct},
                                              indent=1))


def report(results: dict[str, list[dict]], distinct: dict[str, list[dict]]) -> None:
    """Medians over rounds per policy, and kv_aware / round_robin both ways: per round (paired
    runs of one round) and as the ratio of the per-policy means over the rounds."""
    keys = ("hit_rate", "mean_ttft_ms", "output_tok_s")
    print("\n| policy | hit rate per round | mean TTFT (ms) per round | output tok/s per round |\n|---|---|---|---|")
    for policy, runs in results.items():
        hits = " / ".join(f"{100 * r['hit_rate']:.1f}%" for r in runs)
        ttfts = " / ".join(f"{r['mean_ttft_ms']:.0f}" for r in runs)
        tputs = " / ".join(f"{r['output_tok_s']:.1f}" for r in runs)
        print(f"| {policy} | {hits} | {ttfts} | {tputs} |")
    kv, rr = results["kv_aware"], results["round_robin"]
    if kv and rr:
        mean = {p: {k: statistics.mean(r[k] for r in runs) for k in keys} for p, runs in results.items() if runs}
        hit = [a["hit_rate"] / b["hit_rate"] for a, b in zip(kv, rr)]
        ttft = [b["mean_ttft_ms"] / a["mean_ttft_ms"] for a, b in zip(kv, rr)]
        tput = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(kv, rr)]
        print(f"\nkv_aware / round_robin: hit rate x{statistics.median(hit):.2f} (per round "
              f"{', '.join(f'{x:.2f}' for x in hit)}); mean TTFT {statistics.median(ttft):.2f}x lower as the median "
              f"of per-round ratios ({', '.join(f'{x:.2f}' for x in ttft)}), "
              f"{mean['round_robin']['mean_ttft_ms'] / mean['kv_aware']['mean_ttft_ms']:.2f}x as the ratio of the "
              f"per-policy means over rounds ({mean['kv_aware']['mean_ttft_ms']:.0f} vs "
              f"{mean['round_robin']['mean_ttft_ms']:.0f} ms); output tok/s x{statistics.median(tput):.2f}")
    for policy, runs in distinct.items():
        if runs:
            print(f"all-distinct {policy}: output tok/s {' / '.join(str(round(r['output_tok_s'], 1)) for r in runs)}, "
                  f"mean TTFT ms {' / '.join(str(round(r['mean_ttft_ms'])) for r in runs)}")
    if distinct["kv_aware"] and distinct["round_robin"]:
        ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(distinct["kv_aware"], distinct["round_robin"])]
        print("\nall-distinct pairs (kv_aware vs round_robin): output tok/s "
              + "; ".join(f"{a['output_tok_s']:.1f} vs {b['output_tok_s']:.1f}"
                          for a, b in zip(distinct["kv_aware"], distinct["round_robin"]))
              + "; mean TTFT ms " + "; ".join(f"{a['mean_ttft_ms']:.0f} vs {b['mean_ttft_ms']:.0f}"
                                               for a, b in zip(distinct["kv_aware"], distinct["round_robin"]))
              + f"; throughput ratio median {statistics.median(ratios):.3f} ({', '.join(f'{x:.3f}' for x in ratios)})")


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/router/state", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
