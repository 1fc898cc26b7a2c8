"""Triton's interpreter with a GPU's dot: each output sums over K in one order, wherever its row lies.

Under TRITON_INTERPRET=1 (how CI runs kvserve's Triton kernels on CPU) `tl.dot` is NumPy's matmul,
that is OpenBLAS. OpenBLAS's AVX2 (Haswell/Zen) sgemm kernel sums a row's products in an order
that depends on the row's place in the tile, so the same row gives other bits beside other rows;
its AVX-512 kernel and a GPU's MMA instructions do not. kvserve's batch invariance
(`--deterministic`: the fixed-order GEMM, the attention kernels' chunked prefill) rests on that
property, so its kernel modules swap the interpreter's dot for `np.einsum`, which sums each output
over K in order without BLAS. Nothing changes when Triton compiles for a GPU.
"""
from __future__ import annotations

import numpy as np

from kvserve.hardware import triton_interpreting


def use_row_invariant_dots() -> None:
    """Under the interpreter, make `tl.dot` row-invariant (once per process); else nothing."""
    if not triton_interpreting():
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "row_invariant", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)  # its fp8 widening
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    create_dot.row_invariant = True
    builder.create_dot = create_dot
