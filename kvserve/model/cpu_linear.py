"""Linear layers for CPU inference: bf16 weights on kvserve's AVX512-BF16 kernel where the CPU has
it; elsewhere oneDNN-prepacked weights (bf16 and float32), and for bf16 torch's own GEMV for a
single row.

On a CPU with AVX512-BF16 and without AMX (Cooper Lake, AMD Zen 4 on) a bf16 weight is packed once
for csrc/bf16_gemm.h, whose `vdpbf16ps` tiles stream the weight once per call. At a decode batch
(1-32 rows) it beats both oneDNN's GEMM, which does not hide its weight reads there, and torch's
GEMV; from 128 to 2,048 rows it runs on par with oneDNN (BENCHMARKS.md, issue 26, eighth pass). So
such a layer holds that one copy and nothing else, and every row count takes it. The rest of this
note is about the CPUs without it.

`F.linear` on a plain bf16 weight lets oneDNN reorder the weight into its blocked layout on
every call; for a decode step, which is one pass over all weights, that reorder is a large share
of the memory traffic. Reordering once at load time (what torch.compile's freezing pass does)
is faster at every batch size, with bitwise-identical results.

A single row (batch-1 decode, the LM head of a prefill) is a matrix-vector product, and there
torch's native bf16 GEMV over the plain row-major weight reads the weights faster than oneDNN's
prepacked kernel (float32 accumulation in both); from two rows on, the prepacked kernel wins
(BENCHMARKS.md, "Offline throughput", "Before"). So
each bf16 layer also keeps its plain weight when memory allows (a second copy of the linear weights,
see `prepack_linears`) and sends single rows to the native kernel. Not where oneDNN runs bf16 on
AMX tiles (Sapphire Rapids on): there the prepacked kernel is the faster one at one row too
(BENCHMARKS.md, "On a CPU with AMX"). torch picks oneDNN for any
large bf16 matmul while oneDNN is enabled, so the flag is switched off around that one call;
it is process-global, which is safe because the engine runs its forward passes from one thread
(another thread's matmul in that window would just take the native kernel too).

float32 (what an AVX2-only CPU runs) gains more: `F.linear` goes to MKL's sgemm on the plain
weight, and oneDNN's prepacked float32 kernel beats it at every row count, most at 8-64 rows (a
decode batch), single rows included, so float32 layers keep no plain copy (BENCHMARKS.md,
"On a real AVX2-only CPU").
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.fixed_order import at_least_two_rows
from kvserve.hardware import available_ram_bytes, onednn_bf16_missing, onednn_runs_amx
from kvserve.model.lean_kernel import load_lean_decode_module
from kvserve.units import format_size

logger = logging.getLogger(__name__)


def prepacking_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears of `dtype` on `device` can be prepacked: float32 wherever torch has oneDNN,
    bf16 only where oneDNN runs bf16 (without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, e.g. an AVX2-only
    CPU, torch raises at the reorder); elsewhere the layers stay plain nn.Linear (F.linear)."""
    if device.type != "cpu" or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    return dtype == torch.bfloat16 and onednn_bf16_missing() is None


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear through torch's own CPU kernels, with oneDNN switched off for the call."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


# The batch size oneDNN is told to expect at the reorder: float32's layout for 32 rows ran a decode
# batch (8-64 rows) fastest and single rows as fast as for 1 (BENCHMARKS.md, "On a real AVX2-only CPU").
_PACKING_ROWS = {torch.float32: 32}


def bf16_kernel() -> Any | None:
    """The compiled module whose `bf16_matmul` (csrc/bf16_gemm.h) runs bf16 linears, or None where
    this CPU or build lacks it (no AVX512-BF16) or oneDNN runs bf16 on AMX (faster there)."""
    if onednn_runs_amx():
        return None
    module, _ = load_lean_decode_module()
    return module if module is not None and module.bf16_available() else None


def takes_bf16_kernel(linear: nn.Linear, kernel: Any | None) -> bool:
    """Whether `linear` goes on `kernel` (bf16_kernel()): a bf16 weight (and bias) of a shape its
    layout fits."""
    return (kernel is not None and linear.weight.dtype == torch.bfloat16
            and kernel.bf16_fits(linear.out_features, linear.in_features)
            and (linear.bias is None or linear.bias.dtype == torch.bfloat16))


