"""The physical KV pool: one preallocated set of tensors per layer, addressed by block id.

Layout of one layer's pool (full precision)::

    key[kv_head, block, offset, head_dim]      value[kv_head, block, offset, head_dim]

KV heads lead so that gathering a batch's blocks (`index_select` on dim 1) directly yields
[kv_head, batch, tokens, head_dim], the operand shape of the grouped attention matmul, with no
permute copy. A token's *slot* is `block * block_size + offset`; writes scatter by slot, reads
gather through block tables (the PagedAttention contract, Kwon et al. 2023).

How values are stored (full precision, fp8, int8, int4...) is a `KVFormat` (one module each under
`kvserve/cache/formats/`); the pool only sizes
and owns the tensors. Any per-block scales a format needs live in the same per-layer dict and
are indexed by the same block ids, so they are allocated, shared and freed with their blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.fixed_order import fixed_order_matmul
from kvserve.transfers import host_to_device


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape facts that determine the size of a block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass
class ScaledKV:
    """Gathered K and V as codes in the compute dtype plus per-token factors, for a decode step to
    apply to its [queries x tokens] scores and probabilities (head_dim / queries-per-KV-head times
    fewer values than K and V) instead of dequantizing every gathered value first::

        K[h, b, t, :] = key[h, b, t, :] * key_scale[h, b, t] + key_zero[h, b, t]     (V likewise)
    """

    key: torch.Tensor  # [kv_heads, batch, tokens, head_dim], compute dtype
    value: torch.Tensor
    key_scale: torch.Tensor  # [kv_heads, batch, tokens], float32
    value_scale: torch.Tensor
    key_zero: torch.Tensor | None = None  # None: symmetric codes
    value_zero: torch.Tensor | None = None


@dataclass(frozen=True)
class InPlaceLayout:
    """How a decode kernel may read a format's pool in place (the model picks the kernel):

    * "float": K/V as they are, in the queries' dtype, in pool["kv"] [2 * kv_heads, blocks, block_size, d];
    * "codes": 1-byte codes in pool["kv"] with one scale per token in pool["kv_scale"]; fp8 bits
      when `fp8_multiplier` > 0 (widened by multiply and mask, times `fp8_unit`), else int8;
    * "int4": two codes a byte in pool["kv"] with a float16 (scale, zero) per token in pool["kv_params"].
    """

    kind: str
    fp8_multiplier: int = 0
    fp8_mask: int = 0
    fp8_unit: float = 1.0


class KVFormat:
    """How K/V values are stored in the pool: sizes, allocation, writes and reads. Subclasses
    implement one storage dtype each; how attention consumes the pool is the model's business
    (model/attention/), which asks `in_place_layout` whether a kernel can read it directly."""

    name: str = "abstract"
    value_bits: int  # bits per cached K or V value, scales not counted (the planner's formula)
    # True when every pool tensor holds one row per token slot ([heads, blocks, block_size, ...]),
    # so a token moves (eviction's compaction) by copying its rows bit for bit.
    copies_token_rows: bool = True
    # Store keys minus a per-(layer, KV head) constant calibrated at start-up (engine/key_centering.py).
    center_keys: bool = False
    # Store keys in a basis fitted at start-up to the format's relative rounding (engine/key_basis.py).
    fit_key_basis: bool = False
    # --deterministic: rotations multiply each row in one fixed order, whatever the row count.
    fixed_order: bool = False

    def bytes_per_block(self, spec: KVCacheSpec) -> int:
        """Bytes one block takes in one layer, K and V and any scales included."""
        raise NotImplementedError

    def allocate(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def write(self, pool: dict[str, torch.Tensor], key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store key/value [tokens, kv_heads, head_dim] at the given slots."""
        raise NotImplementedError

    def gather(self, pool: dict[str, torch.Tensor], block_ids: torch.Tensor, batch: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the flattened block tables `block_ids` [batch * blocks_per_seq], as
        [kv_heads, batch, blocks_per_seq * block_size, head_dim] in the compute dtype."""
        raise NotImplementedError

    def gather_scaled(self, pool: dict[str, torch.Tensor], block_ids: torch.Tensor, batch: int,
                      dtype: torch.dtype) -> ScaledKV | None:
        """Like `gather`, but leaves per-token scales (and zero-points) for the attention to apply;
        None (the default) when the format has no per-token factors."""
        return None

    def in_place_layout(self, query_dtype: torch.dtype) -> InPlaceLayout | None:
        """The layout a decode kernel reads in place for queries of `query_dtype`; None (the
        default): attention gathers through `gather`/`gather_scaled`."""
        return None

    def rotation(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """An orthogonal [head_dim, head_dim] matrix R if the format stores K·R and V·R instead of
        K and V (so `gather` returns them rotated); the attention then scores q·R against the keys
        and multiplies its output by R^T. None (the default): K and V are stored as given."""
        return None

    def rotate_rows(self, x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """x @ matrix (the rotation or its transpose), in x's dtype; under `fixed_order` each row's
        sums in one order whatever the row count (kvserve/fixed_order.py)."""
        return fixed_order_matmul(x, matrix) if self.fixed_order else x @ matrix


class Scratch:
    """Grow-only buffers reused by every layer's gather. A fresh multi-MB tensor per layer costs
    more in allocation and page faults than the copy itself on CPU; a view of a
    buffer returned here is valid until the next request for the same name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, batch: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """[kv_heads, blocks, block_size, ...] -> [kv_heads, batch, tokens, ...] for flat block ids,
    into `out` ([kv_heads, len(block_ids), block_size, ...]) when given.

    Rows of the 2-D view [kv_heads * blocks, block bytes] are gathered: index_select on dim 0 of
    a 2-D tensor is a plain row copy, faster than selecting along dim 1."""
    heads, num_blocks = cache.shape[:2]
    rows = (torch.arange(heads, device=block_ids.device)[:, None] * num_blocks + block_ids).view(-1)
    flat = cache.view(heads * num_blocks, -1)
    if out is not None:
        picked = torch.index_select(flat, 0, rows, out=out.view(rows.shape[0], -1))
    else:
        picked = torch.index_select(flat, 0, rows)
    return picked.view(heads, batch, -1, *cache.shape[3:])


class KVCache:
    """All layers' pools, allocated once at start-up and never resized. `num_blocks` is the blocks
    the pool hands out (ids 1..num_blocks), the null block not counted."""

    def __init__(self, spec: KVCacheSpec, kv_format: KVFormat, num_blocks: int, device: torch.device):
        self.spec = spec
        self.format = kv_format
        self.num_blocks = num_blocks
        self.device = device
        # One block more than the pool hands out: block_pool.NULL_BLOCK_ID, never allocated or
        # written, where padded block-table entries point.
        self.layers = [kv_format.allocate(spec, num_blocks + 1, device) for _ in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        """Real bytes held by the pool tensors (scales included)."""
        return sum(t.nbytes for layer in self.layers for t in layer.values())

    # ------------------------------------------------------------------ whole blocks as bytes
    # Every pool tensor of every format is [heads, blocks, ...]: a block's codes and scales are the
    # dim-1 slices of each tensor of each layer. The tiers (kvserve/cache/tiers) store exactly those
    # bytes, so any KV dtype round-trips bit for bit.

    def _block_parts(self) -> list[tuple[torch.Tensor, int]]:
        """(tensor, bytes of one block in it) for every layer and tensor, in a fixed order."""
        parts = []
        for layer in self.layers:
            for _, t in sorted(layer.items()):
                raw = t.view(torch.uint8)  # index ops on bytes: not every storage dtype has them
                parts.append((raw, raw[:, 0].numel()))
        return parts

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers: codes and scales together."""
        return sum(nbytes for _, nbytes in self._block_parts())

    def layout_signature(self) -> str:
        """Names, dtypes and per-block shapes of every pool tensor: what a block's bytes mean."""
        layer = self.layers[0]
        parts = [f"{name}:{str(t.dtype).removeprefix('torch.')}:{tuple(t.shape[:1] + t.shape[2:])}"
                 for name, t in sorted(layer.items())]
        return f"{self.spec.num_layers}x[{','.join(parts)}]"

    def read_blocks(self, block_ids: list[int], out_device: torch.device | None = None) -> torch.Tensor:
        """The bytes of `block_ids` as a uint8 tensor [len(block_ids), block_nbytes] on
        `out_device` (default: the pool's device)."""
        ids = host_to_device(block_ids, self.device)
        n = len(block_ids)
        parts = self._block_parts()
        data = torch.empty(n, sum(nbytes for _, nbytes in parts), dtype=torch.uint8, device=self.device)
        offset = 0
        for t, nbytes in parts:
            picked = t.index_select(1, ids).movedim(1, 0)  # [n, heads, ...]
            data[:, offset:offset + nbytes].view(n, t.shape[0], -1).copy_(picked.reshape(n, t.shape[0], -1))
            offset += nbytes
        return data if out_device is None else data.to(out_device, non_blocking=True)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Store `data` [len(block_ids), block_nbytes] (uint8, any device) into `block_ids`."""
        ids = host_to_device(block_ids, self.device)
        n = len(block_ids)
        data = data.to(self.device, non_blocking=True)
        offset = 0
        for t, nbytes in self._block_parts():
            part = data[:, offset:offset + nbytes]
            t.index_copy_(1, ids, part.view(n, t.shape[0], *t.shape[2:]).movedim(0, 1))
            offset += nbytes
