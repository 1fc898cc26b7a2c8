"""Fused elementwise kernels (Triton) for the CUDA step: fewer launches per layer.

In torch ops a decoder layer's small steps are a dozen launches each on a GPU, where a decode step
of a 1B model is mostly launch gaps (issue 42's profile). Each of these is one launch:

* `add_rms_norm`: the residual add and the next RMSNorm (vLLM's fused_add_rms_norm): the sum is
  rounded to the model dtype as `x + h` is, then normalised in float32, rounded, and scaled by the
  weight, as llama.RMSNorm does;
* `silu_mul`: SiLU(gate) * up over the gate/up projection's output, rounding SiLU's result to the
  model dtype before the product, as `F.silu(gate) * up` does;
* `rotary`: RoPE on the q and k heads (rotate-half convention, rope.apply_rotary's arithmetic);
  the Triton attention backend applies the same `rotate_row` as it stores keys, where it can
  (attention/triton_kernels.rope_store).

They run on CUDA, and under Triton's interpreter on CPU for tests (tests/test_fused_ops.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.model.triton_rounding import round_to
from kvserve.triton_interpreter import prepare_interpreter

prepare_interpreter()  # under Triton's interpreter only (triton_interpreter.py)


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s,
                         hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32))
        x = round_to(x, sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = round_to(xf * inv, out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, round_to(normed * weight, out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual) for [rows, hidden]; with residual None,
    (RMSNorm(x) * weight, x)."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, total, x.stride(0),
                                      0 if residual is None else residual.stride(0), out.stride(0), total.stride(0),
                                      hidden, eps, HAS_RESIDUAL=residual is not None,
                                      BLOCK=triton.next_power_of_2(hidden))
    return out, total


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=ok, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, round_to(silu * up, out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 I] (gate, then up) -> SiLU(gate) * up [rows, I]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(width))
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0), width,
                                                            BLOCK=block)
    return out


@triton.jit
def rotate_row(x_ptr, cos_ptr, sin_ptr, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """One head's RoPE (rotate-half convention): the row at x_ptr rotated by the token's cos and
    signed sin rows, x * cos + [x2, x1] * signed_sin, each product and the sum rounded to DTYPE as
    torch ops round them (rope.apply_rotary). Returns the two channel halves in DTYPE."""
    c = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + c).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + c).to(tl.float32)
    cos1 = tl.load(cos_ptr + c).to(tl.float32)
    cos2 = tl.load(cos_ptr + HALF + c).to(tl.float32)
    sin1 = tl.load(sin_ptr + c).to(tl.float32)  # signed: the first half negated
    sin2 = tl.load(sin_ptr + HALF + c).to(tl.float32)
    first = round_to(x1 * cos1, DTYPE).to(tl.float32) + round_to(x2 * sin1, DTYPE).to(tl.float32)
    second = round_to(x2 * cos2, DTYPE).to(tl.float32) + round_to(x1 * sin2, DTYPE).to(tl.float32)
    return round_to(first, DTYPE), round_to(second, DTYPE)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                   HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    c = tl.arange(0, HALF)
    first, second = rotate_row(x_ptr + token * stride_xt + head * stride_xh, cos_ptr + token * stride_ct,
                               sin_ptr + token * stride_ct, HALF, out_ptr.dtype.element_ty)
    out = out_ptr + token * stride_ot + head * stride_oh
    tl.store(out + c, first)
    tl.store(out + HALF + c, second)


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """rope.apply_rotary in one launch: x [tokens, heads, D] (last dim contiguous), cos and signed
    sin [tokens, 1, D] -> a new [tokens, heads, D]."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        cos, signed_sin = cos.reshape(tokens, dim), signed_sin.reshape(tokens, dim)
        _rotary_kernel[(tokens, heads)](x, cos, signed_sin, out, x.stride(0), x.stride(1), cos.stride(0),
                                        out.stride(0), out.stride(1), HALF=dim // 2)
    return out
