"""`--deterministic` for the model's layers: every reduction of a token's computation in one order,
whatever else is in the batch (Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference",
2025; SGLang's --enable-deterministic-inference, vLLM's batch-invariant kernels).

A token's row meets other rows only inside matmuls and attention; elementwise ops, RoPE and
row-wise RMSNorm already treat each row alone. So the pass switches the layers whose result for
one row could depend on the row count onto fixed-order paths:
- quantized linears: one path for every row count. Their dense copy where it is on kvserve's
  AVX512-BF16 kernel (faster than the integer kernel from a few rows on), else kvserve's integer
  kernel (csrc/quant_gemv.h), never the dense copy oneDNN multiplies large batches with;
- bf16 linears on kvserve's AVX512-BF16 kernel (csrc/bf16_gemm.h): fixed order already;
- linears on oneDNN's prepacked GEMM: a single row is multiplied as two (kvserve/fixed_order.py),
  checked here at start-up on this CPU, since oneDNN documents no such guarantee;
- on CUDA (and on CPU tensors under Triton's interpreter, for tests), plain and dequantized
  linears through a Triton GEMM with one blocking for every row count (fixed_order_triton.py),
  where cuBLAS changes its kernel with the shape;
- RMSNorm: the batched rms_norm for one row too (its one-row layer_norm trick sums in another
  order); on CUDA the fused add + RMSNorm kernel is one program per row already (the CUDA
  platform refuses the option where the fused ops are off).
Attention is the backend's business (BackendConfig.deterministic). The lean decode step, which
fuses the same math in another order, then runs every step of a quantized model or none
(lean_decode.py), so no token is computed one way in one step and the other way in another.
"""
from __future__ import annotations

import importlib

import torch
from torch import nn

from kvserve.hardware import triton_runs_on
from kvserve.model.cpu_linear import PrepackedLinear
from kvserve.model.llama import LlamaForCausalLM, RMSNorm
from kvserve.model.quant_linear import QuantizedLinear

# Row counts whose rows the start-up check compares with the same rows multiplied two at a time.
_CHECKED_ROWS = (3, 8, 33)


def make_batch_invariant(model: LlamaForCausalLM) -> None:
    """Put every layer on its fixed-order path (ValueError naming a layer that has none) and mark
    the model (`model.batch_invariant`)."""
    checked: set[tuple[int, int, torch.dtype]] = set()
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm):
            module.fixed_order = True
        elif isinstance(module, QuantizedLinear):
            if module.gemv is None and not module.dense_on_bf16_kernel and not _on_triton(module):
                raise ValueError(f"--deterministic: {name} is quantized but kvserve's CPU kernel does not serve it "
                                 f"(torch's int4 kernel's rows depend on the batch); run `kvserve build-kernel`, "
                                 f"or --quantization none")
            module.fixed_order = True
        elif isinstance(module, PrepackedLinear):
            module.fixed_order = True
            if module.kernel_weight is None:  # oneDNN's GEMM: check it here, once per shape and dtype
                shape = (module.in_features, module.out_features, module.packed.dtype)
                if shape not in checked:
                    _check_rows_independent(name, module)
                    checked.add(shape)
        elif isinstance(module, nn.Linear):
            if not triton_runs_on(module.weight.device.type):
                raise ValueError(f"--deterministic: {name} multiplies through torch's {str(module.weight.dtype)[6:]} "
                                 f"GEMM on {module.weight.device.type}, whose rows depend on the batch; on CPU "
                                 f"--dtype float32 (or bfloat16 where oneDNN runs it) takes a fixed-order path, "
                                 f"on CUDA the triton package's")
            module.__class__ = importlib.import_module("kvserve.model.fixed_order_linear").FixedOrderLinear
    model.batch_invariant = True


def _on_triton(linear: QuantizedLinear) -> bool:
    """Whether a quantized linear dequantizes its weight on each call (CUDA) where the
    fixed-blocking Triton GEMM runs: its fixed-order path then multiplies through that."""
    return linear.matrix is not None and triton_runs_on(linear.matrix.device.type)


def _check_rows_independent(name: str, linear: PrepackedLinear) -> None:
    """Whether oneDNN gives each row of a call the same bits at several row counts (single rows are
    padded to two); ValueError if not, rather than a flag that does not hold."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(_CHECKED_ROWS), linear.in_features, generator=generator).to(linear.packed.dtype)
    with torch.inference_mode():
        pairs = torch.cat([linear(x[i: i + 2]) for i in range(0, len(x) - 1, 2)] + [linear(x[-1:])])
        for rows in _CHECKED_ROWS:
            if not torch.equal(linear(x[:rows]), pairs[:rows]):
                raise ValueError(f"--deterministic: oneDNN's GEMM on this CPU gives {name} ({linear.in_features} -> "
                                 f"{linear.out_features}, {str(x.dtype)[6:]}) other results for a row at {rows} "
                                 f"rows than at 2; try --dtype float32 or --quantization int8")
