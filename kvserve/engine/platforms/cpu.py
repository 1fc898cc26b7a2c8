"""The CPU platform: bfloat16 only where the CPU has native bf16 matmul, a KV budget from RAM,
and the lean decode step (model/lean_decode.py) where the CPU paged kernel reads decodes."""
from __future__ import annotations

import logging

import torch

from kvserve.cache.sizing import default_cpu_budget
from kvserve.engine.parallel.group import processes_on_node
from kvserve.engine.platforms.base import BatchLimits, Platform
from kvserve.hardware import available_ram_bytes, cpu_flags, native_bf16_missing
from kvserve.model.lean_decode import LeanDecoder
from kvserve.model.quant_linear import QuantizedLinear
from kvserve.units import GiB

logger = logging.getLogger("kvserve")

# 256 sequences and 2048 tokens a step, served or offline: a CPU step's time grows with its
# tokens, and a decode waits for the prefill chunks beside it.
CPU_BATCH_LIMITS = BatchLimits(256, 2048, "the CPU's defaults")


class CpuPlatform(Platform):
    name = "cpu"

    def auto_dtype(self, device):
        """bfloat16 where it runs natively (AVX512-BF16 or AMX), else float32: emulated bf16 is
        slower than float32."""
        missing = native_bf16_missing()
        if missing is not None:
            return torch.float32, missing
        flags = ", ".join(sorted({"avx512_bf16", "amx_bf16"} & cpu_flags())) or "oneDNN"
        return torch.bfloat16, f"native bf16 matmul ({flags})"

    def batch_limits(self, device, serving):
        return CPU_BATCH_LIMITS

    def kv_budget_before_load(self, args, budget, device):
        if args.gpu_memory_utilization != type(args).gpu_memory_utilization:  # not the default
            logger.warning("--gpu-memory-utilization concerns CUDA: on CPU the KV pool is --kv-cache-memory, "
                           "by default min(4GiB, RAM/4 shared by the processes on the machine)")
        processes = processes_on_node(args)  # each holds a pool of this size
        if budget is None:
            return default_cpu_budget(processes)
        if budget * processes > (available := available_ram_bytes()):
            times = "" if processes == 1 else (f" x {processes} processes on this machine (tensor-parallel ranks, "
                                                f"data-parallel replicas: a pool each)")
            raise ValueError(f"--kv-cache-memory {args.kv_cache_memory} ({budget / GiB:.2f} GiB){times} is more "
                             f"than the memory available now ({available / GiB:.2f} GiB)")
        return budget

    def prepare_model(self, model, backend, tensor_parallel):
        """Decode steps as two fused C++ calls per layer (lean decode) where the CPU paged kernel
        reads decodes in place; not under tensor parallelism (its sharded layers reduce). Under
        --deterministic it takes every step or none (LeanDecoder.for_model)."""
        if tensor_parallel or not backend.reads_decodes_in_place:
            return
        model.lean, why = LeanDecoder.for_model(model)
        if model.lean is not None and model.batch_invariant:
            logger.info("Every step runs each layer as two fused C++ calls (lean decode; --deterministic)")
        elif model.lean is not None:
            logger.info("Decode steps of %d to %d sequences run each layer as two fused C++ calls (lean decode)",
                        model.lean.min_rows, model.lean.max_rows)
        elif any(isinstance(m, QuantizedLinear) for m in model.modules()):
            logger.info("Lean decode step not used: %s", why)

    def capture_decode_graphs(self, runner, args, max_model_len):
        if args.enforce_eager or args.max_cudagraph_capture_size is not None:
            logger.warning("--enforce-eager and --max-cudagraph-capture-size concern CUDA graphs: on CPU every step "
                           "runs eagerly")
