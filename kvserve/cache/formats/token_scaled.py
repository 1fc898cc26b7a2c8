"""Symmetric 1-byte codes with one scale per (token, KV head): the fp8 and int8 formats.

Layout of one layer's pool (keys in the first kv_heads rows, values in the next kv_heads)::

    kv        [2 * kv_head, block, offset, head_dim]   1-byte codes
    kv_scale  [2 * kv_head, block, offset]             each token's scale, in the format's encoding

K and V share one tensor so that a write or a gather is one set of ops for both. The scales are
indexed by block id like the codes, so they are allocated, shared through the prefix cache and
freed with their blocks. fp8_e5m2 rotates K and V before quantizing (rotation.py); fp8_e4m3
takes its keys in a basis the model fitted for it (engine/key_basis.py); int8 stores them as they come.

Why one scale per token rather than per (block, KV head): a block fills over several decode
steps, so a block scale has to grow with the block's absmax and re-encode the block's earlier
tokens whenever it does. That was built first; per-token scales won (BENCHMARKS.md, "KV-cache
dtypes"). They never change once written, so a write is about a dozen ops instead of ~25 (on CPU
the write of a decode step is mostly per-op overhead), nothing is rounded twice, and the range is
that of 64 values, not 1,024, which gives keys with outlier channels a smaller relative error.
The price is the scale bytes: fp8 stores its power-of-two
scale as a 1-byte exponent (65 bytes per token and head against 128 in float16: 1.97x the
tokens), int8 a float16 scale (66 bytes: 1.94x), against 1.99x for per-block scales.
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.rotation import hadamard_rotation
from kvserve.cache.kv_cache import InPlaceLayout, KVCacheSpec, KVFormat, ScaledKV, Scratch, gather_blocks


class TokenScaledFormat(KVFormat):
    """Subclasses say how a token's scale is stored and how a scaled value becomes a code and back."""

    storage_dtype: torch.dtype  # dtype of the codes tensor (int8, float8_e4m3fn, ...)
    index_dtype: torch.dtype = torch.int8  # an integer view of it that index_select / index_copy_ accept
    scale_dtype: torch.dtype  # dtype of the stored scales
    decode_unit: float = 1.0  # decode(codes) * decode_unit * scale is the stored value
    value_bits = 8

    def __init__(self, rotate: bool = False):
        self.rotate = rotate  # store K·H and V·H (rotation.py): outlier channels spread before quantizing
        self.scratch = Scratch()

    def scale_for(self, amax: torch.Tensor) -> torch.Tensor:
        """Stored scales (`scale_dtype`) at which values up to `amax` (float32) encode without overflow."""
        raise NotImplementedError

    def scale_value(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored scales -> float32 scales (> 0)."""
        raise NotImplementedError

    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """float32 values already divided by their scale -> codes (`index_dtype`)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Codes (`index_dtype`) -> a new or scratch float tensor of unscaled values (divided by
        `decode_unit`), in `dtype` or a float dtype that holds them exactly."""
        raise NotImplementedError

    # ------------------------------------------------------------------ KVFormat
    def bytes_per_block(self, spec: KVCacheSpec) -> int:
        code_bytes = spec.head_dim * torch.empty((), dtype=self.storage_dtype).element_size()
        scale_bytes = torch.empty((), dtype=self.scale_dtype).element_size()
        return 2 * spec.num_kv_heads * spec.block_size * (code_bytes + scale_bytes)

    def allocate(self, spec, num_blocks, device):
        lead = (2 * spec.num_kv_heads, num_blocks, spec.block_size)
        return {"kv": torch.zeros((*lead, spec.head_dim), dtype=self.storage_dtype, device=device),
                "kv_scale": torch.zeros(lead, dtype=self.scale_dtype, device=device)}

    def rotation(self, head_dim, dtype, device):
        return hadamard_rotation(head_dim, dtype, device) if self.rotate else None

    def write(self, pool, key, value, slot_mapping):
        new = torch.cat((key, value), dim=1).float()  # [tokens, 2 * kv_heads, head_dim]
        rotation = self.rotation(key.shape[-1], torch.float32, key.device)
        if rotation is not None:
            new = self.rotate_rows(new, rotation)
        stored = self.scale_for(new.abs().amax(-1))  # [tokens, 2 * kv_heads]
        codes = self.encode(new / self.scale_value(stored).unsqueeze(-1))
        heads, dim = new.shape[1], new.shape[2]
        pool["kv"].view(self.index_dtype).view(heads, -1, dim).index_copy_(1, slot_mapping, codes.transpose(0, 1))
        pool["kv_scale"].view(heads, -1).index_copy_(1, slot_mapping, stored.T)

    def gather(self, pool, block_ids, batch, dtype):
        values, factor = self._gather_decoded(pool, block_ids, batch, dtype)
        values = values.mul_(factor.to(values.dtype).unsqueeze(-1)).to(dtype)
        heads = values.shape[0] // 2
        return values[:heads], values[heads:]

    def in_place_layout(self, query_dtype):
        """Codes with per-token scales, for bfloat16 or float32 queries; int8 codes unless a
        subclass says how its bits widen (fp8)."""
        return None if query_dtype == torch.float16 else InPlaceLayout("codes")

    def gather_scaled(self, pool, block_ids, batch, dtype):
        """The decoded codes and each token's factor, for the decode attention to apply to its
        scores and probabilities: a multiply over the gathered K/V would be the costliest pass of
        a quantized decode on CPU (BENCHMARKS.md, "KV-cache dtypes")."""
        values, factor = self._gather_decoded(pool, block_ids, batch, dtype)
        values = values.to(dtype)
        heads = values.shape[0] // 2
        return ScaledKV(values[:heads], values[heads:], factor[:heads], factor[heads:])

    def _gather_decoded(self, pool: dict[str, torch.Tensor], block_ids: torch.Tensor, batch: int,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` of the given blocks' codes [2H, batch, tokens, D] and each token's float32
        factor (scale * decode_unit) [2H, batch, tokens]: the stored value is their product."""
        codes, stored = self._gather_codes(pool, block_ids, batch)
        return self.decode(codes, dtype), self.scale_value(stored) * self.decode_unit

    def _gather_codes(self, pool: dict[str, torch.Tensor], block_ids: torch.Tensor,
                      batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes [2H, batch, tokens, D] (`index_dtype`) and stored scales [2H, batch, tokens] of the
        given blocks, in scratch buffers."""
        codes = pool["kv"].view(self.index_dtype)
        scales = pool["kv_scale"]
        picked = self.scratch.get("codes", (codes.shape[0], block_ids.shape[0], *codes.shape[2:]), codes.dtype,
                                  codes.device)
        picked_scales = self.scratch.get("scales", (scales.shape[0], block_ids.shape[0], scales.shape[2]),
                                         scales.dtype, scales.device)
        return (gather_blocks(codes, block_ids, batch, picked),
                gather_blocks(scales, block_ids, batch, picked_scales))
