"""fp8 KV cache: `fp8` / `fp8_e4m3` (OCP e4m3fn, max 448, 3 mantissa bits) and `fp8_e5m2`
(max 57344, 2 mantissa bits), one byte per value in torch float8 tensors.

Scales: one per (token, KV head), a power of two chosen so the token's absmax lands in
(fmax/2, fmax], stored as its 1-byte exponent. Nothing saturates, and because fp8 is a
floating-point format its relative precision is the same at any magnitude, so a finer or
non-power-of-two scale would buy nothing (it would only keep the smallest values out of the
subnormal range). See token_scaled.py for the layout. What does matter is the basis the keys
are stored in. For e4m3 the model hands them over in a basis fitted at start-up to this relative
rounding (engine/key_basis.py), and values are stored as they come (their relative error is the same
in any basis): on SmolLM2-135M (`kvserve eval`) KL from the full-precision cache went 0.0086 ->
0.0057, top-1 agreement 94.8% -> 95.4%, passkey 27/27 both. e5m2 keeps the Hadamard rotation of
K and V (rotation.py): with the fitted basis its KL went 0.0288 -> 0.0172 and perplexity +2.35%
-> +0.67%, but passkey retrieval 27/27 -> 23/27 (17/18 at 2,048-4,096 tokens run on its own, with
or without the basis: two mantissa bits leave it on a cliff), against a target of one miss.

Decoding avoids torch's float8 -> bfloat16 cast, which is an unvectorised loop on CPU (~15 ms
for 3M values, 40x slower than an int8 cast). An fp8 byte s|e|m is moved bitwise into the sign,
low exponent and high mantissa bits of a bfloat16 (whose exponent bias is 127 instead of 7 or
15); the bias difference, 2^120 or 2^112, is folded into the scale. fp8 subnormals land on
bfloat16 subnormals, so the mapping is exact for every finite code, and no code decodes to inf
or NaN (0x7f, e4m3fn's NaN, would read as 480), so unwritten slots stay finite.

Decode attention keeps the decoded values at ~2^-120 and applies decode_unit * scale to its
scores and probabilities (`gather_scaled`): a multiply over every gathered value measured ~300
us a layer on CPU (32 x 272 tokens), twice the bitwise decode. The small values are normal
bfloat16 numbers and their products with queries are accumulated in float32, so the matmuls
lose nothing, except that bfloat16 dot-product instructions may read the subnormal ones (fp8
subnormals: below 2^-13 of the token's absmax) as zero, far under the rounding error of its
large values. float16 cannot hold them at all: a float16 model scales the values first.
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
        # The shift, as a multiply (|code| <= 128 cannot overflow int16): ~30% faster on CPU.
        bits.mul_(1 << self._shift).bitwise_and_(self._mask)
        return bits.view(torch.bfloat16)

    def in_place_layout(self, query_dtype):
        if query_dtype == torch.float16:
            return None
        return InPlaceLayout("codes", fp8_multiplier=1 << self._shift, fp8_mask=self._mask, fp8_unit=self.decode_unit)

    def gather_scaled(self, pool, block_ids, batch, dtype):
        return None if dtype == torch.float16 else super().gather_scaled(pool, block_ids, batch, dtype)
