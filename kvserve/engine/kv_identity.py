"""The identity of what a KV block's bytes mean, for the root of the prefix-cache hash chain.

Blocks in the KV tiers outlive the process (the disk tier) and may be shared by several servers,
so a hash must never match bytes another model, weight file, dtype, block layout, start-up
calibration or tier format produced. The namespace string holds all of them: the model's config,
a fingerprint of its weight files (size and a hash of their first and last MiB: cheap, and any
re-quantization or fine-tune changes the size or those bytes' headers and tensors), the compute
dtype, the pool's per-block layout, the KV format, the disk tier's format version and a hash of
the key centres and bases the format calibrated at start-up (engine/key_transforms.py), and the
kinds of the served linear layers (--quantization).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from kvserve.cache.kv_cache import KVCache
from kvserve.cache.tiers.disk import FORMAT_VERSION
from kvserve.model.config import ModelConfig
from kvserve.model.llama import LlamaForCausalLM

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
FINGERPRINT_BYTES = 1 << 20


def weights_fingerprint(path: Path) -> str:
    """Hex digest over each weight file's name, size and first and last MiB (a directory: every
    weight file in it, sorted, plus config.json)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"))
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}\x00{size}\x00".encode())
        with open(file, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            if size > 2 * FINGERPRINT_BYTES:
                f.seek(size - FINGERPRINT_BYTES, os.SEEK_SET)
                digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


def calibration_fingerprint(model: LlamaForCausalLM) -> str:
    """Hex digest of the key centres and key bases set on the model (empty when there are none)."""
    digest = hashlib.sha256()
    for layer in model.layers:
        attn = layer.self_attn
        tensors = [attn.key_center] if attn.key_center is not None else []
        if attn.key_basis is not None:
            tensors.append(attn.key_basis[0])
        for t in tensors:
            digest.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def kv_namespace(kv_cache: KVCache, config: ModelConfig, model_path: Path, dtype: torch.dtype,
                 model: LlamaForCausalLM, deterministic: bool = False, dummy_weights: bool = False) -> str:
    """The namespace string of the prefix-cache hash chain (kv_cache_manager.KVCacheManager). Under
    --deterministic the layers compute K/V on other paths, so its blocks are not shared with the
    default mode's (a disk tier may hold both); nor are those of --load-format dummy's weights."""
    parts = [kv_cache.format.name, f"tier-format-{FORMAT_VERSION}", str(dtype), kv_cache.layout_signature(),
             f"block_size={kv_cache.spec.block_size}", repr(sorted(dataclasses.asdict(config).items())),
             # dummy weights follow from the config alone (a fixed seed), whatever files lie beside it
             "dummy-weights" if dummy_weights else weights_fingerprint(model_path), calibration_fingerprint(model),
             # the served linears (--quantization): another kernel or weight format computes other KV
             repr(sorted({repr(m) for m in model.modules() if type(m).__name__.endswith("Linear")}))]
    if deterministic:
        parts.append("batch-invariant")
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()
