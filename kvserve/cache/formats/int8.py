"""int8 KV cache: symmetric codes in [-127, 127] with one float16 scale per (token, KV head),
scale = absmax / 127 rounded to float16 and at least 2^-14 (float16's smallest normal). When that
rounding lands the scale a hair below absmax / 127, the largest value encodes to 127 by the
clamp, an error far under half a step (float16 rounds to 2^-11 relative). -128 is never used, so
the code range is symmetric. See token_scaled.py for the layout.

Decode attention takes the codes (exact in bfloat16) and applies the scales to its scores and
probabilities (`gather_scaled`), so a gathered value costs one int8 -> bfloat16 conversion.

No Hadamard rotation (rotation.py), unlike fp8_e5m2 and int4: int8 stays near lossless without
one, and its three small matmuls a layer (queries, output, the write) cost decode speed on CPU for
no change in perplexity (BENCHMARKS.md, "KV-cache dtypes").
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.token_scaled import TokenScaledFormat

_QMAX = 127.0
_MIN_SCALE = 2.0 ** -14


class Int8Format(TokenScaledFormat):
    name = "int8"
    storage_dtype = torch.int8
    scale_dtype = torch.float16

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        return (amax / _QMAX).clamp_min_(_MIN_SCALE).to(torch.float16)

    def scale_value(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.float()

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round_().clamp_(-_QMAX, _QMAX).to(torch.int8)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.scratch.get("values", codes.shape, dtype, codes.device).copy_(codes)
