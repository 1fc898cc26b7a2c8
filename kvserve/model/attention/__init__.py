"""Attention backends (vLLM's plug-in split): the interface (base.py), the per-step data every
backend builds from (metadata.py), the registry behind `--attention-backend` (registry.py) and
one module per backend: torch ops (torch_backend.py + torch_ops.py), the CPU paged decode kernel
(cpu_paged.py), Triton kernels for CUDA (triton_backend.py + triton_kernels.py)."""
from kvserve.model.attention.base import AttentionBackend, BackendConfig
from kvserve.model.attention.metadata import (AttentionGroup, AttentionMetadata, ObservedAttention, PrefillChunk,
                                              StepSequence, packing_order)
from kvserve.model.attention.registry import attention_backend_names, make_attention_backend

__all__ = ["AttentionBackend", "BackendConfig", "AttentionGroup", "AttentionMetadata", "ObservedAttention",
           "PrefillChunk", "StepSequence", "packing_order", "attention_backend_names", "make_attention_backend"]
