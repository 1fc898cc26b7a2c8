"""int8 KV cache: symmetric codes in [-127, 127] with one float16 scale per (token, KV head),
scale = absmax / 127 rounded up to float16 (so nothing clips), at least 2^-14 (float16's smallest
normal). -128 is never used, so the code range is symmetric. See token_scaled.py for the layout.

Decode attention takes the codes (exact in bfloat16) and applies the scales to its scores and
probabilities (`gather_scaled`), so a gathered value costs one int8 -> bfloat16 conversion.
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.token_scaled import TokenScaledFormat
from kvserve.cache.kv_cache import ScaledKV

_QMAX = 127.0
_MIN_SCALE = 2.0 ** -14


class Int8Format(TokenScaledFormat):
    name = "int8"
    storage_dtype = torch.int8
    scale_dtype = torch.float16

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        scale = (amax / _QMAX).clamp_min(_MIN_SCALE)
        stored = scale.to(torch.float16)
        return torch.where(stored.float() < scale, torch.nextafter(stored, stored.new_tensor(torch.inf)), stored)

    def scale_value(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.float()

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-_QMAX, _QMAX).to(torch.int8)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return codes.to(dtype)

    def gather_scaled(self, pool, block_ids, batch, dtype):
        codes, stored = self._gather_codes(pool, block_ids, batch)
        values = self.scratch.get("values", codes.shape, dtype, codes.device).copy_(codes)
        scale = stored.float()
        heads = codes.shape[0] // 2
        return ScaledKV(values[:heads], values[heads:], scale[:heads], scale[heads:])
