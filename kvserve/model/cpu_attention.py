"""The CPU paged decode kernel (csrc/paged_decode.cpp): build, load, choose.

Decode attention in torch ops has to gather each request's blocks into one padded tensor before
its matmuls: on CPU that copy, the padding and the mask were about a third of a decode step at
32 concurrent requests of the default model. The kernel reads K/V in place through the block
tables instead (what vLLM's CPU and CUDA backends do), ~3x faster per layer at that batch.

It is C++ compiled on first use with torch's own extension builder (`torch.utils.cpp_extension`,
which needs a C++ compiler and ninja) for the CPU's vector ISA as torch reports it, and cached
under torch's extensions directory (~25 s once per machine and source version). When it cannot
be built, `--attention-backend auto` logs why and keeps the torch path, which is also the path
on CUDA.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu_paged")
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"

# Compiler flags per vector ISA torch dispatches to: the same CPU_CAPABILITY macros ATen's own
# kernels are built with, so at::vec::Vectorized is the 512- or 256-bit implementation.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}

# (query [B, H, D], kv pool [2 * KVH, blocks, block_size, D], block tables [B, W] int64,
#  seq_lens [B] int64, window or 0) -> attention output [B, H, D]
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@functools.cache
def _build() -> tuple[object | None, str]:
    """The compiled extension module, or None and why not."""
    start = time.monotonic()
    logger.info("Loading the CPU paged decode kernel (compiled on first use on a machine, ~30 s)")
    try:
        from torch.utils.cpp_extension import load

        isa = torch.backends.cpu.get_cpu_capability()
        flags = ["-O3", "-fopenmp", *_ISA_FLAGS.get(isa, [])]
        # One module name per ISA: a cache directory shared by different machines never hands
        # one a binary built for another's instructions.
        module = load(name=f"kvserve_paged_decode_{isa.lower()}", sources=[str(SOURCE)],
                      extra_cflags=flags, extra_ldflags=["-fopenmp"])  # at::parallel_for is OpenMP
        logger.info("CPU paged decode kernel (%s) ready in %.1f s", isa, time.monotonic() - start)
        return module, ""
    except Exception as error:  # no compiler, no ninja, a build error: all mean "use torch ops"
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"


def paged_decode_kernel(backend: str, device: torch.device, head_dim: int) -> DecodeKernel | None:
    """The decode kernel an engine uses for `--attention-backend`, or None for the torch path.
    `auto` takes the kernel on CPU when it builds; `cpu_paged` insists on it (ValueError if it
    cannot run here); `torch` never uses it."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "torch":
        return None
    if device.type != "cpu":
        if backend == "cpu_paged":
            raise ValueError(f"--attention-backend cpu_paged runs on CPU only, not {device}")
        return None
    module, why = _build()
    if module is not None and not module.supports_head_dim(head_dim):
        module, why = None, f"head_dim {head_dim} is not one the kernel is compiled for"
    if module is None:
        if backend == "cpu_paged":
            raise ValueError(f"the CPU paged decode kernel is not available: {why}")
        logger.warning("CPU paged decode kernel unavailable (%s); decode attention uses torch ops", why)
        return None
    scale = 1.0 / math.sqrt(head_dim)

    def decode(query, kv_pool, block_tables, seq_lens, window):
        return module.paged_decode(query, kv_pool, block_tables, seq_lens, window, scale)

    return decode
