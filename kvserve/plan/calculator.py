"""KV-cache bytes and capacity for a `ModelArch`.

Two answers, kept apart on purpose:

* the formula: value bytes a model must cache, `2 × batch × seq_len × layers × kv_heads ×
  head_dim × bytes` generalised to per-layer head counts, sliding windows (a windowed layer keeps
  at most `window` tokens) and MLA (one latent vector per token instead of K and V);
* kvserve's layout: what the engine's paged pool really allocates, from the same functions the
  engine sizes its pool with (`kvserve.cache.sizing`, `KVFormat.bytes_per_block`): whole blocks,
  every token in every layer, plus the scale/zero-point bytes of quantized formats.

Capacity (blocks, tokens, concurrent sequences) follows kvserve's layout wherever it applies.
The offload tiers below the pool (host memory, disk) hold the same blocks, codes and scales
together, so their capacity is their size over the same bytes per block (no null block there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.cache.formats import FORMATS, KV_CACHE_DTYPES, make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec, KVFormat
from kvserve.cache.sizing import blocks_for_tokens, blocks_per_sequence, bytes_per_block, num_blocks_for_budget
from kvserve.engine.llm_engine import CapacityError
from kvserve.engine.preflight import SequenceHold, calibration_floor
from kvserve.model.quant_linear import served_matrix_bytes
from kvserve.plan.arch import AttentionLayer, ConfigError, ModelArch

PLAN_KV_CACHE_DTYPES = KV_CACHE_DTYPES  # the engine's formats: each says its own value_bits


@dataclass(frozen=True)
class PlanInputs:
    max_model_len: int
    batch_size: int
    block_size: int
    weight_dtype: torch.dtype  # the dtype weights are held in once loaded; "auto" KV follows it
    tensor_parallel_size: int = 1
    kv_cache_memory: int | None = None  # the KV pool budget per device, as the engine takes it
    gpu_memory: int | None = None  # memory of one device
    gpu_memory_utilization: float = 0.9
    # Offload tiers (vLLM's --kv-offloading-size rule): total bytes summed over the
    # tensor-parallel devices, each device keeping its share of the KV heads.
    kv_offloading_size: int | None = None  # host memory tier
    kv_offloading_disk_size: int | None = None  # disk tier
    quantization: str = "none"  # --quantization: what the weights are held as
    # the most tokens a step gives a sequence (--max-num-batched-tokens): with a sliding window in
    # every layer, kvserve's pool holds a sequence's window and one step (cache.sizing)
    step_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "batch_size", "block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class Budget:
    bytes: int  # KV pool budget of one device
    source: str  # how it was obtained, in words


@dataclass(frozen=True)
class Weights:
    num_params: int | None
    dtype: str
    bytes: int | None  # all devices
    bytes_per_device: int | None
    file_bytes: int | None  # checkpoint on disk
    quantization: str = "none"  # what the weights are held as (dense in dtype, or --quantization's form)


@dataclass(frozen=True)
class Layout:
    """kvserve's paged pool for this plan's batch of max-model-len sequences."""

    format_name: str
    bytes_per_block: int  # one device, all layers, K + V + scales
    value_bytes_per_block: int  # of which K and V values
    blocks_per_sequence: int
    bytes_per_device: int
    bytes: int  # all devices
    value_bytes: int  # all devices
    scale_bytes: int  # all devices: the format's scales / zero points


@dataclass(frozen=True)
class Capacity:
    layout: str  # "kvserve" (the engine's pool) or "formula" (block-rounded values, no scales)
    bytes_per_block: int  # one device
    num_blocks: int
    kv_tokens: int
    blocks_per_sequence: int
    max_concurrent_sequences: int  # at max-model-len
    largest_max_model_len: int  # longest single sequence the pool holds
    batch_fits: bool  # batch_size sequences of max-model-len fit at once


@dataclass(frozen=True)
class TierCapacity:
    """What one offload tier holds of this model in this KV dtype."""

    tier: str  # "host" or "disk"
    bytes: int  # the tier's size, all devices together
    bytes_per_device: int
    layout: str  # "kvserve" or "formula", as the pool's capacity
    bytes_per_block: int  # one device
    num_blocks: int
    kv_tokens: int
    max_concurrent_sequences: int  # whole sequences of max-model-len


@dataclass(frozen=True)
class KVFootprint:
    kv_cache_dtype: str  # as asked ("auto" resolved to the weight dtype's name)
    bits_per_value: int
    formula: str  # the formula with this plan's numbers substituted
    value_bytes: int  # the formula's result: batch × max-model-len, exact
    mha_value_bytes: int  # the same model if every query head cached its own K and V
    layout: Layout | None
    layout_unavailable: str | None  # why kvserve's layout bytes cannot be given
    # What the pool needs on one device for the batch: kvserve's layout, or without one whole
    # blocks of the formula's values (every layer keeping every token, no scales).
    pool_bytes_per_device: int
    pool_layout: str  # "kvserve" or "formula"
    capacity: Capacity | None
    offload_tiers: list[TierCapacity]  # one per tier given, host first


def resolve_kv_dtype(name: str, weight_dtype: torch.dtype) -> str:
    if name == "auto":
        return str(weight_dtype).removeprefix("torch.")
    if name not in FORMATS:
        raise ValueError(f"unknown kv cache dtype {name!r}: choose from {', '.join(PLAN_KV_CACHE_DTYPES)}")
    return name


def value_bytes(arch: ModelArch, seq_len: int, batch: int, bits: int, mha: bool = False) -> int:
    """Exact bytes of cached values (rounded up to a whole byte for sub-byte dtypes)."""
    total_bits = sum(layer.cached_tokens(seq_len) * (layer.mha_values_per_token if mha else layer.values_per_token)
                     for layer in arch.layers) * batch * bits
    return -(-total_bits // 8)


def _bytes_factor(bits: int) -> str:
    return f"{bits // 8}" if bits % 8 == 0 else f"{bits / 8:g}"


def formula_text(arch: ModelArch, seq_len: int, batch: int, bits: int) -> str:
    """`symbols = numbers = result`, one term per kind of layer."""
    symbols, numbers = [], []
    b = _bytes_factor(bits)
    for layer, count in arch.layer_groups():
        tokens = "seq_len" if layer.sliding_window is None else "min(seq_len, window)"
        if layer.latent_dim:
            symbols.append(f"batch × {tokens} × layers × (kv_lora_rank + qk_rope_head_dim) × bytes")
            numbers.append(f"{batch} × {layer.cached_tokens(seq_len):,} × {count} × {layer.latent_dim} × {b}")
        else:
            symbols.append(f"2 × batch × {tokens} × layers × kv_heads × head_dim × bytes")
            numbers.append(f"2 × {batch} × {layer.cached_tokens(seq_len):,} × {count} × {layer.num_kv_heads} × "
                           f"{layer.head_dim} × {b}")
    result = value_bytes(arch, seq_len, batch, bits)
    return f"{' + '.join(symbols)} = {' + '.join(numbers)} = {result:,} bytes"


def kv_heads_per_device(num_kv_heads: int, tp: int) -> int:
    """KV heads one device holds under tensor parallelism: split evenly, or one replicated head
    each when there are more devices than KV heads (vLLM's rule)."""
    if num_kv_heads % tp == 0:
        return num_kv_heads // tp
    if tp % num_kv_heads == 0:
        return 1
    raise ConfigError(f"--tensor-parallel-size {tp} cannot split {num_kv_heads} KV heads evenly")


def _device_values_per_token(layer: AttentionLayer, tp: int) -> int:
    if layer.latent_dim:  # the MLA latent is shared by all heads, so every device keeps all of it
        return layer.latent_dim
    return 2 * kv_heads_per_device(layer.num_kv_heads, tp) * layer.head_dim


def kvserve_spec(arch: ModelArch, block_size: int, tp: int) -> KVCacheSpec | str:
    """The engine's KVCacheSpec for one device, or why its layout cannot hold this model."""
    if arch.is_mla:
        return "kvserve's pool stores K and V per head; it has no MLA latent layout"
    if len({(layer.num_kv_heads, layer.head_dim) for layer in arch.layers}) != 1:
        return "kvserve's pool needs the same KV heads and head_dim in every layer"
    first = arch.layers[0]
    return KVCacheSpec(arch.num_layers, kv_heads_per_device(first.num_kv_heads, tp), first.head_dim, block_size)


def _layout(spec: KVCacheSpec, kv_format: KVFormat, bits: int, inputs: PlanInputs, blocks: int) -> Layout:
    """`blocks`: what one sequence of max-model-len holds at most."""
    per_block = bytes_per_block(spec, kv_format)
    values = spec.num_layers * 2 * spec.num_kv_heads * spec.block_size * spec.head_dim * bits // 8
    per_device = inputs.batch_size * blocks * per_block
    tp = inputs.tensor_parallel_size
    value_total = tp * inputs.batch_size * blocks * values
    return Layout(kv_format.name, per_block, values, blocks, per_device, tp * per_device, value_total,
                  tp * per_device - value_total)


def _capacity(layout_name: str, per_block: int, num_blocks: int, inputs: PlanInputs,
              blocks_per_seq: int | None = None, longest: int | None = None) -> Capacity:
    """`blocks_per_seq`: what one sequence of max-model-len holds at most (default: all its
    blocks); `longest`: the longest max-model-len once the pool holds that (a sliding-window
    model's; default: what the pool's blocks hold)."""
    bs = inputs.block_size
    blocks_per_seq = blocks_per_seq or blocks_for_tokens(inputs.max_model_len, bs)
    concurrent = num_blocks // blocks_per_seq
    largest = longest if longest is not None and concurrent > 0 else num_blocks * bs
    return Capacity(layout_name, per_block, num_blocks, num_blocks * bs, blocks_per_seq, concurrent,
                    largest, concurrent >= inputs.batch_size)


def offload_tiers(layout_name: str, per_block: int, inputs: PlanInputs) -> list[TierCapacity]:
    """Blocks, tokens and full-length sequences each offload tier holds, one device's share of its
    size over one device's bytes per block."""
    tiers = []
    for tier, size in (("host", inputs.kv_offloading_size), ("disk", inputs.kv_offloading_disk_size)):
        if size is None:
            continue
        per_device = size // inputs.tensor_parallel_size
        blocks = per_device // per_block
        tiers.append(TierCapacity(tier, size, per_device, layout_name, per_block, blocks, blocks * inputs.block_size,
                                  blocks // blocks_for_tokens(inputs.max_model_len, inputs.block_size)))
    return tiers


def footprint(arch: ModelArch, kv_cache_dtype: str, inputs: PlanInputs, budget: Budget | None) -> KVFootprint:
    kv_dtype = resolve_kv_dtype(kv_cache_dtype, inputs.weight_dtype)
    kv_format = make_kv_format(kv_dtype, inputs.weight_dtype)
    bits = kv_format.value_bits
    seq, batch, tp = inputs.max_model_len, inputs.batch_size, inputs.tensor_parallel_size
    spec = kvserve_spec(arch, inputs.block_size, tp)
    layout, unavailable, capacity = None, spec if isinstance(spec, str) else None, None
    if isinstance(spec, KVCacheSpec):
        hold = SequenceHold(arch.uniform_sliding_window, inputs.step_tokens, calibration_floor(kv_format))
        per_seq = hold.blocks(seq, inputs.block_size)  # the engine's preflight.sequence_hold
        layout = _layout(spec, kv_format, bits, inputs, per_seq)
        if budget is not None:  # exactly the engine's sizing (engine/pool_sizing.size_kv_pool)
            num_blocks = num_blocks_for_budget(budget.bytes, spec, kv_format)
            windowed = per_seq < blocks_for_tokens(seq, inputs.block_size)
            capacity = _capacity("kvserve", layout.bytes_per_block, num_blocks, inputs, per_seq,
                                 arch.max_position_embeddings if windowed else None)
    if layout is not None:
        pool_bytes = layout.bytes_per_device
        tiers = offload_tiers("kvserve", layout.bytes_per_block, inputs)
    else:
        values = sum(_device_values_per_token(layer, tp) for layer in arch.layers)
        per_block = -(-inputs.block_size * values * bits // 8)
        pool_bytes = batch * blocks_for_tokens(seq, inputs.block_size) * per_block
        if budget is not None:
            capacity = _capacity("formula", per_block, budget.bytes // per_block, inputs)
        tiers = offload_tiers("formula", per_block, inputs)
    return KVFootprint(
        kv_cache_dtype=kv_dtype, bits_per_value=bits, formula=formula_text(arch, seq, batch, bits),
        value_bytes=value_bytes(arch, seq, batch, bits), mha_value_bytes=value_bytes(arch, seq, batch, bits, mha=True),
        layout=layout, layout_unavailable=unavailable, pool_bytes_per_device=pool_bytes,
        pool_layout="kvserve" if layout is not None else "formula",
        capacity=capacity, offload_tiers=tiers)


def weights(arch: ModelArch, dtype: torch.dtype, tp: int, quantization: str = "none") -> Weights:
    name = str(dtype).removeprefix("torch.")
    if arch.num_params is None:
        return Weights(None, name, None, None, arch.file_bytes)
    total = quantized_weight_bytes(arch, dtype, quantization)
    held = "none" if total is None else quantization
    if total is None:
        total = arch.num_params * torch.empty((), dtype=dtype).element_size()
    # Tensor parallelism shards the weight matrices; the few replicated norms are rounding error.
    return Weights(arch.num_params, name, total, math.ceil(total / tp), arch.file_bytes, held)


def quantized_weight_bytes(arch: ModelArch, dtype: torch.dtype, quantization: str) -> int | None:
    """The engine's weight bytes under --quantization (kvserve/model/quant_linear.py), or None for
    dense weights. GGUF files count tensor by tensor; other checkpoints as every parameter at the
    mode's width (embedding and norms included, so a slight undercount). The embedding stays dense
    (a tied one is kept twice: dense to embed, 8-bit as LM head), the LM head 8-bit under int4. On
    CPU the engine may add a dense copy for large batches (its start-up log says)."""
    width = {"int8": 8, "int4": 4}.get(quantization)
    if arch.gguf_tensors is None:
        return None if width is None else served_matrix_bytes(arch.num_params, width, dtype)
    if quantization == "none" or (quantization == "auto" and not any(bits for *_, bits in arch.gguf_tensors)):
        return None
    total = 0
    for role, values, is_matrix, stored in arch.gguf_tensors:
        bits = stored if quantization == "auto" else (width if role == "other" else 8)
        if not is_matrix:  # norms stay dense
            total += served_matrix_bytes(values, None, dtype)
        elif role == "embedding":
            total += served_matrix_bytes(values, None, dtype)
            if arch.tied_embedding and bits is not None:
                total += served_matrix_bytes(values, bits, dtype)
        else:
            total += served_matrix_bytes(values, bits, dtype)
    return total


def kv_budget(inputs: PlanInputs, weights_: Weights, cpu_default: int | None) -> Budget | None:
    """The KV pool budget of one device: --kv-cache-memory as the engine takes it; else what
    --gpu-memory × --gpu-memory-utilization leaves after the weights; else the engine's CPU default
    (`cpu_default`, None when planning for a GPU)."""
    kv_cache_memory, gpu_memory, utilization = inputs.kv_cache_memory, inputs.gpu_memory, inputs.gpu_memory_utilization
    usable = int(gpu_memory * utilization) if gpu_memory is not None else None
    if kv_cache_memory is not None:
        if usable is not None and weights_.bytes_per_device is not None and \
                weights_.bytes_per_device + kv_cache_memory > usable:
            raise CapacityError(
                f"weights ({weights_.bytes_per_device:,} bytes per device) plus --kv-cache-memory "
                f"({kv_cache_memory:,} bytes) exceed {utilization:.0%} of --gpu-memory ({usable:,} bytes)")
        return Budget(kv_cache_memory, "--kv-cache-memory")
    if usable is not None:
        if weights_.bytes_per_device is None:
            raise ConfigError("the parameter count of this model is unknown (no preset, no weights beside the "
                              "config): give the KV budget with --kv-cache-memory")
        budget = usable - weights_.bytes_per_device
        if budget <= 0:
            raise CapacityError(
                f"the weights alone ({weights_.bytes_per_device:,} bytes per device) do not fit in "
                f"{utilization:.0%} of --gpu-memory ({usable:,} bytes): raise --tensor-parallel-size "
                "or --gpu-memory, or hold the weights in a smaller --dtype")
        return Budget(budget, "--gpu-memory × --gpu-memory-utilization − weights (activations not counted)")
    if cpu_default is not None:
        return Budget(cpu_default, "engine default on CPU: min(4 GiB, available RAM / 4 / tensor-parallel ranks)")
    return None


@dataclass(frozen=True)
class Plan:
    arch: ModelArch
    inputs: PlanInputs
    weights: Weights
    budget: Budget | None
    footprints: list[KVFootprint]
    notes: list[str]


def make_plan(arch: ModelArch, inputs: PlanInputs, kv_cache_dtypes: list[str], cpu_default_budget: int | None) -> Plan:
    """`cpu_default_budget`: the engine's KV budget when planning for a CPU with no budget given."""
    tp = inputs.tensor_parallel_size
    weights_ = weights(arch, inputs.weight_dtype, tp, inputs.quantization)
    budget = kv_budget(inputs, weights_, cpu_default_budget)
    footprints = [footprint(arch, name, inputs, budget) for name in kv_cache_dtypes]
    return Plan(arch, inputs, weights_, budget, footprints, _notes(arch, inputs, budget))


def _notes(arch: ModelArch, inputs: PlanInputs, budget: Budget | None) -> list[str]:
    notes = []
    if inputs.max_model_len > arch.max_position_embeddings:
        notes.append(f"--max-model-len {inputs.max_model_len:,} exceeds the model's max_position_embeddings "
                     f"({arch.max_position_embeddings:,}); the engine would refuse it")
    if arch.has_sliding_window:
        windows = sorted({layer.sliding_window for layer in arch.layers if layer.sliding_window})
        count = sum(1 for layer in arch.layers if layer.sliding_window)
        per_seq = blocks_per_sequence(inputs.max_model_len, inputs.block_size, arch.uniform_sliding_window,
                                      inputs.step_tokens)
        if per_seq < blocks_for_tokens(inputs.max_model_len, inputs.block_size):
            notes.append(f"every layer attends to a sliding window of {windows[0]:,} tokens: the formula caches at "
                         f"most that many; in kvserve's pool a sequence holds its window and a step of "
                         f"{inputs.step_tokens:,} tokens (--max-num-batched-tokens), {per_seq * inputs.block_size:,} "
                         "tokens at most (the blocks behind the window go back to the pool)")
        elif arch.uniform_sliding_window is not None:
            notes.append(f"every layer attends to a sliding window of {windows[0]:,} tokens: the formula caches at "
                         f"most that many; in kvserve's pool a sequence's window and a step are no fewer than its "
                         f"{inputs.max_model_len:,} tokens, so it holds them all")
        else:
            notes.append(f"{count} of {arch.num_layers} layers attend to a sliding window of {windows[0]:,} tokens: "
                         "the formula caches at most that many there; kvserve's pool keeps every token in every "
                         "layer (it gives blocks back only when every layer shares one window)")
    if not arch.served_by_kvserve:
        layout = isinstance(kvserve_spec(arch, inputs.block_size, inputs.tensor_parallel_size), KVCacheSpec)
        notes.append(f"kvserve itself does not serve {arch.architecture!r} models"
                     + ("; its layout rows show what its paged pool would take" if layout else ""))
    if arch.source == "gguf" and arch.file_bytes and inputs.quantization == "none":
        notes.append("the GGUF file holds quantized weights; --quantization none dequantizes them to the weight dtype")
    if arch.num_params is None:
        notes.append("parameter count unknown (a config.json with no weights beside it, of a family kvserve "
                     "does not serve): weight bytes not given")
    kv = arch.uniform_kv_heads
    if kv is not None and inputs.tensor_parallel_size > kv:
        notes.append(f"{inputs.tensor_parallel_size} devices share {kv} KV heads: each KV head is replicated "
                     f"on {inputs.tensor_parallel_size // kv} devices")
    if arch.is_mla and inputs.tensor_parallel_size > 1:
        notes.append("the MLA latent is shared by all heads, so every device keeps a full copy")
    if budget is None:
        notes.append("no capacity figures: give --kv-cache-memory, or --gpu-memory for a GPU")
    tp = inputs.tensor_parallel_size
    if tp > 1 and (inputs.kv_offloading_size or inputs.kv_offloading_disk_size):
        notes.append(f"offload tier sizes are totals over the {tp} devices (vLLM's rule for --kv-offloading-size): "
                     f"each device's share holds its KV heads of the same tokens")
    if inputs.kv_offloading_disk_size:
        notes.append("disk tier: block contents only; file-system overhead and per-file headers are not counted")
    return notes
