"""What differs between CPU and CUDA, behind one small interface (vLLM's `vllm/platforms`): the
`auto` dtype, the KV budget, the default step limits (--max-num-seqs, --max-num-batched-tokens),
and how a loaded model is prepared to run (the CPU's lean decode step; CUDA's fused Triton ops).
`platform_for(device)` gives the one for a device."""
from __future__ import annotations

import torch

from kvserve.engine.platforms.base import BatchLimits, Platform
from kvserve.engine.platforms.cpu import CpuPlatform
from kvserve.engine.platforms.cuda import CudaPlatform

_PLATFORMS: dict[str, Platform] = {"cpu": CpuPlatform(), "cuda": CudaPlatform()}


def platform_for(device: torch.device) -> Platform:
    """The platform of `device` (a device type kvserve does not run on gets the CPU's rules, which
    ask nothing of the hardware beyond torch)."""
    return _PLATFORMS.get(device.type, _PLATFORMS["cpu"])


__all__ = ["BatchLimits", "Platform", "CpuPlatform", "CudaPlatform", "platform_for"]
