"""`--attention-backend`: the backends by name, and the choice `auto` makes.

Adding a backend is one module with an `AttentionBackend` subclass and one entry in `BACKENDS`:
`auto` tries the entries of `AUTO_ORDER` in turn (the fastest first), those meant for the device
(`auto_devices`), and takes the first whose `unsupported` says nothing; the start-up log names
the backend and, for each faster one passed over, why.
"""
from __future__ import annotations

import importlib
import logging

import torch

from kvserve.cache.kv_cache import KVCacheSpec, KVFormat
from kvserve.model.attention.base import AttentionBackend, BackendConfig
from kvserve.model.rope import RotaryEmbedding

logger = logging.getLogger("kvserve")

# name -> "module:class", imported when chosen (the Triton backend imports triton, which the CPU
# runtime does not require).
BACKENDS: dict[str, str] = {
    "torch": "kvserve.model.attention.torch_backend:TorchBackend",
    "cpu_paged": "kvserve.model.attention.cpu_paged:CpuPagedBackend",
    "triton": "kvserve.model.attention.triton_backend:TritonBackend",
}
# What `auto` tries, in order.
AUTO_ORDER = ("triton", "cpu_paged", "torch")


def attention_backend_names() -> tuple[str, ...]:
    """Every accepted --attention-backend value."""
    return ("auto", *BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(attention_backend_names())}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_attention_backend(name: str, kv_format: KVFormat, spec: KVCacheSpec, query_dtype: torch.dtype,
                           rope: RotaryEmbedding, device: torch.device, deterministic: bool = False) -> AttentionBackend:
    """The backend `name` for this configuration (ValueError naming why when it cannot serve it), or
    with `auto` the first of AUTO_ORDER that can. The choice is logged once."""
    config = BackendConfig(kv_format, spec, query_dtype, rope, device, deterministic)
    if name != "auto":
        cls = backend_class(name)
        why = cls.unsupported(config)
        if why is not None:
            raise ValueError(f"--attention-backend {name}: {why}")
        backend = cls(config)
        logger.info("Attention backend: %s (--attention-backend %s)", backend.description, name)
        return backend
    passed_over = []
    for candidate in AUTO_ORDER:
        cls = backend_class(candidate)
        if cls.auto_devices is not None and config.device.type not in cls.auto_devices:
            continue
        why = cls.unsupported(config)
        if why is None:
            backend = cls(config)
            reasons = "".join(f"; not {other}: {reason}" for other, reason in passed_over)
            logger.info("Attention backend: %s (auto%s)", backend.description, reasons)
            return backend
        passed_over.append((candidate, why))
    raise ValueError("no attention backend serves this configuration: "
                     + "; ".join(f"{other}: {reason}" for other, reason in passed_over))
