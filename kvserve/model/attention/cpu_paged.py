"""The CPU paged backend: the torch backend with decodes read in place by a C++ kernel
(csrc/paged_decode.cpp), built, loaded and chosen here.

Decode attention in torch ops has to gather each request's blocks into one padded tensor before
its matmuls: on CPU that copy, the padding and the mask were a large share of a decode step at
32 concurrent requests. The kernel reads K/V in place through the block
tables instead (what vLLM's CPU and CUDA backends do; BENCHMARKS.md, "Offline throughput",
"Latest"). It reads the full-precision pool and the fp8, int8 and int4 codes.

It is C++ built for the CPU's vector ISA by `kvserve build-kernel` at set-up, or on first use
(kernel_build.py: cached per ISA and torch version, safe when processes start at once). When it
cannot be built or loaded, `--attention-backend auto` logs why in one line and takes the torch
backend.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.cache.kv_cache import InPlaceLayout
from kvserve.model.attention.base import BackendConfig
from kvserve.model.attention.torch_backend import TorchBackend
from kvserve.model.kernel_build import KernelBuild, current_isa, load_kernel


SOURCE = Path(__file__).parent.parent / "csrc" / "paged_decode.cpp"


@dataclass(frozen=True)
class PagedDecodeKernel:
    """The compiled kernel's entry points for one head_dim. Each takes the step's queries [B, H, D]
    (one per request), the pool, block tables [B, W] int64, seq_lens [B] int64 and the sliding
    window (None: unlimited), and returns the attention output [B, H, D] in the query dtype."""

    module: Any
    scale: float  # 1 / sqrt(head_dim)

    def decode(self, layout: InPlaceLayout, pool: dict[str, torch.Tensor], query: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
        """Decode attention over a layer's pool stored in `layout` (the format's description)."""
        if layout.kind == "float":
            return self.float_pool(query, pool["kv"], block_tables, seq_lens, window)
        if layout.kind == "codes":
            return self.code_pool(query, pool["kv"].view(torch.int8), pool["kv_scale"], block_tables, seq_lens,
                                  window, layout.fp8_multiplier, layout.fp8_mask, layout.fp8_unit)
        if layout.kind == "int4":
            return self.int4_pool(query, pool["kv"], pool["kv_params"], block_tables, seq_lens, window)
        raise ValueError(f"the paged decode kernel cannot read a {layout.kind!r} pool")

    def float_pool(self, query: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   window: int | None) -> torch.Tensor:
        """kv [2 * KVH, blocks, block_size, D] in the query's dtype (FullPrecisionFormat)."""
        return self.module.paged_decode(query.contiguous(), kv, block_tables, seq_lens, window or 0, self.scale)

    def code_pool(self, query: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, window: int | None, fp8_multiplier: int = 0, fp8_mask: int = 0,
                  fp8_unit: float = 1.0) -> torch.Tensor:
        """1-byte codes [2 * KVH, blocks, block_size, D] (an int8 view) with per-token scales
        [2 * KVH, blocks, block_size] (TokenScaledFormat): fp8 bits with int8 exponents when
        fp8_multiplier > 0 (Fp8Format.decode's shift and mask, unit = its decode_unit), else int8
        codes with float16 scales. Queries in bfloat16 or float32."""
        return self.module.paged_decode_codes(query.contiguous(), codes, scales, block_tables, seq_lens, window or 0,
                                              self.scale, fp8_multiplier, fp8_mask, fp8_unit)

    def int4_pool(self, query: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
        """int4 codes [2 * KVH, blocks, block_size, D / 2] (uint8, two per byte) with float16 (scale,
        zero) per token [2 * KVH, blocks, block_size, 2] (Int4Format). Queries in bfloat16 or float32."""
        return self.module.paged_decode_int4(query.contiguous(), packed, params, block_tables, seq_lens, window or 0,
                                             self.scale)


def paged_decode_build(isa: str | None = None) -> KernelBuild:
    """The paged decode kernel built for `isa` (default: the ISA torch dispatches to here)."""
    isa = isa or current_isa()
    return KernelBuild(f"kvserve_paged_decode_{isa.lower()}", SOURCE, isa)


@functools.cache
def load_paged_decode_module() -> tuple[Any | None, str]:
    """The compiled extension module for this process, or None and why not (asked once)."""
    return load_kernel(paged_decode_build())


def paged_decode_kernel(head_dim: int) -> tuple[PagedDecodeKernel | None, str]:
    """The compiled decode kernel for `head_dim`, or None and why not."""
    module, why = load_paged_decode_module()
    if module is not None and not module.supports_head_dim(head_dim):
        return None, f"head_dim {head_dim} is not one the kernel is compiled for"
    if module is None:
        return None, f"the CPU paged decode kernel is not available: {why}"
    return PagedDecodeKernel(module, 1.0 / math.sqrt(head_dim)), ""


class CpuPagedBackend(TorchBackend):
    """Decodes read in place by the CPU kernel (one call over every decode of the step, no gather,
    no padding); prefill chunks and sequences under KV eviction as in the torch backend."""

    name = "cpu_paged"
    auto_devices = ("cpu",)
    reads_decodes_in_place = True

    def __init__(self, config: BackendConfig):
        super().__init__(config)
        self.layout = config.kv_format.in_place_layout(config.query_dtype)
        self.kernel, why = paged_decode_kernel(config.spec.head_dim)
        if self.kernel is None or self.layout is None:
            raise ValueError(why or self.unsupported(config))

    @classmethod
    def unsupported(cls, config: BackendConfig) -> str | None:
        if config.device.type != "cpu":
            return f"the cpu_paged backend runs on CPU only, not {config.device}"
        if config.kv_format.in_place_layout(config.query_dtype) is None:
            return (f"the cpu_paged backend reads a KV cache in the model dtype, or fp8/int8/int4 under a bfloat16 "
                    f"or float32 model; not a {config.kv_format.name} KV cache with "
                    f"{str(config.query_dtype).removeprefix('torch.')} weights")
        return paged_decode_kernel(config.spec.head_dim)[1] or None

    @property
    def description(self) -> str:
        return "CPU paged kernel (in place)"

    def decode_in_place(self, pool, query, block_tables, seq_lens, window):
        return self.kernel.decode(self.layout, pool, query, block_tables, seq_lens, window)
