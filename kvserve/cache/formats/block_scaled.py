"""Symmetric 1-byte codes with one float32 scale per (block, KV head): the fp8 and int8 formats.

Layout of one layer's pool (keys in the first kv_heads rows, values in the next kv_heads)::

    kv        [2 * kv_head, block, offset, head_dim]   1-byte codes
    kv_scale  [2 * kv_head, block]                     float32, value = code * scale

K and V share one tensor so that a write or a gather is one set of ops for both (on CPU a
decode step's write is dominated by per-op overhead). The scales are indexed by block id like
the codes, so they are allocated, shared through the prefix cache and freed with their blocks.
One 4-byte scale per 16x64 codes costs 0.4%, which keeps fp8/int8 at 1.99x the tokens of a
float16 pool (a per-token scale would give 1.94x).

A block fills over several steps (one token per decode step), so its scale must grow with the
absmax of what it holds. On each write, a touched block that already holds tokens of its owner
gets scale = max(old scale, scale needed by the new tokens); if that grew, the block's codes are
re-encoded (decode with the old scale, encode with the new one) before the new tokens are
stored. The absmax of a block grows only a few times as it fills (for i.i.d. values, the number
of running-maximum records in 16 draws is H_16 = 3.4 on average), so re-encoding is rare; for
fp8 the scales are powers of two and re-encoding is exact (an exponent shift), for int8 each
re-encoding rounds once more (error <= half a step of the new scale per event). K and V are
rotated first (rotation.py).
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.block_writes import BlockWrite
from kvserve.cache.formats.rotation import hadamard_rotation
from kvserve.cache.kv_cache import KVCacheSpec, KVFormat


class BlockScaledFormat(KVFormat):
    """Subclasses say how a scaled float32 value becomes a code and back (one module each)."""

    storage_dtype: torch.dtype  # dtype of the pool tensor (int8, float8_e4m3fn, ...)
    index_dtype: torch.dtype  # an integer view of it that index_select / index_copy_ accept
    decode_unit: float = 1.0  # decode(codes) * decode_unit * scale is the stored value

    def __init__(self, rotate: bool = True):
        self.rotate = rotate  # store K·H and V·H (rotation.py): outlier channels spread before quantizing

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """The smallest scale at which values up to `amax` encode without overflow (float32, > 0)."""
        raise NotImplementedError

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """float32 values already divided by their scale -> codes (in `index_dtype`)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Codes (in `index_dtype`) -> unscaled floats (`dtype` or any float dtype that holds them exactly)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ KVFormat
    def bytes_per_block(self, spec: KVCacheSpec) -> int:
        codes = spec.block_size * spec.head_dim * torch.empty((), dtype=self.storage_dtype).element_size()
        return 2 * spec.num_kv_heads * (codes + 4)

    def allocate(self, spec, num_blocks, device):
        heads = 2 * spec.num_kv_heads
        return {"kv": torch.zeros((heads, num_blocks, spec.block_size, spec.head_dim), dtype=self.storage_dtype,
                                  device=device),
                "kv_scale": torch.zeros((heads, num_blocks), dtype=torch.float32, device=device)}

    def rotation(self, head_dim, dtype, device):
        return hadamard_rotation(head_dim, dtype, device) if self.rotate else None

    def write(self, pool, key, value, slot_mapping):
        new = torch.cat((key, value), dim=1).float()  # [tokens, 2 * kv_heads, head_dim]
        rotation = self.rotation(key.shape[-1], torch.float32, key.device)
        if rotation is not None:
            new = new @ rotation
        codes = pool["kv"].view(self.index_dtype)
        self._write(codes, pool["kv_scale"], new, slot_mapping, BlockWrite.from_slots(slot_mapping, codes.shape[2]))

    def gather(self, pool, block_ids, batch, dtype):
        codes = pool["kv"].view(self.index_dtype)
        heads, _, _, dim = codes.shape
        values = self.decode(torch.index_select(codes, 1, block_ids), dtype)
        factor = (torch.index_select(pool["kv_scale"], 1, block_ids) * self.decode_unit).to(values.dtype)
        values = values.mul_(factor[..., None, None]).to(dtype).view(heads, batch, -1, dim)
        return values[: heads // 2], values[heads // 2:]

    # ------------------------------------------------------------------ internals
    def _write(self, codes: torch.Tensor, scales: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor,
               write: BlockWrite) -> None:
        """Store float32 `new` [tokens, H, D], growing and re-encoding the touched blocks' scales."""
        heads, _, _, dim = codes.shape
        needed = self.scale_for(write.per_block(new.abs().amax(-1), "amax", 0.0).T)  # [H, U]
        old = torch.where(write.continuing, torch.index_select(scales, 1, write.touched), 0.0)
        scale = torch.maximum(old, needed)
        regrow = write.continuing & (scale > old).any(0)
        if regrow.any():
            ids = write.touched[regrow]
            ratio = (old[:, regrow] / scale[:, regrow] * self.decode_unit)[..., None, None]
            values = self.decode(torch.index_select(codes, 1, ids), torch.float32).float() * ratio
            codes.index_copy_(1, ids, self.encode(values))
        scales.index_copy_(1, write.touched, scale)
        token_scale = scale.T[write.inverse]  # [tokens, H]
        encoded = self.encode(new / token_scale[..., None])
        codes.view(heads, -1, dim).index_copy_(1, slot_mapping, encoded.transpose(0, 1))
