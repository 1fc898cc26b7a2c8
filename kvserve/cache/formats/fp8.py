"""fp8 KV cache: `fp8` / `fp8_e4m3` (OCP e4m3fn, max 448) and `fp8_e5m2` (max 57344), one byte
per value (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433).

One power-of-two scale per (token, KV head) puts the token's absmax in (fmax/2, fmax], stored as
its 1-byte exponent (layout: token_scaled.py); fp8's relative precision is the same at any
magnitude, so a finer scale would buy nothing. What matters is the keys' basis: e4m3 takes them in
a basis fitted at start-up to its relative rounding (engine/key_basis.py); e5m2 rotates K and V
(rotation.py), which kept its passkey score where a fitted basis did not (BENCHMARKS.md,
"KV-cache dtypes").

Decoding avoids torch's float8 -> bfloat16 cast (an unvectorised loop on CPU): the byte s|e|m is
moved bitwise into a bfloat16, whose different exponent bias (2^120 or 2^112) is folded into the
scale. This is exact for every finite code and never yields inf or NaN. Decode attention keeps
the values at ~2^-120 and applies decode_unit * scale to its scores and probabilities
(`gather_scaled`) rather than to every gathered value; a float16 model scales the values first,
since float16 cannot hold them.
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.token_scaled import TokenScaledFormat
from kvserve.cache.kv_cache import InPlaceLayout

_MIN_AMAX = 1e-6  # an all-zero token still gets a finite scale


class Fp8Format(TokenScaledFormat):
    scale_dtype = torch.int8  # the exponent of a power-of-two scale

    def __init__(self, variant: str = "e4m3"):
        # e4m3: keys in a fitted basis (engine/key_basis.py), values as they come. e5m2: K and V in the
        # Hadamard basis; its passkey retrieval fell with the fitted basis (see the docstring).
        super().__init__(rotate=variant == "e5m2")
        self.fit_key_basis = variant == "e4m3"
        if variant == "e4m3":
            self.storage_dtype, exp_bits, bias = torch.float8_e4m3fn, 4, 7
        elif variant == "e5m2":
            self.storage_dtype, exp_bits, bias = torch.float8_e5m2, 5, 15
        else:
            raise ValueError(f"unknown fp8 variant {variant!r}: use e4m3 or e5m2")
        self.name = f"fp8_{variant}"
        self.fmax = torch.finfo(self.storage_dtype).max
        # bfloat16 has 7 mantissa bits: shifting the 7 magnitude bits (exponent, mantissa) up by
        # exp_bits puts the fp8 mantissa at the top of bfloat16's mantissa and the fp8 exponent in
        # the low bits of bfloat16's exponent.
        self._shift = exp_bits
        self._mask = (0x8000 | (0x7F << self._shift)) - 0x10000  # sign + magnitude, as a signed int16
        self.decode_unit = 2.0 ** (127 - bias)
        # decode_unit * 2^exponent must stay a finite bfloat16: exponents up to `bias` (values up
        # to fmax * 2^bias, far beyond any K/V) are allowed.
        self._max_exponent = bias

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        exponent = torch.ceil(torch.log2(amax.clamp_min(_MIN_AMAX) / self.fmax))
        return exponent.clamp_(max=self._max_exponent).to(torch.int8)

    def scale_value(self, stored: torch.Tensor) -> torch.Tensor:
        return torch.exp2(stored.float())

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.clamp_(-self.fmax, self.fmax).to(self.storage_dtype).view(torch.int8)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        bits = self.scratch.get("bits", codes.shape, torch.int16, codes.device)
        bits.copy_(codes)  # sign-extends: a negative code's high byte is all ones
        # The shift, as a multiply (|code| <= 128 cannot overflow int16): faster on CPU.
        bits.mul_(1 << self._shift).bitwise_and_(self._mask)
        return bits.view(torch.bfloat16)

    def in_place_layout(self, query_dtype):
        if query_dtype == torch.float16:
            return None
        return InPlaceLayout("codes", fp8_multiplier=1 << self._shift, fp8_mask=self._mask, fp8_unit=self.decode_unit)

    def gather_scaled(self, pool, block_ids, batch, dtype):
        return None if dtype == torch.float16 else super().gather_scaled(pool, block_ids, batch, dtype)
