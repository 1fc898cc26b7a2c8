"""Time from `kvserve chat` start to its answer's first token, on a fresh machine and on later starts.

Each run is a new process, `kvserve chat QUESTION --max-tokens 1` (so the wall time is start-up,
prefill and one token), timed from spawn to exit. "fresh" gives every run empty cache directories
(KVSERVE_CACHE_DIR and TORCH_EXTENSIONS_DIR) after the set-up step, as a new machine has after the
README's set-up command: with `--setup-build` that step is `kvserve build-kernel` (the current
set-up; run once, its kernel copied into each run's empty cache), without it nothing (a checkout from before `build-kernel` existed compiles on first
use). "warm" runs again on the cache the fresh run left. Reported: the median of `--runs`.

    python benchmarks/first_token.py [--runs 3] [--setup-build] [--checkout DIR] [-- extra chat flags]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 KVSERVE_CPU_BF16=0 python benchmarks/first_token.py ...
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

QUESTION = "What is the capital of France?"


def run_chat(env: dict[str, str], extra: list[str], cwd: str | None) -> float:
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", QUESTION, "--max-tokens", "1", *extra],
                            env=env, capture_output=True, text=True, timeout=1800, cwd=cwd)
    elapsed = time.monotonic() - start
    if result.returncode != 0:
        raise SystemExit(f"kvserve chat failed ({result.returncode}): {result.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--setup-build", action="store_true", help="run `kvserve build-kernel` before timing")
    parser.add_argument("--checkout", default=None, help="a kvserve source tree to time instead (PYTHONPATH)")
    parser.add_argument("extra", nargs="*", help="more `kvserve chat` flags (after --)")
    args = parser.parse_args()
    fresh, warm = [], []
    with tempfile.TemporaryDirectory() as setup:
        if args.setup_build:  # the set-up step once; each fresh cache starts as it leaves the cache
            env = {**os.environ, "KVSERVE_CACHE_DIR": setup}
            subprocess.run([sys.executable, "-m", "kvserve.cli", "build-kernel"], env=env, check=True,
                           capture_output=True)
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as cache:
                shutil.copytree(setup, cache, dirs_exist_ok=True)
                env = {**os.environ, "KVSERVE_CACHE_DIR": cache, "TORCH_EXTENSIONS_DIR": os.path.join(cache, "torch")}
                if args.checkout:
                    env["PYTHONPATH"] = args.checkout
                # `-m` puts the working directory first on sys.path: run in the checkout timed.
                fresh.append(run_chat(env, args.extra, args.checkout))
                warm.append(run_chat(env, args.extra, args.checkout))
    for name, times in (("fresh", fresh), ("warm", warm)):
        print(f"{name}: median {statistics.median(times):.1f} s  (runs: {', '.join(f'{t:.1f}' for t in times)})")


if __name__ == "__main__":
    main()
