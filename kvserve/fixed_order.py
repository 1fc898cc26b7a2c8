"""Matrix products whose rows do not depend on the other rows: the building block of
`--deterministic` (batch-invariant inference).

A GEMM library picks its blocking, and so the order of each dot product's additions, from the
shape of the call: the same row multiplied alone or among 63 others can differ in its last bits,
and greedy decoding turns such bits into other tokens when two logits are nearly tied (Thinking
Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025). kvserve's own CPU kernels sum
each output in one fixed order whatever the row count (csrc/bf16_gemm.h, csrc/quant_gemv.h, the
paged decode kernel). oneDNN's prepacked GEMM (float32 and bfloat16) computes every row of a call
of two or more rows identically, at any row count and thread count (tests/test_deterministic.py
checks it on the CPU at hand), but a single row takes another kernel: so under `--deterministic` a
single row is multiplied as two (`at_least_two_rows`).

This module sits below `cache` and `model`: the KV formats' rotations and the fitted key basis use
`fixed_order_matmul` for their small float32 products.
"""
from __future__ import annotations

import torch

from kvserve.hardware import triton_runs_on


def at_least_two_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, K] as given, or a single row repeated to [2, K] (take the first row of the result)."""
    return x.expand(2, x.shape[1]).contiguous() if x.shape[0] == 1 else x


def onednn_packing_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and torch.backends.mkldnn.is_available()


# (data_ptr, shape, strides, dtype) -> (the matrix, kept so that its memory is not reused; its packing)
_PACKED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _packed_transpose(matrix: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of matrix^T (float32), packed once per matrix (rotations and key
    bases live as long as the model; a view such as R.T is its own entry)."""
    key = (matrix.data_ptr(), tuple(matrix.shape), matrix.stride(), matrix.dtype)
    if key not in _PACKED:
        _PACKED[key] = (matrix, torch.ops.mkldnn._reorder_linear_weight(matrix.float().T.contiguous(), 32))
    return _PACKED[key][1]


def fixed_order_matmul(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ matrix [K, N] in float32, each row's result independent of the row count
    (oneDNN's prepacked kernel, at least two rows; on CUDA the fixed-blocking Triton GEMM of
    fixed_order_triton.py); returned in x's dtype. Elsewhere a plain matmul, with no such claim."""
    if not onednn_packing_available(x.device):
        if triton_runs_on(x.device.type):
            from kvserve.fixed_order_triton import fixed_order_linear  # imports triton: only where it runs
            return fixed_order_linear(x.float(), matrix.float().T).to(x.dtype)
        return (x.float() @ matrix.float()).to(x.dtype)
    k = x.shape[-1]
    flat = x.reshape(-1, k).float()
    rows = flat.shape[0]
    if rows == 0:
        return x.new_empty(*x.shape[:-1], matrix.shape[1])
    out = torch.ops.mkldnn._linear_pointwise(at_least_two_rows(flat), _packed_transpose(matrix), None, "none", [], "")
    return out[:rows].reshape(*x.shape[:-1], matrix.shape[1]).to(x.dtype)
