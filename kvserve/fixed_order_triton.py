"""A Triton GEMM with one blocking for every call: `--deterministic` on CUDA.

cuBLAS picks its kernel, tile shape and split-K from the call's shape, so a row's dot products
sum in another order when the batch grows (Thinking Machines Lab, "Defeating Nondeterminism in
LLM Inference", 2025; SGLang's deterministic inference and vLLM's batch-invariant mode replace the
GEMM the same way). Here every output tile is one program that walks K in fixed BLOCK_K steps, in
order, with no split-K, and the tile shape and launch configuration depend on N and K (the
weight's) only: a row's result is the same bits whatever M is and wherever the row falls in its
tile. The row count is never specialised on (`do_not_specialize`); the variants Triton compiles
for other arguments (alignment, divisibility by 16) change how operands load, not the order of
any sum.

Float32 operands multiply in IEEE float32 (no TF32), 16-bit ones on the tensor cores. It runs on
CUDA, and under Triton's interpreter on CPU tensors for tests (tests/test_fixed_order_triton.py),
where 16-bit operands are widened to float32 first (the interpreter's 16-bit dot is not torch's).
This module sits at the bottom with fixed_order.py, which imports it only where Triton runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.hardware import triton_interpreting
from kvserve.triton_interpreter import prepare_interpreter

prepare_interpreter()  # under Triton's interpreter only (triton_interpreter.py)

BLOCK_M = 64  # a multiple of 64: Hopper's wgmma instructions take such tiles
BLOCK_K = 64


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_wk, stride_om,
                 HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _block_n(n: int) -> int:
    """Output columns per program, from the weight's width only: narrow layers get narrower
    tiles, so that a decode step of one row still spreads over the GPU's SMs."""
    return 32 if n <= 4096 else 64


def fixed_order_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) in x's dtype, float32 accumulation; each row's bits
    independent of the other rows and of their number. x and weight share a dtype."""
    if weight.dtype != x.dtype:
        raise TypeError(f"fixed_order_linear: x is {x.dtype}, the weight {weight.dtype}")
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    interpreting = triton_interpreting()
    # The interpreter truncates float32 -> 16-bit casts where CUDA rounds to nearest even: there
    # the kernel writes float32 and torch rounds.
    out = torch.empty(m, n, dtype=torch.float32 if interpreting else x.dtype, device=x.device)
    if m:
        block_n = _block_n(n)
        _gemm_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))](
            flat, weight, weight if bias is None else bias, out, m, n, k, flat.stride(0), weight.stride(0),
            weight.stride(1), out.stride(0), HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32 or interpreting,
            BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3)
    return out.to(x.dtype).view(*x.shape[:-1], n)
