"""K/V stored as-is in a float dtype: the "auto", float16, bfloat16 and float32 cache dtypes."""
from __future__ import annotations

import torch

from kvserve.cache.kv_cache import KVCacheSpec, KVFormat, Scratch, gather_blocks


class FullPrecisionFormat(KVFormat):
    """K/V stored as-is in a float dtype (the "auto", float16, bfloat16, float32 cache dtypes)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")
        self.scratch = Scratch()

    def bytes_per_block(self, spec: KVCacheSpec) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * spec.num_kv_heads * spec.block_size * spec.head_dim * elem

    def allocate(self, spec, num_blocks, device):
        shape = (spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
        return {"key": torch.zeros(shape, dtype=self.dtype, device=device),
                "value": torch.zeros(shape, dtype=self.dtype, device=device)}

    def write(self, pool, key, value, slot_mapping):
        for name, new in (("key", key), ("value", value)):
            cache = pool[name]
            flat = cache.view(cache.shape[0], -1, cache.shape[-1])
            flat.index_copy_(1, slot_mapping, new.transpose(0, 1).to(cache.dtype))

    def gather(self, pool, block_ids, batch, dtype):
        result = []
        for name in ("key", "value"):
            cache = pool[name]
            out = self.scratch.get(name, (cache.shape[0], block_ids.shape[0], *cache.shape[2:]), cache.dtype,
                                   cache.device)
            result.append(gather_blocks(cache, block_ids, batch, out).to(dtype))
        return tuple(result)
