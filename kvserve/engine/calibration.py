"""The start-up calibration pass that quantized formats learn their key transforms from.

One prefill of random tokens runs through the (still empty) pool's first blocks, prepared and run
by the engine's ModelRunner like any serving step; every layer's fused q/k/v projection output is
recorded. Those blocks are free again afterwards and are overwritten before anything reads them.
Random tokens keep the calibration independent of any
text a user or an evaluation later feeds the model, and the same seed makes it deterministic,
so the cached K/V of a prompt (and prefix-cache hits) do not depend on when the engine started.
Used by key_centering.py (the mean key) and key_basis.py (query and key second moments).

Their results are kept in the on-disk cache (kvserve/disk_cache.py), keyed by everything they
depend on, so a later start of the same configuration loads them instead of calibrating again.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvserve import disk_cache
from kvserve.cache.block_pool import leading_block_ids
from kvserve.cache.kv_cache import KVCache
from kvserve.cache.sizing import blocks_for_tokens
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest
from kvserve.model.llama import LlamaForCausalLM
from kvserve.sampling_params import SamplingParams

CALIBRATION_TOKENS = 1024  # fewer gave key centring a noisier mean (BENCHMARKS.md, "KV-cache dtypes")
_SEED = 0

logger = logging.getLogger(__name__)


def calibration_tokens(kv_cache: KVCache, max_tokens: int, num_tokens: int = CALIBRATION_TOKENS) -> int:
    """How many tokens the calibration prefill runs: `num_tokens`, fewer when max-model-len or
    the pool is smaller."""
    return min(num_tokens, max_tokens, kv_cache.num_blocks * kv_cache.spec.block_size)


@torch.inference_mode()
def record_projections(runner: ModelRunner, max_tokens: int, num_tokens: int = CALIBRATION_TOKENS) -> list[torch.Tensor]:
    """Each layer's q/k/v heads [tokens, heads + 2 * kv_heads, head_dim], before RoPE and any key
    centring (after Qwen3's per-head norms: what RoPE takes), over one prefill of random tokens at
    positions 0, 1, ..., run by `runner` like any step (the pool's first blocks as its block
    table). The model's key transforms in effect (centres, bases) shape the hidden states of later
    layers, as they do when serving."""
    model, kv_cache = runner.model, runner.kv_cache
    config = model.config
    num_tokens = calibration_tokens(kv_cache, max_tokens, num_tokens)
    generator = torch.Generator().manual_seed(_SEED)
    token_ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=generator).tolist()
    request = Request("calibration", token_ids, SamplingParams(max_tokens=1))
    block_table = leading_block_ids(blocks_for_tokens(num_tokens, kv_cache.spec.block_size))
    recorded: list[torch.Tensor] = []

    def recorder(attention):
        def record(_module, _inputs, qkv: torch.Tensor) -> None:
            heads = qkv.view(num_tokens, -1, config.head_dim)
            recorded.append(heads.clone() if attention.q_norm is None else attention.norm_heads(heads))
        return record

    hooks = [layer.self_attn.qkv_proj.register_forward_hook(recorder(layer.self_attn)) for layer in model.layers]
    lean, model.lean = model.lean, None  # the modules' hooks record (under --deterministic lean takes prefills)
    try:
        runner.forward(runner.prepare([ScheduledRequest(request, num_tokens)], {request.request_id: block_table}))
    finally:
        model.lean = lean
        for hook in hooks:
            hook.remove()
    return recorded


def cached_calibration(kind: str, model: LlamaForCausalLM, kv_cache: KVCache, model_file: Path | None,
                       parameters: dict[str, Any], compute: Callable[[], dict[str, Any]],
                       valid: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """`compute()`'s result (a dict of tensors and numbers), from the disk cache when an entry for
    the same inputs exists. The key: the model file's fingerprint, model dtype, device, KV format,
    block size, --deterministic, `parameters` (the calibration's token count, steps, ...), the key transforms
    already set on the model, and the torch version and source of kvserve's model, cache and
    engine code. Without `model_file` nothing is cached. An entry that fails `valid` is ignored with a warning."""
    entry = None
    if model_file is not None:
        device = kv_cache.device
        entry = disk_cache.entry_path(f"calibration-{kind}", {
            "model": disk_cache.file_fingerprint(model_file),
            "dtype": str(model.embed_tokens.weight.dtype),
            # the served linears (--quantization): their kinds, widths and kernels
            "linears": sorted({repr(m) for m in model.modules() if type(m).__name__.endswith("Linear")}),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "kv_format": kv_cache.format.name, "block_size": kv_cache.spec.block_size, "seed": _SEED,
            # --deterministic computes the calibration prefill another way (every row as a decode,
            # fixed-order linears): its keys differ in their last bits, and so do the fitted transforms
            "batch_invariant": model.batch_invariant,
            "transforms_in_effect": _transforms_digest(model), "parameters": parameters,
            "torch": torch.__version__, "source": disk_cache.source_digest("cache", "model", "engine")}, ".pt")
    cached = disk_cache.load_tensors(entry)
    if cached is not None:
        if isinstance(cached, dict) and valid(cached):
            logger.info("Loaded the %s calibration from %s", kind, entry)
            return {name: _moved(value, kv_cache.device) for name, value in cached.items()}
        logger.warning("kvserve cache: ignoring the %s calibration entry %s (not what this model needs); recomputing",
                       kind, entry)
    result = compute()
    disk_cache.save_tensors(entry, {name: _moved(value, torch.device("cpu")) for name, value in result.items()})
    return result


def _moved(value: Any, device: torch.device) -> Any:
    """Tensors (alone or in a list) on `device`; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [_moved(item, device) for item in value]
    return value


def _transforms_digest(model: LlamaForCausalLM) -> str:
    """A hash of the key centres and bases the model applies now: they shape the hidden states
    the calibration prefill records."""
    digest = hashlib.sha256()
    for layer in model.layers:
        attention = layer.self_attn
        for tensor in (attention.key_center, attention.key_basis[0] if attention.key_basis else None):
            digest.update(b"-" if tensor is None else tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
