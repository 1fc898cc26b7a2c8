"""The torch backend's attention: paged attention over a packed batch of mixed decode and prefill tokens.

The runner packs every scheduled token of every request into one flat batch (no padding in the
linear layers). Attention then needs, per request: where its new K/V go (`slot_mapping`), which
physical blocks hold its context (`block_tables`), how many tokens its context has (`seq_lens`)
and which packed rows are its queries. The runner packs decodes first, then prefill chunks;
the torch backend (torch_backend.py) builds this metadata.

* decodes (one query each): with a format that reads them in place (the CPU kernel,
  cpu_paged.py), one kernel call over all of them. Otherwise vectorised over the
  requests with padding and a mask:
  grouped-query matmuls, queries of a KV head batched together, softmax in float32: on CPU much
  faster than SDPA with a length-1 query. Decode time is mostly reading K/V (gather, then
  the matmuls), so the backend splits decodes of very different context lengths into a few groups
  padded separately (torch_backend.split_by_length). A group of one request needs no padding:
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
from typing import Callable

import torch
import torch.nn.functional as F

from kvserve.cache.eviction.positions import rope_gathered_keys
from kvserve.cache.kv_cache import KVFormat, ScaledKV
from kvserve.model.attention.metadata import AttentionGroup, AttentionMetadata, ObservedAttention, PrefillChunk


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool: dict,
                    kv_format: KVFormat, meta: AttentionMetadata, window: int | None) -> torch.Tensor:
    """query [tokens, heads, d], key/value [tokens, kv_heads, d] -> [tokens, heads * d]."""
    kv_format.write(pool, key, value, meta.slot_mapping)
    rotation = kv_format.rotation(query.shape[-1], query.dtype, query.device)
    if rotation is not None:  # the pool holds K·R and V·R: (qR)·(kR) = q·k
        query = kv_format.rotate_rows(query, rotation)
    tokens, heads, dim = query.shape
    parts, start = [], 0
    for group in meta.decodes:
        q = query[start: start + group.num_requests].unsqueeze(1)
        parts.append(_decode(q, group, pool, kv_format, window, meta.decode_in_place).view(-1, heads, dim))
        start += group.num_requests
    if meta.evicting_decode is not None:
        group = meta.evicting_decode
        parts.append(decode_gathered(query[start: start + group.num_requests], group, pool, kv_format, rotation,
                                     window))
    parts.extend(prefills_gathered(query, meta.prefills, pool, kv_format, rotation, window))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    if rotation is not None:  # probs·(VR)·R^T = probs·V
        out = kv_format.rotate_rows(out, rotation.T)
    return out.reshape(tokens, heads * dim)


def decode_gathered(query: torch.Tensor, group: AttentionGroup, pool: dict, kv_format: KVFormat,
                    rotation: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """The decodes of sequences under eviction (queries [n, H, d] -> [n, H, d]): their context
    gathered, keys rotated by cache index (stored before RoPE), attention observed if asked."""
    heads, dim = query.shape[1:]
    k_ctx, v_ctx = kv_format.gather(pool, group.block_ids, group.num_requests, query.dtype)
    k_ctx = rope_gathered_keys(k_ctx, *group.key_rope, rotation)
    return _decode_attention(query.unsqueeze(1), k_ctx, v_ctx, group, window).view(-1, heads, dim)


def prefills_gathered(query: torch.Tensor, chunks: list[PrefillChunk], pool: dict, kv_format: KVFormat,
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
