"""The lean decode step: each decoder layer of a small decode batch in two C++ calls.

With 4-bit weights a batch-1 decode step reads so few bytes that the step is bound by the small
ops between the matmuls, not by the weights: as torch ops from Python, a layer's RMSNorms,
residual adds, casts around the quantized matmuls, RoPE and SiLU × up are some fifty dispatches.
csrc/lean_decode.cpp fuses everything from one attention call to the next into two calls (the
residual add and RMSNorm in front of the qkv matmul and RoPE after it, Qwen3's per-head norms
before that; then o_proj, its residual,
RMSNorm, gate/up, SiLU × up and down), multiplying through the same small-batch kernel and codes
as the QuantizedLinear layers (quant_linear.py, csrc/quant_gemv.h). Between the two calls the
step's K/V go into the pool (one C++ copy for a full-precision pool in the model dtype, the KV
format's own write otherwise) and the paged decode kernel attends in place.

It runs only where it computes what the module path computes: a CPU model whose four linears per
layer are all on kvserve's small-batch kernel, or all packed full-precision weights (oneDNN's, or in
bf16 kvserve's AVX512-BF16 kernel's; `--quantization none`; not the single rows the module path
sends to a plain copy), a step of
decodes only in one group read in place, at most MAX_ROWS rows (past the rows the kernel takes,
through the layers' packed dense copies, the weights the module path multiplies there),
and no key centring, key basis, KV rotation (the fp8 and int4 KV formats' calibrations) or
eviction. Everything else (prefill chunks, big batches, CUDA, `KVSERVE_DISABLE_CPU_KERNEL=1`, a
kernel that does not build) takes the module path unchanged.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.cache.formats.full_precision import FullPrecisionFormat
from kvserve.cache.kv_cache import KVCache
from kvserve.model.attention import AttentionMetadata
from kvserve.model.lean_kernel import load_lean_decode_module
from kvserve.model.cpu_linear import PrepackedLinear
from kvserve.model.quant_linear import QuantizedLinear

# Decode rows up to which the fused layers were measured to beat the module path where the kernel
# takes every row count (BENCHMARKS.md, "4-bit weights interleaved"; on bf16/AMX past the kernel's
# rows, "The decode step at 32 rows"; full-precision weights, "seventh pass").
MAX_ROWS = 32


def _operands(linear: QuantizedLinear) -> list[torch.Tensor]:
    """A QuantizedLinear's codes, scales and offsets (an empty tensor for none) for the C++ ops."""
    codes, scales, offsets = linear.gemv_operands
    return [codes, scales, offsets if offsets is not None else codes.new_empty(0)]


def _dense_operands(linear: QuantizedLinear) -> list[torch.Tensor] | None:
    """The packed weight of a QuantizedLinear's dense copy (what batches past its kernel rows
    multiply through), or None where it has none in that form."""
    return _packed_operands(linear.dense) if isinstance(linear.dense, PrepackedLinear) else None


def _packed_operands(linear: PrepackedLinear) -> list[torch.Tensor]:
    """A PrepackedLinear's one weight the fused layers multiply by: bf16_gemm.h's where it has one,
    else oneDNN's (the weight its forward takes past a single row)."""
    return [linear.packed if linear.kernel_weight is None else linear.kernel_weight]


@dataclass(frozen=True)
class _Linears:
    qkv: list[torch.Tensor]
    o: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]


@dataclass(frozen=True)
class _Layer:
    index: int
    window: int | None
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # Qwen3's q_norm and k_norm weights [2, head_dim], or None
    kernel: _Linears | None  # the int kernel's operands, for up to kernel_rows rows (None: full precision)
    dense: _Linears | None  # the dense copies, for more rows (None: the layer has none)


