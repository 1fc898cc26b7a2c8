"""What watching costs the engine: output tokens/s of a fixed batch of completions against one
`kvserve serve`, with a light client polling GET /dashboard/state at the page's rate (twice a
second) and with none, in interleaved pairs (the order alternates within pairs so drift cancels);
reports each condition's median, the median per-pair slowdown, and the engine-thread time a
snapshot takes (the state's `engine.snapshot_s`), which bounds the cost without the noise of a
shared machine.

A real browser is left out on purpose: on the same two cores it would measure its own rendering.

    python benchmarks/dashboard_cost.py --pairs 5                 # the bundled default model
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path

import httpx
import torch

from kvserve.bench.launcher import kvserve_serve_command, running_server

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def run_batch(url: str, requests: int, max_tokens: int) -> float:
    """Send `requests` completions at once; returns output tokens per second of wall time."""
    tokens = [0] * requests

    def one(i: int) -> None:
        with httpx.Client(timeout=600) as client:
            r = client.post(url + "/v1/completions", json={
                "prompt": f"{PROMPT} ({i})", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
            r.raise_for_status()
            tokens[i] = r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.perf_counter() - start)


class Poller:
    """GET /dashboard/state every `interval` s (the page's rate) until stopped; counts the polls."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval, self.polls, self.blocks = url, interval, 0, 0
        self.snapshot_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                state = client.get(self.url + "/dashboard/state").json()
                self.polls += 1
                self.blocks = state["pool"]["num_blocks"]
                self.snapshot_s.append(state["engine"]["snapshot_s"])
                self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between polls (the page's rate)")
    parser.add_argument("--server-args", default="", help="extra `kvserve serve` arguments")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/dashboard_cost.json"))
    args = parser.parse_args()
    with running_server(kvserve_serve_command, args.server_args.split(), Path("/tmp/kvserve-dashboard-cost.log"),
                        300) as url:
        run_batch(url, args.requests, 16)  # warm-up
        pairs = []
        for i in range(args.pairs):
            result = {}
            for watched in ((False, True) if i % 2 == 0 else (True, False)):
                poller = Poller(url, args.interval) if watched else None
                rate = run_batch(url, args.requests, args.max_tokens)
                if poller is not None:
                    poller.stop()
                    result["polls"], result["blocks"] = poller.polls, poller.blocks
                    result["snapshot_s_median"] = statistics.median(poller.snapshot_s)
                result["watched" if watched else "unwatched"] = rate
            pairs.append(result)
            print(f"pair {i + 1}: unwatched {result['unwatched']:.1f} tok/s, watched {result['watched']:.1f} tok/s "
                  f"({result['polls']} polls)", flush=True)
    slowdowns = [1 - p["watched"] / p["unwatched"] for p in pairs]
    summary = {
        "unwatched_median_tok_s": statistics.median(p["unwatched"] for p in pairs),
        "watched_median_tok_s": statistics.median(p["watched"] for p in pairs),
        "median_slowdown": statistics.median(slowdowns),
        "pool_blocks": pairs[0]["blocks"],
        # engine-thread time per snapshot x snapshots per second: the share of the engine's time
        "snapshot_s_median": statistics.median(p["snapshot_s_median"] for p in pairs), "pairs": pairs, "args": vars(args) | {"out": str(args.out)},
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
    }
    print(f"median: unwatched {summary['unwatched_median_tok_s']:.1f} tok/s, watched "
          f"{summary['watched_median_tok_s']:.1f} tok/s, median slowdown per pair "
          f"{100 * summary['median_slowdown']:.1f}% (pool of {summary['pool_blocks']} blocks; a snapshot takes "
          f"{1e3 * summary['snapshot_s_median']:.2f} ms of engine-thread time, "
          f"{100 * summary['snapshot_s_median'] / args.interval:.2f}% of it at this poll rate)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
