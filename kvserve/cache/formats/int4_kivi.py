"""int4_kivi KV cache: KIVI's layout (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit
Quantization for KV Cache", arXiv:2402.02750) at 4 bits: keys quantized per channel, values per
token.

Keys have a few outlier channels with large magnitude in every token, so a per-token group
spends its 16 levels on the outliers; grouping each channel over the tokens of a block gives
every channel its own range. Values have no such channels and stay per token (int4.py).

Layout of one layer's pool::

    key           [kv_head, block, offset, head_dim // 2]   uint8, two codes per byte (int4.py)
    key_params    [kv_head, block, 2, head_dim]             float16 (scale, zero) per channel
    value         [kv_head, block, offset, head_dim // 2]   uint8, per-token groups as in int4.py
    value_params  [kv_head, block, offset, 2]               float16 (scale, zero) per token

No rotation: per-channel ranges are the point, and a rotation would mix the channels (rotating
K and V changed its error within noise: BENCHMARKS.md, "KV-cache dtypes").

KIVI keeps the newest (not yet full) key group in full precision until it fills. A paged pool
has no per-sequence storage for such a residual, so here a block's channel ranges grow as it
fills instead: a write that widens a channel's range re-encodes the block's earlier keys with
the new (scale, zero) (decode, encode: one extra rounding per widening, which happens a few
times per block). The endpoints of a range are exact in every grid, so a block's first
token is stored exactly until a second arrives.

Bytes per token and KV head (head_dim 64, block 16): keys 32 + 2*2*64/16 = 48, values 36, i.e.
84 against 256 in float16: 3.05x the tokens (the default int4 layout gets 3.56x).
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.block_writes import BlockWrite
from kvserve.cache.formats.int4 import (LEVELS, affine_params, dequantize_, gather_token_groups, pack_int4,
                                        quantize, unpack_int4, unpack_int4_into, write_token_groups)
from kvserve.cache.kv_cache import KVCacheSpec, KVFormat, Scratch, gather_blocks


class Int4KiviFormat(KVFormat):
    name = "int4_kivi"
    value_bits = 4
    # A block's key channel ranges are shared by its tokens: a moved token is re-encoded.
    copies_token_rows = False

    def __init__(self) -> None:
        self.scratch = Scratch()

    def bytes_per_block(self, spec: KVCacheSpec) -> int:
        keys = spec.block_size * spec.head_dim // 2 + 2 * spec.head_dim * 2
        values = spec.block_size * (spec.head_dim // 2 + 2 * 2)
        return spec.num_kv_heads * (keys + values)

    def allocate(self, spec, num_blocks, device):
        if spec.head_dim % 2:
            raise ValueError(f"int4 KV cache needs an even head_dim, got {spec.head_dim}")
        lead = (spec.num_kv_heads, num_blocks)
        half = spec.head_dim // 2
        return {
            "key": torch.zeros((*lead, spec.block_size, half), dtype=torch.uint8, device=device),
            "key_params": torch.zeros((*lead, 2, spec.head_dim), dtype=torch.float16, device=device),
            "value": torch.zeros((*lead, spec.block_size, half), dtype=torch.uint8, device=device),
            "value_params": torch.zeros((*lead, spec.block_size, 2), dtype=torch.float16, device=device),
        }

    def write(self, pool, key, value, slot_mapping):
        self._write_keys(pool["key"], pool["key_params"], key, slot_mapping)
        write_token_groups(pool["value"], pool["value_params"], value, slot_mapping)

    def gather(self, pool, block_ids, batch, dtype):
        packed, params = pool["key"], pool["key_params"]
        heads, _, block_size, half = packed.shape
        count = block_ids.shape[0]
        picked = self.scratch.get("key_packed", (heads, count, block_size, half), packed.dtype, packed.device)
        gather_blocks(packed, block_ids, batch, picked)
        picked_params = self.scratch.get("key_params", (heads, count, *params.shape[2:]), params.dtype,
                                         params.device)
        gather_blocks(params, block_ids, batch, picked_params)  # [H, N, 2, D]
        keys = unpack_int4_into(picked, self.scratch.get("key_codes", (heads, count, block_size, 2 * half), dtype,
                                                         packed.device))
        keys = dequantize_(keys, picked_params[:, :, :1], picked_params[:, :, 1:])
        codes, value_params = gather_token_groups(pool["value"], pool["value_params"], block_ids, batch, dtype,
                                                  self.scratch, "value_")
        values = dequantize_(codes, value_params[..., :1], value_params[..., 1:])
        return keys.view(heads, batch, -1, 2 * half), values

    def _write_keys(self, packed: torch.Tensor, params: torch.Tensor, new: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
        heads, _, block_size, half = packed.shape
        write = BlockWrite.from_slots(slot_mapping, block_size)
        new = new.float()
        new_low = write.per_block(new, "amin", torch.inf).transpose(0, 1)  # [H, U, D]
        new_high = write.per_block(new, "amax", -torch.inf).transpose(0, 1)
        old = torch.index_select(params, 1, write.touched)  # [H, U, 2, D]
        old_scale, old_zero = old[:, :, 0], old[:, :, 1]
        old_low = old_zero.float()
        old_high = old_low + LEVELS * old_scale.float()
        continuing = write.continuing[None, :, None]
        low = torch.where(continuing, torch.minimum(old_low, new_low), new_low)
        high = torch.where(continuing, torch.maximum(old_high, new_high), new_high)
        scale, zero = affine_params(low, high)
        grown = ((new_low < old_low) | (new_high > old_high)).any(-1).any(0)  # [U]
        regrow = write.continuing & grown
        keep = (write.continuing & ~grown)[None, :, None]
        scale = torch.where(keep, old_scale, scale)
        zero = torch.where(keep, old_zero, zero)
        if regrow.any():
            ids = write.touched[regrow]
            was = unpack_int4(torch.index_select(packed, 1, ids)).float()  # [H, R, bs, D]
            was = was * old_scale[:, regrow, None].float() + old_low[:, regrow, None]
            packed.index_copy_(1, ids, pack_int4(quantize(was, scale[:, regrow, None], zero[:, regrow, None])))
        params.index_copy_(1, write.touched, torch.stack((scale, zero), dim=2))
        tokens = new.transpose(0, 1)  # [H, T, D]
        codes = quantize(tokens, scale[:, write.inverse], zero[:, write.inverse])
        packed.view(heads, -1, half).index_copy_(1, slot_mapping, pack_int4(codes))
