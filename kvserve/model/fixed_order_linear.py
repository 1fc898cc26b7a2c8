"""nn.Linear through the fixed-blocking Triton GEMM (kvserve/fixed_order_triton.py): the linears
of a model on CUDA under `--deterministic` (batch_invariant.py), where torch's GEMM (cuBLAS) picks
another blocking, and so another order of each row's sums, as the row count changes."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.fixed_order_triton import fixed_order_linear


class FixedOrderLinear(nn.Linear):
    """An nn.Linear whose rows do not depend on the other rows of the call (same weight, same bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fixed_order_linear(x, self.weight, self.bias)
