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
    """Requests of one kind (decode or prefill), padded to a common query and context length.

    The runner packs decodes first, then prefills, so each group's queries occupy one run of
    rows starting at `row_offset`. Without padding (all decodes, or a single prefill chunk) the
    group reads and writes that run as a view; otherwise it gathers and scatters by `query_rows`.
    """

    row_offset: int
    query_rows: torch.Tensor  # [requests, max_queries] rows of the packed batch (padding repeats a row)
    query_valid: torch.Tensor  # [requests, max_queries] bool
    query_positions: torch.Tensor  # [requests, max_queries] position of each query in its sequence
    block_ids: torch.Tensor  # [requests * blocks_per_seq] flattened, padded block tables
    seq_lens: torch.Tensor  # [requests] context length after this step's tokens are written
    context_len: int  # blocks_per_seq * block_size
    padded: bool  # some requests have fewer queries than max_queries
    _masks: dict[tuple[int | None, bool], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return self.query_rows.shape[0]

    @property
    def num_rows(self) -> int:
        return self.query_rows.numel()

    def mask(self, window: int | None) -> torch.Tensor:
        """[requests, max_queries, context] bool, True where a query may attend. Built once per
        step for each distinct sliding window and shared by all layers."""
        key = (window, False)
        if key not in self._masks:
            kv_pos = torch.arange(self.context_len, device=self.seq_lens.device)
            q_pos = self.query_positions.unsqueeze(-1)
            allowed = (kv_pos <= q_pos) & (kv_pos < self.seq_lens[:, None, None])
            if window is not None:
                allowed &= kv_pos > q_pos - window
            # Padded queries see position 0 so that no softmax row is empty (their output is dropped).
            allowed[..., 0] |= ~self.query_valid
            self._masks[key] = allowed
        return self._masks[key]

    def mask_bias(self, window: int | None) -> torch.Tensor:
        """The same mask as float32 0 / -inf, to add to scores in one op."""
        key = (window, True)
        if key not in self._masks:
            bias = torch.zeros(self.mask(window).shape, dtype=torch.float32, device=self.seq_lens.device)
            self._masks[key] = bias.masked_fill_(~self.mask(window), float("-inf"))
        return self._masks[key]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] pool slot of each packed token
    decode: AttentionGroup | None
    prefill: AttentionGroup | None


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool: dict,
                    kv_format: KVFormat, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """query [tokens, heads, d], key/value [tokens, kv_heads, d] -> [tokens, heads * d]."""
    kv_format.write(pool, key, value, meta.slot_mapping)
    rotation = kv_format.rotation(query.shape[-1], query.dtype, query.device)
    if rotation is not None:  # the pool holds K·R and V·R: (qR)·(kR) = q·k
        query = query @ rotation
    tokens, heads, dim = query.shape
    groups = [(g, attend) for g, attend in ((meta.decode, _decode_attention), (meta.prefill, _prefill_attention))
              if g is not None]
    out = None if len(groups) == 1 and not groups[0][0].padded else torch.empty_like(query)
    for group, attend in groups:
        k_ctx, v_ctx = kv_format.gather(pool, group.block_ids, group.num_requests, query.dtype)
        start, stop = group.row_offset, group.row_offset + group.num_rows
        if group.padded:
            result = attend(query[group.query_rows], k_ctx, v_ctx, group, window)
            out[group.query_rows[group.query_valid]] = result[group.query_valid]
        else:
            q = query[start:stop].view(group.num_requests, -1, heads, dim)
            result = attend(q, k_ctx, v_ctx, group, window).reshape(stop - start, heads, dim)
            if out is None:
                out = result
            else:
                out[start:stop] = result
    if rotation is not None:  # probs·(VR)·R^T = probs·V
        out = out @ rotation.T
    return out.reshape(tokens, heads * dim)


def _decode_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, group: AttentionGroup,
                      window: int | None) -> torch.Tensor:
    """q [B, 1, H, d]; k/v [kvh, B, L, d] -> [B, 1, H, d]."""
    batch, _, heads, dim = q.shape
    kv_heads = k_ctx.shape[0]
    # [B, H, d] -> [kvh, B, H/kvh, d]: the query heads that share a KV head form one matmul.
    q = q.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(q, k_ctx.transpose(-1, -2)).float().mul_(1.0 / math.sqrt(dim))
    probs = torch.softmax(scores.add_(group.mask_bias(window)), dim=-1).to(v_ctx.dtype)
    out = torch.matmul(probs, v_ctx)  # [kvh, B, group, d]
    return out.transpose(0, 1).reshape(batch, 1, heads, dim)


def _prefill_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, group: AttentionGroup,
                       window: int | None) -> torch.Tensor:
    """q [B, Q, H, d]; k/v [kvh, B, L, d] -> [B, Q, H, d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_ctx.transpose(0, 1), v_ctx.transpose(0, 1),
        attn_mask=group.mask(window).unsqueeze(1), enable_gqa=True,
    )
    return out.transpose(1, 2)
