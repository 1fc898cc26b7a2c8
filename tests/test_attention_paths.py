"""The decode of a lone request (one exact-length SDPA call) against the padded, masked matmul path
it replaces and against attention written out head by head (HF's GQA mapping: query head h reads
KV head h // (heads / kv_heads)), with sliding windows shorter and longer than the context."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec
from kvserve.model.attention import AttentionGroup, _decode_attention, _single_decode

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16, block_size=8)
HEADS = 6  # three query heads per KV head
SEQ_LEN = 37  # not a multiple of the block size: the padded path masks the last block's tail
BLOCKS = torch.tensor([7, 2, 9, 0, 4])


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [H, d], k/v [L, kv_heads, d] in float32 -> [H, d]."""
    start = 0 if window is None else max(0, k.shape[0] - window)
    group = HEADS // SPEC.num_kv_heads
    out = []
    for h in range(HEADS):
        keys, values = k[start:, h // group], v[start:, h // group]
        probs = torch.softmax(keys @ q[h] / math.sqrt(q.shape[-1]), dim=0)
        out.append(probs @ values)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 36, 37, 1000])
def test_single_request_decode_matches_the_padded_path_and_the_definition(dtype, window):
    fmt = make_kv_format("auto", dtype)
    pool = fmt.allocate(SPEC, 10, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(SEQ_LEN, SPEC.num_kv_heads, SPEC.head_dim, generator=gen).to(dtype) for _ in range(2))
    slots = (BLOCKS[:, None] * SPEC.block_size + torch.arange(SPEC.block_size)).reshape(-1)[:SEQ_LEN]
    fmt.write(pool, k, v, slots)
    group = AttentionGroup(block_ids=BLOCKS, seq_lens=torch.tensor([SEQ_LEN]),
                           context_len=BLOCKS.numel() * SPEC.block_size, max_seq_len=SEQ_LEN)
    q = torch.randn(1, 1, HEADS, SPEC.head_dim, generator=gen).to(dtype)

    got = _single_decode(q, group, pool, fmt, window)[0, 0].float()
    k_ctx, v_ctx = fmt.gather(pool, BLOCKS, 1, dtype)
    padded = _decode_attention(q, k_ctx, v_ctx, group, window)[0, 0].float()
    expected = by_hand(q[0, 0].float(), k.float(), v.float(), window)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, expected, atol=tolerance), (got - expected).abs().max()
    assert torch.allclose(padded, expected, atol=tolerance), (padded - expected).abs().max()
