"""What `--scheduling-policy priority` buys under overload: interactive requests arriving behind a
queue of batch work, time to first token per class, fcfs against priority, side by side.

Two `kvserve serve` processes of the same model and flags (`--max-num-seqs` small enough that a
queue forms), one per policy, both up for the whole run; rounds alternate between them. A round
sends `--batch` batch requests at once, waits until the server queues them, then sends
`--interactive` interactive requests, one every `--gap` seconds. Under priority the batch requests
carry priority 10 and the interactive ones 0; under fcfs everything is 0 (fcfs refuses others).
Every request is a streamed chat completion of `--max-tokens` tokens (`ignore_eos`, greedy) on its
own slice of the book (no prefix-cache hits between requests or rounds). Reported per policy and
class: the median over rounds of the median and the worst TTFT, and of the batch's output tokens/s
(all tokens / the round's wall time).

    flock /tmp/kvserve-heavy.lock python benchmarks/priority_scheduling.py [--rounds 3] [--max-num-seqs 8]
        [--batch 48] [--interactive 8] [--gap 0.5] [--max-tokens 64] [-- extra serve flags]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_process import ServerProcess  # noqa: E402

from kvserve.bench.client import ClientConfig, http_session, send_request  # noqa: E402
from kvserve.bench.datasets import SampleRequest  # noqa: E402

BOOK = (Path(__file__).resolve().parent.parent / "kvserve" / "data" / "pride-and-prejudice.txt").read_text()
PRIORITY = {"batch": 10, "interactive": 0}
PROMPT_CHARS = 600


def chat_config(base_url: str, model: str, priority: int) -> ClientConfig:
    return ClientConfig(base_url, "/v1/chat/completions", model, ignore_eos=True, extra_body={"priority": priority})


def sample(text: str, max_tokens: int) -> SampleRequest:
    return SampleRequest(prompt=f"Summarise this passage:\n\n{text}", prompt_len=0, expected_output_len=max_tokens)


async def waiting(client: httpx.AsyncClient, base_url: str) -> float:
    text = (await client.get(f"{base_url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvserve:num_requests_waiting"))


async def one_round(base_url: str, model: str, policy: str, args: argparse.Namespace, offset: int) -> dict:
    texts = iter(BOOK[i:i + PROMPT_CHARS] for i in range(offset, len(BOOK), PROMPT_CHARS))
    configs = {kind: chat_config(base_url, model, PRIORITY[kind] if policy == "priority" else 0) for kind in PRIORITY}
    async with http_session() as session, httpx.AsyncClient(timeout=60) as client:
        t0 = time.perf_counter()

        def send(kind: str) -> asyncio.Task:
            return asyncio.create_task(send_request(session, configs[kind], sample(next(texts), args.max_tokens), t0))

        batch = [send("batch") for _ in range(args.batch)]
        queued = args.batch - args.max_num_seqs
        while await waiting(client, base_url) < queued:  # the batch work has arrived and queued
            await asyncio.sleep(0.05)
        interactive = []
        for _ in range(args.interactive):
            interactive.append(send("interactive"))
            await asyncio.sleep(args.gap)
        results = {"batch": await asyncio.gather(*batch), "interactive": await asyncio.gather(*interactive)}
        wall = time.perf_counter() - t0
    failed = [r.error for rows in results.values() for r in rows if not r.success]
    counts = {r.output_tokens for rows in results.values() for r in rows}
    if failed or counts != {args.max_tokens}:
        raise SystemExit(f"expected {args.max_tokens} tokens from every request, got {sorted(counts)} {failed[:1]}")
    summary = {"tokens_per_s": args.max_tokens * (args.batch + args.interactive) / wall, "wall_s": wall}
    for kind, rows in results.items():
        ttfts = [r.ttft for r in rows]
        summary[kind] = {"median_ttft_s": statistics.median(ttfts), "max_ttft_s": max(ttfts)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=48, help="batch requests sent at once")
    parser.add_argument("--interactive", type=int, default=8, help="interactive requests sent after them")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between interactive requests")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="write the per-round results here")
    parser.add_argument("serve_args", nargs="*", help="more `kvserve serve` flags (after --)")
    args = parser.parse_args()
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    servers = {}
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            for policy in ("fcfs", "priority"):
                (Path(log_dir) / policy).mkdir()
                servers[policy] = ServerProcess.start(
                    ["--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", policy, *args.serve_args],
                    Path(log_dir) / policy, env=env, wait=False)
            for server in servers.values():
                server.wait_healthy()
            model = httpx.get(f"{servers['fcfs'].base_url}/v1/models").json()["data"][0]["id"]
            rounds = []
            per_round = (args.batch + args.interactive) * PROMPT_CHARS
            for index in range(args.rounds):
                order = ("fcfs", "priority") if index % 2 == 0 else ("priority", "fcfs")
                result = {}
                for policy in order:
                    offset = (2 * index + order.index(policy)) * per_round % (len(BOOK) - per_round)
                    result[policy] = r = asyncio.run(one_round(servers[policy].base_url, model, policy, args, offset))
                    print(f"round {index + 1} {policy:>8}: interactive TTFT median "
                          f"{r['interactive']['median_ttft_s']:6.2f} s max {r['interactive']['max_ttft_s']:6.2f} s; "
                          f"batch TTFT median "
                          f"{r['batch']['median_ttft_s']:6.2f} s max {r['batch']['max_ttft_s']:6.2f} s; "
                          f"{r['tokens_per_s']:6.1f} tok/s", flush=True)
                rounds.append(result)
        finally:
            for server in servers.values():
                server.stop()
    print(f"\n{args.batch} batch + {args.interactive} interactive chat requests of {args.max_tokens} tokens, "
          f"--max-num-seqs {args.max_num_seqs}, medians of {args.rounds} rounds:")
    medians = {}
    for policy in ("fcfs", "priority"):
        m = medians[policy] = {
            "tokens_per_s": statistics.median(r[policy]["tokens_per_s"] for r in rounds),
            **{f"{kind}_{key}": statistics.median(r[policy][kind][key] for r in rounds)
               for kind in ("interactive", "batch") for key in ("median_ttft_s", "max_ttft_s")}}
        print(f"  {policy:>8}: interactive TTFT median {m['interactive_median_ttft_s']:6.2f} s, max "
              f"{m['interactive_max_ttft_s']:6.2f} s | batch TTFT median {m['batch_median_ttft_s']:6.2f} s, max "
              f"{m['batch_max_ttft_s']:6.2f} s | {m['tokens_per_s']:6.1f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "medians": medians, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
