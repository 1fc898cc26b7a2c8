"""Sizing the KV pool from a byte budget. The engine and `kvserve plan` both use these functions,
so the planner's prediction is the engine's allocation."""
from __future__ import annotations

from kvserve.cache.kv_cache import KVCacheSpec, KVFormat
from kvserve.hardware import available_ram_bytes
from kvserve.units import GiB

def bytes_per_block(spec: KVCacheSpec, kv_format: KVFormat) -> int:
    """All layers' bytes for one block (K, V and scales)."""
    return spec.num_layers * kv_format.bytes_per_block(spec)


def blocks_in_budget(budget_bytes: int, per_block: int) -> int:
    """Blocks the pool hands out within `budget_bytes`: the null block (block_pool.NULL_BLOCK_ID)
    is paid from the budget too."""
    return max(budget_bytes // per_block - 1, 0)


def num_blocks_for_budget(budget_bytes: int, spec: KVCacheSpec, kv_format: KVFormat) -> int:
    return blocks_in_budget(budget_bytes, bytes_per_block(spec, kv_format))


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def blocks_per_sequence(max_model_len: int, block_size: int, window: int | None = None,
                        step_tokens: int | None = None) -> int:
    """Blocks one sequence of max_model_len holds at most. Under full attention all of them; when
    every layer attends to the same sliding `window` (Mistral v0.1), the blocks behind the window
    go back to the pool as the sequence moves on (kv_cache_manager), so it holds the window and one
    step's `step_tokens`, plus a block a boundary may split and a spare (vLLM sizes its
    sliding-window layers so too)."""
    full = blocks_for_tokens(max_model_len, block_size)
    if window is None or step_tokens is None:
        return full
    return min(full, blocks_for_tokens(window + step_tokens, block_size) + 2)


def default_cpu_budget(processes: int = 1) -> int:
    """On CPU, with no --kv-cache-memory: 4 GiB or this process's share of a quarter of available
    RAM, whichever is less. `processes`: the engine processes on this machine, each with a pool of
    its own (tensor-parallel ranks, data-parallel replicas)."""
    return min(4 * GiB, available_ram_bytes() // 4 // max(1, processes))