class LeanDecoder:
    """Runs a model's decoder layers for a decode-only step through the fused ops."""

    def __init__(self, module: Any, model: torch.nn.Module, layers: list[_Layer], kernel_rows: int, max_rows: int,
                 min_rows: int = 1):
        self.module = module
        self.model = model
        self.layers = layers
        self.kernel_rows = kernel_rows  # up to these rows the int kernel, above them the dense copies
        self.min_rows, self.max_rows = min_rows, max_rows
        config = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> tuple["LeanDecoder | None", str]:
        """A decoder for `model` (a LlamaForCausalLM), or None and why it does not apply. Under
        --deterministic (`model.batch_invariant`) it takes every step of quantized layers, whatever
        its rows: with every query row a decode, each step is one it serves, and its kernels treat
        each row alone, so the same path for every step keeps a row's bits independent of the rest."""
        weight = model.embed_tokens.weight
        if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32):
            return None, f"runs on CPU in bfloat16 or float32 only, not {weight.device.type} {weight.dtype}"
        layers, limits, kinds, plain, bf16_kernel_everywhere = [], set(), set(), False, True
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if all(isinstance(lin, QuantizedLinear) and lin.gemv_operands is not None for lin in linears):
                kinds.add("quantized")
                limits.update(lin.max_kernel_rows for lin in linears)
                kernel = _Linears(*(_operands(lin) for lin in linears))
                dense = [_dense_operands(lin) for lin in linears]
                bf16_kernel_everywhere &= all(lin.dense_on_bf16_kernel for lin in linears)
            elif all(isinstance(lin, PrepackedLinear) for lin in linears):  # --quantization none
                kinds.add("dense")
                plain = plain or any(lin.plain is not None for lin in linears)
                bf16_kernel_everywhere &= all(lin.kernel_weight is not None for lin in linears)
                kernel, dense = None, [_packed_operands(lin) for lin in linears]
            else:
                return None, "not every linear layer is on the quantized small-batch kernel or oneDNN-packed"
            if any(lin.bias is not None for lin in linears[1:]) or attn.reduce is not None or mlp.reduce is not None:
                return None, "biases after qkv or tensor parallelism"
            head_norms = () if attn.q_norm is None else (attn.q_norm, attn.k_norm)
            if any(norm.eps != layer.input_layernorm.eps for norm in (layer.post_attention_layernorm, *head_norms)):
                return None, "the layer's norms differ in eps"
            qk_norm = torch.stack([norm.weight.detach() for norm in head_norms]) if head_norms else None
            layers.append(_Layer(i, attn.window, layer.input_layernorm.weight.detach(),
                                 layer.post_attention_layernorm.weight.detach(), layer.input_layernorm.eps,
                                 attn.qkv_proj.bias, qk_norm, kernel,
                                 _Linears(*dense) if all(d is not None for d in dense) else None))
        if len(kinds) != 1:
            return None, "the layers' linears are not all of one kind"
        module, why = load_lean_decode_module()
        if module is None:
            return None, why
        if model.batch_invariant:  # the path QuantizedLinear / PrepackedLinear take at every row count
            if bf16_kernel_everywhere:
                return cls(module, model, layers, kernel_rows=0, max_rows=sys.maxsize), ""
            if kinds == {"quantized"}:
                return cls(module, model, layers, kernel_rows=sys.maxsize, max_rows=sys.maxsize), ""
            # oneDNN's packed GEMM takes another kernel for a single row
            return None, "under --deterministic, layers on oneDNN's GEMM keep the module path"
        if kinds == {"dense"}:
            # full-precision weights: every row count multiplies through the packed weights, except
            # the single rows the module path sends to torch's GEMV on a plain copy (cpu_linear.py)
            return cls(module, model, layers, kernel_rows=0, max_rows=MAX_ROWS, min_rows=2 if plain else 1), ""
        kernel_rows = min([MAX_ROWS] + [limit for limit in limits if limit is not None])
        # past the kernel's rows every layer's dense copies (oneDNN-packed) take the batch, as on the
        # module path where every linear switches to its copy at the same row count
        all_dense = all(layer.dense is not None for layer in layers) and len(limits) == 1
        max_rows = MAX_ROWS if all_dense else kernel_rows
        return cls(module, model, layers, kernel_rows, max_rows), ""

    def applies(self, rows: int, kv_cache: KVCache, meta: AttentionMetadata) -> bool:
        """Whether this step (`rows` packed tokens) is one the fused path computes as the modules do."""
        if not self.min_rows <= rows <= self.max_rows or meta.prefills or len(meta.decodes) != 1:
            return False
        if meta.decode_in_place is None or meta.evicting_decode is not None or meta.unrotated_key_rows is not None:
            return False
        first = self.model.layers[0].self_attn
        if first.key_center is not None or first.key_basis is not None:
            return False
        return kv_cache.format.rotation(self.head_dim, self.model.embed_tokens.weight.dtype,
                                        meta.slot_mapping.device) is None

    def run(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: KVCache,
            meta: AttentionMetadata) -> torch.Tensor:
        """x [rows, hidden] (the embeddings) -> the last layer's output [rows, hidden]."""
        rows = x.shape[0]
        cos, signed_sin = (t.reshape(rows, self.head_dim) for t in rope)
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        group = meta.decodes[0]
        block_tables = group.block_ids.view(rows, -1)
        kv_format, pools = kv_cache.format, kv_cache.layers
        attention_input, attention_output = self.module.attention_input, self.module.attention_output
        write_kv = self.module.write_kv
        # a full-precision pool in the model dtype takes the step's K/V rows as they are
        same_dtype_pool = isinstance(kv_format, FullPrecisionFormat) and kv_format.dtype == x.dtype
        h, delta = x.contiguous(), None
        for layer in self.layers:
            linears = layer.kernel if rows <= self.kernel_rows else layer.dense
            h, heads_out = attention_input(h, delta, layer.input_norm, layer.eps, linears.qkv, layer.qkv_bias, cos,
                                           signed_sin, heads + kv_heads, dim, layer.qk_norm, heads)
            pool = pools[layer.index]
            if same_dtype_pool:
                write_kv(pool["kv"], heads_out, meta.slot_mapping, heads)
            else:
                kv_format.write(pool, heads_out[:, heads:heads + kv_heads], heads_out[:, heads + kv_heads:],
                                meta.slot_mapping)
            attn = meta.decode_in_place(pool, heads_out[:, :heads], block_tables, group.seq_lens, layer.window)
            h, delta = attention_output(attn.reshape(rows, heads * dim), h, linears.o, layer.post_norm, layer.eps,
                                        linears.gate_up, linears.down)
        return h + delta
