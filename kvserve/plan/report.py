"""A plan as a rich table for people and as JSON for scripts.

JSON keys (stable; a value is null where it does not apply; byte counts are integers):

    model       name, source (preset|config|gguf), path, architecture, attention (mha|gqa|mqa|mla),
                num_layers, num_attention_heads, num_kv_heads, head_dim (null unless uniform),
                max_position_embeddings, num_params, file_bytes,
                layer_groups: [{layers, num_kv_heads, head_dim, sliding_window, latent_dim}]
    inputs      max_model_len, batch_size, block_size, weight_dtype, tensor_parallel_size,
                kv_cache_memory, gpu_memory, gpu_memory_utilization, kv_offloading_size,
                kv_offloading_disk_size (bytes, totals over the devices; null when not given),
                step_tokens (--max-num-batched-tokens as the engine would take it: what a sequence
                holds beside a sliding window)
    weights     num_params, dtype, bytes, bytes_per_device, file_bytes, quantization
    kv_budget   {bytes (one device), source} or null
    kv_cache    one entry per --kv-cache-dtype:
                kv_cache_dtype, bits_per_value, formula, value_bytes, mha_value_bytes,
                pool_bytes_per_device, pool_layout (kvserve|formula), layout_unavailable,
                layout: {format_name, bytes_per_block, value_bytes_per_block, blocks_per_sequence,
                         bytes_per_device, bytes, value_bytes, scale_bytes} or null,
                capacity: {layout, bytes_per_block, num_blocks, kv_tokens, blocks_per_sequence,
                           max_concurrent_sequences, largest_max_model_len, batch_fits} or null,
                offload_tiers: one per tier given (--kv-offloading-size: host, then
                           --kv-offloading-disk-size: disk): {tier, bytes, bytes_per_device, layout,
                           bytes_per_block, num_blocks, kv_tokens, max_concurrent_sequences}
    notes       list of strings
"""
from __future__ import annotations

import dataclasses
from typing import Any

from rich.console import Console
from rich.table import Table

from kvserve.units import GiB
from kvserve.plan.calculator import KVFootprint, Plan, TierCapacity

TIER_NAMES = {"host": "host memory", "disk": "disk"}


def size(num_bytes: int | None) -> str:
    """Exact bytes, then GB (10^9) and GiB (2^30)."""
    if num_bytes is None:
        return "n/a"
    return f"{num_bytes:,} B ({num_bytes / 1e9:,.2f} GB, {num_bytes / GiB:,.2f} GiB)"


def size_cell(num_bytes: int) -> str:
    return f"{num_bytes:,} B\n{num_bytes / 1e9:,.2f} GB / {num_bytes / GiB:,.2f} GiB"


def to_dict(plan: Plan) -> dict[str, Any]:
    arch, inputs = plan.arch, plan.inputs
    heads = {layer.head_dim for layer in arch.layers}
    return {
        "model": {
            "name": arch.name, "source": arch.source, "path": arch.path, "architecture": arch.architecture,
            "attention": arch.attention_kind, "num_layers": arch.num_layers,
            "num_attention_heads": arch.num_attention_heads, "num_kv_heads": arch.uniform_kv_heads,
            "head_dim": heads.pop() if len(heads) == 1 and not arch.is_mla else None,
            "max_position_embeddings": arch.max_position_embeddings, "num_params": arch.num_params,
            "file_bytes": arch.file_bytes,
            "layer_groups": [{"layers": count, "num_kv_heads": layer.num_kv_heads, "head_dim": layer.head_dim,
                              "sliding_window": layer.sliding_window, "latent_dim": layer.latent_dim}
                             for layer, count in arch.layer_groups()],
        },
        "inputs": {
            "max_model_len": inputs.max_model_len, "batch_size": inputs.batch_size, "block_size": inputs.block_size,
            "weight_dtype": plan.weights.dtype, "tensor_parallel_size": inputs.tensor_parallel_size,
            "kv_cache_memory": inputs.kv_cache_memory, "gpu_memory": inputs.gpu_memory,
            "gpu_memory_utilization": inputs.gpu_memory_utilization,
            "kv_offloading_size": inputs.kv_offloading_size, "kv_offloading_disk_size": inputs.kv_offloading_disk_size,
            "step_tokens": inputs.step_tokens,
        },
        "weights": dataclasses.asdict(plan.weights),
        "kv_budget": dataclasses.asdict(plan.budget) if plan.budget else None,
        "kv_cache": [dataclasses.asdict(fp) for fp in plan.footprints],
        "notes": list(plan.notes),
    }