class PrepackedLinear(nn.Module):
    """y = x W^T + b with W packed once at load. A bf16 weight on a CPU with AVX512-BF16 (not AMX)
    is held once, in the layout of kvserve's kernel, which takes every row count (`kernel_weight`);
    otherwise in oneDNN's blocked layout (`packed`), and with `keep_copy` (bf16 only) also W itself,
    whose single rows go through torch's GEMV (`plain`)."""

    def __init__(self, linear: nn.Linear, keep_copy: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.bias = linear.bias
        self.packed = self.plain = self.kernel_weight = None
        self.fixed_order = False  # --deterministic (batch_invariant.py): single rows multiplied as two
        kernel = bf16_kernel() if weight.dtype == torch.bfloat16 else None
        if takes_bf16_kernel(linear, kernel):
            self.kernel_weight, self._kernel_matmul = kernel.bf16_pack(weight), kernel.bf16_matmul
            self._kernel_bias = None if self.bias is None else self.bias.detach()
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_ROWS.get(weight.dtype, 1))
        if keep_copy and weight.dtype == torch.bfloat16:
            self.plain = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernel_weight is not None:
            out = self._kernel_matmul(x.reshape(rows, self.in_features), self.kernel_weight, self._kernel_bias)
            return out.view(*x.shape[:-1], self.out_features)
        if rows == 1 and self.fixed_order:  # oneDNN takes another kernel for a single row
            flat = at_least_two_rows(x.reshape(1, self.in_features))
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
            return out[:1].view(*x.shape[:-1], self.out_features)
        if self.plain is not None and rows == 1:
            return native_linear(x, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` with a PrepackedLinear; returns how many.

    bf16 layers go on kvserve's AVX512-BF16 kernel where it runs and their shape fits, one copy each.
    The others keep their plain weights for single rows when that second copy takes at most a
    quarter of the RAM available now (a weight shared with another module, like a tied LM head's
    embedding, costs nothing). A model too large for it keeps only the packed copy: correct, slower
    at batch 1. float32 layers never keep it, nor bf16 ones where oneDNN runs on AMX: their packed
    kernel is the faster one at one row too."""
    linears = [(module, name, child) for module in list(model.modules())
               for name, child in list(module.named_children()) if isinstance(child, nn.Linear)]
    linear_ids = {id(child) for _, _, child in linears}
    owned_elsewhere = {p.data_ptr() for module in model.modules() if id(module) not in linear_ids
                       for p in module.parameters(recurse=False)}
    bf16 = all(child.weight.dtype == torch.bfloat16 for _, _, child in linears)
    kernel = bf16_kernel() if bf16 else None
    on_kernel = [takes_bf16_kernel(child, kernel) for _, _, child in linears]
    # the plain copies the rest would keep (a weight shared with another module costs nothing)
    extra = sum(child.weight.nbytes for (_, _, child), fits in zip(linears, on_kernel)
                if not fits and child.weight.data_ptr() not in owned_elsewhere)
    available = available_ram_bytes()
    amx = onednn_runs_amx()
    keep_copy = bf16 and not amx and extra <= available // 4
    for module, name, child in linears:
        setattr(module, name, PrepackedLinear(child, keep_copy))
    if any(on_kernel):
        logger.info("bf16 linears on kvserve's AVX512-BF16 kernel: %d of %d (one packed copy of each weight)",
                    sum(on_kernel), len(linears))
    if keep_copy and extra:
        logger.info("Batch-1 linears: keeping a plain copy of the weights (%s) for torch's GEMV", format_size(extra))
    elif bf16 and amx:
        logger.info("Batch-1 linears use the prepacked weights: oneDNN runs them on AMX, faster than torch's GEMV")
    elif bf16 and extra:
        logger.info("Batch-1 linears use the prepacked weights: a plain copy (%s) would take more than a "
                    "quarter of the available RAM (%s)", format_size(extra), format_size(available))
    return len(linears)
