"""The benchmark client's own CPU per streamed event: `run_load` (what `kvserve bench serve` runs)
against a server already up, its process's CPU time over the run. Works on any revision of
kvserve (PYTHONPATH), so clients can be compared against the same server; `kvserve bench serve`
itself prints the same measure as "Client CPU (% of one core)".

    kvserve serve /tmp/hostmodel --port 8765 --max-num-seqs 256 --kv-cache-memory 1GiB &
    python benchmarks/client_cost.py --base-url http://localhost:8765 [--num-prompts 256 --output-len 256]
    PYTHONPATH=/path/to/other/checkout python benchmarks/client_cost.py ...   # another revision
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://localhost:8765")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    args = parser.parse_args()

    from kvserve.bench.client import ClientConfig
    from kvserve.bench.datasets import SampleRequest
    from kvserve.bench.serve import LoadConfig, run_load

    with urllib.request.urlopen(args.base_url + "/v1/models") as reply:
        model = json.load(reply)["data"][0]["id"]
    config = ClientConfig(args.base_url, "/v1/completions", model, ignore_eos=True)
    samples = [SampleRequest(f"request {i}: " + "hello " * 12, 16, args.output_len) for i in range(args.num_prompts)]
    cpu, start = time.process_time(), time.perf_counter()
    run = asyncio.run(run_load(config, samples, LoadConfig(progress=False, metrics_interval=1.0)))
    cpu, seconds = time.process_time() - cpu, time.perf_counter() - start
    events = sum(len(r.token_times) for r in run.results)
    tokens = sum(r.output_tokens for r in run.results)
    print(f"{tokens / seconds:,.0f} output tok/s, {events} events: client CPU {cpu:.2f} s = "
          f"{cpu / events * 1e6:.1f} us an event, {100 * cpu / seconds:.0f}% of one core")


if __name__ == "__main__":
    main()
