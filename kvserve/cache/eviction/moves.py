"""Carrying out a compaction's token copies on the pool tensors, in every layer.

A format whose every pool tensor holds one row per token slot (`KVFormat.copies_token_rows`:
full precision, int4, per-token-scaled fp8/int8) is copied row by row, bit for bit. Otherwise
(a scale or range shared by the tokens of a block, e.g. int4_kivi's per-channel key ranges) the
tokens are read back through the format (dequantized, un-rotated) and written again at their
destination, which re-quantizes them once with the destination block's range.
Every read of a layer happens before any write, so sources and destinations may overlap.
"""
from __future__ import annotations

import torch

from kvserve.cache.kv_cache import KVCache, KVFormat

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.inference_mode()  # like the forward pass: the formats' scratch buffers are inference tensors
def move_tokens(kv_cache: KVCache, src_slots: list[int], dst_slots: list[int]) -> None:
    if not src_slots:
        return
    device = next(iter(kv_cache.layers[0].values())).device
    src = torch.tensor(src_slots, dtype=torch.long, device=device)
    dst = torch.tensor(dst_slots, dtype=torch.long, device=device)
    block_size = kv_cache.spec.block_size
    for pool in kv_cache.layers:
        if kv_cache.format.copies_token_rows:
            for tensor in pool.values():
                # Integer view: index_select/index_copy_ do not take float8 on every device.
                as_int = tensor.view(_INT_OF_SIZE[tensor.element_size()])
                rows = as_int.view(tensor.shape[0], tensor.shape[1] * block_size, -1)
                rows.index_copy_(1, dst, rows.index_select(1, src))
        else:
            key, value = read_slots(kv_cache.format, pool, src, block_size)
            kv_cache.format.write(pool, key, value, dst)


def read_slots(kv_format: KVFormat, pool: dict[str, torch.Tensor], slots: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V [tokens, kv_heads, head_dim] stored at `slots`, as they were given to
    `write` (the format's rotation undone)."""
    blocks, offsets = slots // block_size, slots % block_size
    unique, inverse = torch.unique(blocks, return_inverse=True)
    rows = inverse * block_size + offsets
    key, value = kv_format.gather(pool, unique, 1, torch.float32)  # [kv_heads, 1, blocks * bs, d]
    key, value = key[:, 0, rows].transpose(0, 1), value[:, 0, rows].transpose(0, 1)
    rotation = kv_format.rotation(key.shape[-1], torch.float32, key.device)
    if rotation is not None:  # the pool holds K·R: (K·R)·R^T = K
        key, value = kv_format.rotate_rows(key, rotation.T), kv_format.rotate_rows(value, rotation.T)
    return key, value
