"""`kvserve bench {serve,compare,throughput,latency}`."""
from __future__ import annotations

import importlib

# sub-subcommand modules; each exposes `register(subparsers)` and sets `func`.
BENCH_MODULES = ("kvserve.bench.serve", "kvserve.bench.compare", "kvserve.bench.throughput", "kvserve.bench.latency")


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: serve (online load test), compare (configs side by "
                                                "side), throughput and latency (offline)")
    inner = bench.add_subparsers(dest="bench_command", required=True, metavar="{serve,compare,throughput,latency}")
    for module in BENCH_MODULES:
        importlib.import_module(module).register(inner)
