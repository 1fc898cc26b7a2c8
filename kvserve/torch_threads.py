"""Run a stretch of small torch ops on one intra-op thread.

Ops of a few MB or less gain little from a second thread, and when another process keeps a core
busy (two-core machines, CI runners) every parallel op waits for the descheduled thread: such
loops ran many times slower on two threads than on one (BENCHMARKS.md, start-up time). A plain
module every layer may import.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op thread count set to 1 inside the block, restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
