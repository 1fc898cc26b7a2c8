"""K/V stored as-is in a float dtype: the "auto", float16, bfloat16 and float32 cache dtypes."""
from __future__ import annotations

import torch

from kvserve.cache.kv_cache import KVCacheSpec, KVFormat, Scratch, gather_blocks
from kvserve.model.cpu_attention import PagedDecodeKernel


class FullPrecisionFormat(KVFormat):
    """K/V stored as-is in a float dtype (the "auto", float16, bfloat16, float32 cache dtypes).
    With a `decode_kernel` (model/cpu_attention.py) decodes read the pool in place."""

    def __init__(self, dtype: torch.dtype, decode_kernel: PagedDecodeKernel | None = None):
        self.dtype = dtype
        self.name = str(dtype).removeprefix("torch.")
        self.scratch = Scratch()
        self.decode_kernel = decode_kernel

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

    def attend_decode(self, pool, query, block_tables, seq_lens, window):
        if self.decode_kernel is None:
            return None
        return self.decode_kernel.float_pool(query, pool["kv"], block_tables, seq_lens, window)
