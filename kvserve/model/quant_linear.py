"""Weight-only quantized linear layers (`--quantization`) and the pass that puts them in a model.

A decode step at small batch reads every weight once per token, so its speed is the weights'
size: int4 weights are a quarter of bf16's bytes. torch ships a CPU kernel that multiplies by
int4 weights in groups (a scale and zero per group of 32) without materialising them,
`aten._weight_int4pack_mm_for_cpu`; int8 weights go through it too, as their high and low nibbles
(`_int4_kernel_operands`), which keeps llama.cpp's Q8_0 group scales exact and at one row reads
faster than torch's per-channel int8 kernel (`aten._weight_int8pack_mm`) or a bf16 GEMV. The kernel
is fast only with bfloat16 activations (its float32 path is a scalar loop), also on CPUs without
native bf16 (it widens to float32 with vector shifts), so a float32 model runs it with its
activations rounded to bfloat16 and the result widened back. At many rows (prefill chunks, large
decode batches) it loses to oneDNN's dense GEMM, so a layer also keeps its dequantized weight for
those when RAM allows (the plain-copy rule of cpu_linear.py).

Devices without the kernel (CUDA here) dequantize the weight on each call: correct, and the memory
saving holds, but no faster than dense weights.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.hardware import available_ram_bytes
from kvserve.model.cpu_linear import PrepackedLinear, prepacking_available
from kvserve.model.quantized import QuantizedMatrix, concat_rows, quantize_int4, quantize_int8, same_format
from kvserve.units import format_size

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
# Rows up to which the int4 kernel beats the dense GEMM: oneDNN's bf16 GEMM catches up sooner than
# float32 F.linear (BENCHMARKS.md, "Quantized weights", benchmarks/quantized_linears.py).
KERNEL_MAX_ROWS = 4
KERNEL_MAX_ROWS_FLOAT32 = 8


def kernel_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which a quantized layer of a `dtype` model multiplies through the int4 kernel."""
    return KERNEL_MAX_ROWS_FLOAT32 if dtype == torch.float32 else KERNEL_MAX_ROWS
