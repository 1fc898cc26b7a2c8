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
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvserve.model.cpu_attention import PagedDecodeKernel


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


class KVFormat:
    """How K/V values are stored in the pool. Subclasses implement one storage dtype each."""

    name: str = "abstract"
    # Store keys minus a per-(layer, KV head) constant calibrated at start-up (engine/key_centering.py).
    center_keys: bool = False
    # Store keys in a basis fitted at start-up to the format's relative rounding (engine/key_basis.py).
    fit_key_basis: bool = False

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

    # The CPU paged decode kernel (model/cpu_attention.py) when the format's decodes use it.
    decode_kernel: "PagedDecodeKernel | None" = None

    @property
    def reads_decodes_in_place(self) -> bool:
        """True when `attend_decode` serves every decode (no gather, so no padding to minimise)."""
        return self.decode_kernel is not None

    def attend_decode(self, pool: dict[str, torch.Tensor], query: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, window: int | None) -> torch.Tensor | None:
        """Decode attention read in place from the pool by `decode_kernel`: query [batch, heads, d]
        (one token per request, already written), block tables [batch, width], seq_lens [batch]
        -> [batch, heads, d]. None (the default) when the format has no kernel; the caller then
        gathers."""
        return None

    def rotation(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """An orthogonal [head_dim, head_dim] matrix R if the format stores K·R and V·R instead of
        K and V (so `gather` returns them rotated); the attention then scores q·R against the keys
        and multiplies its output by R^T. None (the default): K and V are stored as given."""
        return None


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
    """All layers' pools, allocated once at start-up and never resized."""

    def __init__(self, spec: KVCacheSpec, kv_format: KVFormat, num_blocks: int, device: torch.device):
        self.spec = spec
        self.format = kv_format
        self.num_blocks = num_blocks
        self.device = device
        self.layers = [kv_format.allocate(spec, num_blocks, device) for _ in range(spec.num_layers)]

    @property
    def nbytes(self) -> int:
        """Real bytes held by the pool tensors (scales included)."""
        return sum(t.nbytes for layer in self.layers for t in layer.values())