def comparison_line(plan: Plan, fp: KVFootprint) -> str:
    """GQA / MQA / MLA against plain multi-head attention, for the same tokens and dtype."""
    arch = plan.arch
    kind = arch.attention_kind
    ratio = fp.mha_value_bytes / fp.value_bytes
    if kind == "mha":
        return (f"MHA: every one of the {arch.num_attention_heads} query heads caches its own K and V "
                f"(no grouped-query saving): {fp.value_bytes:,} bytes")
    if kind == "mla":
        latent = arch.layers[0].latent_dim
        per_head = arch.layers[0].mha_values_per_token
        return (f"MLA caches {latent} values per token and layer where MHA with {arch.num_attention_heads} heads "
                f"would cache {per_head:,}: {fp.value_bytes:,} vs {fp.mha_value_bytes:,} bytes ({ratio:.1f}x smaller)")
    kv = arch.uniform_kv_heads
    heads = f"{kv} KV heads" if kv is not None else "per-layer KV heads"
    return (f"{kind.upper()}: {heads} for {arch.num_attention_heads} query heads: {fp.value_bytes:,} bytes; "
            f"with MHA ({arch.num_attention_heads} KV heads) it would be {fp.mha_value_bytes:,} bytes "
            f"({ratio:.1f}x more)")


def _model_line(plan: Plan) -> str:
    arch = plan.arch
    groups = []
    for layer, count in arch.layer_groups():
        if layer.latent_dim:
            what = f"MLA latent {layer.latent_dim}"
        else:
            what = f"{layer.num_kv_heads} KV heads × head_dim {layer.head_dim}"
        window = f", window {layer.sliding_window:,}" if layer.sliding_window else ""
        groups.append(f"{count} layers: {what}{window}")
    params = f"{arch.num_params:,} parameters" if arch.num_params is not None else "parameter count unknown"
    return (f"{arch.name} ({arch.source}, {arch.architecture}, {arch.attention_kind.upper()}, "
            f"{arch.num_attention_heads} query heads): {'; '.join(groups)}; {params}; "
            f"max_position_embeddings {arch.max_position_embeddings:,}")