_KERNEL_DTYPE = torch.bfloat16
_KERNEL_GROUP = 32  # the group size the layers give the int4 kernel
# The model's fused linears and the checkpoint matrices they are made of, in order.
_FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _int4_kernel_operands(matrix: QuantizedMatrix) -> tuple[torch.Tensor, torch.Tensor]:
    """The int32 codes [out, in'] and float32 scales and zeros [in' / 32, out, 2] that make torch's
    int4 kernel multiply by `matrix`. An int8 matrix becomes two int4 halves side by side (in' = 2 in):
    with u = q + 128 = 16 hi + lo, d q = 16d (hi - 8) + (d (lo - 8) + 8d), so the high nibbles take
    scale 16d and zero 0, the low ones scale d and zero 8d: the same weight, no rounding but the
    kernel's bf16 scales (16d, 8d and d round alike)."""
    out, cols = matrix.shape
    repeat = matrix.group_size // _KERNEL_GROUP
    scale = matrix.scale.repeat_interleave(repeat, dim=1)
    if matrix.bits == 4:
        zero = matrix.zero.repeat_interleave(repeat, dim=1) if matrix.zero is not None else torch.zeros_like(scale)
        q, scales, zeros = matrix.q.to(torch.int32), scale, zero
    else:
        u = matrix.q.to(torch.int32) + 128
        q = torch.cat((u >> 4, u & 15), dim=1)
        scales = torch.cat((16 * scale, scale), dim=1)
        zeros = torch.cat((torch.zeros_like(scale), 8 * scale), dim=1)
    return q, torch.stack((scales, zeros), dim=-1).transpose(0, 1)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held as a QuantizedMatrix: through torch's CPU kernel for up to
    `kernel_max_rows(dtype)` rows, through a dense copy (if kept) above that, else dequantized per call."""

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, keep_dense: bool):
        super().__init__()
        self.out_features, self.in_features = matrix.shape
        self.bits, self.group_size = matrix.bits, matrix.group_size
        self.bias = bias
        self.dtype = dtype
        self.max_kernel_rows = kernel_max_rows(dtype)
        self.kernel = (device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
                       and self.in_features % _KERNEL_GROUP == 0 and matrix.group_size % _KERNEL_GROUP == 0)
        self.matrix: QuantizedMatrix | None = None
        if self.kernel:
            q, scales_zeros = _int4_kernel_operands(matrix)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.scales_zeros = scales_zeros.to(_KERNEL_DTYPE).contiguous()
        else:
            self.matrix = QuantizedMatrix(matrix.q.to(device), matrix.scale.to(device),
                                          None if matrix.zero is None else matrix.zero.to(device),
                                          matrix.group_size, matrix.bits)
        self.dense: nn.Module | torch.Tensor | None = None
        if keep_dense and self.kernel:
            weight = matrix.dequantize().to(dtype)
            if prepacking_available(device, dtype):
                dense = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
                dense.weight = nn.Parameter(weight, requires_grad=False)
                self.dense = PrepackedLinear(dense, keep_plain=False)
            else:
                self.dense = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.kernel and (rows <= self.max_kernel_rows or self.dense is None):
            flat = x.reshape(rows, self.in_features).to(_KERNEL_DTYPE)
            if self.bits == 8:  # the weight's high and low nibbles, each multiplied by x
                flat = torch.cat((flat, flat), dim=1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, _KERNEL_GROUP, self.scales_zeros)
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.dense is not None:
            if isinstance(self.dense, torch.Tensor):
                return F.linear(x, self.dense, self.bias)
            y = self.dense(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.matrix.dequantize().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group_size={self.group_size}, kernel={self.kernel}, dense_copy={self.dense is not None}")


@dataclass
class QuantizationReport:
    """What `quantize_linears` did, for the start-up log."""

    mode: str
    kinds: dict[str, int] = field(default_factory=dict)  # "int4 g32" -> number of linears
    dense_copy_bytes: int = 0

    def describe(self) -> str:
        if not self.kinds:
            return "none (full-precision weights)"
        return ", ".join(f"{count} × {kind}" for kind, count in sorted(self.kinds.items()))


def _source_matrix(name: str, sources: dict[str, QuantizedMatrix], tied_embedding: bool) -> QuantizedMatrix | None:
    """The checkpoint's quantized matrix for the model's linear `name` (fused ones concatenated),
    or None where the checkpoint stores it unquantized or in formats that do not fuse."""
    if name == "lm_head" and tied_embedding:
        return sources.get("embed_tokens.weight")
    for fused, parts in _FUSED_PARTS.items():
        if name.endswith(fused):
            prefix = name[: -len(fused)]
            matrices = [sources.get(f"{prefix}{part}.weight") for part in parts]
            return concat_rows(matrices) if same_format(matrices) else None
    return sources.get(f"{name}.weight")


def _target(mode: str, name: str, source: QuantizedMatrix | None, weight: torch.Tensor) -> QuantizedMatrix | None:
    """The matrix a linear is served with under `mode`: a checkpoint's own quantized matrix where
    it has the asked width (auto: whatever it has), else one quantized from its values. The LM
    head stays 8-bit under int4 (as llama.cpp's quantizers keep the output layer at 6-8 bits: its
    errors reach the logits directly)."""
    bits = {"int8": 8, "int4": 8 if name == "lm_head" else 4}.get(mode)
    if source is not None and (mode == "auto" or source.bits == bits):
        return source
    if mode == "auto":
        return None
    dense = source.dequantize() if source is not None else weight.float()
    return quantize_int4(dense) if bits == 4 else quantize_int8(dense)


def quantization_targets(model: nn.Module, mode: str, sources: dict[str, QuantizedMatrix], dtype: torch.dtype,
                         skip: tuple[str, ...] = ()) -> dict[str, QuantizedMatrix]:
    """The quantized matrix each of the model's nn.Linear layers (by module name, those in `skip`
    left out) is served with under `mode` (auto: what the checkpoint stores, `sources`, by HF name
    without the "model." prefix; int8/int4: every linear, quantized from its weight in `dtype`;
    none: nothing). Tensor parallelism computes these on the full model and shards them, so that
    every rank holds the codes and scales a single process would."""
    if mode == "none":
        return {}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    targets = {}
    for name, linear in model.named_modules():
        if not isinstance(linear, nn.Linear) or name in skip:
            continue
        target = _target(mode, name, _source_matrix(name, sources, tied), linear.weight.to(dtype))
        if target is not None:
            targets[name] = target
    return targets


def install_quantized(model: nn.Module, targets: dict[str, QuantizedMatrix], mode: str, dtype: torch.dtype,
                      device: torch.device) -> QuantizationReport:
    """Replace the nn.Linear layers named in `targets` by QuantizedLinear layers of those matrices
    (each keeping its linear's bias)."""
    report = QuantizationReport(mode)
    dense_bytes = sum(t.shape[0] * t.shape[1] for t in targets.values()) * torch.finfo(dtype).bits // 8
    keep_dense = device.type == "cpu" and dense_bytes <= available_ram_bytes() // 4
    for name, target in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = getattr(parent, child).bias
        setattr(parent, child, QuantizedLinear(target, bias, dtype, device, keep_dense))
        per_channel = target.bits == 8 and target.group_size == target.shape[1]
        kind = f"int{target.bits} " + ("per channel" if per_channel else f"g{target.group_size}")
        report.kinds[kind] = report.kinds.get(kind, 0) + 1
    if keep_dense and targets:
        report.dense_copy_bytes = dense_bytes
    if targets and device.type == "cpu" and not keep_dense:
        logger.info("Quantized linears run every batch size through the int kernels: a dense copy for large "
                    "batches (%s) would take more than a quarter of the available RAM", format_size(dense_bytes))
    return report


@contextmanager
def quantized_for_a_while(model: nn.Module, targets: dict[str, QuantizedMatrix], mode: str, dtype: torch.dtype,
                          device: torch.device) -> Iterator[None]:
    """Serve `targets` (install_quantized) inside the block, then put the plain linears back: rank 0
    of a tensor-parallel engine calibrates the KV format over the full model as one process would
    serve it, then shards the plain layers."""
    plain = {name: model.get_submodule(name) for name in targets}
    install_quantized(model, targets, mode, dtype, device)
    try:
        yield
    finally:
        for name, linear in plain.items():
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)


