"""Start-up, first part: from the options to a built model and the KV format it will cache in.

`load_engine_model` checks the options (preflight.py) before the weights load, reads the
checkpoint, builds `LlamaForCausalLM` in the chosen dtype on the chosen device, and collects
what the engine needs next to it (tokenizer, EOS ids, max-model-len). `select_attention` picks
the cache's storage format and the attention backend that reads it. Both log their
decisions once, as users read them at start-up.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVFormat
from kvserve.engine.args import EngineArgs
from kvserve.engine.preflight import Preflight, emulated_bf16_warning, lowered_max_model_len_warning, preflight
from kvserve.model.config import ModelConfig
from kvserve.model.attention import AttentionBackend, make_attention_backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import LoadedModel, load_model, quantized_sources
from kvserve.model.quant_linear import (
    QuantizationReport, install_quantized, kernel_max_rows, quantization_targets, resident_weight_bytes,
    weights_served_from_sources)
from kvserve.model.quantized import QuantizedMatrix
from kvserve.units import format_size
from kvserve.model.shape import ModelShape

logger = logging.getLogger("kvserve")


@dataclass
class EngineModel:
    """A built model and what comes with it. `plan.max_model_len` may still be lowered by the
    CUDA profiling pass (pool_sizing.py)."""

    plan: Preflight
    model: LlamaForCausalLM
    config: ModelConfig
    path: Path
    tokenizer: Any
    eos_token_ids: tuple[int, ...]
    # Tensor parallelism only: the full model's quantized matrices by linear name, to be cut per
    # rank (the model's linears are still plain); empty otherwise.
    quantized: dict[str, QuantizedMatrix] = field(default_factory=dict)
    dummy: bool = False  # --load-format dummy: random weights

    @property
    def calibration_file(self) -> Path | None:
        """The file calibrations are cached under (none for random weights)."""
        return None if self.dummy else self.path


def load_engine_model(args: EngineArgs, loaded_model: LoadedModel | None = None, prepack: bool = True) -> EngineModel:
    """Preflight, load (unless `loaded_model` is given: a checkpoint already read by
    `load_model(args.model)`, whose tensors are only read) and build the model. Raises ValueError
    (CapacityError) for a bad option before the weights load. `prepack=False`: the linears stay
    plain nn.Linear (tensor parallelism shards them first)."""
    # First, args.validate() and the checks against the model's shape: a bad option fails
    # with one line before the weights load.
    plan = preflight(args, ModelShape.of(loaded_model.config) if loaded_model else None)
    if args.seed is None:
        torch.seed()  # from the OS's entropy: unseeded requests differ between runs
    else:
        torch.manual_seed(args.seed)
    start = time.monotonic()
    loaded = loaded_model or load_model(args.model, tokenizer=args.tokenizer,
                                          trust_remote_code=args.trust_remote_code, load_format=args.load_format)
    if ModelShape.of(loaded.config) != plan.shape:  # the quick read disagreed: check with the real config
        plan = preflight(args, ModelShape.of(loaded.config))
    _log_dtype(args, plan)  # after the load, so that a bad model file still fails with one line
    if plan.lowered:
        logger.warning(lowered_max_model_len_warning(plan.max_model_len, plan.shape.max_position_embeddings,
                                                     plan.kv_budget))
    reports: list[QuantizationReport] = []
    # Under tensor parallelism the full model's quantized matrices are only planned here: each
    # rank installs its cut of them once the model is sharded (parallel/rank_zero.py, worker.py).
    quantized: dict[str, QuantizedMatrix] = {}
    sharded = args.tensor_parallel_size > 1

    sources = {} if args.quantization == "none" else quantized_sources(loaded)

    def replace_linears(model: torch.nn.Module) -> None:
        targets = quantization_targets(model, args.quantization, sources, plan.dtype)
        if sharded:
            quantized.update(targets)
        else:
            reports.append(install_quantized(model, targets, args.quantization, plan.dtype, plan.device))

    # A GGUF's layers served from its own blocks are never dequantized (loader.LazyWeights); under
    # tensor parallelism rank 0 keeps the full plain model, to be sharded (parallel/rank_zero.py).
    unread = None if sharded else lambda model: weights_served_from_sources(model, args.quantization, sources)
    model = LlamaForCausalLM.from_hf_weights(loaded.config, loaded.weights, plan.max_model_len, plan.dtype,
                                             plan.device, shard=None, prepack=prepack, replace_linears=replace_linears,
                                             unread=unread)
    logger.info("Loaded %s (%s, %s, %s) in %.1f s", loaded.path, loaded.config.architecture,
                str(plan.dtype).removeprefix("torch."), plan.device, time.monotonic() - start)
    if not sharded:
        log_quantization(reports[0], model, plan.dtype)
    return EngineModel(plan, model, loaded.config, loaded.path, loaded.tokenizer,
                       _eos_token_ids(loaded.config, loaded.tokenizer), quantized, args.load_format == "dummy")


def _log_dtype(args: EngineArgs, plan: Preflight) -> None:
    """The dtype decision, once at start-up: auto's choice and why, or a warning for an
    explicit bfloat16 that this CPU only emulates."""
    name = str(plan.dtype).removeprefix("torch.")
    if args.dtype == "auto":
        logger.info("dtype auto -> %s: %s", name, plan.dtype_reason)
    elif (warning := emulated_bf16_warning(plan.dtype, plan.device)) is not None:
        logger.warning(warning)


def log_quantization(report: QuantizationReport, model: torch.nn.Module, dtype: torch.dtype) -> None:
    """What --quantization chose and the weight bytes now resident (a rank's, under tensor
    parallelism), once at start-up."""
    dense = (f", of which {format_size(report.dense_copy_bytes)} dequantized copies for batches over "
             f"{kernel_max_rows(dtype)} rows") if report.dense_copy_bytes else ""
    logger.info("quantization %s -> linears %s; weights resident: %s%s", report.mode, report.describe(),
                format_size(resident_weight_bytes(model)), dense)


def _eos_token_ids(config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """The model's EOS ids and the tokenizer's, sorted."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def select_attention(args: EngineArgs, built: EngineModel) -> tuple[KVFormat, AttentionBackend]:
    """The KV cache's storage format (--kv-cache-dtype) and the attention backend that reads it
    (--attention-backend: the CPU decode kernel where it builds and the format's layout allows it)
    for the built model; the backend logs which decode path runs."""
    plan = built.plan
    kv_format = make_kv_format(args.kv_cache_dtype, plan.dtype)
    kv_format.fixed_order = args.deterministic
    backend = make_attention_backend(args.attention_backend, kv_format, plan.kv_spec, plan.dtype, built.model.rope,
                                     plan.device, args.deterministic)
    return kv_format, backend
