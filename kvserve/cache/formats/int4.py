"""int4 KV cache: asymmetric 4-bit codes, two per byte, with one float16 scale and zero-point
per token and KV head (a group of head_dim values).

Layout of one layer's pool (keys in the first kv_heads rows, values in the next kv_heads)::

    kv         [2 * kv_head, block, offset, head_dim // 2]   uint8, two codes per byte
    kv_params  [2 * kv_head, block, offset, 2]               float16 (scale, zero)

A byte holds the codes of channels j (low nibble) and j + head_dim/2 (high nibble), so
unpacking is two bitwise ops and a concatenation, no interleave. value = code * scale + zero,
code in [0, 15]; zero is the group's minimum rounded down to float16 and scale is rounded up,
so the group's whole range is covered and nothing clips. Per-token groups are quantized once,
when the token is written, so a block filling over many steps needs no re-encoding.

Bytes per token and KV head: head_dim / 2 + 4, i.e. 36 for head_dim 64 against 128 in float16:
3.56x the tokens. Keys are centred (engine/key_centering.py) and K and V rotated (rotation.py) first:
keys have outlier channels that would otherwise take most of each token's 16 levels. Per-token groups are the layout of KIVI's values and of most int4 KV caches
(e.g. the "per-token asymmetric" scheme in Liu et al. 2024, KIVI, arXiv:2402.02750); the
`int4_kivi` format quantizes keys per channel instead.
"""
from __future__ import annotations

import torch

from kvserve.cache.formats.rotation import hadamard_rotation
from kvserve.cache.kv_cache import InPlaceLayout, KVCacheSpec, KVFormat, ScaledKV, Scratch, gather_blocks

LEVELS = 15  # the largest 4-bit code
_FP16_MAX = 65504.0
_MIN_SCALE = 1e-12  # divide by this instead of a zero scale (a constant group encodes as all zeros)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], [..., D] -> [..., D/2]: byte j = codes[j] | codes[j + D/2] << 4."""
    low, high = codes.chunk(2, dim=-1)
    return low | (high << 4)


def unpack_int4_into(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The codes of `packed` [..., D/2] as numbers in `out` [..., D] (any dtype): one copy into
    each half of the output, no concatenation."""
    half = packed.shape[-1]
    out[..., :half].copy_(packed & 0xF)
    out[..., half:].copy_(packed >> 4)
    return out


def dequantize_(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """codes * scale + zero in place (scale/zero broadcastable, cast to the codes' dtype)."""
    # mul_ then add_: a fused addcmul with operands broadcast along the last dim is slower on CPU.
    return codes.mul_(scale.to(codes.dtype)).add_(zero.to(codes.dtype))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: [..., D/2] -> uint8 codes [..., D]."""
    return torch.cat((packed & 0xF, packed >> 4), dim=-1)


def affine_params(low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (scale, zero) such that zero <= low and zero + 15 * scale >= high."""
    low = low.clamp(-_FP16_MAX, _FP16_MAX)
    high = high.clamp(-_FP16_MAX, _FP16_MAX)
    zero = low.to(torch.float16)
    zero = torch.where(zero.float() > low, torch.nextafter(zero, zero.new_tensor(-torch.inf)), zero)
    scale = ((high - zero.float()) / LEVELS).to(torch.float16)
    scale = torch.where(scale.float() * LEVELS + zero.float() < high,
                        torch.nextafter(scale, scale.new_tensor(torch.inf)), scale)
    return scale, zero


def quantize(values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float values and broadcastable float16 scale/zero -> uint8 codes in [0, 15]."""
    codes = (values.float() - zero.float()) / scale.float().clamp_min(_MIN_SCALE)
    return codes.round_().clamp_(0, LEVELS).to(torch.uint8)


def write_token_groups(packed: torch.Tensor, params: torch.Tensor, new: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Quantize `new` [tokens, H, D] one (token, head) group at a time and store it at its slots."""
    heads, _, _, half = packed.shape
    new = new.float().transpose(0, 1)  # [H, tokens, D]
    scale, zero = affine_params(new.amin(-1, keepdim=True), new.amax(-1, keepdim=True))
    packed.view(heads, -1, half).index_copy_(1, slot_mapping, pack_int4(quantize(new, scale, zero)))
    params.view(heads, -1, 2).index_copy_(1, slot_mapping, torch.cat((scale, zero), dim=-1))


def gather_token_groups(packed: torch.Tensor, params: torch.Tensor, block_ids: torch.Tensor, batch: int,
                        dtype: torch.dtype, scratch: Scratch, prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The given blocks' codes as numbers in `dtype` [H, batch, tokens, D] and their float16
    (scale, zero) [H, batch, tokens, 2], in scratch buffers named after `prefix`."""
    heads, _, block_size, half = packed.shape
    rows = (heads, block_ids.shape[0], block_size)
    picked = gather_blocks(packed, block_ids, batch, scratch.get(prefix + "packed", (*rows, half), packed.dtype,
                                                                 packed.device))
    picked_params = gather_blocks(params, block_ids, batch, scratch.get(prefix + "params", (*rows, 2), params.dtype,
                                                                        params.device))
    codes = unpack_int4_into(picked, scratch.get(prefix + "codes", (*picked.shape[:-1], 2 * half), dtype,
                                                 packed.device))
    return codes, picked_params


class Int4Format(KVFormat):
    name = "int4"
    value_bits = 4
    center_keys = True  # the keys' shared offset would take most of a token's 16 levels

    def __init__(self, rotate: bool = True):
        self.rotate = rotate  # store K·H and V·H (rotation.py): outlier channels spread before quantizing
        self.scratch = Scratch()

    def rotation(self, head_dim, dtype, device):
        return hadamard_rotation(head_dim, dtype, device) if self.rotate else None

    def bytes_per_block(self, spec: KVCacheSpec) -> int:
        return 2 * spec.num_kv_heads * spec.block_size * (spec.head_dim // 2 + 2 * 2)

    def allocate(self, spec, num_blocks, device):
        if spec.head_dim % 2:
            raise ValueError(f"int4 KV cache needs an even head_dim, got {spec.head_dim}")
        lead = (2 * spec.num_kv_heads, num_blocks, spec.block_size)
        return {"kv": torch.zeros((*lead, spec.head_dim // 2), dtype=torch.uint8, device=device),
                "kv_params": torch.zeros((*lead, 2), dtype=torch.float16, device=device)}

    def write(self, pool, key, value, slot_mapping):
        new = torch.cat((key, value), dim=1).float()  # [tokens, 2 * kv_heads, head_dim]
        rotation = self.rotation(key.shape[-1], torch.float32, key.device)
        if rotation is not None:
            new = self.rotate_rows(new, rotation)
        write_token_groups(pool["kv"], pool["kv_params"], new, slot_mapping)

    def gather(self, pool, block_ids, batch, dtype):
        codes, params = gather_token_groups(pool["kv"], pool["kv_params"], block_ids, batch, dtype, self.scratch, "")
        values = dequantize_(codes, params[..., :1], params[..., 1:])
        heads = values.shape[0] // 2
        return values[:heads], values[heads:]

    def in_place_layout(self, query_dtype):
        return None if query_dtype == torch.float16 else InPlaceLayout("int4")

    def gather_scaled(self, pool, block_ids, batch, dtype):
        codes, params = gather_token_groups(pool["kv"], pool["kv_params"], block_ids, batch, dtype, self.scratch, "")
        scale, zero = params[..., 0].float(), params[..., 1].float()
        h = codes.shape[0] // 2
        return ScaledKV(codes[:h], codes[h:], scale[:h], scale[h:], zero[:h], zero[h:])
