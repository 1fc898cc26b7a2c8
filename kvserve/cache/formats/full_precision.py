"""K/V stored as-is in a float dtype: the "auto", float16, bfloat16 and float32 cache dtypes."""
from __future__ import annotations

import torch

from kvserve.cache.kv_cache import InPlaceLayout, KVCacheSpec, KVFormat, Scratch, gather_blocks


class FullPrecisionFormat(KVFormat):
    """K/V stored as-is in a float dtype (the "auto", float16, bfloat16, float32 cache dtypes)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")
        self.value_bits = 8 * torch.empty((), dtype=dtype).element_size()
        self.scratch = Scratch()

    def bytes_per_block(self, spec: KVCacheSpec) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * spec.num_kv_heads * spec.block_size * spec.head_dim * elem

    def allocate(self, spec, num_blocks, device):
        # K in the first kv_heads rows, V in the next: a write or a gather is one op for both.
        shape = (2 * spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
        return {"kv": torch.zeros(shape, dtype=self.dtype, device=device)}

    def write(self, pool, key, value, slot_mapping):
        cache = pool["kv"]
        new = torch.cat((key, value), dim=1).transpose(0, 1).to(cache.dtype)  # [2 * kv_heads, tokens, d]
        cache.view(cache.shape[0], -1, cache.shape[-1]).index_copy_(1, slot_mapping, new)

    def gather(self, pool, block_ids, batch, dtype):
        cache = pool["kv"]
        out = self.scratch.get("kv", (cache.shape[0], block_ids.shape[0], *cache.shape[2:]), cache.dtype, cache.device)
        both = gather_blocks(cache, block_ids, batch, out).to(dtype)
        heads = both.shape[0] // 2
        return both[:heads], both[heads:]

    def in_place_layout(self, query_dtype):
        return InPlaceLayout("float") if query_dtype == self.dtype else None
