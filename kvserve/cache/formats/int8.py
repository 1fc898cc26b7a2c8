"""int8 KV cache: symmetric codes in [-127, 127] with one float32 scale per (block, KV head),
scale = absmax / 127 (re-encoded as the block fills, see block_scaled.py). -128 is never used,
so the code range is symmetric and negating a value never overflows."""
from __future__ import annotations

import torch

from kvserve.cache.formats.block_scaled import BlockScaledFormat

_QMAX = 127.0
_MIN_AMAX = 1e-6  # an all-zero block still gets a positive, finite scale


class Int8Format(BlockScaledFormat):
    name = "int8"
    storage_dtype = torch.int8
    index_dtype = torch.int8

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        return amax.clamp_min(_MIN_AMAX) / _QMAX

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp_(-_QMAX, _QMAX).to(torch.int8)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return codes.to(dtype)
