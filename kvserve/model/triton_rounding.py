"""Rounding float32 to a kernel's output dtype in Triton, to nearest even on every target.

Triton's interpreter (TRITON_INTERPRET=1, how CI runs the kernels on CPU) truncates its casts to
bfloat16 where CUDA rounds to nearest even, as torch does; rounding the bits by hand gives torch's
result in both, so the interpreter tests can compare bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x -> DTYPE, rounded to nearest, ties to even."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
