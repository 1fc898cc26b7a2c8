"""Paged attention over a packed batch of mixed decode and prefill tokens.

The runner packs every scheduled token of every request into one flat batch (no padding in the
linear layers). Attention then needs, per request: where its new K/V go (`slot_mapping`), which
physical blocks hold its context (`block_tables`), how many tokens its context has (`seq_lens`)
and which packed rows are its queries. The runner packs decodes first, then prefill chunks;
the attention backend (attention_backend.py) builds this metadata.

* decodes (one query each): with a format that reads them in place (the CPU kernel,
  model/cpu_attention.py), one kernel call over all of them. Otherwise vectorised over the
  requests with padding and a mask:
  grouped-query matmuls, queries of a KV head batched together, softmax in float32: on CPU much
  faster than SDPA with a length-1 query. Decode time is mostly reading K/V (gather, then
  the matmuls), so the backend splits decodes of very different context lengths into a few groups
  padded separately (attention_backend.split_by_length). A group of one request needs no padding:
  its exact context goes to one SDPA call, the KV head's query heads as its query rows.
* prefill chunks (several queries each), one `scaled_dot_product_attention` call per chunk at
  its exact context length (a step holds only a few chunks; padding them to a common length and
  masking cost more on CPU), or one batched call for chunks of the same shape. A chunk with
  no earlier context is plain causal attention (`is_causal`, the fused kernel's fast path);
  otherwise its mask is causal aligned to the end of the context.

New K/V are written into the pool before the context is gathered, so a chunk attends to itself.

Sequences under KV eviction (kvserve/cache/eviction) store their keys before RoPE and take
their own paths: their decodes form a second decode group packed after the others, and their
gathered keys are rotated by cache index (`key_rope`). Their eviction policy may ask to observe
the attention probabilities of some of their query rows (`observed_attention`), summed over
layers and heads into tensors the runner hands in. Other requests never pay for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.cache.eviction.positions import rope_gathered_keys
from kvserve.cache.kv_cache import KVFormat, ScaledKV


@dataclass
class AttentionGroup:
    """The decode requests of a step (one query each), padded to a common context length. Their
    queries are the first rows of the packed batch."""

    block_ids: torch.Tensor  # [requests * blocks_per_seq] flattened, padded block tables
    seq_lens: torch.Tensor  # [requests] context length after this step's token is written
    context_len: int  # blocks_per_seq * block_size
    max_seq_len: int  # the longest of seq_lens (a group of one request: its exact length)
    # Evicting requests only: cos and signed sin [context_len, head_dim] to rotate their keys
    # (stored before RoPE) by cache index (positions.py); a [requests, context_len] float32
    # tensor that each layer adds its attention probabilities to, summed over query heads.
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    observed_attention: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    def mask_bias(self, window: int | None) -> torch.Tensor:
        """[requests, 1, context] float32, 0 where the query may attend and -inf elsewhere; built
        once per step for each distinct sliding window and shared by all layers."""
        if window not in self._masks:
            kv_pos = torch.arange(self.context_len, device=self.seq_lens.device)
            q_pos = (self.seq_lens - 1)[:, None]
            allowed = kv_pos < self.seq_lens[:, None]
            if window is not None:
                allowed &= kv_pos > q_pos - window
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
            self._masks[window] = bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1)
        return self._masks[window]


@dataclass
class ObservedAttention:
    """Where a chunk reports the attention of its queries [first, num_queries) (what a KV
    eviction policy observes): every layer adds their softmax probabilities, summed over query
    heads, into `rows` [num_queries - first, context_len], one row per query, or with `summed`
    into `rows` [1, context_len], summed over those queries too."""

    rows: torch.Tensor
    first: int = 0
    summed: bool = False


@dataclass
class PrefillChunk:
    """One request's chunk of several queries: packed rows [row_start, row_start + num_queries),
    attending to a context of `context_len` tokens (earlier ones and the chunk itself)."""

    row_start: int
    num_queries: int
    context_len: int
    block_ids: torch.Tensor  # [blocks] the request's block table
    # As in AttentionGroup, for a request under eviction.
    key_rope: tuple[torch.Tensor, torch.Tensor] | None = None
    observed_attention: ObservedAttention | None = None
    _masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict, repr=False)
    _biases: dict[tuple[int | None, torch.dtype], torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None) -> torch.Tensor | None:
        """[queries, context] bool, or None when the chunk is plain causal self-attention."""
        if window not in self._masks:
            start = self.context_len - self.num_queries
            if start == 0 and (window is None or window >= self.context_len):
                self._masks[window] = None
            else:
                device = self.block_ids.device
                q_pos = torch.arange(start, self.context_len, device=device)[:, None]
                kv_pos = torch.arange(self.context_len, device=device)
                allowed = kv_pos <= q_pos
                if window is not None:
                    allowed &= kv_pos > q_pos - window
                self._masks[window] = allowed
        return self._masks[window]

    def bias(self, window: int | None, dtype: torch.dtype) -> torch.Tensor | None:
        """`mask` as an additive [queries, context] tensor in `dtype` (0 or -inf): CPU SDPA runs
        faster with it than with the bool mask."""
        key = (window, dtype)
        if key not in self._biases:
            allowed = self.mask(window)
            self._biases[key] = None if allowed is None else torch.zeros(
                allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        return self._biases[key]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] pool slot of each packed token
    decodes: list[AttentionGroup]  # consecutive runs of the first rows
    prefills: list[PrefillChunk]
    evicting_decode: AttentionGroup | None = None  # decodes of evicting requests, right after `decodes`'
    unrotated_key_rows: torch.Tensor | None = None  # packed rows whose keys are stored before RoPE
    # Reads all of `decodes` in place (pool, queries [B, H, d], block tables [B, W], seq_lens, window),
    # or None: they are gathered. Set by the backend when a kernel reads the format's layout.
    decode_in_place: Callable[..., torch.Tensor] | None = None
    # (request id, [rows, seq_len] float32): the attention rows a sequence's eviction policy
    # observes, summed over layers and heads; filled by the forward pass.
    observed_attention: list[tuple[str, torch.Tensor]] = field(default_factory=list)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool: dict,
                    kv_format: KVFormat, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """query [tokens, heads, d], key/value [tokens, kv_heads, d] -> [tokens, heads * d]."""
    kv_format.write(pool, key, value, meta.slot_mapping)
    rotation = kv_format.rotation(query.shape[-1], query.dtype, query.device)
    if rotation is not None:  # the pool holds K·R and V·R: (qR)·(kR) = q·k
        query = query @ rotation
    tokens, heads, dim = query.shape
    parts, start = [], 0
    for group in meta.decodes:
        q = query[start: start + group.num_requests].unsqueeze(1)
        parts.append(_decode(q, group, pool, kv_format, window, meta.decode_in_place).view(-1, heads, dim))
        start += group.num_requests
    if meta.evicting_decode is not None:
        group = meta.evicting_decode
        k_ctx, v_ctx = kv_format.gather(pool, group.block_ids, group.num_requests, query.dtype)
        k_ctx = rope_gathered_keys(k_ctx, *group.key_rope, rotation)
        q = query[start: start + group.num_requests].unsqueeze(1)
        parts.append(_decode_attention(q, k_ctx, v_ctx, group, window).view(-1, heads, dim))
    parts.extend(_prefills(query, meta.prefills, pool, kv_format, rotation, window))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    if rotation is not None:  # probs·(VR)·R^T = probs·V
        out = out @ rotation.T
    return out.reshape(tokens, heads * dim)


def _prefills(query: torch.Tensor, chunks: list[PrefillChunk], pool: dict, kv_format: KVFormat,
              rotation: torch.Tensor | None, window: int | None) -> list[torch.Tensor]:
    """Each chunk's attention output [num_queries, H, d], in chunk order. Chunks of the same shape
    (queries, context) share one batched SDPA call: e.g. questions after a cached system prompt,
    faster on CPU than a call per chunk. Chunks under eviction go one by one."""
    outputs: list[torch.Tensor | None] = [None] * len(chunks)
    same_shape: dict[tuple[int, int, int], list[int]] = {}  # (queries, context, blocks) -> chunk indices
    for i, chunk in enumerate(chunks):
        if chunk.key_rope is None and chunk.observed_attention is None:
            same_shape.setdefault((chunk.num_queries, chunk.context_len, chunk.block_ids.shape[0]), []).append(i)
            continue
        q = query[chunk.row_start: chunk.row_start + chunk.num_queries]
        k_ctx, v_ctx = kv_format.gather(pool, chunk.block_ids, 1, query.dtype)
        k_ctx, v_ctx = k_ctx[:, 0, : chunk.context_len], v_ctx[:, 0, : chunk.context_len]
        if chunk.key_rope is not None:
            k_ctx = rope_gathered_keys(k_ctx, *chunk.key_rope, rotation)
        if chunk.observed_attention is not None:
            outputs[i] = _prefill_attention_observed(q, k_ctx, v_ctx, chunk.mask(window), chunk.observed_attention)
        else:
            outputs[i] = _prefill_attention(q[None], k_ctx[:, None], v_ctx[:, None], chunk.bias(window, query.dtype))[0]
    for (num_queries, context_len, _), members in same_shape.items():
        block_ids = torch.cat([chunks[i].block_ids for i in members])
        k_ctx, v_ctx = kv_format.gather(pool, block_ids, len(members), query.dtype)  # [kvh, B, blocks*bs, d]
        q = torch.stack([query[chunks[i].row_start: chunks[i].row_start + num_queries] for i in members])
        out = _prefill_attention(q, k_ctx[:, :, :context_len], v_ctx[:, :, :context_len],
                                 chunks[members[0]].bias(window, query.dtype))
        for i, chunk_out in zip(members, out):
            outputs[i] = chunk_out
    return outputs


def _decode(q: torch.Tensor, group: AttentionGroup, pool: dict, kv_format: KVFormat, window: int | None,
            decode_in_place: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """Attend in place when the backend has a kernel for the format; otherwise gather the decodes'
    context and attend. Quantized formats that have per-token factors hand over their codes
    (ScaledKV), saving a dequantizing pass over the gathered K/V."""
    batch, _, heads, dim = q.shape
    if decode_in_place is not None:
        out = decode_in_place(pool, q.view(batch, heads, dim), group.block_ids.view(batch, -1), group.seq_lens, window)
        return out.view(batch, 1, heads, dim)
    if group.num_requests == 1:
        return _single_decode(q, group, pool, kv_format, window)
    scaled = kv_format.gather_scaled(pool, group.block_ids, group.num_requests, q.dtype)
    if scaled is not None:
        return _decode_attention_scaled(q, scaled, group, window)
    k_ctx, v_ctx = kv_format.gather(pool, group.block_ids, group.num_requests, q.dtype)
    return _decode_attention(q, k_ctx, v_ctx, group, window)


def _single_decode(q: torch.Tensor, group: AttentionGroup, pool: dict, kv_format: KVFormat,
                   window: int | None) -> torch.Tensor:
    """One request's decode: its context sliced to its exact length (and window), so nothing is
    masked and one fused SDPA call does the work, the query heads that share a KV head taken as
    that head's query rows: at batch 1 on CPU much cheaper than the padded matmul path
    (BENCHMARKS.md, "Offline throughput")."""
    _, _, heads, dim = q.shape
    k_ctx, v_ctx = kv_format.gather(pool, group.block_ids, 1, q.dtype)  # [kvh, 1, padded, d]
    end = group.max_seq_len
    start = 0 if window is None else max(0, end - window)
    kv_heads = k_ctx.shape[0]
    q = q.view(kv_heads, 1, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(q, k_ctx[:, :, start:end], v_ctx[:, :, start:end])
    return out.reshape(1, 1, heads, dim)


def _decode_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, group: AttentionGroup,
                      window: int | None) -> torch.Tensor:
    """q [B, 1, H, d]; k/v [kvh, B, L, d] -> [B, 1, H, d]."""
    batch, _, heads, dim = q.shape
    kv_heads = k_ctx.shape[0]
    # [B, H, d] -> [kvh, B, H/kvh, d]: the query heads that share a KV head form one matmul.
    q = q.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(q, k_ctx.transpose(-1, -2)).float().mul_(1.0 / math.sqrt(dim))
    probs = torch.softmax(scores.add_(group.mask_bias(window)), dim=-1)
    if group.observed_attention is not None:  # summed over KV heads and the query heads of each
        group.observed_attention += probs.sum(dim=(0, 2))
    out = torch.matmul(probs.to(v_ctx.dtype), v_ctx)  # [kvh, B, group, d]
    return out.transpose(0, 1).reshape(batch, 1, heads, dim)


def _decode_attention_scaled(q: torch.Tensor, kv: ScaledKV, group: AttentionGroup,
                             window: int | None) -> torch.Tensor:
    """_decode_attention over codes with per-token factors (ScaledKV):
    q·(c s + z) = s (q·c) + z Σq, and Σ p (c s + z) = Σ (p s) c + Σ p z."""
    batch, _, heads, dim = q.shape
    kv_heads = kv.key.shape[0]
    q = q.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(q, kv.key.transpose(-1, -2)).float()  # [kvh, B, group, L]
    scores.mul_(kv.key_scale.unsqueeze(2) * (1.0 / math.sqrt(dim)))
    if kv.key_zero is not None:
        scores.add_(q.float().sum(-1, keepdim=True) * (kv.key_zero.unsqueeze(2) * (1.0 / math.sqrt(dim))))
    probs = torch.softmax(scores.add_(group.mask_bias(window)), dim=-1)
    out = torch.matmul((probs * kv.value_scale.unsqueeze(2)).to(kv.value.dtype), kv.value)
    if kv.value_zero is not None:
        out += torch.matmul(probs, kv.value_zero.unsqueeze(-1)).to(out.dtype)
    return out.transpose(0, 1).reshape(batch, 1, heads, dim)


def _prefill_attention(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, Q, H, d]; k/v [kvh, B, L, d]; mask [Q, L] (additive, shared by the batch) or None
    (causal, Q == L) -> [B, Q, H, d]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k_ctx.transpose(0, 1), v_ctx.transpose(0, 1),
                                         attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return out.transpose(1, 2)


def _prefill_attention_observed(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, mask: torch.Tensor | None,
                                observed: ObservedAttention) -> torch.Tensor:
    """_prefill_attention with explicit probabilities (SDPA does not expose them), adding those
    of the observed queries, summed over heads, into `observed.rows`."""
    queries, heads, dim = q.shape
    kv_heads, length, _ = k_ctx.shape
    q = q.view(queries, kv_heads, heads // kv_heads, dim).permute(1, 2, 0, 3)  # [kvh, group, Q, d]
    scores = torch.matmul(q, k_ctx.unsqueeze(1).transpose(-1, -2)).float().mul_(1.0 / math.sqrt(dim))
    if mask is None:  # causal over the chunk itself (Q == L)
        mask = torch.ones(queries, length, dtype=torch.bool, device=q.device).tril_()
    probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)  # [kvh, group, Q, L]
    if observed.summed:
        observed.rows[0] += probs[:, :, observed.first:].sum(dim=(0, 1, 2))
    else:
        observed.rows += probs[:, :, observed.first:].sum(dim=(0, 1))
    out = torch.matmul(probs.to(v_ctx.dtype), v_ctx.unsqueeze(1))  # [kvh, group, Q, d]
    return out.permute(2, 0, 1, 3).reshape(queries, heads, dim)
