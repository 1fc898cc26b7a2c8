"""The lean decode kernel (csrc/lean_decode.cpp with csrc/quant_gemv.h): build and load.

One compiled module holds the small-batch matmul over group-quantized weights that QuantizedLinear
uses (quant_gemv.h) and the fused decoder-layer ops of the lean decode step (lean_decode.py) that
call it. Built per ISA and cached like the paged decode kernel (kernel_build.py); when it cannot
be built or loaded, or `KVSERVE_DISABLE_CPU_KERNEL=1`, quantized layers keep torch's int4 kernel
and every step takes the module path.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kvserve.model.kernel_build import KernelBuild, current_isa, load_kernel

_CSRC = Path(__file__).with_name("csrc")
SOURCE = _CSRC / "lean_decode.cpp"
HEADERS = (_CSRC / "quant_gemv.h", _CSRC / "bf16_gemm.h")


def lean_decode_build(isa: str | None = None) -> KernelBuild:
    """The lean decode kernel built for `isa` (default: the ISA torch dispatches to here)."""
    isa = isa or current_isa()
    return KernelBuild(f"kvserve_lean_decode_{isa.lower()}", SOURCE, isa, HEADERS)


@functools.cache
def load_lean_decode_module() -> tuple[Any | None, str]:
    """The compiled extension module for this process, or None and why not (asked once)."""
    return load_kernel(lean_decode_build())
