"""Sizing the KV pool from a byte budget. The engine and `kvserve plan` both use these functions,
so the planner's prediction is the engine's allocation."""
from __future__ import annotations

import re

from kvserve.cache.kv_cache import KVCacheSpec, KVFormat
from kvserve.hardware import available_ram_bytes

GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """'4GiB', '4 GB', '512MiB', '1e9', 4294967296 -> bytes. GB is 10^9, GiB is 2^30."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot parse size {text!r}: use bytes or a unit like 512MiB, 4GiB, 8GB")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def format_size(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.2f} GB ({num_bytes / GiB:.2f} GiB)"


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


def default_cpu_budget() -> int:
    """On CPU, with no --kv-cache-memory: 4 GiB or a quarter of available RAM, whichever is less."""
    return min(4 * GiB, available_ram_bytes() // 4)
