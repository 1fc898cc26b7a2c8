"""The attention backend interface: what every way of computing paged attention provides.

A backend is chosen once at start-up (registry.py, `--attention-backend`) for one configuration
(`BackendConfig`: device, KV format, query dtype, pool shape). It declares whether it can serve
that configuration (`unsupported`), builds each step's metadata from the runner's plain
`StepSequence` data (`build`), and computes attention for the packed batch: it writes the step's
new K/V into the pool and attends decodes and prefill chunks, prefix hits included (`attend`).

The model's attention layer stops at its packed q, k, v heads and hands them over with the
tokens' RoPE tables (`forward`), so that a backend may rotate keys as it stores them; RoPE, the
key transforms a KV format asks for (centering, a fitted key basis: engine/key_centering.py,
engine/key_basis.py) and the unrotated keys of sequences under KV eviction are applied here,
once, for every backend. The same split as vLLM's `AttentionBackend` / `AttentionImpl`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvserve.cache.kv_cache import KVCacheSpec, KVFormat
from kvserve.fixed_order import fixed_order_matmul
from kvserve.model.attention.metadata import AttentionMetadata, StepSequence
from kvserve.model.rope import RotaryEmbedding, apply_rotary
from kvserve.transfers import host_to_device

if TYPE_CHECKING:
    from kvserve.cache.kv_cache import KVCache
    from kvserve.model.llama import Attention


@dataclass(frozen=True)
class BackendConfig:
    """What a backend is asked to serve."""

    kv_format: KVFormat
    spec: KVCacheSpec
    query_dtype: torch.dtype
    rope: RotaryEmbedding
    device: torch.device
    # --deterministic: every query row attended by one kernel in one reduction order over its
    # context (prefill rows as decode rows), whatever the batch, chunking or prefix hits.
    deterministic: bool = False


class AttentionBackend:
    """One way of computing paged attention. Subclasses set `name`, say what they cannot serve
    (`unsupported`) and implement `build` and `attend`."""

    name: str = "abstract"
    # Device types on which `--attention-backend auto` considers this backend (None: any).
    auto_devices: tuple[str, ...] | None = None
    # Whether `build` hands the CPU lean decode step (lean_decode.py) an in-place decode reader.
    reads_decodes_in_place: bool = False
    # Whether `graph_metadata` works: decodes read from fixed-shape inputs (CUDA graphs).
    captures_decodes: bool = False

    def __init__(self, config: BackendConfig):
        self.config = config
        self.spec = config.spec
        self.rope = config.rope
        self.device = config.device

    @classmethod
    def unsupported(cls, config: BackendConfig) -> str | None:
        """Why this backend cannot serve `config` (one line), or None when it can."""
        return None

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def description(self) -> str:
        """What the start-up log says runs attention."""
        return self.name

    def for_spec(self, spec: KVCacheSpec) -> AttentionBackend:
        """The same backend over a pool of another shape (calibration's full-model scratch pool)."""
        return type(self)(replace(self.config, spec=spec))

    def build(self, sequences: list[StepSequence], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """The step's metadata; `sequences` in packed order (metadata.packing_order)."""
        raise NotImplementedError

    def graph_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       max_seq_len: int) -> AttentionMetadata:
        """The metadata of a step whose every row is a plain decode, over fixed-shape device
        tensors (slots [B], block tables [B, W], seq_lens [B]) and a context bound fixed in
        advance, with nothing computed on the host: what a CUDA graph can replay with new values
        in the same tensors (engine/decode_graphs.py). Backends with `captures_decodes` only."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run decodes in a CUDA graph")

    def decode_scratch_bytes(self, rows: int, query_heads: int, max_seq_len: int) -> int:
        """At most how much device memory a decode of `rows` sequences of up to `max_seq_len`
        tokens allocates for itself (the Triton kernels' split partial sums), for the CUDA
        profiling pass, whose prefill step does not decode (engine/pool_sizing.py). 0 by default."""
        return 0

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool: dict[str, torch.Tensor],
               kv_format: KVFormat, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
        """Write key/value [tokens, kv_heads, d] at `meta.slot_mapping`, then attend: query
        [tokens, heads, d] -> [tokens, heads * d], rows in packed order."""
        raise NotImplementedError

    def forward(self, layer: Attention, heads: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """A decoder layer's attention from its packed q/k/v heads [tokens, heads + 2 kv_heads, d]
        and the tokens' RoPE tables: q and k rotated (one launch with the CUDA fused ops), the
        layer's key transforms, the keys stored before RoPE for sequences under eviction, then
        `attend` over the layer's pool. A backend may override it to rotate the keys as it stores
        them (the Triton backend's `rope_store`)."""
        q_heads, kv_heads = layer.num_heads, layer.num_kv_heads
        rotate = apply_rotary if layer.fused is None else layer.fused.rotary
        query, key = rotate(heads[:, : q_heads + kv_heads], *rope).split((q_heads, kv_heads), dim=1)
        value, key_before_rope = heads[:, q_heads + kv_heads:], heads[:, q_heads: q_heads + kv_heads]
        query, key = layer_keys(layer, query, key, key_before_rope, meta.unrotated_key_rows,
                                self.config.deterministic)
        return self.attend(query, key, value, kv_cache.layers[layer.layer_idx], kv_cache.format, meta, layer.window)

    def _tensor(self, array: np.ndarray | list[int]) -> torch.Tensor:
        return host_to_device(array, self.device)


def layer_keys(layer: Attention, query: torch.Tensor, key: torch.Tensor, key_before_rope: torch.Tensor,
               unrotated_rows: torch.Tensor | None, fixed_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the pool stores and scores them: keys minus the layer's centre, in its fitted
    basis (the queries in the dual basis), and for the packed rows of sequences under KV
    eviction the keys before RoPE (with their queries left in the plain basis)."""
    if layer.key_center is not None:
        key = key - layer.key_center
    plain_query = query
    if layer.key_basis is not None:
        query, key = change_key_basis(query, key, *layer.key_basis, fixed_order=fixed_order)
    if unrotated_rows is not None:
        key = key.index_copy(0, unrotated_rows, key_before_rope[unrotated_rows].to(key.dtype))
        if layer.key_basis is not None:
            query = query.index_copy(0, unrotated_rows, plain_query[unrotated_rows])
    return query, key


def change_key_basis(query: torch.Tensor, key: torch.Tensor, key_transform: torch.Tensor,
                     query_transform: torch.Tensor, fixed_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, d] -> q·T^-T and k [tokens, kv_heads, d] -> k·T, per KV head, as one
    float32 bmm each over [kv_heads, rows, d] (on CPU faster than einsum or bfloat16); with
    `fixed_order` (--deterministic) one fixed-order matmul per KV head instead."""
    tokens, kv_heads, dim = key.shape
    if fixed_order:
        q_heads = query.float().view(tokens, kv_heads, -1, dim)
        q_new = torch.stack([fixed_order_matmul(q_heads[:, h], query_transform[h]) for h in range(kv_heads)], 1)
        k_new = torch.stack([fixed_order_matmul(key[:, h].float(), key_transform[h]) for h in range(kv_heads)], 1)
        return q_new.reshape(query.shape).to(query.dtype), k_new
    grouped = query.float().view(tokens, kv_heads, -1, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
    q_new = torch.bmm(grouped, query_transform).view(kv_heads, tokens, -1, dim).transpose(0, 1)
    k_new = torch.bmm(key.float().transpose(0, 1), key_transform).transpose(0, 1)
    # The keys stay float32: the format rounds them once, from float32, as they are stored.
    return q_new.reshape(query.shape).to(query.dtype), k_new
