"""Weight-only quantized linear layers (`--quantization`) and the pass that puts them in a model.

A decode step at small batch reads every weight once per token, so its speed is the weights'
size: int4 weights are a quarter of bf16's bytes. A layer multiplies through kvserve's own CPU
kernel (csrc/quant_gemv.h, built with the lean decode kernel, lean_kernel.py): integer dot
products over the codes in group-32 layout with float16 scales (4-bit codes eight output rows
interleaved, as llama.cpp repacks Q4_0 for its CPU GEMM), the rows of activations quantized per
group like llama.cpp's (8 bits against 4-bit weights, 16 bits against 8-bit ones, whose Q8_0
group scales stay exact). Where that kernel cannot be built or loaded
(`KVSERVE_DISABLE_CPU_KERNEL=1`, no compiler), torch's `aten._weight_int4pack_mm_for_cpu` does it:
group-32 int4 with bfloat16 scales and zeros, an 8-bit matrix as its high and low nibbles
(`_int4_kernel_operands`), bfloat16 activations. Where a kernel loses to oneDNN's dense GEMM at many
rows (prefill chunks, large decode batches: `kernel_max_rows`), a layer also keeps its dequantized
weight for those when RAM allows (the plain-copy rule of cpu_linear.py).

Devices without either kernel (CUDA here) dequantize the weight on each call: correct, and the
memory saving holds, but no faster than dense weights.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.hardware import available_ram_bytes, cpu_flags
from kvserve.model.cpu_linear import PrepackedLinear, prepacking_available
from kvserve.model.kernel_build import current_isa
from kvserve.model.lean_kernel import load_lean_decode_module
from kvserve.model.quantized import (
    CompactMatrix, QuantizedMatrix, concat_rows, quantize_int4, quantize_int8, same_format)
from kvserve.units import format_size

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
# Rows up to which the int kernels beat the dense GEMM: oneDNN's bf16 GEMM catches up sooner than
# its float32 one (BENCHMARKS.md, "Quantized weights", "On a real AVX2-only CPU" and "4-bit weights
# interleaved", benchmarks/quantized_linears.py).
KERNEL_MAX_ROWS = 4
KERNEL_MAX_ROWS_FLOAT32 = 16


def kernel_max_rows(dtype: torch.dtype, own_kernel_bits: int | None = None) -> int | None:
    """Rows up to which a quantized layer of a `dtype` model multiplies through its int kernel (None:
    every row count, so the layer keeps no dense copy). `own_kernel_bits`: the width of the layer's
    codes where kvserve's kernel serves it. Its 4-bit GEMM outruns oneDNN's float32 GEMM at every
    row count measured on an AVX2 build, and on an AVX-512 one where the CPU has VNNI (its dpbusd
    variant); oneDNN's bf16 GEMM (AVX512-BF16 or AMX) wins from 8 rows, and against AVX-512 float32
    without VNNI or the scalar build it has not been measured, so the crossovers stay there."""
    if own_kernel_bits == 4 and dtype == torch.float32 and own_4bit_kernel_beats_float32_gemm():
        return None
    return KERNEL_MAX_ROWS_FLOAT32 if dtype == torch.float32 else KERNEL_MAX_ROWS


def own_4bit_kernel_beats_float32_gemm() -> bool:
    """Whether this build of kvserve's 4-bit kernel was measured faster than oneDNN's float32 GEMM
    at every row count: AVX2, or AVX-512 on a CPU with VNNI."""
    isa = current_isa()
    return isa == "AVX2" or (isa == "AVX512" and "avx512_vnni" in cpu_flags())


_KERNEL_DTYPE = torch.bfloat16
_KERNEL_GROUP = 32  # the group size the layers give the int4 kernel
_KERNEL_BLOCK = 8  # output rows kvserve's kernel interleaves in a 4-bit matrix (quant_gemv.h kBlock)
# The model's fused linears and the checkpoint matrices they are made of, in order.
_FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _fits_gemv_layout(matrix: QuantizedMatrix) -> bool:
    """Whether `matrix`'s shape and format map onto kvserve's kernel layout (its scales may still
    fall outside float16's range: gemv_operands)."""
    out, cols = matrix.shape
    if cols % _KERNEL_GROUP or matrix.group_size % _KERNEL_GROUP:
        return False
    return matrix.zero is None if matrix.bits == 8 else out % _KERNEL_BLOCK == 0


def _served_by_own_kernel_at_every_row_count(matrix: QuantizedMatrix, dtype: torch.dtype,
                                             device: torch.device) -> bool:
    """Whether QuantizedLinear(matrix) runs every batch through kvserve's kernel (no dense copy)."""
    return (device.type == "cpu" and matrix.bits == 4 and kernel_max_rows(dtype, 4) is None
            and _fits_gemv_layout(matrix) and load_lean_decode_module()[0] is not None)


def _torch_int4_kernel_takes(matrix: QuantizedMatrix, device: torch.device) -> bool:
    """Whether torch's int4 CPU kernel can multiply by `matrix` (its groups are whole 32s)."""
    return (device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
            and matrix.shape[1] % _KERNEL_GROUP == 0 and matrix.group_size % _KERNEL_GROUP == 0)


def gemv_operands(matrix: QuantizedMatrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The codes, float16 scales d and offsets m of `matrix` for kvserve's kernel (csrc/quant_gemv.h:
    w = d u + m with 4-bit codes u, w = d q with int8 codes q), or None where its format does not map
    (an 8-bit matrix with zeros, scales outside float16's range, a 4-bit one whose rows are not a
    multiple of 8).
    8-bit: codes [out, in], d [out, in / 32] as the matrix has them. 4-bit: eight output rows
    interleaved, codes [out, in / 2] and d, m [out, in / 32] holding blocks of rows 8b..8b+7 (see
    quant_gemv.h): per group, four 32-byte chunks, chunk c holding for each of the eight rows four
    columns 4c.. in its low nibbles and 16+4c.. in its high ones; scales [block, group, row].
    From a GGUF file (float16 scales), d u + m is the same float32 value as `dequantize()`."""
    out, cols = matrix.shape
    if not _fits_gemv_layout(matrix):
        return None
    repeat = matrix.group_size // _KERNEL_GROUP
    scale = matrix.scale.float().repeat_interleave(repeat, dim=1)
    d = scale.to(torch.float16)
    if not torch.isfinite(d).all() or ((d == 0) & (scale != 0)).any():
        return None
    if matrix.bits == 8:
        return matrix.q.to(torch.int8).contiguous(), d.contiguous(), None
    zero = matrix.zero.float().repeat_interleave(repeat, dim=1) if matrix.zero is not None else torch.zeros_like(scale)
    m = (zero - matrix.offset * scale).to(torch.float16)
    if not torch.isfinite(m).all():
        return None
    groups, blocks = cols // _KERNEL_GROUP, out // _KERNEL_BLOCK
    # [block, row, group, half, chunk, column] -> bytes [block, group, chunk, row, column]
    q = matrix.q.to(torch.uint8).reshape(blocks, _KERNEL_BLOCK, groups, 2, 4, 4)
    codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(out, cols // 2)

    def interleaved(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(blocks, _KERNEL_BLOCK, groups).transpose(1, 2).reshape(out, groups).contiguous()

    return codes.contiguous(), interleaved(d), interleaved(m)


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
    """y = x W^T + b with W held as a QuantizedMatrix: through an int kernel (kvserve's, else torch's)
    for up to `max_kernel_rows` rows (all, where that is None), through a dense copy (if kept) above
    that; with no kernel (CUDA), held compact (CompactMatrix) and dequantized per call."""

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device, keep_dense: bool):
        super().__init__()
        self.out_features, self.in_features = matrix.shape
        self.bits, self.group_size = matrix.bits, matrix.group_size
        self.bias = bias
        self.dtype = dtype
        # The small-batch kernel: kvserve's own (lean_kernel.py) where it loads, else torch's int4 one.
        self.gemv = None
        self.gemv_operands = None
        if device.type == "cpu":
            module, _ = load_lean_decode_module()
            self.gemv_operands = gemv_operands(matrix) if module is not None else None
            self.gemv = module.gemv if self.gemv_operands is not None else None
        self.kernel = self.gemv is not None or _torch_int4_kernel_takes(matrix, device)
        self.max_kernel_rows = kernel_max_rows(dtype, self.bits if self.gemv is not None else None)
        self.fixed_order = False  # --deterministic (batch_invariant.py): one path at every row count
        self.matrix: CompactMatrix | None = None  # no kernel (CUDA): dequantized on each call
        if self.gemv is not None:
            pass  # the codes live in gemv_operands
        elif self.kernel:
            q, scales_zeros = _int4_kernel_operands(matrix)
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            self.scales_zeros = scales_zeros.to(_KERNEL_DTYPE).contiguous()
        else:
            self.matrix = CompactMatrix.of(matrix, device)
        self.dense: nn.Module | torch.Tensor | None = None
        if keep_dense and self.kernel and self.max_kernel_rows is not None:
            weight = matrix.dequantize().to(dtype)
            if prepacking_available(device, dtype):
                dense = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
                dense.weight = nn.Parameter(weight, requires_grad=False)
                self.dense = PrepackedLinear(dense, keep_copy=False)
            else:
                self.dense = weight
        # A dense copy on kvserve's AVX512-BF16 kernel sums in one order at every row count, and beats
        # the int kernel from a few rows on: under --deterministic it then takes every row count.
        self.dense_on_bf16_kernel = isinstance(self.dense, PrepackedLinear) and self.dense.kernel_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        on_kernel = self.dense is None or rows <= self.max_kernel_rows
        if self.fixed_order:  # one path for every row count (batch_invariant.py)
            on_kernel = not self.dense_on_bf16_kernel
        if self.gemv is not None and on_kernel:
            flat = x.reshape(rows, self.in_features)
            if flat.dtype not in (torch.float32, torch.bfloat16):
                flat = flat.float()
            y = self.gemv(flat.contiguous(), *self.gemv_operands)
            y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.kernel and on_kernel:
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
        weight = self.matrix.dequantize(x.dtype)
        if self.fixed_order:  # CUDA under --deterministic (batch_invariant.py)
            return importlib.import_module("kvserve.fixed_order_triton").fixed_order_linear(x, weight, self.bias)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group_size={self.group_size}, "
                f"kernel={'kvserve' if self.gemv else 'torch int4' if self.kernel else None}, "
                f"dense_copy={self.dense is not None}")


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


def weights_served_from_sources(model: nn.Module, mode: str, sources: dict[str, QuantizedMatrix]) -> frozenset[str]:
    """The HF tensor names (as a checkpoint has them) of the linears `mode` serves from the
    checkpoint's own quantized matrices: auto takes those as they are and int8/int4 requantize from
    them (`_target`), so the dense values are never read and a loader need not make them."""
    if mode == "none" or not sources:
        return frozenset()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    names = set()
    for name, linear in model.named_modules():
        if not isinstance(linear, nn.Linear) or (name == "lm_head" and tied):
            continue  # a tied head is the embedding table, which the model reads whole
        parts = _checkpoint_parts(name)
        if all(sources.get(f"{part}.weight") is not None for part in parts):
            names.update(f"{part}.weight" if part == "lm_head" else f"model.{part}.weight" for part in parts)
    return frozenset(names)


def _source_matrix(name: str, sources: dict[str, QuantizedMatrix], tied_embedding: bool) -> QuantizedMatrix | None:
    """The checkpoint's quantized matrix for the model's linear `name` (fused ones concatenated),
    or None where the checkpoint stores it (or a part of it) unquantized. Parts stored in different
    formats (a Q4_K_M file's Q4_K q/k and Q6_K v) are fused as int8 in groups of 32 of their values."""
    if name == "lm_head" and tied_embedding:
        return sources.get("embed_tokens.weight")
    matrices = [sources.get(f"{part}.weight") for part in _checkpoint_parts(name)]
    if any(m is None for m in matrices):
        return None
    if len(matrices) == 1:
        return matrices[0]
    if same_format(matrices):
        return concat_rows(matrices)
    return quantize_int8(torch.cat([m.dequantize() for m in matrices]), group_size=32)


def _checkpoint_parts(name: str) -> list[str]:
    """The checkpoint's modules whose weights the model's linear `name` holds: q/k/v for a fused
    qkv_proj, gate/up for gate_up_proj, else itself."""
    fused = next((f for f in _FUSED_PARTS if name.endswith(f)), None)
    return [name[: -len(fused)] + part for part in _FUSED_PARTS[fused]] if fused else [name]


def _target(mode: str, name: str, source: QuantizedMatrix | None,
            weight: Callable[[], torch.Tensor]) -> QuantizedMatrix | None:
    """The matrix a linear is served with under `mode`: a checkpoint's own quantized matrix where
    it has the asked width (auto: whatever it has), else one quantized from its values. The LM
    head stays 8-bit under int4 (as llama.cpp's quantizers keep the output layer at 6-8 bits: its
    errors reach the logits directly)."""
    bits = {"int8": 8, "int4": 8 if name == "lm_head" else 4}.get(mode)
    if source is not None and (mode == "auto" or source.bits == bits):
        return source
    if mode == "auto":
        return None
    dense = source.dequantize() if source is not None else weight().float()
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
        # the weight only where it is quantized from (one served from a source may be a meta stand-in)
        target = _target(mode, name, _source_matrix(name, sources, tied), lambda: linear.weight.to(dtype))
        if target is not None:
            targets[name] = target
    return targets


def install_quantized(model: nn.Module, targets: dict[str, QuantizedMatrix], mode: str, dtype: torch.dtype,
                      device: torch.device) -> QuantizationReport:
    """Replace the nn.Linear layers named in `targets` by QuantizedLinear layers of those matrices
    (each keeping its linear's bias)."""
    report = QuantizationReport(mode)
    dense_bytes = sum(t.shape[0] * t.shape[1] for t in targets.values()
                      if not _served_by_own_kernel_at_every_row_count(t, dtype, device)) * torch.finfo(dtype).bits // 8
    keep_dense = device.type == "cpu" and dense_bytes <= available_ram_bytes() // 4
    for name, target in targets.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = getattr(parent, child).bias
        setattr(parent, child, QuantizedLinear(target, bias, dtype, device, keep_dense))
        per_channel = target.bits == 8 and target.group_size == target.shape[1]
        kind = f"int{target.bits} " + ("per channel" if per_channel else f"g{target.group_size}")
        report.kinds[kind] = report.kinds.get(kind, 0) + 1
    if keep_dense:
        report.dense_copy_bytes = dense_bytes
    if dense_bytes and device.type == "cpu" and not keep_dense:
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
    """Bytes of a linear's weight in the form it is served (QuantizedLinear: its small-batch kernel's
    codes, scales and offsets, not its dense copy for large batches; nn.Linear: its weight) and bias."""
    bias = linear.bias.nbytes if getattr(linear, "bias", None) is not None else 0
    if isinstance(linear, QuantizedLinear):
        if linear.gemv_operands is not None:
            return sum(t.nbytes for t in linear.gemv_operands if t is not None) + bias
        if linear.kernel:
            return linear.packed.nbytes + linear.scales_zeros.nbytes + bias
        return linear.matrix.nbytes + bias
    return linear.weight.nbytes + bias


def served_matrix_bytes(values: int, bits: int | None, dtype: torch.dtype) -> int:
    """Bytes a matrix of `values` weights takes in QuantizedLinear's small-batch kernel form (`bits`
    4: two codes a byte plus a float16 scale and offset per 32; 8: a byte a code plus a float16 scale
    per 32), or dense in `dtype` (bits None): also what a layer with no kernel (CUDA) holds
    (CompactMatrix). Where only torch's int4 kernel runs, an 8-bit matrix takes about twice that
    (two nibbles, bfloat16 scales and zeros for each)."""
    if bits is None:
        return values * torch.empty((), dtype=dtype).element_size()
    groups = values // _KERNEL_GROUP
    return values // 2 + groups * 4 if bits == 4 else values + groups * 2


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
            elif isinstance(value, CompactMatrix):
                tensors += [t for t in (value.codes, value.d, value.m) if t is not None]
            elif isinstance(value, tuple):  # QuantizedLinear.gemv_operands
                tensors += [t for t in value if isinstance(t, torch.Tensor)]
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
