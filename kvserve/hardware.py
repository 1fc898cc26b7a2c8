"""What this machine can do: CPU instruction sets, native bfloat16, memory available now, where
Triton kernels run.

A plain helper module (it imports nothing from kvserve) so that every layer may ask it: the model
for its linears and kernels, the engine for dtype and pool sizing, `kvserve plan` for defaults.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import platform

# Set KVSERVE_CPU_BF16=0 to make kvserve decide as on a CPU without native bfloat16 (dtype auto ->
# float32), e.g. to test that path on an AVX512-BF16 machine together with ATEN_CPU_CAPABILITY=avx2.
CPU_BF16_ENV = "KVSERVE_CPU_BF16"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the kernel reports them (/proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def triton_interpreting() -> bool:
    """Whether Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1): on CPU tensors,
    slowly, which is how CI tests kvserve's Triton kernels."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable(device_type: str) -> str | None:
    """Why kvserve's Triton kernels (the Triton attention backend, the fused ops, the fixed-order
    GEMM) cannot run on tensors of this device type here, or None: they run on CUDA with the
    triton package, or on CPU under the interpreter."""
    if device_type not in ("cpu", "cuda"):
        return f"the Triton backend runs on CUDA, not {device_type}"
    if device_type == "cpu" and not triton_interpreting():
        return ("the Triton backend needs CUDA, or TRITON_INTERPRET=1 to run its kernels under Triton's "
                "interpreter on CPU (slow: for tests)")
    if importlib.util.find_spec("triton") is None:
        return "the Triton backend needs the triton package (CUDA builds of torch ship it; pip install triton)"
    return None


def triton_runs_on(device_type: str) -> bool:
    return triton_unavailable(device_type) is None


def machine() -> str:
    """x86_64, aarch64, ..."""
    return platform.machine().lower()


def cpu_bf16_disabled() -> bool:
    return os.environ.get(CPU_BF16_ENV, "").strip().lower() in ("0", "false", "no", "off")


def native_bf16_missing() -> str | None:
    """None when bfloat16 matmuls run natively on this CPU (AVX512-BF16 or AMX, usable by oneDNN);
    otherwise the reason, for logs and errors. Without native support torch emulates bf16 and it is
    slower than float32."""
    import torch

    if cpu_bf16_disabled():
        return f"{CPU_BF16_ENV}=0 is set"
    flags = cpu_flags()
    if not ({"avx512_bf16", "amx_bf16"} & flags):
        return "this CPU has no native bfloat16 matmul (no avx512_bf16 or amx_bf16 flag)"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN's bfloat16 path is not available here (ONEDNN_MAX_CPU_ISA or the CPU limits it)"
    return None


def onednn_runs_amx() -> bool:
    """Whether oneDNN's bf16 GEMMs run on AMX tiles here: the CPU has amx_bf16 and
    ONEDNN_MAX_CPU_ISA, where set, admits AMX."""
    if "amx_bf16" not in cpu_flags():
        return False
    limit = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    return not limit or limit == "ALL" or "AMX" in limit


def onednn_bf16_missing() -> str | None:
    """None when oneDNN can run bf16 linears here (natively or on AVX-512 BW/VL/DQ), else why not:
    without it, prepacked bf16 weights raise inside torch."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return "torch is built without oneDNN"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return ("oneDNN cannot run bfloat16 here: it needs avx512bw/vl/dq or avx_ne_convert "
                "(missing on this CPU, or masked by ONEDNN_MAX_CPU_ISA)")
    return None


def available_ram_bytes() -> int:
    """Memory the OS can give us now (Linux MemAvailable; total physical memory elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
