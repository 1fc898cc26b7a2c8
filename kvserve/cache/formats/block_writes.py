"""Which blocks a write touches, and whether it continues them or starts them afresh.

A format whose scales describe a whole block (int4_kivi's per-channel key ranges) must keep them
right while the block fills over several steps. They rely on one fact
of the engine: a block's tokens are written strictly in order and a full (published) block is
never written again. So when a write's first token in a block sits at offset 0, the block is
being (re)started by a new owner and whatever it held before is garbage; when the first new
offset is k > 0, offsets [0, k) hold this owner's earlier tokens, quantized with the block's
current scales, and those must be kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockWrite:
    touched: torch.Tensor  # [U] distinct block ids written by this call
    inverse: torch.Tensor  # [tokens] index into `touched` of each written token's block
    continuing: torch.Tensor  # [U] bool: the block already holds earlier tokens of the same owner

    @classmethod
    def from_slots(cls, slot_mapping: torch.Tensor, block_size: int) -> "BlockWrite":
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping - blocks * block_size
        touched, inverse = torch.unique(blocks, return_inverse=True)
        first = torch.full(touched.shape, block_size, dtype=offsets.dtype, device=offsets.device)
        first.scatter_reduce_(0, inverse, offsets, "amin")
        return cls(touched, inverse, first > 0)

    def per_block(self, per_token: torch.Tensor, reduce: str, neutral: float) -> torch.Tensor:
        """Reduce `per_token` [tokens, ...] over the tokens of each touched block -> [U, ...]."""
        out = torch.full((self.touched.shape[0], *per_token.shape[1:]), neutral,
                         dtype=per_token.dtype, device=per_token.device)
        index = self.inverse.view(-1, *([1] * (per_token.dim() - 1))).expand_as(per_token)
        return out.scatter_reduce_(0, index, per_token, reduce)
