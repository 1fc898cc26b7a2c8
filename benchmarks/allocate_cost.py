"""The block manager's cost per decoded token, model-free: 64 sequences of 16 prompt tokens decode
256 tokens each through `KVCacheManager.allocate` (prefix caching on, blocks of 16, no sliding
window). `--against CHECKOUT` loads that checkout's kv_cache_manager.py beside this one and
alternates the two in one process (30 runs each), so the VM's drift hits both alike.

    python benchmarks/allocate_cost.py [--against /path/to/other/checkout]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import kvserve.cache.kv_cache_manager as this_manager
from kvserve.engine.request import Request
from kvserve.sampling_params import SamplingParams

SEQUENCES, DECODES, RUNS = 64, 256, 30


def run(manager: ModuleType) -> float:
    """Microseconds per decoded token."""
    kv = manager.KVCacheManager(4096, 16, True, "ns")
    requests = [Request(f"r{i}", list(range(i * 7, i * 7 + 16)), SamplingParams(max_tokens=DECODES, ignore_eos=True))
                for i in range(SEQUENCES)]
    for request in requests:
        assert kv.allocate(request, request.num_tokens)
        request.num_computed_tokens = request.num_tokens
    start = time.perf_counter()
    for step in range(DECODES):
        for request in requests:
            request.append_token(step + 3)
            assert kv.allocate(request, 1)
            request.num_computed_tokens += 1
    seconds = time.perf_counter() - start
    for request in requests:
        kv.free(request)
    return seconds / (DECODES * SEQUENCES) * 1e6


def load(checkout: str) -> ModuleType:
    """The other checkout's kv_cache_manager module (it imports the rest from this one's package)."""
    spec = importlib.util.spec_from_file_location("other_kv_cache_manager",
                                                  Path(checkout) / "kvserve/cache/kv_cache_manager.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", help="another checkout, timed alternately in this process")
    args = parser.parse_args()
    managers = {"this": this_manager}
    if args.against:
        managers["against"] = load(args.against)
    times: dict[str, list[float]] = {name: [] for name in managers}
    for i in range(RUNS):
        for name in (list(managers) if i % 2 else list(reversed(managers))):
            times[name].append(run(managers[name]))
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.3f} us per decoded token (median of {RUNS})")
    if args.against:
        ratios = [a / b for a, b in zip(times["this"], times["against"])]
        print(f"this / against: {statistics.median(ratios):.3f} (median of the {RUNS} paired ratios)")


if __name__ == "__main__":
    main()
