"""Tensor parallelism's model side: which heads and MLP columns a rank holds, and the sharding.

Megatron-LM's split (Shoeybi et al. 2019, arXiv:1909.08053): the fused q/k/v and gate/up
projections are column-parallel (each rank computes its own heads and its own slice of the
intermediate activations, no communication), o_proj and down_proj are row-parallel (each rank
multiplies its slice of the inputs; one all-reduce sums the partial outputs). So a decoder layer
costs two all-reduces of [tokens, hidden]. The embedding, the norms and the LM head stay
replicated: the head runs on rank 0 only (sampling happens there), so workers never pay for it.

Quantized weights (--quantization) are cut the same way, as the full model's codes, scales and
zeros (quantized.py) before each rank packs its part: rows of the column-parallel layers, whole
groups of input columns of the row-parallel ones, so every rank multiplies by exactly the values
one process would.

When there are more ranks than KV heads, each rank holds one KV head and a head is replicated
on `size // num_kv_heads` ranks (vLLM's rule), the query heads that read it split among them.

A single-process engine never touches this module: the model's `reduce` hooks stay None.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kvserve.model.quantized import QuantizedMatrix


class TensorParallelSizeError(ValueError):
    """The model's heads or MLP width cannot be split evenly over the requested ranks."""


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds: query heads [q_start, q_start + q_heads), KV heads
    [kv_start, kv_start + kv_heads) and intermediate columns [mlp_start, mlp_start + mlp_size)."""

    rank: int
    size: int
    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int
    mlp_start: int
    mlp_size: int
    total_kv_heads: int

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1: split, no replication)."""
        return max(self.size // self.total_kv_heads, 1)

    def checkpoint_cut(self, name: str, head_dim: int) -> tuple[int, int, int] | None:
        """The part (dim, start, stop) of the HF checkpoint tensor `name` this rank holds, or None
        for a replicated one: rows of q/k/v (weights and biases) and gate/up, columns of o_proj and
        down_proj, as shard_model cuts the fused layers (a loader reads only that: loader.load_model)."""
        q = (self.q_start * head_dim, (self.q_start + self.q_heads) * head_dim)
        kv = (self.kv_start * head_dim, (self.kv_start + self.kv_heads) * head_dim)
        mlp = (self.mlp_start, self.mlp_start + self.mlp_size)
        for suffix, dim, (start, stop) in (("self_attn.q_proj", 0, q), ("self_attn.k_proj", 0, kv),
                                           ("self_attn.v_proj", 0, kv), ("self_attn.o_proj", 1, q),
                                           ("mlp.gate_proj", 0, mlp), ("mlp.up_proj", 0, mlp),
                                           ("mlp.down_proj", 1, mlp)):
            if name.endswith((f"{suffix}.weight", f"{suffix}.bias")):
                return (0 if name.endswith(".bias") else dim), start, stop
        return None


def valid_tensor_parallel_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Every rank count that splits the query heads and the MLP width evenly and either splits
    the KV heads evenly or replicates them a whole number of times."""
    return [n for n in range(1, num_heads + 1)
            if num_heads % n == 0 and intermediate_size % n == 0 and (num_kv_heads % n == 0 or n % num_kv_heads == 0)]


def check_tensor_parallel_size(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
    """Raise TensorParallelSizeError (one line naming the valid sizes) unless `size` is valid."""
    valid = valid_tensor_parallel_sizes(num_heads, num_kv_heads, intermediate_size)
    if size not in valid:
        raise TensorParallelSizeError(
            f"--tensor-parallel-size {size} cannot split this model ({num_heads} attention heads, {num_kv_heads} "
            f"KV heads, intermediate size {intermediate_size}) evenly; valid sizes: {', '.join(map(str, valid))}")


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads one rank caches: an even split, or one (replicated) head when ranks outnumber them."""
    return num_kv_heads // size if num_kv_heads % size == 0 else 1


def shard_layout(rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> ShardLayout:
    check_tensor_parallel_size(size, num_heads, num_kv_heads, intermediate_size)
    q_heads = num_heads // size
    kv_heads = kv_heads_per_rank(num_kv_heads, size)
    # Replicated: ranks [k * replicas, (k + 1) * replicas) share KV head k.
    kv_start = rank * kv_heads if num_kv_heads % size == 0 else rank // (size // num_kv_heads)
    mlp = intermediate_size // size
    return ShardLayout(rank, size, rank * q_heads, q_heads, kv_start, kv_heads, rank * mlp, mlp, num_kv_heads)


def shard_model(model: nn.Module, layout: ShardLayout, reduce: Callable[[torch.Tensor], torch.Tensor],
                quantized: Mapping[str, QuantizedMatrix] | None = None) -> dict[str, QuantizedMatrix]:
    """Cut a full LlamaForCausalLM (plain nn.Linear layers, before any prepacking) down to the
    rank's shard in place, and hook `reduce` (a sum over ranks) after o_proj and down_proj.

    `quantized`: the full model's quantized matrices by module name (quant_linear.quantization_targets);
    the returned dict holds the rank's matrices, for the caller to install once the model is on
    its device: the cut of each sharded layer's along the same rows or columns as the plain weights
    (row-parallel cuts fall on whole groups: check_quantized_shards), the others (the LM head) whole."""
    quantized = quantized or {}
    shards = dict(quantized)
    config = model.config
    d = config.head_dim
    for i, layer in enumerate(model.layers):
        attention = layer.self_attn
        q_rows = torch.arange(layout.q_start * d, (layout.q_start + layout.q_heads) * d)
        kv_rows = torch.arange(layout.kv_start * d, (layout.kv_start + layout.kv_heads) * d)
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        qkv_rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
        attention.qkv_proj = _rows(attention.qkv_proj, qkv_rows)
        attention.o_proj = _columns(attention.o_proj, q_rows)
        attention.num_heads, attention.num_kv_heads = layout.q_heads, layout.kv_heads
        attention.reduce = reduce
        mlp = layer.mlp
        cols = torch.arange(layout.mlp_start, layout.mlp_start + layout.mlp_size)
        gate_up_rows = torch.cat([cols, config.intermediate_size + cols])
        mlp.gate_up_proj = _rows(mlp.gate_up_proj, gate_up_rows)
        mlp.down_proj = _columns(mlp.down_proj, cols)
        mlp.reduce = reduce
        prefix = f"layers.{i}."
        for name, cut in ((f"{prefix}self_attn.qkv_proj", lambda m: m.rows(qkv_rows)),
                          (f"{prefix}self_attn.o_proj", lambda m: m.columns(int(q_rows[0]), int(q_rows[-1]) + 1)),
                          (f"{prefix}mlp.gate_up_proj", lambda m: m.rows(gate_up_rows)),
                          (f"{prefix}mlp.down_proj", lambda m: m.columns(int(cols[0]), int(cols[-1]) + 1))):
            if name in quantized:
                shards[name] = cut(quantized[name])
    return shards


def check_quantized_shards(size: int, num_heads: int, head_dim: int, intermediate_size: int,
                           group_size: int) -> None:
    """Raise TensorParallelSizeError (one line naming the sizes) unless each rank's inputs of the
    row-parallel layers (o_proj: its query heads' columns; down_proj: its MLP columns) are whole
    groups of `group_size`, as a group's one scale and zero cannot be split between ranks."""
    o_cols, down_cols = num_heads // size * head_dim, intermediate_size // size
    if o_cols % group_size or down_cols % group_size:
        raise TensorParallelSizeError(
            f"--tensor-parallel-size {size} cannot split the quantized weights in whole groups of {group_size}: "
            f"each rank would hold {o_cols} input columns of o_proj (of {num_heads * head_dim}) and {down_cols} "
            f"of down_proj (of {intermediate_size}); use another size or --quantization none")


def shard_heads(per_layer: list[torch.Tensor] | None, layout: ShardLayout) -> list[torch.Tensor] | None:
    """The rank's KV heads of per-layer [kv_heads, ...] tensors (key centres, key bases)."""
    if per_layer is None:
        return None
    return [t[layout.kv_start: layout.kv_start + layout.kv_heads].contiguous() for t in per_layer]


def _rows(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A column-parallel shard: the output features `rows` of `linear`."""
    weight = linear.weight.detach()
    out = nn.Linear(linear.in_features, rows.numel(), bias=linear.bias is not None,
                    device="meta", dtype=weight.dtype)
    out.weight = nn.Parameter(weight.index_select(0, rows.to(weight.device)).contiguous(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach().index_select(0, rows.to(weight.device)).contiguous(),
                                requires_grad=False)
    return out


def _columns(linear: nn.Linear, columns: torch.Tensor) -> nn.Linear:
    """A row-parallel shard: the input features `columns` of `linear` (biases stay on no rank:
    the layers that are cut this way have none)."""
    if linear.bias is not None:
        raise ValueError("row-parallel layers with a bias are not supported")
    weight = linear.weight.detach()
    out = nn.Linear(columns.numel(), linear.out_features, bias=False, device="meta", dtype=weight.dtype)
    out.weight = nn.Parameter(weight.index_select(1, columns.to(weight.device)).contiguous(), requires_grad=False)
    return out
