"""Rank 0's start-up under tensor parallelism: calibrate, shard, tell the workers, wait for them.

A KV format's key transforms (key centres for int4, key bases for fp8: key_transforms.py) are
calibrated once, on rank 0, over the still unsharded model, with a throw-away pool holding every
KV head: the same computation (and disk cache entry) as a single-process engine's. Every rank
then applies its own heads' slice, so all ranks transform keys exactly as one process would.
Quantized weights (--quantization) are served during that calibration as one process serves
them, and afterwards each rank installs its cut of the full model's quantized matrices.
The price: rank 0 holds the full model until it is sharded (it has read the full checkpoint anyway).
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from kvserve.cache.kv_cache import KVCache, KVCacheSpec, KVFormat
from kvserve.cache.sizing import blocks_for_tokens
from kvserve.engine.calibration import CALIBRATION_TOKENS
from kvserve.engine.key_transforms import calibrate_key_transforms
from kvserve.engine.loading import EngineModel, log_quantization
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.parallel.executor import TensorParallelExecutor
from kvserve.engine.parallel.messages import RankStats, Setup
from kvserve.engine.parallel.worker import mib, release_freed_memory, sharded_layer_bytes
from kvserve.model.attention import AttentionBackend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.parallel import ShardLayout, shard_heads, shard_layout, shard_model
from kvserve.model.quant_linear import install_quantized, quantized_for_a_while, resident_weight_bytes

logger = logging.getLogger("kvserve")


def start_rank_zero(executor: TensorParallelExecutor, built: EngineModel, kv_format: KVFormat,
                    backend: AttentionBackend, num_blocks: int, max_model_len: int,
                    quantization: str = "none") -> ShardLayout:
    """Join the group, calibrate on the full model, shard it to rank 0's part, send the Setup and
    wait until every worker has built its shard. `built.model` is sharded in place, and serves its
    cut of `built.quantized` (under --quantization `quantization`)."""
    groups = executor.join()
    model, config, spec = built.model, built.config, built.plan.kv_spec
    mode, dtype = quantization, built.plan.dtype
    calibrating = kv_format.center_keys or kv_format.fit_key_basis
    with quantized_for_a_while(model, built.quantized if calibrating else {}, mode, dtype, backend.device):
        centers, bases = calibrate_full_model(model, kv_format, backend, spec, num_blocks, max_model_len, built)
    layout = shard_layout(0, executor.world_size, config.num_heads, config.num_kv_heads, config.intermediate_size)
    shards = shard_model(model, layout, groups.all_reduce, built.quantized)
    built.quantized = {}  # the full matrices: no longer needed
    report = install_quantized(model, shards, mode, dtype, backend.device)
    model.set_key_centers(shard_heads(centers, layout))
    model.set_key_bases(shard_heads(bases, layout))
    shard_weights = resident_weight_bytes(model)  # before prepacking
    executor.local_stats = RankStats(0, shard_weights, sharded_layer_bytes(model),
                                     num_blocks * built.plan.bytes_per_block, layout.q_heads, layout.kv_heads,
                                     report.describe())
    model.prepack()
    release_freed_memory()  # the full model's pages
    if layout.kv_replicas > 1:
        logger.info("Tensor parallel: %d ranks share %d KV heads: each KV head is replicated on %d ranks",
                    layout.size, config.num_kv_heads, layout.kv_replicas)
    pool_bytes = num_blocks * built.plan.bytes_per_block
    logger.info("Tensor parallel rank 0 of %d: query heads [%d, %d), KV heads [%d, %d); per rank: weights "
                "%s (embedding, norms and LM head replicated), KV pool %s",
                layout.size, layout.q_start, layout.q_start + layout.q_heads, layout.kv_start,
                layout.kv_start + layout.kv_heads, mib(shard_weights), mib(pool_bytes))
    log_quantization(report, model, dtype)
    # On the host: a pickled CUDA tensor unpickles on the device it left (rank 0's), not the worker's.
    centers, bases = ([t.cpu() for t in ts] if ts is not None else None for ts in (centers, bases))
    executor.start(Setup(built.plan.dtype, model.rope.cos.shape[0], spec, num_blocks, centers, bases))
    return layout


def calibrate_full_model(model: LlamaForCausalLM, fmt: KVFormat, backend: AttentionBackend, spec: KVCacheSpec,
                         num_blocks: int,
                         max_model_len: int, built: EngineModel) -> tuple[list[torch.Tensor] | None,
                                                                        list[torch.Tensor] | None]:
    """The full per-layer key centres and key bases (None where the format needs none), calibrated
    over `model` before it is sharded, with a scratch pool holding every KV head."""
    if not (fmt.center_keys or fmt.fit_key_basis):
        return None, None
    full_spec = replace(spec, num_kv_heads=built.config.num_kv_heads)
    blocks = min(num_blocks, blocks_for_tokens(CALIBRATION_TOKENS, spec.block_size) + 1)
    scratch = KVCache(full_spec, fmt, blocks, backend.device)
    scratch_backend = backend.for_spec(full_spec)
    calibrate_key_transforms(ModelRunner(model, scratch, scratch_backend), max_model_len, built.calibration_file)
    attention = [layer.self_attn for layer in model.layers]
    centers = [a.key_center for a in attention] if fmt.center_keys else None
    bases = [a.key_basis[0] for a in attention] if fmt.fit_key_basis else None
    return centers, bases

