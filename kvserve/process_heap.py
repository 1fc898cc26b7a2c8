"""Python's garbage collector in a long-lived serving process (a server, a tensor-parallel worker).

What start-up built (the model's modules, the tokenizer, the app) lives as long as the process,
yet every full collection walks all of it, stalling whatever step is running: `gc.freeze` moves it
out of the collector's sight (vLLM freezes its start-up heap too). The youngest generation is
collected every 50,000 allocations instead of CPython's 700, so that a step's short-lived objects
(outputs, events, metadata) mostly die before a pass would promote them into older generations
(BENCHMARKS.md, "The served path's host ceiling").
"""
from __future__ import annotations

import gc

GC_GENERATION0_THRESHOLD = 50_000


def settle_heap() -> None:
    """Call once start-up is done, before the process starts serving."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GENERATION0_THRESHOLD, *gc.get_threshold()[1:])
