"""Positions of an evicting sequence: a token's rotary position is its index in the cache, not in
the text (StreamingLLM, Xiao et al. 2023, section 3.2), so a query never sees a position beyond
the budget and generation can run past the model's trained context.

When tokens before a kept key are evicted, the key's position drops. Two ways to follow:

(a) store keys before RoPE and rotate the gathered keys by their cache index at attention time
    (what StreamingLLM's own code does);
(b) keep keys rotated and re-rotate the kept ones by -delta at each eviction (RoPE rotations
    compose: R(p - d) = R(-d) R(p); what transformers' SinkCache did).

kvserve uses (a). (b) re-writes every key after the first evicted one at each eviction event
(one per block of decoding), so a key is re-rotated and re-rounded once per event over its life
in the cache: ~budget / block_size times (64 for 1,024 tokens in blocks of 16). In bfloat16 that
is a random walk of roundings; in a quantized cache each re-rotation is a fresh quantization of
a rotated vector, whose error adds up the same way (`benchmarks/eviction_positions.py` measures
both: BENCHMARKS.md, "Positions by cache index"). (a) is exact up to one storage rounding in
every format, and moves nothing for streaming but the tail of the sink block; its cost is a
rotation of the gathered keys of evicting sequences in every layer and step (their own attention
path: requests without eviction run exactly as before).

Keys stored before RoPE are a different layout from everyone else's, so evicting sequences hash
their blocks in their own prefix-cache namespace (kv_cache_manager.KEYS_BEFORE_ROPE).
"""
from __future__ import annotations

import torch


def rope_gathered_keys(keys: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                       basis: torch.Tensor | None) -> torch.Tensor:
    """Rotate keys gathered from an evicting sequence's blocks ([..., tokens, head_dim], stored
    before RoPE) to their positions: gathered index i is cache index i, position i. cos:
    [tokens, head_dim] (the model's table); signed_sin: the sin table with its first half
    negated (rotate-half convention: channel j pairs with j + head_dim/2, so the result is
    x * cos + swap(x) * signed_sin with swap exchanging the halves). `basis`: the format's
    orthogonal rotation R when the pool holds K·R (quantized formats, rotation.py); the keys are
    then turned back, rotated, and turned again.

    The same formula as the model's `apply_rotary`, with the second product and the sum fused
    into one `addcmul`: apply_rotary keeps the reference's separate roundings (it must match HF
    transformers bit for bit), which these keys, already rounded by storage, do not need, and
    it is faster on CPU than writing the halves separately."""
    if basis is not None:
        keys = keys @ basis.T
    half = keys.shape[-1] // 2
    swapped = torch.cat((keys[..., half:], keys[..., :half]), dim=-1)
    out = torch.addcmul(keys * cos, swapped, signed_sin)
    return out @ basis if basis is not None else out