def quantize_linears(model: nn.Module, mode: str, sources: dict[str, QuantizedMatrix], dtype: torch.dtype,
                     device: torch.device) -> QuantizationReport:
    """Replace the model's nn.Linear layers by QuantizedLinear under `mode` (quantization_targets)."""
    return install_quantized(model, quantization_targets(model, mode, sources, dtype), mode, dtype, device)


def quantized_bytes(linear: nn.Module) -> int:
    """Bytes of a linear's weight in the form it is served (QuantizedLinear: the packed codes and
    the scales and zeros, not its dense copy for large batches; nn.Linear: its weight) and bias."""
    bias = linear.bias.nbytes if getattr(linear, "bias", None) is not None else 0
    if isinstance(linear, QuantizedLinear):
        if linear.kernel:
            return linear.packed.nbytes + linear.scales_zeros.nbytes + bias
        m = linear.matrix
        return m.q.nbytes + m.scale.nbytes + (m.zero.nbytes if m.zero is not None else 0) + bias
    return linear.weight.nbytes + bias


def served_matrix_bytes(values: int, bits: int | None, dtype: torch.dtype) -> int:
    """Bytes a matrix of `values` weights takes in QuantizedLinear's kernel form (`bits` 4 or 8: the
    codes at 4 bits each, 8-bit ones as two nibbles, plus a bfloat16 scale and zero per 32 codes),
    or dense in `dtype` (bits None)."""
    if bits is None:
        return values * torch.empty((), dtype=dtype).element_size()
    codes = values * bits // 4
    return codes // 2 + codes // _KERNEL_GROUP * 4


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters, buffers and the tensors of quantized and
    prepacked layers), each storage counted once."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, QuantizedMatrix):
                tensors += [t for t in (value.q, value.scale, value.zero) if t is not None]
        for tensor in tensors:
            try:
                key = tensor.untyped_storage().data_ptr()
                size = tensor.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # opaque tensors (oneDNN's blocked weights)
                key, size = id(tensor), tensor.numel() * tensor.element_size()
            if key not in seen:
                seen.add(key)
                total += size
    return total
