"""Host numbers to the device without blocking the host.

A plain helper module (it imports nothing from kvserve) so that every layer may use it: the cache
for block ids, the attention backends for their metadata, the engine for a step's inputs.
"""
from __future__ import annotations

import numpy as np
import torch


def host_to_device(array: np.ndarray | list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`array` as a tensor on `device`. On CUDA through pinned memory, so the copy does not wait
    for the work already queued (torch's caching host allocator keeps the pinned block until the
    copy is done); on CPU the array itself, no copy."""
    host = torch.as_tensor(array, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
