"""`kvserve build-kernel`: compile the CPU kernels now (the set-up command runs it): the paged decode
attention and the lean decode step's fused layer ops, so that no `kvserve` start waits for a
compile. Where one cannot be built, says why and exits 0: kvserve then decodes with torch ops,
which is slower but complete."""
from __future__ import annotations

import argparse
import multiprocessing
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from kvserve.model.kernel_build import (
    ISA_LEVELS, KernelBuild, current_isa, kernel_cache_dir, load_kernel, runnable_isa_levels)


def register(subparsers) -> None:
    parser = subparsers.add_parser("build-kernel",
                                   help="compile the CPU kernels (paged decode, lean decode step) ahead of use")
    parser.add_argument("--isa", default="current", choices=("current", "all", *ISA_LEVELS),
                        help="vector ISA to build for: current = the one torch dispatches to here (default); "
                             "all = every level this CPU can run (a cache shared with other machines)")
    parser.set_defaults(func=run)


def _build(make_build: Callable[[str], KernelBuild], isa: str) -> tuple[str, str | None, float]:
    """Build (or find) one kernel: (its library path, None or why it is unavailable, seconds)."""
    build = make_build(isa)
    start = time.monotonic()
    module, why = load_kernel(build, retry_failed=True)
    return str(build.library), None if module is not None else why, time.monotonic() - start


def run(args: argparse.Namespace) -> int:
    from kvserve.cli import UserError
    from kvserve.model.attention.cpu_paged import paged_decode_build
    from kvserve.model.lean_kernel import lean_decode_build

    runnable = runnable_isa_levels()
    levels = {"current": [current_isa()], "all": runnable}.get(args.isa, [args.isa])
    if args.isa in ISA_LEVELS and args.isa not in runnable:
        raise UserError(f"this CPU cannot run {args.isa} code (it runs {', '.join(runnable)})")
    kernels = (("paged decode", paged_decode_build), ("lean decode step", lean_decode_build))
    jobs = [(title, make_build, isa) for isa in levels for title, make_build in kernels]
    # Each kernel is one translation unit, compiled on one core: the builds run side by side, one
    # process each, as many at once as there are cores.
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_build, make_build, isa) for _, make_build, isa in jobs]
        for (title, _, isa), future in zip(jobs, futures):
            library, why, seconds = future.result()
            if why is not None:
                print(f"CPU {title} kernel ({isa}) unavailable: {why}. kvserve will decode with torch ops.")
            else:
                print(f"CPU {title} kernel ({isa}) ready in {seconds:.1f} s: {library}")
    print(f"kernel cache: {kernel_cache_dir()}")
    return 0