def _table(plan: Plan) -> Table:
    inputs = plan.inputs
    per_dev = " per device" if inputs.tensor_parallel_size > 1 else ""
    table = Table(title=f"batch {inputs.batch_size} × {inputs.max_model_len:,} tokens, block size {inputs.block_size}"
                        + (f", {inputs.tensor_parallel_size} devices" if inputs.tensor_parallel_size > 1 else ""))
    table.add_column("")
    for fp in plan.footprints:
        table.add_column(f"{fp.kv_cache_dtype} ({fp.bits_per_value}-bit)", overflow="fold")

    def row(label: str, cells: list[str]) -> None:
        table.add_row(label, *cells)

    fps = plan.footprints
    row("values (formula)", [size_cell(fp.value_bytes) for fp in fps])
    row("kvserve layout", [size_cell(fp.layout.bytes) if fp.layout else f"unavailable: {fp.layout_unavailable}"
                           for fp in fps])
    row("  scales / zero points", [size_cell(fp.layout.scale_bytes) if fp.layout else "n/a" for fp in fps])
    row("  values beyond the formula\n  (block rounding, windows,\n  replicated heads)",
        [size_cell(fp.layout.value_bytes - fp.value_bytes) if fp.layout else "n/a" for fp in fps])
    row("  bytes per block" + per_dev, [f"{fp.layout.bytes_per_block:,}" if fp.layout else "n/a" for fp in fps])
    if plan.budget is not None:
        caps = [fp.capacity for fp in fps]
        row("KV budget" + per_dev, [size_cell(plan.budget.bytes)] * len(fps))
        row("sized with", [f"{c.layout} layout" for c in caps])
        row("blocks that fit", [f"{c.num_blocks:,}" for c in caps])
        row("KV tokens that fit", [f"{c.kv_tokens:,}" for c in caps])
        row(f"sequences of {inputs.max_model_len:,}\nat once", [f"{c.max_concurrent_sequences:,}" for c in caps])
        row("largest max-model-len\n(one sequence)", [f"{c.largest_max_model_len:,}" for c in caps])
        row(f"batch of {inputs.batch_size} fits", ["yes" if c.batch_fits else "NO" for c in caps])
    for i, tier in enumerate(fps[0].offload_tiers):
        name = TIER_NAMES[tier.tier]
        row(f"{name} tier" + per_dev, [size_cell(fp.offload_tiers[i].bytes_per_device) for fp in fps])
        row("  KV tokens it holds", [f"{fp.offload_tiers[i].kv_tokens:,}" for fp in fps])
        row(f"  sequences of {inputs.max_model_len:,}", [f"{fp.offload_tiers[i].max_concurrent_sequences:,}"
                                                         for fp in fps])
    return table


def tier_line(plan: Plan, fp: KVFootprint, tier: TierCapacity) -> str:
    """One offload tier's capacity in words, for one KV dtype."""
    tp = plan.inputs.tensor_parallel_size
    where = f" ({size(tier.bytes_per_device)} on each of {tp} devices)" if tp > 1 else ""
    return (f"{TIER_NAMES[tier.tier]} tier of {size(tier.bytes)}{where}: {tier.num_blocks:,} blocks of "
            f"{tier.bytes_per_block:,} bytes = {tier.kv_tokens:,} tokens of {fp.kv_cache_dtype}, "
            f"{tier.max_concurrent_sequences:,} sequences of {plan.inputs.max_model_len:,}")


def render(plan: Plan, console: Console) -> None:
    console.print(_model_line(plan), soft_wrap=True)
    w = plan.weights
    if w.bytes is not None:
        per_dev = (f"; {size(w.bytes_per_device)} on each of {plan.inputs.tensor_parallel_size} devices"
                   if plan.inputs.tensor_parallel_size > 1 else "")
        held = w.dtype if w.quantization == "none" else f"{w.dtype}, --quantization {w.quantization}"
        console.print(f"Weights: {w.num_params:,} ({held}) = {size(w.bytes)}{per_dev}", soft_wrap=True)
    if w.file_bytes:
        console.print(f"Checkpoint on disk: {size(w.file_bytes)}", soft_wrap=True)
    if plan.budget is not None:
        console.print(f"KV budget: {size(plan.budget.bytes)} from {plan.budget.source}", soft_wrap=True)
    console.print(_table(plan))
    for fp in plan.footprints:
        console.print(f"[bold]{fp.kv_cache_dtype}[/bold]: {fp.formula}", soft_wrap=True)
        if fp.layout is not None and fp.layout.scale_bytes:
            console.print(f"  kvserve {fp.layout.format_name} layout adds {fp.layout.scale_bytes:,} bytes of scales "
                          f"/ zero points", soft_wrap=True)
    for fp in plan.footprints:
        for tier in fp.offload_tiers:
            console.print(tier_line(plan, fp, tier), soft_wrap=True)
    console.print(comparison_line(plan, plan.footprints[0]), soft_wrap=True)
    for note in plan.notes:
        console.print(f"note: {note}", soft_wrap=True)
