"""Paged attention over a packed batch of mixed decode and prefill tokens.

The runner packs every scheduled token of every request into one flat batch (no padding in the
linear layers). Attention then needs, per request: where its new K/V go (`slot_mapping`), which
physical blocks hold its context (`block_tables`), how many tokens its context has (`seq_lens`)
and which packed rows are its queries. Requests are split in two groups, each vectorised over
its requests with padding and a mask:

* decode (one query each): grouped-query matmuls, queries of a KV head batched together,
  softmax in float32. On CPU this is ~10x faster than SDPA with a length-1 query.
* prefill chunks (several queries each): `scaled_dot_product_attention` with a mask, whose fused
  kernels avoid materialising [queries x context] scores.

New K/V are written into the pool before the context is gathered, so a chunk attends to itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.cache.kv_cache import KVFormat


@dataclass
class AttentionGroup:
    """Requests of one kind (decode or prefill), padded to a common query and context length."""

    query_rows: torch.Tensor  # [requests, max_queries] rows of the packed batch (padding repeats a row)
    query_valid: torch.Tensor  # [requests, max_queries] bool
    query_positions: torch.Tensor  # [requests, max_queries] position of each query in its sequence
    block_ids: torch.Tensor  # [requests * blocks_per_seq] flattened, padded block tables
    seq_lens: torch.Tensor  # [requests] context length after this step's tokens are written
    context_len: int  # blocks_per_seq * block_size
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return self.query_rows.shape[0]

    def mask(self, window: int | None) -> torch.Tensor:
        """[requests, max_queries, context] True where a query may attend. Built once per step
        for each distinct sliding window and shared by all layers."""
        if window not in self._masks:
            kv_pos = torch.arange(self.context_len, device=self.seq_lens.device)
            q_pos = self.query_positions.unsqueeze(-1)
            allowed = (kv_pos <= q_pos) & (kv_pos < self.seq_lens[:, None, None])
            if window is not None:
                allowed &= kv_pos > q_pos - window
            # Padded queries see position 0 so that no softmax row is empty (their output is dropped).
            allowed[..., 0] |= ~self.query_valid
            self._masks[window] = allowed
        return self._masks[window]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] pool slot of each packed token
    decode: AttentionGroup | None
    prefill: AttentionGroup | None


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool: dict,
                    kv_format: KVFormat, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """query [tokens, heads, d], key/value [tokens, kv_heads, d] -> [tokens, heads * d]."""
    kv_format.write(pool, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    for group, attend in ((meta.decode, _decode_attention), (meta.prefill, _prefill_attention)):
        if group is None:
            continue
        k_ctx, v_ctx = kv_format.gather(pool, group.block_ids, group.num_requests, query.dtype)
        q = query[group.query_rows]  # [requests, max_queries, heads, d]
        result = attend(q, k_ctx, v_ctx, group.mask(window))
        out[group.query_rows[group.query_valid]] = result[group.query_valid]
    return out.flatten(1)


def _decode_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """q [B, 1, H, d]; k/v [kvh, B, L, d]; mask [B, 1, L] -> [B, 1, H, d]."""
    batch, _, heads, dim = q.shape
    kv_heads = k_ctx.shape[0]
    group = heads // kv_heads
    # [B, H, d] -> [kvh, B, group, d]: the query heads that share a KV head form one matmul.
    q = q.view(batch, kv_heads, group, dim).transpose(0, 1)
    scores = torch.matmul(q, k_ctx.transpose(-1, -2)).float() * (1.0 / math.sqrt(dim))
    scores.masked_fill_(~mask.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_ctx.dtype)
    out = torch.matmul(probs, v_ctx)  # [kvh, B, group, d]
    return out.transpose(0, 1).reshape(batch, 1, heads, dim)


def _prefill_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """q [B, Q, H, d]; k/v [kvh, B, L, d]; mask [B, Q, L] -> [B, Q, H, d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_ctx.transpose(0, 1), v_ctx.transpose(0, 1),
        attn_mask=mask.unsqueeze(1), enable_gqa=True,
    )
    return out.transpose(1, 2)
