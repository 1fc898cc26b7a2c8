"""The CUDA platform: bfloat16 where the GPU has it, a KV budget measured after loading (vLLM's
profiling pass, engine/pool_sizing.py) unless given, and the layers' small steps as fused Triton
kernels (model/fused_ops.py) where triton is installed."""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch

from kvserve.engine.decode_graphs import DecodeGraphs, graphs_unavailable, max_capture_size
from kvserve.engine.platforms.base import BatchLimits, Platform
from kvserve.units import GiB

logger = logging.getLogger("kvserve")
DISABLE_FUSED_OPS_ENV = "KVSERVE_DISABLE_FUSED_OPS"


class CudaPlatform(Platform):
    name = "cuda"

    def auto_dtype(self, device):
        # Native bfloat16 from Ampere (sm_80) on; torch.cuda.is_bf16_supported() also counts the
        # emulated kind of older GPUs, where Triton's bfloat16 dots do not compile.
        if torch.cuda.get_device_capability(device) >= (8, 0):
            return torch.bfloat16, "this GPU supports bfloat16"
        return torch.float16, "this GPU has no native bfloat16"

    def batch_limits(self, device, serving):
        properties = torch.cuda.get_device_properties(device)
        return cuda_batch_limits(properties.total_memory, properties.name, serving)

    def kv_budget_before_load(self, args, budget, device):
        if budget is not None and budget > (total := torch.cuda.get_device_properties(device).total_memory):
            raise ValueError(f"--kv-cache-memory {args.kv_cache_memory} ({budget / GiB:.2f} GiB) is more than "
                             f"{device}'s memory ({total / GiB:.2f} GiB)")
        return budget

    def prepare_model(self, model, backend, tensor_parallel):
        """Residual add + RMSNorm, SiLU x up and RoPE as one Triton launch each (on the Triton
        backend RoPE with the KV store, triton_kernels.rope_store), unless
        KVSERVE_DISABLE_FUSED_OPS=1 keeps the torch ops (these kernels are not yet measured on a GPU);
        --deterministic needs them (ValueError without)."""
        why_not = (f"{DISABLE_FUSED_OPS_ENV} is set" if os.environ.get(DISABLE_FUSED_OPS_ENV, "0") not in ("", "0")
                   else "triton is not installed" if importlib.util.find_spec("triton") is None else None)
        if why_not is not None:
            if model.batch_invariant:  # torch's rms_norm on CUDA makes no promise for a row whatever the batch
                raise ValueError(f"--deterministic on CUDA needs the fused Triton ops (their RMSNorm is one "
                                 f"program per row), but {why_not}")
            logger.info("Fused Triton ops not used: %s", why_not)
            return
        model.use_fused_ops(importlib.import_module("kvserve.model.fused_ops"))
        rope = ("RoPE (applied with the KV store where the format allows)" if backend.name == "triton" else "RoPE")
        logger.info("Residual add + RMSNorm, SiLU x up and %s run as fused Triton kernels", rope)

    def capture_decode_graphs(self, runner, args, max_model_len):
        """Decode steps of up to --max-cudagraph-capture-size sequences replayed from CUDA graphs
        (engine/decode_graphs.py), unless --enforce-eager. A failed capture leaves every step
        eager, with a warning (these graphs are not yet measured on a GPU)."""
        why = graphs_unavailable(args, runner.backend)
        if why is not None:
            logger.info("CUDA graphs not used: %s", why)
            return
        graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.backend, max_capture_size(args), max_model_len)
        try:
            graphs.capture()
        except RuntimeError as exc:
            logger.warning("CUDA graph capture failed (%s); every step runs eagerly (--enforce-eager)", exc)
            return
        runner.graphs = graphs


def cuda_batch_limits(total_memory: int, device_name: str, serving: bool) -> BatchLimits:
    """vLLM's default step limits on CUDA: a GPU of 70 GiB or more other than an A100 (H100, H200,
    MI300X) takes 1024 sequences and 8192 tokens a step served, 16384 offline, where larger steps
    fill the device; any other takes 256 sequences and 2048 tokens served, 8192 offline (vLLM
    measured larger steps slower on the A100)."""
    use = "served" if serving else "offline"
    if total_memory >= 70 * GiB and "a100" not in device_name.lower():
        return BatchLimits(1024, 8192 if serving else 16384, f"vLLM's defaults {use} on a {device_name}")
    return BatchLimits(256, 2048 if serving else 8192, f"vLLM's defaults {use} on a {device_name}")
